"""Lightning's ModelPruning: torch.nn.utils.prune at epoch ends, the lottery ticket reset, masks folded
into checkpoints and into the module when training ends."""

from __future__ import annotations

import logging

import pytest
import torch
from linear_regression import LinearRegression

from callbacks import ModelCheckpoint, ModelPruning


def test_pruning_each_epoch_folds_the_masks_into_checkpoints_and_the_module(make_trainer, regression_loader, tmp_path,
                                                                              caplog):
    torch.manual_seed(0)
    module = LinearRegression()
    pruning = ModelPruning("l1_unstructured", parameters_to_prune=[(module.layer, "weight")], amount=0.5,
                           use_lottery_ticket_hypothesis=False, verbose=1)
    saving = ModelCheckpoint(tmp_path, filename="{epoch}", save_top_k=-1, save_last=False)
    with caplog.at_level(logging.INFO):
        make_trainer(max_epochs=2, callbacks=[pruning, saving], enable_checkpointing=True).fit(module, regression_loader)
    # torch prunes half of what remains each time: 4 of the 8 weights, then 2 of the other 4
    assert [m for m in caplog.messages if m.startswith("Applied")] == [
        "Applied `L1Unstructured`. Pruned: 0/8 (0.00%) -> 4/8 (50.00%)",
        "Applied `L1Unstructured`. Pruned: 4/8 (50.00%) -> 6/8 (75.00%)"]
    assert not hasattr(module.layer, "weight_orig") and isinstance(module.layer.weight, torch.nn.Parameter)
    assert int((module.layer.weight == 0).sum()) == 6
    first = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)["state_dict"]
    assert set(first) == {"layer.weight", "layer.bias"}  # loads into the plain module
    assert int((first["layer.weight"] == 0).sum()) == 4
    LinearRegression().load_state_dict(first)


def test_the_lottery_ticket_reset_keeps_the_mask_and_restores_the_starting_weights(make_trainer, regression_loader):
    torch.manual_seed(0)
    module = LinearRegression()
    start = module.layer.weight.detach().clone()
    pruning = ModelPruning("random_unstructured", amount=3, parameter_names=["weight"], make_pruning_permanent=False)
    idle = ModelPruning("l1_unstructured", apply_pruning=False, make_pruning_permanent=False)  # two: allowed
    make_trainer(max_epochs=1, callbacks=[pruning, idle]).fit(module, regression_loader)
    mask = module.layer.weight_mask
    assert int((mask == 0).sum()) == 3  # an int amount is a count
    torch.testing.assert_close(module.layer.weight_orig.detach(), start)
    module.layer(torch.zeros(1, 4))  # torch computes the pruned weight before each forward
    torch.testing.assert_close(module.layer.weight.detach(), start * mask)
    assert module.layer.bias.detach().ne(0).all()  # not named: not pruned


def test_bad_pruning_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match=r"chocolate isn't in \('weight', 'bias'\)"):
        ModelPruning("l1_unstructured", parameter_names=["chocolate"])
    with pytest.raises(ValueError, match=r"`pruning_fn` is expected to be a str in \['ln_structured'"):
        ModelPruning({})
    with pytest.raises(ValueError, match=r"`pruning_dim` should be provided \(the dimension"):
        ModelPruning("random_structured")
    with pytest.raises(ValueError, match=r"Only the \"unstructured\" PRUNING_TYPE is supported with "
                                         r"`use_global_unstructured=True`.*use_global_unstructured=False"):
        ModelPruning("ln_structured", pruning_dim=0, pruning_norm=1)
    with pytest.raises(ValueError, match=r"`verbose` must be any of \(0, 1, 2\)"):
        ModelPruning("l1_unstructured", verbose=3)
    module = LinearRegression()
    with pytest.raises(ValueError, match=r"don't exist in the model. Found missing modules: \[Linear"):
        ModelPruning.sanitize_parameters_to_prune(module, [(torch.nn.Linear(1, 1), "weight")])
