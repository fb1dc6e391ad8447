"""BaseFinetuning and BackboneFinetuning: freezing, unfreezing into new param groups, and a resumed
run that continues with the same param groups and the same parameters training."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import BackboneFinetuning, BaseFinetuning, LearningRateFinder
from trainer import TrainingModule, Tuner


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(32, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class Backboned(TrainingModule):
    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.lr = lr
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=self.lr)

    def train_dataloader(self):
        return loader()


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.state_dict().items()}


def test_freeze_and_make_trainable_set_requires_grad_and_batchnorm_tracking():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    BaseFinetuning.freeze(model, train_bn=True)
    assert not model[0].weight.requires_grad and not model[3].weight.requires_grad
    assert model[1].weight.requires_grad and model[1].track_running_stats
    BaseFinetuning.freeze(model, train_bn=False)
    assert not model[1].weight.requires_grad and not model[1].track_running_stats
    BaseFinetuning.make_trainable(model)
    assert all(p.requires_grad for p in model.parameters()) and model[1].track_running_stats
    BaseFinetuning.freeze([model[1], [model[3]]], train_bn=True)  # nested lists of modules
    assert model[1].weight.requires_grad and not model[3].weight.requires_grad


def test_flatten_modules_keeps_parents_that_hold_parameters_themselves():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.ModuleDict({"conv": nn.Conv2d(3, 4, 3), "act": nn.ReLU()})
            self.scale = nn.Parameter(torch.zeros(1))
            self.bn = nn.BatchNorm2d(4)

    model = nn.Sequential(OrderedDict(encoder=nn.Sequential(Block(), Block()), head=nn.Linear(4, 2)))
    assert len(BaseFinetuning.flatten_modules(model)) == 9  # per block: itself, conv, act, bn; and the head
    BaseFinetuning.freeze(model.encoder, train_bn=True)
    assert not model.encoder[0].scale.requires_grad and not model.encoder[0].inner["conv"].weight.requires_grad
    assert model.encoder[0].bn.weight.requires_grad
    BaseFinetuning.make_trainable(model)
    assert len(list(BaseFinetuning.filter_params(model.encoder))) == 2 * 5  # conv w/b, scale, bn w/b per block


def test_unfreeze_and_add_param_group_adds_only_what_the_optimizer_lacks():
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(4)], nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.01)
    with pytest.warns(UserWarning, match="already exist within another group of this optimizer"):
        BaseFinetuning.unfreeze_and_add_param_group(model[0], optimizer)
    assert len(optimizer.param_groups) == 1
    model[1].weight.requires_grad = False
    BaseFinetuning.unfreeze_and_add_param_group(model[1], optimizer)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.001)  # the first group's over initial_denom_lr
    assert optimizer.param_groups[1]["params"][0] is model[1].weight and model[1].weight.requires_grad
    with pytest.warns(UserWarning, match="already exist"):
        BaseFinetuning.unfreeze_and_add_param_group(model, optimizer, lr=100, train_bn=False)
    assert optimizer.param_groups[2]["lr"] == 100
    assert [id(p) for p in optimizer.param_groups[2]["params"]] == [id(model[2].weight), id(model[3].weight)]  # no BN


def test_backbone_finetuning_trains_the_backbone_from_its_epoch_with_a_growing_rate(make_trainer):
    class Watch(BackboneFinetuning):
        def __init__(self):
            super().__init__(unfreeze_backbone_at_epoch=2, lambda_func=lambda epoch: 1.5)
            self.seen = []

        def on_train_epoch_start(self, trainer, module):
            super().on_train_epoch_start(trainer, module)
            groups = trainer.optimizers[0].param_groups
            self.seen.append((snapshot(module.backbone[0]), [group["lr"] for group in groups]))

    model, callback = Backboned(), Watch()
    make_trainer(max_epochs=6, callbacks=[callback]).fit(model)
    weights = [weight for weight, _ in callback.seen]
    assert all(torch.equal(weights[0][k], weights[2][k]) for k in weights[0])  # frozen through epochs 0 and 1
    assert not torch.equal(weights[2]["weight"], weights[3]["weight"])  # trains from epoch 2 on
    rates = [lrs for _, lrs in callback.seen]
    assert rates[:2] == [[0.1], [0.1]]
    assert rates[2] == pytest.approx([0.1, 0.01])  # backbone_initial_ratio_lr of the model's
    assert rates[3] == pytest.approx([0.1, 0.015]) and rates[4] == pytest.approx([0.1, 0.0225])  # x lambda_func
    assert rates[5] == pytest.approx([0.1, 0.03375])
    assert callback.previous_backbone_lr == pytest.approx(0.03375)


def test_the_backbone_rate_aligns_with_the_models_once_it_would_pass_it(make_trainer):
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=0, lambda_func=lambda epoch: 4.0)
    trainer = make_trainer(max_epochs=4, callbacks=[callback])
    trainer.fit(Backboned())
    assert [group["lr"] for group in trainer.optimizers[0].param_groups] == pytest.approx([0.1, 0.1])


def test_a_resumed_run_has_the_same_param_groups_and_trains_as_the_uninterrupted_one(make_trainer, tmp_path):
    straight = Backboned()
    make_trainer(max_epochs=4, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)]).fit(straight)

    first = Backboned()
    trainer = make_trainer(max_epochs=2, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    resumed, callback = Backboned(), BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    trainer = make_trainer(max_epochs=4, callbacks=[callback])
    trainer.fit(resumed, ckpt_path=tmp_path / "two.ckpt")

    groups = trainer.optimizers[0].param_groups
    backbone_linear = [id(resumed.backbone[0].weight), id(resumed.backbone[0].bias)]  # its BatchNorm trained all along
    assert len(groups) == 2 and [id(p) for p in groups[1]["params"]] == backbone_linear
    assert all(p.requires_grad for p in resumed.backbone.parameters())  # unfrozen again, as when saved
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


class UnfreezeWithoutBatchNorm(BaseFinetuning):
    """As Lightning's computer_vision_fine_tuning example: ``train_bn=False`` keeps the BatchNorm out of the
    new param group, but ``unfreeze_and_add_param_group`` lets it track running statistics again."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone, train_bn=False)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, train_bn=False)


