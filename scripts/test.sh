#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the test suite. .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The Debian packages the FUSE, SLURM and multi-node tests need, installed once, one apt at a time, before pytest's
# workers start (each cluster fixture would otherwise run apt-get at the same moment). Where this machine cannot
# install them (not root, no apt source, no network) it says so in one line and the tests go on: those tests skip,
# and tests/conftest.py lists every skip at the end and fails the run where the machine should have had the piece.
bash scripts/system-packages.sh || true
.venv/bin/ruff check pipeline launchers tests bench
.venv/bin/ruff format --check pipeline launchers tests bench
.venv/bin/mypy pipeline launchers
# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link, a broken anchor or a missing page.
docs_site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$docs_site"
rm -rf "$docs_site"
# The deterministic simulation of the commit protocol (tests/simulate.py): 10,000 random schedules over both
# stores and a small configuration explored exhaustively, on both cores before pytest starts (about 2.5 minutes;
# its last line says how many violations). SIM_SCHEDULES=0 skips it. A violation fails the run, after pytest.
sim=0
if [ "${SIM_SCHEDULES:-10000}" != 0 ]; then
  began=$SECONDS
  PYTHONPATH=. .venv/bin/python -m tests.simulate --schedules "${SIM_SCHEDULES:-10000}" --first-seed 1000000 \
    --workers 2 --show 3 || sim=$?
  echo "simulation: $((SECONDS - began)) s"
  # pytest's own schedules (tests/test_simulation.py, 500 a store for a plain pytest) are a smoke check here
  export SIM_PYTEST_SCHEDULES="${SIM_PYTEST_SCHEDULES:-100}"
fi
# Three workers (PYTEST_WORKERS): the suite mostly waits on the processes it starts; the SLURM tests run one at a
# time across workers on one shared cluster (tests/slurm/conftest.py). --durations=15 (pyproject) prints the
# slowest tests at the end.
.venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-3}" --dist loadgroup "$@"
exit "$sim"
