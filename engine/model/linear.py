"""Linear: nn.Linear that picks the faster CPU matmul for the number of rows it gets.

On CPU in float32, MKL's sgemm is slow for the few-row matmuls of decode steps (measured here: a
8-row step of the benchmark model runs 2.3x faster, a 32-row one 1.5x, through oneDNN with weights
reordered ahead of time into its blocked layout). Large prefill batches are as fast or faster on MKL.
So after loading, prepare() keeps a oneDNN-packed copy of the weight next to the plain one, and
forward() uses it for batches of GEMV_MAX_ROWS + 1 to SMALL_BATCH_ROWS rows. One to three rows (a decode step of
up to three sequences, its LM head) stay on MKL: its matrix-vector path streams the plain weight at the host's
read bandwidth, where the blocked layout, tuned for 32 rows, reads it slower (SmolLM2-135M's four layer shapes,
30 layers each, cold: 0.88 vs 1.16 ms a layer at one row; decode steps of 1 and 3 sequences 12-20% faster,
alternating in one process, on one thread and on two; at 4 rows oneDNN is ahead again, 44 vs 50 ms a step).
Elsewhere (GPU, bf16/fp16, no oneDNN) it is a plain nn.Linear.

oneDNN builds (JIT-compiles) a kernel for every row count it meets: 0.6-4 ms per distinct weight shape,
measured here, so the first decode step at each new batch size took 12-19 ms instead of 4 (the benchmark
model: four weight shapes), and every stream of that decode worker waited for it. prepare_linears() builds
the kernels of every row count it takes up to WARMED_ROWS (decode batches of 4 to 64) once the weights are loaded,
by running each shape once per row count; a larger count compiles once, at its first step. Rows are not
padded to fewer counts instead: that cost every later step at an odd batch size 5-14% (a decode batch of 5
run as 8). oneDNN caches kernels by shape, not by weight, in a cache of 1,024: SmolLM2 keeps 4 x 61 (below).

Building is cheap (~1 ms per row count and shape), but building by running is not for a large weight: the LM
head of SmolLM2 (49,152 x 576) took 1.24 s of matmuls at 1..64 rows to build ~0.1 s of kernels, a third of the
model's load. A weight whose warm-up would compute more than WARM_BUDGET_MACS multiply-adds is left to build
at its first use, 1-2 ms once per row count: a few percent of that weight's own matmul (the LM head's: 20-40 ms
at 32-64 rows here).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GEMV_MAX_ROWS = 3        # at most this many rows: MKL (matrix-vector); above it, up to SMALL_BATCH_ROWS: oneDNN
SMALL_BATCH_ROWS = 192
PACKING_HINT_ROWS = 32  # the batch size oneDNN tunes its weight layout for
WARMED_ROWS = 64        # prepare_linears() builds oneDNN's kernels for GEMV_MAX_ROWS + 1..WARMED_ROWS rows
WARMED_ROW_COUNTS = range(GEMV_MAX_ROWS + 1, WARMED_ROWS + 1)  # the row counts that run on oneDNN's kernels
WARM_BUDGET_MACS = 8 * 10**9  # ...of the weights whose warm-up (those rows) costs at most this

try:  # the overload itself: called through its packet, every call resolved the overload again (~3 us of ~25)
    _PACKED_LINEAR = torch.ops.mkldnn._linear_pointwise.default
except (AttributeError, RuntimeError):  # a torch build without the oneDNN linear ops
    _PACKED_LINEAR = None


class Linear(nn.Linear):
    """A Linear layer; call prepare() once the weights are final (after loading)."""

    packed_weight: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        """On the meta device nothing is drawn: the weights come from a checkpoint, and the draw would only cost
        the import of torch's decompositions (seconds at start). Elsewhere nn.Linear's initialization."""
        if self.weight.device.type != "meta":
            super().reset_parameters()

    def prepare(self) -> None:
        """Pack the weight for oneDNN when that is the faster small-batch path (CPU float32)."""
        self.packed_weight = None
        weight = self.weight
        if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available()
                or _PACKED_LINEAR is None):
            return
        try:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_HINT_ROWS)
        except (RuntimeError, AttributeError):  # a torch build without the oneDNN linear ops
            self.packed_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_rows, in_features]
        if self.packed_weight is not None and x.dim() == 2 and packed_rows(x.shape[0]):
            bias = None if self.bias is None else self.bias.detach()
            return _PACKED_LINEAR(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def packed_rows(rows: int) -> bool:
    """Whether a CPU float32 matmul of this many rows goes through the oneDNN-packed weight (else MKL)."""
    return GEMV_MAX_ROWS < rows <= SMALL_BATCH_ROWS


def meta_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> Linear:
    """A Linear with unallocated (meta) weights; the model is materialized once, then loaded."""
    return Linear(in_features, out_features, bias=bias, device="meta", dtype=dtype)


def prepare_linears(model: nn.Module) -> None:
    """Call prepare() on every Linear of model (after its weights are loaded), then build oneDNN's kernels
    for the WARMED_ROW_COUNTS of every distinct packed weight shape within WARM_BUDGET_MACS (module docstring)."""
    by_shape: dict[tuple[int, int, bool], Linear] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepare()
            if module.packed_weight is not None:
                by_shape.setdefault((module.in_features, module.out_features, module.bias is not None), module)
    with torch.no_grad():
        for linear in by_shape.values():
            if warm_up_macs(linear.in_features, linear.out_features) > WARM_BUDGET_MACS:
                continue
            for rows in WARMED_ROW_COUNTS:
                # Linear's own forward: a row-parallel layer's all-reduce is no part of building kernels
                Linear.forward(linear, torch.zeros(rows, linear.in_features, dtype=linear.weight.dtype))


def warm_up_macs(in_features: int, out_features: int) -> int:
    """The multiply-adds of running a weight once at each of the WARMED_ROW_COUNTS."""
    return sum(WARMED_ROW_COUNTS) * in_features * out_features
