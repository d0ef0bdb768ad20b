"""``python -m pipeline.commit`` for the commit-protocol tests, whose staged steps are in the fake format
``tests.seed_helpers.TEST_FORMAT`` (registered by ``tests.conftest``): ``python -m tests.commit_cli <args>``."""

from __future__ import annotations

import sys

import tests.conftest  # noqa: F401  (registers TEST_FORMAT)
from pipeline.commit import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
