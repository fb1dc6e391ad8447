"""Lightning's weight averaging callbacks: WeightAveraging and EMAWeightAveraging (the average is
updated after optimizer steps, validated on, in the module after fit, in checkpoints and resumed)."""

from __future__ import annotations

import pickle

import pytest
import torch
from linear_regression import LinearRegression

from callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging


class Recording(LinearRegression):
    """Records the weight after each optimizer step (the training weights) and in each validation."""

    def __init__(self):
        super().__init__()
        self.trained, self.validated = [], []

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.trained.append(self.layer.weight.detach().clone())

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated.append(self.layer.weight.detach().clone())


def test_ema_is_validated_on_and_is_the_module_after_fit(make_trainer, regression_loader):
    torch.manual_seed(0)
    module, decay = Recording(), 0.9
    make_trainer(max_epochs=2, limit_train_batches=4, num_sanity_val_steps=0,
                 callbacks=[EMAWeightAveraging(decay=decay)]).fit(module, regression_loader, regression_loader)
    average, expected_validated = None, []
    for step, weight in enumerate(module.trained):  # the first update copies, the next ones move by 1 - decay
        average = weight if average is None else decay * average + (1 - decay) * weight
        if step % 4 == 3:
            expected_validated.append(average)
    assert len(module.validated) == 2
    for seen, expected in zip(module.validated, expected_validated):
        torch.testing.assert_close(seen, expected)
    torch.testing.assert_close(module.layer.weight.detach(), average)
    assert not torch.allclose(average, module.trained[-1])  # the average, not the last training weights


def test_default_averages_once_per_optimizer_step_and_ema_step_options(make_trainer, regression_loader):
    torch.manual_seed(0)
    module, averaging = Recording(), WeightAveraging()
    make_trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[averaging]).fit(module, regression_loader)
    trained = module.trained[1::2]  # 8 batches, 4 optimizer steps: the weights after each
    assert int(averaging._average_model.n_averaged) == 4
    torch.testing.assert_close(module.layer.weight.detach(), torch.stack(trained).mean(0))
    ema = EMAWeightAveraging(update_every_n_steps=5, update_starting_at_step=10, update_starting_at_epoch=2)
    assert [ema.should_update(step_idx=i) for i in (5, 10, 11, 15)] == [False, True, False, True]
    assert [ema.should_update(epoch_idx=i) for i in (1, 2, 3)] == [False, True, True]
    pickle.dumps(ema)  # DDP's spawned processes get it
    module, late = Recording(), EMAWeightAveraging(update_starting_at_step=100)
    with pytest.warns(UserWarning, match=r"should_update never allowed an update during this fit, so there is no average"):
        make_trainer(max_epochs=1, callbacks=[late]).fit(module, regression_loader)
    torch.testing.assert_close(module.layer.weight.detach(), module.trained[-1])  # not the weights fit started with
    with pytest.raises(ValueError, match=r"pass avg_fn or multi_avg_fn, not both"):
        WeightAveraging(avg_fn=lambda a, b, n: a, multi_avg_fn=lambda a, b, n: None)
    with pytest.raises(TypeError, match=r"WeightAveraging got \['decay'\]: besides device and use_buffers"):
        WeightAveraging(decay=0.9)


def test_a_checkpoint_holds_the_average_as_state_dict_and_resumes_both_copies(make_trainer, regression_loader, tmp_path):
    def run(max_epochs, ckpt_path=None, save=False):
        torch.manual_seed(0)
        module, averaging = LinearRegression(), EMAWeightAveraging(decay=0.5)
        saving = [ModelCheckpoint(tmp_path, filename="first", save_top_k=-1, save_last=False)] if save else []
        trainer = make_trainer(max_epochs=max_epochs, callbacks=[averaging, *saving], enable_checkpointing=save)
        trainer.fit(module, regression_loader, ckpt_path=ckpt_path)
        return module, averaging

    run(1, save=True)
    checkpoint = torch.load(tmp_path / "first.ckpt", weights_only=False)
    assert set(checkpoint) >= {"state_dict", "current_model_state", "averaging_state"}
    assert not torch.equal(checkpoint["state_dict"]["layer.weight"], checkpoint["current_model_state"]["layer.weight"])
    assert int(checkpoint["averaging_state"]["n_averaged"]) == 8
    straight, straight_averaging = run(2)
    resumed, resumed_averaging = run(2, ckpt_path=tmp_path / "first.ckpt")
    torch.testing.assert_close(resumed.layer.weight, straight.layer.weight)  # the average after fit, both ways
    torch.testing.assert_close(resumed_averaging._average_model.module.layer.bias, straight_averaging._average_model.module.layer.bias)
    assert int(resumed_averaging._average_model.n_averaged) == 16
