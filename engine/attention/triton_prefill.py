"""Varlen prefill attention over a paged context, in Triton.

The batch's prefill chunks are packed token-major (cu_seqlens). A chunk of n new tokens follows
num_computed tokens already in the pool (a prefix-cache hit or earlier chunks); its own K/V were written
into the pool before this call. So every query reads all of its keys the same way, straight from the
pool through its block table, with the causal rule on absolute positions: the query at position
num_computed + i sees keys 0 .. num_computed + i. No gathered context, no mask tensor.
One program serves one (chunk, KV head, tile of query tokens): the tile's BLOCK_M rows are its tokens times the KV
head's group of query heads, so grouped-query attention reads each K/V tile once for the group.

Shaped for Hopper (issue 27): 64-128 rows per tile, block sizes / warps / stages autotuned per (head_dim, group,
dtype) and nothing that changes from step to step (one config under the interpreter); the key tiles that every
row of the tile sees run without a mask, the causal diagonal's with one, and no tile past the tile's last query is
read; softmax in base 2, log2(e) folded into the scale. Per-step integers (the first sequence, the block tables'
row stride) and the metadata pointers (views into the step's staging buffer) are runtime values: no step compiles.
Imported only when the triton backend is chosen.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.attention.triton_decode import MIN_TILE, _dot_precision

LOG2_E = 1.4426950408889634
STEP_INTS = ["first_seq", "stride_bt"]
STEP_POINTERS = ["block_tables_ptr", "query_start_ptr", "seq_lens_ptr"]


def tile_configs(interpret: bool) -> list[triton.Config]:
    """The configs the autotuner times on a GPU (query rows x key tile, warps, pipeline stages); under the
    interpreter one config, so that tuning costs nothing there."""
    if interpret:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": rows, "BLOCK_N": keys}, num_warps=4 if rows == 64 else 8, num_stages=stages)
            for rows in (64, 128) for keys in (32, 64) for stages in (2, 3)]


def prune_tiles(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """fp32 pools (exact dots, "ieee": a correctness dtype, not a speed one) try the smallest tile alone: ieee dots
    on large tiles take minutes to compile and spill; the 16-bit dtypes try every config."""
    if kwargs.get("PRECISION") != "ieee":
        return configs
    smallest = min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_stages))
    return [smallest]


def tile_queries(block_m: int, group_pad: int) -> int:
    """Query tokens per tile: BLOCK_M rows over the group's padded heads (at least one token). Host and kernel."""
    return (block_m + group_pad - 1) // group_pad


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, q_pos, qk_scale, n_start, n_end, k_head_ptr, v_head_ptr, table_ptr,
                  stride_ks, stride_vs, offs_n, offs_d, d_mask,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax in base 2 (qk_scale: the softmax scale x log2(e)) of q [M, D] over keys [n_start, n_end),
    BLOCK_N at a time, read through the sequence's table row from one KV head's planes. CAUSAL: key pos is seen
    by the rows whose q_pos >= pos and n_end masks the last tile; else every row sees every key (n_end a multiple
    of BLOCK_N). Returns the updated acc [M, D], m_i [M], l_i [M]."""
    for n0 in range(n_start, n_end, BLOCK_N):
        pos = n0 + offs_n  # [N] absolute key positions
        if CAUSAL:
            n_mask = pos < n_end
            block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=n_mask, other=0)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            block = tl.load(table_ptr + pos // BLOCK_SIZE)
            kv_mask = d_mask[None, :]
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # [N]
        k = tl.load(k_head_ptr + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N] in log2 units
        if CAUSAL:  # key 0 is seen by every row, so no row is left without a key
            scores = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])  # [M, N]
        v = tl.load(v_head_ptr + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.autotune(configs=tile_configs(os.environ.get("TRITON_INTERPRET") == "1"),
                 key=["HEAD_DIM", "GROUP_PAD", "BLOCK_SIZE"], prune_configs_by={"early_config_prune": prune_tiles},
                 cache_results=True)
@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=STEP_POINTERS)
def _prefill_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, qk_scale, first_seq,
        stride_ot, stride_oh, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # rows of the tile: BLOCK_Q query tokens x GROUP_PAD query heads of one KV head (row = token * GROUP_PAD + g)
    BLOCK_Q: tl.constexpr = (BLOCK_M + GROUP_PAD - 1) // GROUP_PAD  # tile_queries()
    ROWS: tl.constexpr = BLOCK_Q * GROUP_PAD
    seq = first_seq + tl.program_id(0)
    kv_head, q_block = tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        num_computed = seq_len - q_len
        offs_r, offs_d, offs_n = tl.arange(0, ROWS), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_N)
        token = q_block * BLOCK_Q + offs_r // GROUP_PAD  # [M] query index within the chunk
        head = kv_head * GROUP + offs_r % GROUP_PAD      # [M]
        row_mask = (token < q_len) & (offs_r % GROUP_PAD < GROUP)
        d_mask = offs_d < HEAD_DIM
        io_mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=io_mask, other=0.0)  # [M, D]
        q_pos = num_computed + token  # [M] absolute positions of the queries
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        first_pos = num_computed + q_block * BLOCK_Q  # the tile's first query sees keys 0 .. first_pos
        seen_by_all = (first_pos + 1) // BLOCK_N * BLOCK_N  # whole key tiles every row sees: no mask
        kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)  # the tile's last query sees this far: no tile past it
        k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
        table = block_tables_ptr + seq * stride_bt
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, q_pos, qk_scale, 0, seen_by_all, k_head, v_head, table,
                                      stride_ks, stride_vs, offs_n, offs_d, d_mask,
                                      BLOCK_SIZE, BLOCK_N, False, PRECISION)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, q_pos, qk_scale, seen_by_all, kv_end, k_head, v_head, table,
                                      stride_ks, stride_vs, offs_n, offs_d, d_mask,
                                      BLOCK_SIZE, BLOCK_N, True, PRECISION)
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
    max_query_len: an upper bound of those sequences' new-token counts (sizes the grid, never the kernel).
    One program per (sequence, KV head, tile of query tokens): the tile's rows are its tokens x the KV head's
    query heads, so each K/V tile is read once for the whole group. The first call per (head_dim, group, block
    size, dtypes) on a GPU autotunes the tile (runs each config on this call's inputs; out is rewritten each time).
    """
    if num_seqs == 0:
        return
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_pool.shape[1]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(MIN_TILE, triton.next_power_of_2(head_dim))

    def grid(meta):
        return num_seqs, num_kv_heads, triton.cdiv(max_query_len, tile_queries(meta["BLOCK_M"], group_pad))
    _prefill_kernel[grid](
        out, q, k_pool, v_pool, block_tables, query_start, seq_lens, head_dim ** -0.5 * LOG2_E, first_seq,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PRECISION=_dot_precision(q.dtype))
