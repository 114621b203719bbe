#!/usr/bin/env bash
# The README's first command: the light install (scripts/install.sh), then `hostkv demo` with
# any arguments given here (e.g. bash scripts/demo.sh --tokens 65536).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/_env.sh >/dev/null
step "running: hostkv demo $*"
exec "$("$PY" -c 'import os, sysconfig; print(os.path.join(sysconfig.get_path("scripts"), "hostkv"))')" demo "$@"
