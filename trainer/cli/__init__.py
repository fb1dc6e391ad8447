"""The ``cadence`` command line and its YAML configuration files (also ``python -m trainer``).

Kept apart from the loop: nothing in ``trainer/`` outside this package imports it, and it uses the
Trainer only as a user's script does. ``commands`` holds the subcommands and ``main``; ``config``
turns the merged files (``config_files``) into the objects of a run, checking each class and its
arguments (``specs``); ``runs`` saves each run's resolved configuration and finds its checkpoints.
"""

from typing import Any

from trainer.cli.commands import main

__all__ = ["LightningCLI", "main"]


class LightningCLI:
    """Refused: Cadence's command line is the ``cadence`` command, reading the same config files."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "LightningCLI is Lightning's; Cadence does not build a command line inside your script. Instead: the "
            "cadence command reads a config file of LightningCLI's layout (trainer:, model: and data: with "
            "class_path/init_args): `cadence fit --config run.yaml` (also `python -m trainer fit ...`; "
            "examples/digits.yaml is one to start from); see docs/command-line.md. In a script, build "
            "Trainer(...) and call fit(model, datamodule=...).")
