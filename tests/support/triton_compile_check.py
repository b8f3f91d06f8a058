"""Compiles every Triton kernel of the engine for a Hopper GPU (sm_90) with Triton's own compiler, on a machine with
no GPU: the check that what the interpreter runs in CI is also valid Triton for a real device (the interpreter
accepts code the compiler rejects). Run in a process without TRITON_INTERPRET:
`python -m tests.support.triton_compile_check [dtype]`; prints one line per compiled variant, exits 1 on a failure.
The prefill kernel compiles with its smallest and largest autotune configs (all of them would take ~40 s)."""
from __future__ import annotations

import os
import sys

import torch

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 14, 2, 128  # Qwen2.5-0.5B's grouping: 7 query heads per KV head


def launch_all(dtype: torch.dtype) -> None:
    """Every kernel once, the way the engine launches them (under dry_launches nothing runs)."""
    from engine.attention import triton_decode, triton_prefill, triton_store
    from engine.model import fused_triton

    k_pool = torch.zeros(64 * BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    tables = torch.zeros(3, 16, dtype=torch.int32)
    seq_lens, starts = torch.tensor([5, 40, 200], dtype=torch.int32), torch.tensor([0, 1, 30, 70], dtype=torch.int32)
    q = torch.zeros(70, HEADS, HEAD_DIM, dtype=dtype)
    triton_decode.paged_decode(q[:3], k_pool, v_pool, tables, seq_lens, BLOCK, 200, num_partitions=4)
    triton_prefill.paged_prefill(torch.empty_like(q), q, k_pool, v_pool, tables, starts, seq_lens, 1, 2, 40, BLOCK)
    k, v, slots = torch.zeros(70, KV_HEADS, HEAD_DIM, dtype=dtype), torch.zeros(70, KV_HEADS, HEAD_DIM, dtype=dtype), \
        torch.zeros(70, dtype=torch.int64)
    triton_store.store_kv(k, v, k_pool, v_pool, slots)
    cos = torch.zeros(70, 1, HEAD_DIM, dtype=dtype)
    fused_triton.rotary_store_(q, k, v, cos, cos, k_pool, v_pool, slots)
    hidden, weight = torch.zeros(70, 896, dtype=dtype), torch.ones(896, dtype=dtype)
    fused_triton.rms_norm(hidden, weight, 1e-6)
    fused_triton.add_rms_norm_(hidden, hidden.clone(), weight, 1e-6)
    fused_triton.silu_mul(torch.zeros(70, 2 * 4864, dtype=dtype), 4864)


def main(dtype_name: str = "bfloat16") -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET: this compiles for a GPU")
        return 2
    from triton.backends.compiler import GPUTarget

    from engine.attention import triton_decode, triton_prefill, triton_store
    from engine.model import fused_triton
    from tests.support.triton_specialisations import compile_launch, dry_launches

    with dry_launches(triton_decode, triton_prefill, triton_store, fused_triton) as launches:
        launch_all(getattr(torch, dtype_name))
    prefill = [i for i, launch in enumerate(launches) if launch[0] == "_prefill_kernel"]
    skipped = set(prefill[1:-1])
    failures = 0
    for i, (name, jit, args, kwargs) in enumerate(launches):
        if i in skipped:
            continue
        tile = {k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages") if k in kwargs}
        try:
            kernel = compile_launch(jit, args, kwargs, GPUTarget("cuda", 90, 32))
            print(f"ok {name} {tile} shared memory {kernel.metadata.shared} B")
        except Exception as error:  # noqa: BLE001 - every failure is reported, then the exit status says it
            failures += 1
            print(f"FAILED {name} {tile}: {type(error).__name__}: {error}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
