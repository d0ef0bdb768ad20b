#!/usr/bin/env bash
# Create .venv and install the project with its dev tools. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: this exact version is the CPU wheel; a looser range pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
# deepspeed is an sdist whose setup imports torch: build it against the torch above, not in an isolated env.
.venv/bin/python -m pip install -q setuptools wheel
.venv/bin/python -m pip install -q --no-build-isolation deepspeed==0.19.8
.venv/bin/python -m pip install -q -e '.[all,dev,docs]'
