#!/usr/bin/env bash
# The project's test command (the README's second command; .ci/run calls it).
# Each distribution is tested from its own folder with its own pytest configuration, as its
# users would: the core (with the template provider), the CLI, the Redis plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-install.sh
source scripts/_env.sh
step "ruff"
"$PY" -m ruff check .
step "mypy --strict"
"$PY" -m mypy --strict
step "pytest: cli"
(cd cli && "$PY" -m pytest -q "$@")
step "pytest: plugins/hostkv-redis"
(cd plugins/hostkv-redis && "$PY" -m pytest -q "$@")
step "pytest: core"
"$PY" -m pytest -q "$@"
step "all tests passed"
