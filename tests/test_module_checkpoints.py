"""Checkpoints as Lightning users use them around fit: ``trainer.save_checkpoint`` after fit returns,
then ``fit(ckpt_path=...)`` with a larger ``max_epochs``; ``Module.load_from_checkpoint`` to rebuild
the fitted module from the file alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from callbacks import Callback
from trainer import TrainingModule


class Classifier(TrainingModule):
    def __init__(self, width: int, depth: int = 1, lr: float = 0.05, activation: nn.Module | None = None):
        super().__init__()
        self.save_hyperparameters()
        activation = activation or nn.ReLU()
        hidden = [layer for _ in range(depth - 1) for layer in (nn.Linear(width, width), activation)]
        self.net = nn.Sequential(nn.Linear(4, width), activation, *hidden, nn.Dropout(0.2), nn.Linear(width, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)}


def shuffled(data):
    return DataLoader(data, batch_size=16, shuffle=True)


# --- save_checkpoint after fit, then continue --------------------------------------------------
def test_save_checkpoint_after_fit_continues_exactly_with_a_larger_max_epochs(make_trainer, regression_data, tmp_path):
    # Shuffling with the seeded loader generator, dropout, Adam and an epoch scheduler: each of
    # them has state that the continuation must pick up where the first fit left it.
    torch.manual_seed(0)
    uninterrupted = Classifier(width=8)
    make_trainer(max_epochs=4, seed=7).fit(uninterrupted, shuffled(regression_data))

    torch.manual_seed(0)
    first = Classifier(width=8)
    trainer = make_trainer(max_epochs=2, seed=7)
    trainer.fit(first, shuffled(regression_data))
    torch.randn(100)  # the user's own draws between fit and save change nothing
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")

    continued = Classifier(width=8)
    continuing = make_trainer(max_epochs=4, seed=7)
    continuing.fit(continued, shuffled(regression_data), ckpt_path=tmp_path / "after_fit.ckpt")
    for name, value in uninterrupted.state_dict().items():
        assert torch.equal(continued.state_dict()[name], value), name
    assert (continuing.global_step, continuing.current_epoch) == (16, 4)


def test_save_checkpoint_after_fit_calls_the_checkpoint_hooks(make_trainer, regression_loader, tmp_path):
    class Counts(Callback):
        def on_save_checkpoint(self, trainer, module, checkpoint):
            checkpoint["counted"] = trainer.global_step

    trainer = make_trainer(max_epochs=1, callbacks=[Counts()])
    trainer.fit(Classifier(width=4), regression_loader)
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    state = torch.load(tmp_path / "after_fit.ckpt", weights_only=True)
    assert state["counted"] == 8 and state["loops"]["epoch"] == 1 and state["loops"]["batches_done"] == 0


# --- load_from_checkpoint --------------------------------------------------------------------------
@pytest.fixture
def fitted(make_trainer, regression_loader, tmp_path):
    """A Classifier(width=6, depth=2, lr=0.1) after one epoch, and the checkpoint saved after fit."""
    module = Classifier(width=6, depth=2, lr=0.1)
    trainer = make_trainer(max_epochs=1)
    trainer.fit(module, regression_loader)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    return module, tmp_path / "model.ckpt"


def test_load_from_checkpoint_rebuilds_the_module_from_its_hyperparameters_and_weights(fitted):
    module, path = fitted
    loaded = Classifier.load_from_checkpoint(path)
    assert type(loaded) is Classifier and dict(loaded.hparams) == {"width": 6, "depth": 2, "lr": 0.1, "activation": None}
    for name, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    x = torch.randn(3, 4)
    torch.testing.assert_close(loaded.eval()(x), module.eval()(x))


def test_load_from_checkpoint_takes_overrides_and_map_location(fitted):
    _, path = fitted
    loaded = Classifier.load_from_checkpoint(path, map_location="cpu", lr=0.5)
    assert loaded.hparams.lr == 0.5 and loaded.device == torch.device("cpu")


@pytest.mark.parametrize("past_key", ["hparams", "module_arguments"])
def test_load_from_checkpoint_reads_the_hyperparameters_lightning_kept_under_its_keys_before_1_0(fitted, past_key):
    # Lightning's CHECKPOINT_PAST_HPARAMS_KEYS (its test_load_past_checkpoint): a module's hyperparameters under
    # "hparams" or "module_arguments" build it, and the current key's win over them.
    _, path = fitted
    state = torch.load(path, weights_only=True)
    state[past_key] = {**state.pop("hyper_parameters"), "lr": 0.3}
    torch.save(state, path)
    assert Classifier.load_from_checkpoint(path).hparams.lr == 0.3
    state["hyper_parameters"] = {"width": 6, "depth": 2, "lr": 0.2}
    torch.save(state, path)
    assert Classifier.load_from_checkpoint(path).hparams.lr == 0.2


def test_load_from_checkpoint_names_the_arguments_a_checkpoint_without_hyperparameters_lacks(make_trainer, regression_loader, tmp_path):
    class Bare(TrainingModule):  # no save_hyperparameters()
        def __init__(self, width: int, lr: float = 0.1):
            super().__init__()
            self.net = nn.Linear(4, width)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = make_trainer(max_epochs=1, limit_train_batches=1)
    trainer.fit(Bare(width=3), regression_loader)
    trainer.save_checkpoint(tmp_path / "bare.ckpt")
    with pytest.raises(ValueError, match=r"bare.ckpt holds no hyperparameters \(Bare.__init__ does not call "
                                         r"self.save_hyperparameters\(\)\), and Bare.__init__ needs \['width'\]. Pass "
                                         r"them: Bare.load_from_checkpoint\(path, width=...\)"):
        Bare.load_from_checkpoint(tmp_path / "bare.ckpt")
    assert Bare.load_from_checkpoint(tmp_path / "bare.ckpt", width=3).net.out_features == 3


def test_load_from_checkpoint_asks_again_for_hyperparameters_kept_only_as_descriptions(make_trainer, regression_loader, tmp_path):
    trainer = make_trainer(max_epochs=1, limit_train_batches=1)
    trainer.fit(Classifier(width=4, activation=nn.Tanh()), regression_loader)
    trainer.save_checkpoint(tmp_path / "tanh.ckpt")
    with pytest.raises(ValueError, match=r"could keep the hyperparameters \['activation'\] only as descriptions "
                                         r"\(activation='Tanh\(\)'\).* Classifier.load_from_checkpoint\(path, activation=...\)"):
        Classifier.load_from_checkpoint(tmp_path / "tanh.ckpt")
    assert isinstance(Classifier.load_from_checkpoint(tmp_path / "tanh.ckpt", activation=nn.Tanh()).net[1], nn.Tanh)


def test_load_from_checkpoint_strict_names_the_keys_that_differ(fitted):
    _, path = fitted

    class Wider(Classifier):
        def __init__(self, **hparams):
            super().__init__(**hparams)
            self.head = nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"does not fit Wider: missing keys \[head.bias, head.weight\], unexpected keys \[none\]"):
        Wider.load_from_checkpoint(path)
    with pytest.warns(UserWarning, match=r"with strict=False: missing keys \[head.bias, head.weight\]"):
        loaded = Wider.load_from_checkpoint(path, strict=False)
    assert torch.equal(loaded.net[0].weight, fitted[0].net[0].weight)


def test_load_from_checkpoint_leaves_out_an_override_init_does_not_take_and_says_so(fitted):
    # Lightning drops it silently; Cadence drops it too (Lightning code runs) but names the likely typo.
    with pytest.warns(UserWarning, match=r"\(\.\.\., widht=\.\.\.\): 'widht' is not an argument of Classifier.__init__, "
                                         r"so it is left out \(did you mean 'width'\?\)"):
        loaded = Classifier.load_from_checkpoint(fitted[1], widht=3)
    assert loaded.hparams.width == fitted[0].hparams.width
