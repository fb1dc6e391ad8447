"""Warnings that point at the user's code: the first caller outside Cadence's packages.

A warning issued deep inside the loop with a fixed ``stacklevel`` names a line of Cadence
(``output = getattr(trainer, stage)(...)``), which tells the user nothing. :func:`warn_user` walks
up the stack past ``trainer/``, ``callbacks/`` and ``strategies/`` and issues the warning at the
user's line (their ``trainer.fit(...)`` call, or their hook), filtered and shown once per line as
``warnings.warn`` would.
"""

from __future__ import annotations

import os
import sys
import warnings

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CADENCE = tuple(os.path.join(_ROOT, package) + os.sep for package in ("trainer", "callbacks", "strategies"))


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the innermost frame outside Cadence's packages."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_CADENCE):
        frame = frame.f_back
    if frame is None:  # nothing but Cadence on the stack (a spawned process): the direct caller
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "<unknown>"),
                           registry=module_globals.setdefault("__warningregistry__", {}),
                           module_globals=module_globals)
