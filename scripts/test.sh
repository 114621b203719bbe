#!/usr/bin/env bash
# The project's test command (the README's second command; .ci/run calls it).
# Each distribution is tested from its own folder with its own pytest configuration, as its
# users would: the core (with the template provider), the CLI, the Redis plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-install.sh
python3 -m ruff check .
python3 -m mypy --strict
(cd cli && python3 -m pytest -q "$@")
(cd plugins/hostkv-redis && python3 -m pytest -q "$@")
python3 -m pytest -q "$@"
