"""engine/model/linear.py: the oneDNN small-batch path gives nn.Linear's result, takes the row counts it is faster
at, and builds its kernels up front."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine.model import linear as linear_module
from engine.model.linear import (GEMV_MAX_ROWS, SMALL_BATCH_ROWS, WARMED_ROW_COUNTS, WARMED_ROWS, Linear,
                                 prepare_linears, warm_up_macs)


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
    expected = [(i, o, rows) for i, o in ((32, 64), (64, 32)) for rows in WARMED_ROW_COUNTS]
    assert sorted(calls) == sorted(expected)


def test_a_weight_whose_warm_up_exceeds_the_budget_is_packed_but_left_to_build_at_its_first_use(monkeypatch) -> None:
    calls = _recorded_forward_calls(monkeypatch)
    monkeypatch.setattr(linear_module, "WARM_BUDGET_MACS", warm_up_macs(32, 64))
    small, large = Linear(32, 64, bias=False), Linear(32, 65, bias=False)  # large: one output more than the budget
    prepare_linears(nn.ModuleList([small, large]))
    if small.packed_weight is None:
        pytest.skip("this torch build has no oneDNN linear ops")
    assert large.packed_weight is not None
    assert sorted(calls) == [(32, 64, rows) for rows in WARMED_ROW_COUNTS]
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(large(x), F.linear(x, large.weight), rtol=1e-5, atol=1e-5)


class _OpNames(TorchDispatchMode):
    """Records the name of every op dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_up_to_three_rows_run_on_mkl_and_the_small_batches_above_on_the_packed_weight() -> None:
    """Rows 1..GEMV_MAX_ROWS (a decode step of up to three sequences) and above SMALL_BATCH_ROWS take the plain
    weight (MKL); the rows between take oneDNN's packed one."""
    linear = Linear(48, 80, bias=True)
    prepare_linears(linear)
    if linear.packed_weight is None:
        pytest.skip("this torch build has no oneDNN linear ops")
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 8, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1):
        with torch.no_grad(), _OpNames() as ops:
            linear(torch.randn(rows, 48))
        packed = any("_linear_pointwise" in name for name in ops.names)
        assert packed == (GEMV_MAX_ROWS < rows <= SMALL_BATCH_ROWS), (rows, ops.names)


def _recorded_forward_calls(monkeypatch) -> list[tuple[int, int, int]]:
    """Linear.forward records (in_features, out_features, rows) of each call into the returned list."""
    calls: list[tuple[int, int, int]] = []
    plain_forward = Linear.forward

    def recording_forward(self: Linear, x: torch.Tensor) -> torch.Tensor:
        calls.append((self.in_features, self.out_features, x.shape[0]))
        return plain_forward(self, x)

    monkeypatch.setattr(Linear, "forward", recording_forward)
    return calls
