"""engine/model/linear.py: the oneDNN small-batch path gives nn.Linear's result and builds its kernels up front."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.model import linear as linear_module
from engine.model.linear import SMALL_BATCH_ROWS, WARMED_ROWS, Linear, prepare_linears, warm_up_macs


@pytest.mark.parametrize("bias", [False, True])
def test_a_prepared_linear_gives_the_plain_linear_result_for_any_row_count(bias: bool) -> None:
    torch.manual_seed(0)
    linear = Linear(48, 80, bias=bias)
    prepare_linears(linear)
    if linear.packed_weight is None:
        pytest.skip("this torch build has no oneDNN linear ops")
    for rows in (1, 2, 3, 5, 8, 9, 17, WARMED_ROWS + 1, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 300):
        x = torch.randn(rows, 48)
        with torch.no_grad():
            out = linear(x)  # [rows, 80]
        assert out.shape == (rows, 80)
        torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_prepare_linears_runs_each_distinct_weight_shape_once_at_every_warmed_row_count(monkeypatch) -> None:
    calls = _recorded_forward_calls(monkeypatch)
    model = nn.ModuleList([Linear(32, 64, bias=False), Linear(32, 64, bias=False), Linear(64, 32, bias=False)])
    prepare_linears(model)
    if model[0].packed_weight is None:
        assert calls == []  # nothing to build without oneDNN
        return
    expected = [(i, o, rows) for i, o in ((32, 64), (64, 32)) for rows in range(1, WARMED_ROWS + 1)]
    assert sorted(calls) == sorted(expected)


def test_a_weight_whose_warm_up_exceeds_the_budget_is_packed_but_left_to_build_at_its_first_use(monkeypatch) -> None:
    calls = _recorded_forward_calls(monkeypatch)
    monkeypatch.setattr(linear_module, "WARM_BUDGET_MACS", warm_up_macs(32, 64))
    small, large = Linear(32, 64, bias=False), Linear(32, 65, bias=False)  # large: one output more than the budget
    prepare_linears(nn.ModuleList([small, large]))
    if small.packed_weight is None:
        pytest.skip("this torch build has no oneDNN linear ops")
    assert large.packed_weight is not None
    assert sorted(calls) == [(32, 64, rows) for rows in range(1, WARMED_ROWS + 1)]
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(large(x), F.linear(x, large.weight), rtol=1e-5, atol=1e-5)


def _recorded_forward_calls(monkeypatch) -> list[tuple[int, int, int]]:
    """Linear.forward records (in_features, out_features, rows) of each call into the returned list."""
    calls: list[tuple[int, int, int]] = []
    plain_forward = Linear.forward

    def recording_forward(self: Linear, x: torch.Tensor) -> torch.Tensor:
        calls.append((self.in_features, self.out_features, x.shape[0]))
        return plain_forward(self, x)

    monkeypatch.setattr(Linear, "forward", recording_forward)
    return calls
