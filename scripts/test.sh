#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the test suite. .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check pipeline launchers tests bench
.venv/bin/ruff format --check pipeline launchers tests bench
.venv/bin/mypy pipeline launchers
# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link, a broken anchor or a missing page.
docs_site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$docs_site"
rm -rf "$docs_site"
# Three workers (PYTEST_WORKERS): the suite mostly waits on the processes it starts; the SLURM tests run one at a
# time across workers on one shared cluster (tests/slurm/conftest.py). --durations=15 (pyproject) prints the
# slowest tests at the end.
.venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-3}" --dist loadgroup "$@"
