"""Paged decode attention in Triton: one query token per sequence, K/V read through the block tables.

One program serves one (sequence, KV head, context partition): the query heads of that KV head's group
are the rows of one tile (grouped-query attention without repeating K/V), keys and values are gathered
slot by slot from the pool (no copied context, no padding to the longest sequence), scores accumulate
in fp32 with an online softmax. At a small batch each context is split into partitions that run in parallel
(flash-decoding); one more launch (`_merge_kernel`, one program per (sequence, head)) merges their partial
results and writes the output in its dtype: two launches per decode, whatever the partitions
(`merge_partitions_reference` is the torch reference beside it).

The grid has P partitions per sequence, chosen per step from the batch and the device; each sequence cuts its
own context into at most P partitions of whole key tiles (`tokens_per_partition`), read on the device from its
length. So a CUDA graph captured for the longest context still spreads a short one over several programs (a
128-token context at batch 1 over 4 programs of one tile, not one program of four), and the programs past a
context's end store nothing.

Nothing here is compiled per step (issue 27): the partition count, the block tables' row stride and
the metadata pointers (views into the step's staging buffer, 8-byte aligned) are runtime values
(`do_not_specialize`, `do_not_specialize_on_alignment`); every constexpr is fixed by the model, the pool and the
dtype. So a batch of any size over contexts of any length runs the kernels compiled for the first one.
Imported only when the triton backend is chosen (importing triton reads TRITON_INTERPRET then).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MIN_TILE = 16  # tl.dot needs every tile dimension >= 16 on GPUs
MERGE_BLOCK_P = 32  # partitions the merge kernel reads at a time (a loop over more: no constexpr from the batch)
# Integer arguments that change from step to step, and pointers into the step's staging buffer (8-byte aligned,
# 16 or not depending on the step's counts): runtime values, so that no step compiles a kernel of its own.
STEP_INTS = ["stride_bt", "num_partitions"]
STEP_POINTERS = ["block_tables_ptr", "seq_lens_ptr"]


@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=STEP_POINTERS)
def _decode_partition_kernel(
        acc_ptr, max_ptr, sum_ptr,  # partials: acc [B, H, P, BLOCK_D], max and sum [B, H, P], fp32
        q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, scale,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
        num_heads, num_partitions,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    partition = _tokens_per_partition(seq_len, num_partitions, BLOCK_N)
    start = part * partition
    if part > 0 and start >= seq_len:  # past this context's end: the merge reads no partials of it
        return
    offs_g, offs_d, offs_n = tl.arange(0, GROUP_PAD), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask, d_mask = offs_g < GROUP, offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G, D]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    end = tl.minimum(start + partition, seq_len)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [N, D]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])  # [G, N]
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)  # [N, D]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    row = (seq * num_heads + heads) * num_partitions + part  # [G] index into [B, H, P]
    tl.store(max_ptr + row, m_i, mask=g_mask)
    tl.store(sum_ptr + row, l_i, mask=g_mask)
    tl.store(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _tokens_per_partition(seq_len, num_partitions, BLOCK_N: tl.constexpr):
    """A context of seq_len tokens cut into at most num_partitions partitions of whole BLOCK_N-key tiles."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_partitions), BLOCK_N), 1) * BLOCK_N


