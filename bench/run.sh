#!/usr/bin/env bash
# The whole benchmark in one command, on a fresh machine (Python 3.11 + pip):
#   bash bench/run.sh [--quick] [--device cuda] [--out DIR] [other bench/run.py options]
# 1. runs scripts/setup.sh if .venv is missing (torch==2.13.0 CPU, deepspeed, the project);
# 2. installs the `bench` extras of pyproject.toml (matplotlib, torch-checkpointing) into .venv, with torch
#    pinned to the installed version so that pip cannot replace it;
# 3. runs bench/run.py, which writes bench/results/<UTC timestamp>/{results.json,results.md,plot.png} and
#    copies them to bench/results/latest/.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
if ! .venv/bin/python -c "import matplotlib, torch_checkpointing" 2>/dev/null; then
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    .venv/bin/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >"$constraints"
    echo "installing the bench extras (pinned: $(cat "$constraints"))"
    .venv/bin/python -m pip install -q -c "$constraints" -e '.[bench]'
fi
exec .venv/bin/python bench/run.py "$@"
