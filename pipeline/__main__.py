"""``python -m pipeline +experiment=tiny`` — see README.md."""

import sys

try:
    from pipeline.cli import main
except ModuleNotFoundError as e:  # a library-only install: the app's extra is missing
    from pipeline.errors import missing

    print(f"error: {missing('app', 'the app (python -m pipeline)', e.name or 'hydra-core')}", file=sys.stderr)
    sys.exit(2)

sys.exit(main(sys.argv[1:]))
