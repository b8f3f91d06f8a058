"""KV write into the paged pool in Triton: one program per batch token copies its K and V rows to its slot.

A negative slot means "write nothing": the padding rows of a captured decode graph point there, so a
replay with fewer real sequences than the graph was captured for never touches a block anyone owns.
The slot mapping's alignment is not specialised (a view of any step's buffer launches the same compiled kernel;
issue 27: nothing compiled while serving). Imported only when the triton backend is chosen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_kernel(k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slot_ptr,
                     stride_kt, stride_vt, stride_ks, stride_vs,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        for start in range(0, ROW, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < ROW
            k = tl.load(k_ptr + token * stride_kt + offs, mask=mask)
            v = tl.load(v_ptr + token * stride_vt + offs, mask=mask)
            tl.store(k_pool_ptr + slot * stride_ks + offs, k, mask=mask)
            tl.store(v_pool_ptr + slot * stride_vs + offs, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_pool[slot_mapping[t]] = k[t] (and v) for every token t whose slot is >= 0; other slots untouched.

    k, v: [T, H_kv, D] (each token's heads contiguous); k_pool, v_pool: [num_slots, H_kv, D]; slot_mapping: [T] int64.
    """
    num_tokens, kv_heads, head_dim = k.shape
    row = kv_heads * head_dim
    if num_tokens == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    _store_kv_kernel[(num_tokens,)](k, v, k_pool, v_pool, slot_mapping, k.stride(0), v.stride(0),
                                    k_pool.stride(0), v_pool.stride(0),
                                    ROW=row, BLOCK=min(1024, triton.next_power_of_2(row)))


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    # [T, H_kv, D] slices of the fused qkv projection are strided by token only; anything else is copied
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()
