"""The one vocabulary that per-block features (checkpointing, compile, FSDP) use to pick submodules."""

from __future__ import annotations

import pytest
from torch import nn

from strategies.selection import select_submodules


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(2, 1)


def names(selected):
    return [name for name, _ in selected]


def test_a_class_selects_every_instance_outermost_first():
    assert names(select_submodules(Model(), Block, "X")) == ["blocks.0", "blocks.1"]
    # Linear appears inside the blocks and as the head: all three, none of them nested in another.
    assert names(select_submodules(Model(), nn.Linear, "X")) == ["blocks.0.inner", "blocks.1.inner", "head"]


def test_a_tuple_of_classes_names_and_a_predicate_select_alike():
    model = Model()
    assert names(select_submodules(model, (Block, nn.Linear), "X")) == ["blocks.0", "blocks.1", "head"]
    assert names(select_submodules(model, ["head", "blocks.1"], "X")) == ["blocks.1", "head"]
    assert names(select_submodules(model, lambda name, m: name.endswith("inner"), "X")) == ["blocks.0.inner", "blocks.1.inner"]


def test_a_selection_that_matches_nothing_lists_the_top_level_children():
    with pytest.raises(ValueError, match=r"Owner\(modules=\.\.\.\) selects no submodule of Model\. Its top-level "
                                         r"children are: blocks \(ModuleList\), head \(Linear\)\."):
        select_submodules(Model(), nn.Conv2d, "Owner(modules=...)")


def test_an_unknown_name_or_a_wrong_kind_of_selection_is_an_error():
    with pytest.raises(ValueError, match=r"names \['blocks\.7'\], which Model does not have"):
        select_submodules(Model(), ["blocks.7"], "X")
    with pytest.raises(ValueError, match="use a module class or a tuple of classes, a list of submodule names"):
        select_submodules(Model(), 3, "X")
