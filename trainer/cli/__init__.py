"""The ``cadence`` command line and its YAML configuration files (also ``python -m trainer``).

Kept apart from the loop: nothing in ``trainer/`` outside this package imports it, and it uses the
Trainer only as a user's script does. ``commands`` holds the subcommands and ``main``; ``config``
turns the merged files (``config_files``) into the objects of a run, checking each class and its
arguments (``specs``); ``runs`` saves each run's resolved configuration and finds its checkpoints.
"""

from trainer.cli.commands import main

__all__ = ["main"]
