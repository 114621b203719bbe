#!/usr/bin/env bash
# Installs everything the demo, the tests and the benchmarks need, on a fresh machine that has
# only Python and pip (and, for the Redis plugin's tests, apt as root).  The same Python as
# scripts/install.sh: the active venv, the system Python when pip may write there, else ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh

# A second run with nothing changed skips pip (its resolver alone takes ~30 s here): the stamp
# names this checkout's path (the editable installs point at it), the interpreter, and the
# hash of everything that decides what gets installed.  HOSTKV_REINSTALL=1 forces a run.
stamp_dir="$("$PY" -c 'import sys; print(sys.prefix)')"
[ -w "$stamp_dir" ] || stamp_dir="${XDG_CACHE_HOME:-$HOME/.cache}/hostkv"
key=$( { echo "$PWD $PY"; cat pyproject.toml cli/pyproject.toml plugins/hostkv-redis/pyproject.toml \
  examples/custom_provider/pyproject.toml scripts/dev-install.sh; } | sha256sum | cut -c1-16)
stamp="$stamp_dir/.hostkv-dev-install-$key"
if [ -z "${HOSTKV_REINSTALL:-}" ] && [ -f "$stamp" ] \
   && "$PY" -c 'import torch, hostkv_providers, hostkv_cli, hostkv_redis, hostkv_dictstore, pytest, mypy, ruff, prometheus_client' 2>/dev/null \
   && command -v redis-server >/dev/null && command -v mdb_stat >/dev/null && command -v openssl >/dev/null; then
  step "dev install: up to date (stamp $(basename "$stamp"); HOSTKV_REINSTALL=1 reinstalls)"
  exit 0
fi

# torch stays optional in the library's metadata; the dev/CI path pins the CPU build that these
# machines install from local disk (an unpinned torch would pull a multi-GB CUDA build).
step "dev install into ${VENV:-the system Python} ($("$PY" -V)): torch (CPU), the four distributions editable, test and lint tools"
pip_install "torch==2.13.0"
pip_install -e ".[dev,prometheus]" -e ./cli -e ./plugins/hostkv-redis -e ./examples/custom_provider

# Servers and tools the tests use: redis-server (the Redis plugin's tests start their own on
# loopback), mdb_stat (the LMDB store is checked with LMDB's own tool) and openssl (the TLS
# tests make a throw-away CA and server certificate).
if ! command -v redis-server >/dev/null || ! command -v mdb_stat >/dev/null || ! command -v openssl >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    step "apt-get install redis-server lmdb-utils openssl"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq redis-server lmdb-utils openssl >/dev/null
  else
    echo "warning: redis-server/mdb_stat/openssl missing and apt-get unavailable; their tests will skip" >&2
  fi
fi
mkdir -p "$stamp_dir" && rm -f "$stamp_dir"/.hostkv-dev-install-* && touch "$stamp"
step "dev install done"