def tokens_per_partition(seq_len: int, num_partitions: int, block_n: int) -> int:
    """_tokens_per_partition on the host (tests, references): ceil(seq_len / P) rounded up to whole key tiles."""
    per_partition = -(-seq_len // num_partitions)  # ceil
    return max(-(-per_partition // block_n), 1) * block_n


@dataclass(frozen=True)
class DecodeScratch:
    """One step's flash-decoding plan for B rows: how many partitions the grid has per sequence, and the partials
    the partition kernel writes and the merge reads (acc [B, H, P, BLOCK_D], maxes and sums [B, H, P], fp32). Made
    once per step (decode_scratch) and used by every layer in turn: each layer's merge has read them before the
    next layer's partition kernel writes them (one stream)."""

    num_partitions: int
    acc: torch.Tensor
    maxes: torch.Tensor
    sums: torch.Tensor


def decode_scratch(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                   device: torch.device, num_partitions: int | None = None) -> DecodeScratch:
    """The partitions per sequence (num_partitions, else choose_num_partitions') and the partials' buffers, for
    `batch` rows of contexts of at most max_seq_len tokens."""
    if num_partitions is None:
        num_partitions = choose_num_partitions(batch * num_kv_heads, device)
    num_partitions = max(1, min(num_partitions, -(-max_seq_len // _key_tile(head_dim))))  # no more than its tiles
    block_d = max(MIN_TILE, triton.next_power_of_2(head_dim))
    acc = torch.empty(batch, num_heads, num_partitions, block_d, dtype=torch.float32, device=device)
    maxes = torch.empty(batch, num_heads, num_partitions, dtype=torch.float32, device=device)
    return DecodeScratch(num_partitions, acc, maxes, torch.empty_like(maxes))


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, block_size: int, max_seq_len: int,
                 num_partitions: int | None = None, out: torch.Tensor | None = None,
                 scratch: DecodeScratch | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context. Changes nothing but `out` (and scratch).

    q: [B, H, D]; k_pool, v_pool: [num_slots, H_kv, D]; block_tables: [B, max_blocks] int32;
    seq_lens: [B] int32, the query's own token included (its K/V already in the pool); max_seq_len:
    an upper bound of seq_lens (bounds the partition grid; no host sync). Returns [B, H, D] in q's dtype,
    written into `out` (any [B, H, D] view whose heads are rows) when given. scratch: the step's
    decode_scratch for these B rows (a layer after the first reuses it), else made here (num_partitions: the
    grid's partitions per sequence; default choose_num_partitions').
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    block_d, block_n = max(MIN_TILE, triton.next_power_of_2(head_dim)), _key_tile(head_dim)
    if scratch is None:
        scratch = decode_scratch(batch, num_heads, num_kv_heads, head_dim, max_seq_len, q.device, num_partitions)
    num_partitions = scratch.num_partitions
    _decode_partition_kernel[(batch, num_kv_heads, num_partitions)](
        scratch.acc, scratch.maxes, scratch.sums, q, k_pool, v_pool, block_tables, seq_lens, head_dim ** -0.5,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        block_tables.stride(0), num_heads, num_partitions,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(MIN_TILE, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype))
    if out is None:
        out = torch.empty_like(q)
    _merge_kernel[(batch, num_heads)](out, scratch.acc, scratch.maxes, scratch.sums, seq_lens, out.stride(0),
                                      out.stride(1), num_partitions, HEAD_DIM=head_dim, BLOCK_D=block_d,
                                      BLOCK_N=block_n, BLOCK_P=MERGE_BLOCK_P)
    return out


def _key_tile(head_dim: int) -> int:
    """Keys per tile of the partition kernel's loop."""
    return 32 if max(MIN_TILE, triton.next_power_of_2(head_dim)) <= 128 else 16


@triton.jit(do_not_specialize=["num_partitions"], do_not_specialize_on_alignment=["seq_lens_ptr"])
def _merge_kernel(out_ptr, acc_ptr, max_ptr, sum_ptr, seq_lens_ptr, stride_ob, stride_oh, num_partitions,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """One (sequence, head): sum_p acc_p * exp(max_p - top) / sum_p sum_p * exp(max_p - top), in out's dtype.
    acc: [B, H, P, BLOCK_D]; max, sum: [B, H, P]. Reads only the partitions the sequence's context was cut into
    (ceil(seq_len / _tokens_per_partition), at least one). BLOCK_P partitions at a time: a first pass finds top,
    a second sums (one pass each when they fit)."""
    seq, head, num_heads = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    offs_p, offs_d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    row = (seq * num_heads + head) * num_partitions
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.minimum(tl.maximum(tl.cdiv(seq_len, _tokens_per_partition(seq_len, num_partitions, BLOCK_N)), 1),
                      num_partitions)
    top = tl.max(tl.load(max_ptr + row + offs_p, mask=offs_p < used, other=float("-inf")), 0)
    for p0 in range(BLOCK_P, used, BLOCK_P):  # partition 0 is never empty: top is finite
        p_mask = p0 + offs_p < used
        top = tl.maximum(top, tl.max(tl.load(max_ptr + row + p0 + offs_p, mask=p_mask, other=float("-inf")), 0))
    total = tl.zeros([BLOCK_D], tl.float32)
    denominator = tl.sum(tl.zeros([BLOCK_P], tl.float32), 0)
    for p0 in range(0, used, BLOCK_P):
        parts = p0 + offs_p  # [P]
        p_mask = parts < used
        maxes = tl.load(max_ptr + row + parts, mask=p_mask, other=float("-inf"))
        sums = tl.load(sum_ptr + row + parts, mask=p_mask, other=0.0)
        weights = tl.where(p_mask, tl.exp(maxes - top), 0.0)  # [P]
        acc = tl.load(acc_ptr + (row + parts)[:, None] * BLOCK_D + offs_d[None, :], mask=p_mask[:, None],
                      other=0.0)  # [P, BLOCK_D]
        total += tl.sum(acc * weights[:, None], 0)
        denominator += tl.sum(weights * sums, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, (total / denominator).to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def merge_partitions_reference(acc: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """_merge_kernel in torch. acc: [B, H, P, D] unnormalised partial outputs; maxes, sums: [B, H, P].
    Returns [B, H, D] fp32. Partitions past a sequence's end hold max -inf and sum 0 and weigh nothing."""
    if acc.shape[2] == 1:
        return acc[:, :, 0] / sums
    top = maxes.max(dim=2, keepdim=True).values  # [B, H, 1]; partition 0 is never empty
    weights = torch.exp(maxes - top)  # [B, H, P]
    total = (weights * sums).sum(dim=2, keepdim=True)  # [B, H, 1]
    return (acc * weights.unsqueeze(-1)).sum(dim=2) / total


def choose_num_partitions(num_programs: int, device: torch.device) -> int:
    """Partitions per sequence: one when batch x KV heads already fills the device (two programs per streaming
    multiprocessor), else enough for that (decode_scratch caps them at the context's key tiles)."""
    units = _multiprocessors(device) if device.type == "cuda" else 1
    return max(1, -(-2 * units // max(num_programs, 1)))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 pools must not silently drop to tf32 (greedy equality with fp32 transformers); ignored for bf16
    return "ieee" if dtype == torch.float32 else "tf32"
