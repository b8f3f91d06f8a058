"""Attention in plain torch over the paged pool: the portable path and the reference the kernels are
tested against.

- decode rows: every single-token query's context is gathered through its block table into a padded
  [B, max_len] batch with a key mask, for one SDPA call;
- prefill chunks, one at a time: causal SDPA on the chunk's own fresh K/V when nothing of it is cached
  yet, else on the gathered slots of its whole context with an offset causal mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
    """q: [B, H, D] of the decode rows; k_pool, v_pool: [num_slots, H_kv, D]. Returns [B, H, D]."""
    batch = meta.num_decode_rows
    lengths = meta.seq_lens_host[:batch]
    max_len = max(lengths)
    slots = context_slots(meta.block_tables[:batch], meta.block_size, max_len)  # [B, L]
    k_ctx = k_pool.index_select(0, slots.reshape(-1)).view(batch, max_len, *k_pool.shape[1:])  # [B, L, H_kv, D]
    v_ctx = v_pool.index_select(0, slots.reshape(-1)).view(batch, max_len, *v_pool.shape[1:])
    mask = None
    if min(lengths) != max_len:
        key_pos = torch.arange(max_len, device=q.device)
        mask = (key_pos.unsqueeze(0) < meta.seq_lens[:batch].unsqueeze(1)).view(batch, 1, 1, max_len)
    out = _sdpa(q.unsqueeze(2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2), mask=mask, causal=False)
    return out.squeeze(2)  # [B, H, D]


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata) -> None:
    """Writes out's rows of every prefill chunk. q, out: [T, H, D]; k, v: [T, H_kv, D] (this step's)."""
    starts = meta.query_start_host
    for seq in range(meta.num_decode_rows, meta.num_seqs):
        start, end, seq_len = starts[seq], starts[seq + 1], meta.seq_lens_host[seq]
        q_span = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        num_computed = seq_len - (end - start)
        if num_computed == 0:
            k_ctx, v_ctx = k[start:end], v[start:end]  # [n, H_kv, D]
            mask, causal = None, True
        else:
            slots = context_slots(meta.block_tables[seq:seq + 1], meta.block_size, seq_len)[0]  # [ctx]
            k_ctx, v_ctx = k_pool.index_select(0, slots), v_pool.index_select(0, slots)
            mask, causal = _offset_causal_mask(num_computed, end - start, seq_len, q.device), False
        span = _sdpa(q_span, k_ctx.transpose(0, 1).unsqueeze(0), v_ctx.transpose(0, 1).unsqueeze(0),
                     mask=mask, causal=causal)  # [1, H, n, D]
        out[start:end] = span.squeeze(0).transpose(0, 1)


def context_slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Pool slots of context positions [0, length) of each row's block table: [rows, length] int64."""
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = block_tables.long().unsqueeze(-1) * block_size + offsets  # [rows, max_blocks, block_size]
    return slots.reshape(block_tables.shape[0], -1)[:, :length]


def _offset_causal_mask(num_computed: int, num_new: int, context_len: int, device) -> torch.Tensor:
    # Query i sits at absolute position num_computed + i and sees keys 0..num_computed + i.
    query_pos = torch.arange(num_computed, num_computed + num_new, device=device)
    key_pos = torch.arange(context_len, device=device)
    return key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [n, ctx]


def _sdpa(q, k, v, mask, causal) -> torch.Tensor:
    # q: [B, H, n, D]; k, v: [B, H_kv, L, D]. Grouped-query heads are expanded by SDPA itself.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])
