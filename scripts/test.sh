#!/usr/bin/env bash
# The project's test command (the README's second command; .ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/dev-install.sh
python3 -m ruff check .
python3 -m mypy --strict
python3 -m pytest -q "$@"
