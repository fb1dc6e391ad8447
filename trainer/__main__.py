"""``python -m trainer``: the same command line as ``cadence`` (see ``trainer/cli/commands.py``).

It stays here, not in ``trainer/cli/``: ``python -m trainer`` runs the package's own ``__main__``
(``torchrun ... -m trainer diagnose comm`` and the README's commands use that name).
"""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
