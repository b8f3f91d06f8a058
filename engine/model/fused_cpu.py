"""Fused CPU float32 kernels (numba) for the decoder's elementwise glue, each beside its torch reference.

In plain torch a residual add and the RMSNorm after it are six passes over the hidden states (add, pow, mean,
rsqrt, two multiplies), and the rotary embedding five over q and k (two multiplies, a negation, a concatenation,
an add): each pass a full read and write of the rows on the prefill path, a dispatch of a few microseconds on the
decode path. Here each is one pass, row by row, over as many threads as torch uses:

- add_rms_norm_(residual, delta, weight, eps): residual += delta in place, returns rms_norm(residual) * weight;
- rms_norm(x, weight, eps): the same without the add (the first layer's input);
- rotate_(qk, cos, sin): Neox-style rotation of q and k in place, inside the fused qkv projection's output.

A 512-token prefill of SmolLM2 (30 layers) spent ~1.3 ms a layer in those ops; with these kernels it takes 689-692
ms against 733-761 ms (alternating runs on a 2-core host, docs/benchmarks.md); decode steps, where each op is a
dispatch more than a pass, did not move measurably. The norm sums
its squares in float32 in another order than torch's mean (a relative difference of ~1e-7, as between two BLAS
libraries); the rotation computes what the reference computes, the same roundings in the same order.

AVAILABLE is False when numba is missing: the model then calls the references.
"""
from __future__ import annotations

import types

import numpy as np
import torch

try:
    import numba
    from numba import njit, prange
    AVAILABLE = True
except ImportError:
    AVAILABLE = False

PARALLEL_ROWS = 32  # fewer rows (decode steps) run on the calling thread: a parallel launch costs more


def supports(x: torch.Tensor) -> bool:
    """Whether the fused kernels take x: a CPU float32 tensor whose last dimension is contiguous."""
    return AVAILABLE and x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1


# ---- references (the GPU path, and what the kernels are tested against) ------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, in float32 like Hugging Face's LlamaRMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta); nothing is changed in place."""
    summed = residual + delta
    return rms_norm_reference(summed, weight, eps), summed


def rotate_reference(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk: [T, heads, D]; cos, sin: [T, 1, D]. qk * cos + rotate_half(qk) * sin, a new tensor."""
    half = qk.shape[-1] // 2
    return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin


# ---- the kernels -------------------------------------------------------------------------------------------------
def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual, delta: [T, hidden] (supports() both). Adds delta into residual in place and returns
    rms_norm(residual) * weight as a new [T, hidden] tensor."""
    out = torch.empty_like(residual)
    _launch(_add_rms_norm_rows, residual.shape[0], residual.numpy(), delta.numpy(), weight.detach().numpy(),
            np.float32(eps), out.numpy())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] (supports(x)). rms_norm(x) * weight as a new tensor; x is unchanged."""
    out = torch.empty_like(x)
    _launch(_rms_norm_rows, x.shape[0], x.numpy(), weight.detach().numpy(), np.float32(eps), out.numpy())
    return out


def rotate_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk: [T, heads, D], each row's heads contiguous (a view into the qkv projection's output is fine);
    cos, sin: [T, 1, D]. Rotates qk in place and returns it."""
    _launch(_rotate_rows, qk.shape[0], qk.numpy(), cos.squeeze(1).numpy(), sin.squeeze(1).numpy())
    return qk


def _launch(kernel, num_rows: int, *args) -> None:
    if num_rows >= PARALLEL_ROWS:
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        kernel[1](*args)
    else:
        kernel[0](*args)


def _serial_and_parallel(row_loop, fastmath: bool = True):
    """(serial, parallel) compilations of a kernel written with prange over rows. Each compiles a copy of the
    function under a name of its own: numba's on-disk cache is keyed by the function's name and line, not by
    the compile options, and would hand one variant the other's machine code."""
    options = dict(fastmath=fastmath, boundscheck=False, nogil=True, cache=True)
    return (njit(**options)(_renamed(row_loop, "serial")),
            njit(parallel=True, **options)(_renamed(row_loop, "parallel")))


def _renamed(function, suffix: str):
    copy = types.FunctionType(function.__code__, function.__globals__, f"{function.__name__}_{suffix}",
                              function.__defaults__, function.__closure__)
    copy.__qualname__ = f"{function.__qualname__}_{suffix}"
    return copy


if AVAILABLE:
    @njit(fastmath=True, boundscheck=False, nogil=True, inline="always", cache=True)
    def _norm_row(x, row, weight, eps, out):  # pragma: no cover (compiled)
        hidden = x.shape[1]
        total = np.float32(0.0)
        for i in range(hidden):
            total += x[row, i] * x[row, i]
        scale = np.float32(1.0) / np.sqrt(total / np.float32(hidden) + eps)
        for i in range(hidden):
            out[row, i] = weight[i] * (x[row, i] * scale)

    def _add_rms_norm_loop(residual, delta, weight, eps, out):  # pragma: no cover (compiled)
        for row in prange(residual.shape[0]):
            for i in range(residual.shape[1]):
                residual[row, i] += delta[row, i]
            _norm_row(residual, row, weight, eps, out)

    def _rms_norm_loop(x, weight, eps, out):  # pragma: no cover (compiled)
        for row in prange(x.shape[0]):
            _norm_row(x, row, weight, eps, out)

    @njit(boundscheck=False, nogil=True, inline="always", cache=True)
    def _rotate_row(qk, row, cos, sin):  # pragma: no cover (compiled); no fastmath: the reference's roundings
        half = qk.shape[2] // 2
        for h in range(qk.shape[1]):
            for i in range(half):
                first, second = qk[row, h, i], qk[row, h, i + half]
                qk[row, h, i] = first * cos[row, i] + (-second) * sin[row, i]
                qk[row, h, i + half] = second * cos[row, i + half] + first * sin[row, i + half]

    def _rotate_loop(qk, cos, sin):  # pragma: no cover (compiled)
        for row in prange(qk.shape[0]):
            _rotate_row(qk, row, cos, sin)

    _add_rms_norm_rows = _serial_and_parallel(_add_rms_norm_loop)
    _rms_norm_rows = _serial_and_parallel(_rms_norm_loop)
    _rotate_rows = _serial_and_parallel(_rotate_loop, fastmath=False)
