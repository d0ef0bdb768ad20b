"""``python -m pipeline +experiment=tiny`` — see README.md."""

import sys

from pipeline.cli import main

sys.exit(main(sys.argv[1:]))
