"""A decoder layer's elementwise work as fused Triton kernels: one launch each where eager torch takes 2-8.

| function | eager torch launches | fused | reference (beside it, and in fused_cpu.py) |
|---|---|---|---|
| `rms_norm` | 8 (float, pow, mean, add, rsqrt, mul, to, mul) | 1 | `fused_cpu.rms_norm_reference` |
| `add_rms_norm_` | 9 (+ the residual add) | 1 | `fused_cpu.add_rms_norm_reference` |
| `silu_mul` | 2 (silu, mul) | 1 | `silu_mul_reference` |
| `rotary_store_` | 10 (RoPE on q and k: mul, neg, cat, mul, add each) + 2 (K/V store) | 1 | `rotary_store_reference` |

Math is float32 inside every kernel (RMSNorm: x.float(), its rms, back to x's dtype, then the weight, as
Hugging Face's LlamaRMSNorm; RoPE: one rounding to the output dtype instead of one per torch op), so a
bfloat16 result may differ from the eager path's in its last bit; float32 agrees to rounding. One program
per token row, so the token count is the grid and never an argument: no step compiles a kernel of its own
(issue 27). Imported only where Triton is installed (CUDA, or CPU tensors under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.model.fused_cpu import rotate_reference


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_o, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:  # residual += delta, in the residual's dtype, written back
        x = (x + tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)).to(x.dtype)
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    normed = (x32 * inv_rms).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] -> x / rms(x) * weight, a new [T, hidden] tensor; one launch."""
    x = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.shape[0]:
        hidden = x.shape[1]
        _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, x.stride(0), x.stride(0), out.stride(0), eps,
                                        N=hidden, BLOCK=triton.next_power_of_2(hidden), ADD=False)
    return out


