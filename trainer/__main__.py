"""``python -m trainer``: the same command line as ``cadence`` (see ``trainer/cli.py``)."""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
