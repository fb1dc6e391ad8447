"""The model summary (Lightning's ``utilities.model_summary``, here ``trainer.utilities.model_summary``)
and the ``callbacks.ModelSummary`` callback that prints it: the expected tables and figures are what
Lightning 2.6.5 gives for the same modules (run in its own environment, written here)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import trainer as pl
from callbacks import ModelSummary as ModelSummaryCallback
from linear_regression import LinearRegression
from trainer import TrainingModule
from trainer.utilities.model_summary import (
    UNKNOWN_SIZE, LayerSummary, ModelSummary, get_formatted_model_size, get_human_readable_count, summarize,
)


class Net(TrainingModule):
    """Nested layers, a BatchNorm in eval mode and a parameter that belongs to no layer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.norm = nn.BatchNorm1d(2)
        self.extra = nn.Parameter(torch.ones(3))
        self.example_input_array = torch.zeros(4, 8)

    def forward(self, x):
        return self.norm(self.net(x))


class Example(LinearRegression):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.zeros(3, 4)

    def forward(self, x):
        return self.layer(x)


# Lightning 2.6.5: str(ModelSummary(Net(), max_depth=1)) with net.norm in eval mode.
LIGHTNINGS_TABLE = """\
  | Name         | Type        | Params | Mode  | FLOPs | In sizes | Out sizes
------------------------------------------------------------------------------------
0 | net          | Sequential  | 178    | train | 1.3 K | [4, 8]   | [4, 2]   
1 | norm         | BatchNorm1d | 4      | eval  | 0     | [4, 2]   | [4, 2]   
  | other params | n/a         | 3      | n/a   | n/a   | n/a      | n/a      
------------------------------------------------------------------------------------
185       Trainable params
0         Non-trainable params
185       Total params
0.001     Total estimated model params size (MB)
4         Modules in train mode
1         Modules in eval mode
1.3 K     Total Flops"""


def test_the_summary_is_lightnings_table_and_figures():
    module = Net()
    module.norm.eval()
    assert str(ModelSummary(module, max_depth=1)) == LIGHTNINGS_TABLE
    assert module.training and not module.norm.training  # each module back in its own mode
    every = summarize(module, max_depth=-1)
    assert every.layer_names == ["net", "net.0", "net.1", "net.2", "norm"]
    assert every.layer_types == ["Sequential", "Linear", "ReLU", "Linear", "BatchNorm1d"]
    assert every.in_sizes == [[4, 8], [4, 8], [4, 16], [4, 16], [4, 2]]
    assert every.out_sizes == [[4, 2], [4, 16], [4, 16], [4, 2], [4, 2]]
    assert every.param_nums == [178, 144, 0, 34, 4]
    assert (every.total_parameters, every.trainable_parameters, every.total_layer_params) == (185, 185, 360)
    assert every.model_size == pytest.approx(0.00074)
    assert every.total_training_modes == {"train": 4, "eval": 1}
    assert every.total_flops == 1280
    assert every.training_modes == [True, True, True, True, False]
    nothing = summarize(module, max_depth=0)
    assert (nothing.layer_names, nothing.total_flops) == ([], 1280)
    assert "  | other params | n/a  | 185    | n/a  | n/a   | n/a      | n/a      \n" in str(nothing)
    assert pl.utilities.model_summary.ModelSummary is ModelSummary  # `import trainer as pl`, as Lightning's pl


def test_sizes_unknown_where_the_example_does_not_reach_and_lazy_layers_warn_once():
    layer = LayerSummary(nn.Conv2d(3, 8, 3))
    assert (layer.num_parameters, layer.layer_type, layer.in_size) == (224, "Conv2d", UNKNOWN_SIZE)
    module = Net()
    module.unused = nn.Linear(1, 1)
    assert summarize(module).in_sizes[-1] == UNKNOWN_SIZE

    class Lazy(TrainingModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.LazyLinear(3)

    summary = summarize(Lazy())
    with pytest.warns(UserWarning, match="The total number of parameters detected may be inaccurate"):
        assert summary.total_parameters == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert summary.trainable_parameters == 0 and summary.param_nums == [0]


def test_counts_and_sizes_are_written_as_lightning_writes_them():
    # Lightning 2.6.5's get_human_readable_count for each number.
    numbers = (0, 5, 123, 1234, 99999, 2_000_000, 4e14, 5e15)
    assert [get_human_readable_count(n) for n in numbers] == [
        "0  ", "5  ", "123  ", "1.2 K", "100.0 K", "2.0 M", "400 T", "5,000 T"]
    assert get_formatted_model_size(1234.5) == "1,234.500"
    with pytest.raises(ValueError, match=r"`max_depth` can be -1, 0 or > 0, got -2\. Use -1 for every level"):
        ModelSummary(Net(), max_depth=-2)


def test_the_callback_prints_lightnings_table_and_nothing_at_depth_zero(make_trainer, regression_loader, capsys):
    module = Example()
    make_trainer(max_steps=1, enable_model_summary=True).fit(module, regression_loader)
    # Lightning 2.6.5, the same module and fit: the table its ModelSummary callback logs.
    assert ("  | Name  | Type   | Params | Mode  | FLOPs | In sizes | Out sizes\n"
            + "-" * 72 + "\n0 | layer | Linear | 10     | train | 48    | [3, 4]   | [3, 2]   \n" + "-" * 72 + "\n"
            "10        Trainable params\n0         Non-trainable params\n10        Total params\n"
            "0.000     Total estimated model params size (MB)\n1         Modules in train mode\n"
            "0         Modules in eval mode\n48        Total Flops\n") in capsys.readouterr().err
    make_trainer(max_steps=1, callbacks=[ModelSummaryCallback(max_depth=0)]).fit(module, regression_loader)
    assert "Total params" not in capsys.readouterr().err  # Lightning's callback: depth 0 is no summary


def test_a_callback_subclass_shows_the_columns_its_own_way(make_trainer, regression_loader):
    shown = []

    class Columns(ModelSummaryCallback):
        @staticmethod
        def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                      **summarize_kwargs):
            shown.append(([title for title, _ in summary_data], summary_data[1][1], total_parameters,
                          total_training_modes, summarize_kwargs))

    make_trainer(max_steps=1, callbacks=[Columns()]).fit(LinearRegression(), regression_loader)
    assert shown == [([" ", "Name", "Type", "Params", "Mode", "FLOPs"], ["layer"], 10, {"train": 1, "eval": 0},
                      {"total_flops": 0})]
