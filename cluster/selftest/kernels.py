"""The attention kernels against the torch reference backend (engine/attention/torch_paths.py).

One mixed step like the engine builds: decode rows (one of a 300-token context) followed by prefill chunks,
fresh and after a cached prefix ending mid-block, grouped-query heads, block tables in scattered order.
Each backend stores the step's K/V into its own copy of the pool and attends; the outputs are compared with
the torch backend's in float32 (max |err|), the pools byte for byte. The Triton decode kernel is also run
split into 64-token partitions (flash-decoding's merge), which a small CPU run would otherwise never take.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from cluster.selftest.results import Outcome, skipped, verdict

SPECS = ((4, 1), (300, 1), (37, 1), (0, 5), (16, 20), (19, 33))  # (cached tokens, new tokens), decodes first
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 8, 2, 64, 16, 64
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class MixedStep:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    meta: object  # engine.attention.AttentionMetadata


def mixed_step(device: torch.device, dtype: torch.dtype, seed: int = 0) -> MixedStep:
    from engine.attention import build_step_tensors
    from engine.attention.backends import TorchBackend
    from engine.attention.metadata import padded_tables

    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = []
    for cached, new in SPECS:
        count = -(-(cached + new) // BLOCK_SIZE)
        tables.append(order[:count])
        order = order[count:]
    tokens = sum(new for _, new in SPECS)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)
    pool_shape = (NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    meta = build_step_tensors(TorchBackend(), [c for c, _ in SPECS], [n for _, n in SPECS], padded_tables(tables),
                              BLOCK_SIZE, device).meta
    return MixedStep(randn(tokens, HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM),
                     randn(tokens, KV_HEADS, HEAD_DIM), randn(*pool_shape), randn(*pool_shape), meta)


def attend(backend, step: MixedStep, dtype: torch.dtype | None = None):
    """(output, k_pool, v_pool) of backend.forward on copies of the step's tensors (in `dtype` if given)."""
    def copy(t):
        return t.to(dtype or t.dtype, copy=True)
    k_pool, v_pool = copy(step.k_pool), copy(step.v_pool)
    with torch.inference_mode():
        out = backend.forward(copy(step.q), copy(step.k), copy(step.v), k_pool, v_pool, step.meta)
    return out, k_pool, v_pool


def compare(backend, step: MixedStep) -> tuple[float, bool, tuple]:
    """(max |err| of the output vs the float32 torch reference, pools equal, the reference)."""
    from engine.attention.backends import TorchBackend

    reference = attend(TorchBackend(), step, torch.float32)
    out, k_pool, v_pool = attend(backend, step)
    err = (out.float() - reference[0]).abs().max().item()
    pools_equal = torch.equal(k_pool.float(), reference[1]) and torch.equal(v_pool.float(), reference[2])
    return err, pools_equal, reference


def triton_unavailable(ctx) -> str:
    """Why the Triton kernels cannot run on this device in this process ('' when they can)."""
    from engine.attention.backends import triton_available
    if not triton_available():
        return "triton is not installed"
    if ctx.cuda:
        return ""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels run on CPU only under TRITON_INTERPRET=1, which is not set"
    from engine.attention import triton_decode, triton_prefill, triton_store
    kernels = [value for module in (triton_decode, triton_prefill, triton_store) for value in vars(module).values()
               if type(value).__name__ in ("JITFunction", "InterpretedFunction")]
    if any(type(kernel).__name__ != "InterpretedFunction" for kernel in kernels):
        return ("the Triton kernels were imported in this process before TRITON_INTERPRET=1 was set, so they "
                "are not interpreted; run the selftest in a fresh process")
    return ""


def check_triton(ctx, dtype: torch.dtype) -> Outcome:
    if reason := triton_unavailable(ctx):
        return skipped(reason)
    if not ctx.cuda and dtype != torch.float32:
        return skipped("half-precision tl.dot needs a GPU (Triton's CPU interpreter is float32)")
    from engine.attention.backends import TritonBackend

    step = mixed_step(ctx.device, dtype)
    err, pools_equal, reference = compare(TritonBackend(), step)
    split_err = split_decode_error(step, dtype, reference)
    tol = TOLERANCE[dtype]
    return verdict(err <= tol and split_err <= tol and pools_equal,
                   f"store+decode+prefill max |err| {err:.1e} vs torch (tol {tol:g}); decode in 64-token "
                   f"partitions {split_err:.1e}; KV store {'exact' if pools_equal else 'DIFFERS'}",
                   max_abs_err=err, split_decode_max_abs_err=split_err, pools_equal=pools_equal)


def split_decode_error(step: MixedStep, dtype: torch.dtype, reference) -> float:
    """Max |err| of the Triton decode kernel with each context cut into up to 8 partitions, on the reference's
    pools (which hold this step's K/V), against the reference's decode rows."""
    from engine.attention import triton_decode

    rows = step.meta.num_decode_rows
    k_pool, v_pool = reference[1].to(dtype), reference[2].to(dtype)
    split = triton_decode.paged_decode(step.q[:rows], k_pool, v_pool, step.meta.block_tables[:rows],
                                       step.meta.seq_lens[:rows], BLOCK_SIZE, step.meta.decode_len_bound,
                                       num_partitions=8)
    return (split.float() - reference[0][:rows]).abs().max().item()


def check_cpu_kernel(ctx) -> Outcome:
    from engine.attention import paged_decode_cpu
    from engine.attention.backends import CpuKernelBackend

    if not paged_decode_cpu.AVAILABLE:
        return skipped("numba is not installed (the CPU decode kernel is optional)")
    step = mixed_step(torch.device("cpu"), torch.float32)
    err, pools_equal, _ = compare(CpuKernelBackend(), step)
    tol = TOLERANCE[torch.float32]
    return verdict(err <= tol and pools_equal,
                   f"store+decode+prefill max |err| {err:.1e} vs torch (tol {tol:g}); "
                   f"KV store {'exact' if pools_equal else 'DIFFERS'}",
                   max_abs_err=err, pools_equal=pools_equal)