def test_a_resumed_run_tracks_batchnorm_statistics_the_unfreezing_turned_back_on(make_trainer, tmp_path):
    straight = Backboned()
    make_trainer(max_epochs=4, callbacks=[UnfreezeWithoutBatchNorm()]).fit(straight)

    trainer = make_trainer(max_epochs=2, callbacks=[UnfreezeWithoutBatchNorm()])
    trainer.fit(Backboned())
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    resumed = Backboned()
    trainer = make_trainer(max_epochs=4, callbacks=[UnfreezeWithoutBatchNorm()])
    trainer.fit(resumed, ckpt_path=tmp_path / "two.ckpt")

    assert resumed.backbone[1].track_running_stats and straight.backbone[1].track_running_stats
    assert [p.requires_grad for p in resumed.parameters()] == [p.requires_grad for p in straight.parameters()]
    for name, value in straight.state_dict().items():  # the running statistics kept moving after epoch 2
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_a_finetuning_state_names_its_param_groups_by_parameter(make_trainer):
    class OneLayerAnEpoch(BaseFinetuning):
        def freeze_before_training(self, module):
            self.freeze(module.layers)

        def finetune_function(self, module, epoch, optimizer):
            self.unfreeze_and_add_param_group(module.layers[epoch], optimizer)

    class Layered(Backboned):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.head(self.backbone(self.layers(x))), y)

    callback = OneLayerAnEpoch()
    make_trainer(max_epochs=3, callbacks=[callback]).fit(Layered())
    groups = callback.state_dict()["internal_optimizer_metadata"][0]
    assert [group["params"] for group in groups[1:]] == [[f"layers.{i}.weight", f"layers.{i}.bias"] for i in range(3)]
    assert groups[0]["params"][0] == "backbone.0.weight"


def test_lr_find_runs_with_the_backbone_frozen_and_leaves_the_model_as_given(make_trainer):
    model = Backboned()
    trainer = make_trainer(max_epochs=3, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    finder = Tuner(trainer).lr_find(model, num_training=12, early_stop_threshold=None)
    assert len(finder.results["lr"]) == 12
    assert all(p.requires_grad for p in model.parameters())  # setup froze the backbone; the search put it back
    trainer.fit(model)
    assert len(trainer.optimizers[0].param_groups) == 2


def test_gradient_clipping_reaches_the_groups_added_during_fit(make_trainer):
    class UnfreezeAtOnce(BaseFinetuning):
        def freeze_before_training(self, module):
            self.freeze(module.backbone)

        def finetune_function(self, module, epoch, optimizer):
            if epoch == 0:
                self.unfreeze_and_add_param_group(module.backbone[0], optimizer, lr=1.0)

    class Steep(Backboned):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.head(self.backbone(x)), 100 * y)  # large gradients

    model = Steep()
    before = model.backbone[0].weight.clone()
    make_trainer(max_epochs=1, callbacks=[UnfreezeAtOnce()], gradient_clip_val=1e-3,
                 gradient_clip_algorithm="value").fit(model)
    change = (model.backbone[0].weight - before).abs().max()
    assert 0 < change <= 4 * 1e-3 + 1e-7  # four steps at lr 1.0, each gradient clipped to 1e-3


def test_a_module_without_a_backbone_is_refused(make_trainer):
    class Headless(Backboned):
        def __init__(self):
            super().__init__()
            del self.backbone

    with pytest.raises(ValueError, match="Headless.backbone, which is not an nn.Module attribute"):
        make_trainer(max_epochs=1, callbacks=[BackboneFinetuning()]).fit(Headless())


def test_subclasses_must_say_what_to_freeze(make_trainer):
    with pytest.raises(NotImplementedError, match="must override freeze_before_training"):
        make_trainer(max_epochs=1, callbacks=[BaseFinetuning()]).fit(Backboned())


def test_the_lr_finder_callback_and_backbone_finetuning_compose(make_trainer):
    model = Backboned()
    finder = LearningRateFinder(num_training_steps=30, early_stop_threshold=None)
    trainer = make_trainer(max_epochs=2, callbacks=[finder, BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    trainer.fit(model)
    assert model.lr == finder.optimal_lr.suggestion()
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(model.lr)
    assert trainer.optimizers[0].param_groups[1]["lr"] == pytest.approx(model.lr * 0.1)  # set from the found rate
