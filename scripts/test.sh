#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the test suite. .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check pipeline launchers tests bench
.venv/bin/ruff format --check pipeline launchers tests bench
.venv/bin/mypy pipeline launchers
.venv/bin/python -m pytest -q "$@"
