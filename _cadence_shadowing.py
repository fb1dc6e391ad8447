"""A file of the user's named like a Cadence package is found before it: say so, and which file.

Python puts the script's directory (or the current one) first on ``sys.path``, so a
``callbacks.py``, ``strategies.py`` or ``trainer.py`` next to a script is imported instead of
Cadence's package of that name, and the first import of it fails far from the cause
(``ImportError: cannot import name 'Callback' from 'callbacks'``). Each of Cadence's three
packages calls :func:`check_packages` before it imports anything else, so the error names the
file and says to rename it.

This module sits beside the packages, not inside one: it must be importable before any of them,
and when a user's file shadows a package, nothing inside that package can be imported. The
leading underscore says it is not an API, and no script is named like it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGES = ("trainer", "callbacks", "strategies")
_HOME = Path(__file__).resolve().parent  # where Cadence's packages are installed


def check_packages(names: tuple[str, ...] = PACKAGES) -> None:
    """Raise ImportError if ``import <name>`` would load anything but Cadence's package ``name``."""
    for name in names:
        found = _origin(name)
        if found is None:
            continue
        expected = _HOME / name / "__init__.py"
        if found.resolve() != expected:
            raise ImportError(
                f"{found} shadows Cadence's package '{name}' ({expected.parent}): Python finds it first "
                f"because it is in the script's directory or the current one. Rename it (e.g. my_{name}.py) "
                f"and change the imports of it, so that 'import {name}' finds Cadence."
            )


def _origin(name: str) -> Path | None:
    """The file ``import name`` loads (or has loaded), or None when that is not a file."""
    module = sys.modules.get(name)
    if module is not None:
        origin = getattr(module, "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        origin = spec.origin if spec is not None else None
    return Path(origin) if origin else None
