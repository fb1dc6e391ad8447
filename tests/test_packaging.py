"""What a user installs: every package of the source tree is in the distribution.

``pyproject.toml`` names its packages one by one, so a new subpackage (``strategies/checkpoint``)
that is not named there works from a checkout and in an editable install, and is missing from
the wheel a user installs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_of_the_source_tree_is_named_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    named = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tops = [name for name in named if "." not in name]
    found = {".".join(init.parent.relative_to(ROOT).parts) for top in tops for init in (ROOT / top).rglob("__init__.py")}
    assert found == named, f"pyproject.toml [tool.setuptools] packages: add {sorted(found - named)}, drop {sorted(named - found)}"