def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual, delta: [T, hidden], residual's rows contiguous. Adds delta into residual in place and
    returns rms_norm(residual) * weight as a new tensor; one launch."""
    if residual.stride(-1) != 1:
        raise ValueError("add_rms_norm_ writes the sum into residual: its rows must be contiguous")
    delta = _rows(delta)
    out = torch.empty(residual.shape, dtype=torch.promote_types(residual.dtype, weight.dtype), device=residual.device)
    if residual.shape[0]:
        hidden = residual.shape[1]
        _rms_norm_kernel[(residual.shape[0],)](residual, delta, weight, out, residual.stride(0), delta.stride(0),
                                               out.stride(0), eps, N=hidden, BLOCK=triton.next_power_of_2(hidden),
                                               ADD=True)
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, I: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    for start in range(0, I, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < I
        gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=mask, other=0.0)
        up = tl.load(gate_up_ptr + row * stride_g + I + offs, mask=mask, other=0.0)
        g32 = gate.to(tl.float32)
        silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)  # F.silu's result in the input dtype
        tl.store(out_ptr + row * stride_o + offs, (silu * up).to(gate.dtype), mask=mask)


def silu_mul_reference(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * intermediate] = [gate | up]."""
    return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gate) * up, [T, intermediate]; one launch (eager: two, and a [T, intermediate] temporary)."""
    gate_up = _rows(gate_up)
    out = torch.empty((gate_up.shape[0], intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        _silu_mul_kernel[(gate_up.shape[0],)](gate_up, out, gate_up.stride(0), out.stride(0), I=intermediate,
                                              BLOCK=min(1024, triton.next_power_of_2(intermediate)))
    return out


@triton.jit
def _rotate_(x_ptr, idx, mask, cos_lo, cos_hi, sin_lo, sin_hi, HALF: tl.constexpr):
    """Rotates a token's heads in place (neox: halves [lo | hi] -> [lo cos - hi sin | hi cos + lo sin]), all of
    them at once: idx [HEADS, HALF_BLOCK] are the low halves' offsets, cos/sin [1, HALF_BLOCK]. Returns the rotated
    halves, in x's dtype."""
    lo = tl.load(x_ptr + idx, mask=mask, other=0.0)
    hi = tl.load(x_ptr + HALF + idx, mask=mask, other=0.0)
    lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
    new_lo = (lo32 * cos_lo - hi32 * sin_lo).to(lo.dtype)
    new_hi = (hi32 * cos_hi + lo32 * sin_hi).to(lo.dtype)
    tl.store(x_ptr + idx, new_lo, mask=mask)
    tl.store(x_ptr + HALF + idx, new_hi, mask=mask)
    return new_lo, new_hi


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # any view of a step's slots: one compiled kernel
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_pool_ptr, v_pool_ptr, slot_ptr,
                         stride_qt, stride_kt, stride_vt, stride_ct, stride_ks, stride_vs,
                         H: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, HALF_BLOCK: tl.constexpr,
                         H_PAD: tl.constexpr, H_KV_PAD: tl.constexpr):
    """One token: every query head and KV head as one [heads, HALF_BLOCK] tile each (one wide load and store
    instead of a chain of one head after another: a decode step's few tokens are latency, not bandwidth)."""
    token = tl.program_id(0)
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, HALF_BLOCK)[None, :]  # [1, HALF_BLOCK]
    half_mask = offs < HALF
    cos_lo = tl.load(cos_ptr + token * stride_ct + offs, mask=half_mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + token * stride_ct + HALF + offs, mask=half_mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + token * stride_ct + offs, mask=half_mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + token * stride_ct + HALF + offs, mask=half_mask, other=0.0).to(tl.float32)
    heads = tl.arange(0, H_PAD)[:, None]  # [H_PAD, 1]
    _rotate_(q_ptr + token * stride_qt, heads * D + offs, (heads < H) & half_mask, cos_lo, cos_hi, sin_lo, sin_hi,
             HALF)
    kv_heads = tl.arange(0, H_KV_PAD)[:, None]  # [H_KV_PAD, 1]
    kv_idx, kv_mask = kv_heads * D + offs, (kv_heads < H_KV) & half_mask  # [H_KV_PAD, HALF_BLOCK]
    k_lo, k_hi = _rotate_(k_ptr + token * stride_kt, kv_idx, kv_mask, cos_lo, cos_hi, sin_lo, sin_hi, HALF)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:  # padding rows of a captured graph point at -1: nothing is written
        k_dst = k_pool_ptr + slot * stride_ks
        tl.store(k_dst + kv_idx, k_lo, mask=kv_mask)
        tl.store(k_dst + HALF + kv_idx, k_hi, mask=kv_mask)
        v_src, v_dst = v_ptr + token * stride_vt, v_pool_ptr + slot * stride_vs
        tl.store(v_dst + kv_idx, tl.load(v_src + kv_idx, mask=kv_mask), mask=kv_mask)
        tl.store(v_dst + HALF + kv_idx, tl.load(v_src + HALF + kv_idx, mask=kv_mask), mask=kv_mask)


def rotary_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """RoPE on q and k (in place), then k_pool[slot] = k, v_pool[slot] = v for every token whose slot >= 0."""
    q.copy_(rotate_reference(q, cos, sin))
    k.copy_(rotate_reference(k, cos, sin))
    keep = slot_mapping >= 0
    k_pool[slot_mapping[keep]] = k[keep]
    v_pool[slot_mapping[keep]] = v[keep]


def rotary_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """One launch: rotates q [T, H, D] and k [T, H_kv, D] in place (neox RoPE; cos, sin: [T, 1, D] or [T, D])
    and writes k and v [T, H_kv, D] into k_pool / v_pool [num_slots, H_kv, D] at slot_mapping [T] (int64;
    a negative slot writes nothing). Each token's heads must be contiguous in q, k and v."""
    num_tokens, heads, head_dim = q.shape
    if num_tokens == 0:
        return
    if head_dim % 2 or any(t.stride(2) != 1 or t.stride(1) != head_dim for t in (q, k, v)):
        raise ValueError("rotary_store_ needs an even head_dim and each token's heads contiguous")
    cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    _rotary_store_kernel[(num_tokens,)](
        q, k, v, cos, sin, k_pool, v_pool, slot_mapping, q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
        k_pool.stride(0), v_pool.stride(0), H=heads, H_KV=k.shape[1], D=head_dim,
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2), H_PAD=max(2, triton.next_power_of_2(heads)),
        H_KV_PAD=max(2, triton.next_power_of_2(k.shape[1])))
