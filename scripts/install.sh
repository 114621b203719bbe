#!/usr/bin/env bash
# The light install: the core library and the `hostkv` command (what `hostkv demo` and an
# operator need), built from this checkout as wheels.  No torch, transformers, linters or test
# tools: scripts/dev-install.sh installs those for the tests.
#
# Installs into the active virtual environment, or the system Python when pip may write there,
# or else a project venv in ./.venv (see scripts/_env.sh; HOSTKV_VENV=DIR picks another).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh

step "installing hostkv-providers and hostkv-cli into ${VENV:-$("$PY" -c 'import sys; print(sys.prefix)')} ($("$PY" -V))"
step "  with numpy, msgpack, lmdb, zstandard, xxhash, cuda-bindings, click (about 155 MB in a fresh venv; one line per package)"
pip_install ./ ./cli
HOSTKV=$("$PY" -c 'import os, sysconfig; print(os.path.join(sysconfig.get_path("scripts"), "hostkv"))')
[ -x "$HOSTKV" ] || die "the hostkv command was not installed at $HOSTKV"
step "done: $HOSTKV"
if [ -n "$VENV" ] && [ "${VIRTUAL_ENV:-}" != "$(cd "$VENV" && pwd)" ]; then
  step "it lives in the virtual environment $VENV: run it as $VENV/bin/hostkv, or first: . $VENV/bin/activate"
fi
