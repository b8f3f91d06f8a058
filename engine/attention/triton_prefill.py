"""Varlen prefill attention over a paged context, in Triton.

The batch's prefill chunks are packed token-major (cu_seqlens). A chunk of n new tokens follows
num_computed tokens already in the pool (a prefix-cache hit or earlier chunks); its own K/V were written
into the pool before this call. So every query reads all of its keys the same way, straight from the
pool through its block table, with the causal rule on absolute positions: the query at position
num_computed + i sees keys 0 .. num_computed + i. No gathered context, no mask tensor.
One program serves one (chunk, KV head, tile of query tokens): the tile's rows are those tokens times the KV
head's group of query heads, so grouped-query attention reads each K/V tile once for the group.
Imported only when the triton backend is chosen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_decode import MIN_TILE, _dot_precision


@triton.jit
def _prefill_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, scale, first_seq,
        stride_ot, stride_oh, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # rows of the tile: BLOCK_Q query tokens x GROUP_PAD query heads of one KV head (row = token * GROUP_PAD + g)
    seq = first_seq + tl.program_id(0)
    kv_head, q_block = tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        num_computed = seq_len - q_len
        offs_r, offs_d, offs_n = tl.arange(0, BLOCK_Q * GROUP_PAD), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
        token = q_block * BLOCK_Q + offs_r // GROUP_PAD  # [M] query index within the chunk
        head = kv_head * GROUP + offs_r % GROUP_PAD      # [M]
        row_mask = (token < q_len) & (offs_r % GROUP_PAD < GROUP)
        d_mask = offs_d < HEAD_DIM
        io_mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=io_mask, other=0.0)  # [M, D]
        q_pos = num_computed + token  # [M] absolute positions of the queries
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
        kv_end = tl.minimum(seq_len, num_computed + (q_block + 1) * BLOCK_Q)  # the tile's last query sees this far
        for n0 in range(0, kv_end, BLOCK_N):
            pos = n0 + offs_n  # [N]
            n_mask = pos < kv_end
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)  # [N, D], read once for the whole group
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
            visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]  # key 0 is visible to every row
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])  # [M, N]
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)  # [N, D]
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(out: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  block_tables: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                  first_seq: int, num_seqs: int, max_query_len: int, block_size: int) -> None:
    """Causal attention of sequences [first_seq, first_seq + num_seqs) over their paged contexts.

    Writes out's rows of those sequences' queries and nothing else. q, out: [T, H, D] (token-major);
    k_pool, v_pool: [num_slots, H_kv, D] already holding the new tokens' K/V; block_tables: [N, max_blocks]
    int32; query_start: [N + 1] int32 row offsets (cu_seqlens); seq_lens: [N] int32, cached + new tokens;
    max_query_len: an upper bound of those sequences' new-token counts (sizes the grid).
    One program per (sequence, KV head, tile of query tokens): the tile's rows are its tokens x the KV head's
    query heads, so each K/V tile is read once for the whole group.
    """
    if num_seqs == 0:
        return
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_pool.shape[1]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(MIN_TILE, triton.next_power_of_2(head_dim))
    rows = max(64 if block_d <= 64 else 32, group_pad)  # query tokens x heads per tile
    block_q = min(rows // group_pad, max(1, triton.next_power_of_2(max_query_len)))
    block_q = max(block_q, -(-MIN_TILE // group_pad))  # tl.dot needs >= 16 rows
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        out, q, k_pool, v_pool, block_tables, query_start, seq_lens, head_dim ** -0.5, first_seq,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_Q=block_q, BLOCK_N=32, PRECISION=_dot_precision(q.dtype))
