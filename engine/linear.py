"""Linear: nn.Linear that picks the faster CPU matmul for the number of rows it gets.

On CPU in float32, MKL's sgemm is slow for the few-row matmuls of decode steps (measured here: a
8-row step of the benchmark model runs 2.3x faster, a 32-row one 1.5x, through oneDNN with weights
reordered ahead of time into its blocked layout). Large prefill batches are as fast or faster on MKL.
So after loading, prepare() keeps a oneDNN-packed copy of the weight next to the plain one, and
forward() uses it for batches of at most SMALL_BATCH_ROWS rows. Elsewhere (GPU, bf16/fp16, no oneDNN)
it is a plain nn.Linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 192
PACKING_HINT_ROWS = 32  # the batch size oneDNN tunes its weight layout for


class Linear(nn.Linear):
    """A Linear layer; call prepare() once the weights are final (after loading)."""

    packed_weight: torch.Tensor | None = None

    def prepare(self) -> None:
        """Pack the weight for oneDNN when that is the faster small-batch path (CPU float32)."""
        self.packed_weight = None
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return
        try:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_HINT_ROWS)
        except (RuntimeError, AttributeError):  # a torch build without the oneDNN linear ops
            self.packed_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_rows, in_features]
        if self.packed_weight is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS:
            bias = None if self.bias is None else self.bias.detach()
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def meta_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> Linear:
    """A Linear with unallocated (meta) weights; the model is materialized once, then loaded."""
    return Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)


def prepare_linears(model: nn.Module) -> None:
    """Call prepare() on every Linear of model (after its weights are loaded)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepare()
