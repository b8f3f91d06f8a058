"""Paged attention over one packed varlen batch.

The batch is token-major: rows [0, num_decode_rows) are single-token queries (decodes, and prompt
chunks of one token), then each prefill chunk occupies a contiguous row span. K/V of every batch
token are first written into the pool at slot_mapping; then
- single-token rows attend, all at once, to their sequence's context: on CPU float32 through the
  numba kernel that reads the pool via the block tables; elsewhere gathered into a padded [B, max_len]
  batch with a key mask for one SDPA call;
- each prefill chunk attends causally: to its own fresh K/V when nothing of it is cached yet, else to
  the gathered slots of its whole context with an offset causal mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import paged_decode_cpu


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill chunk: batch rows [start, end), following num_computed cached tokens."""

    start: int
    end: int
    num_computed: int
    context_slots: torch.Tensor | None  # [num_computed + (end - start)] slots, None if num_computed == 0

    @property
    def num_new(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class DecodeBatch:
    """The single-token rows' contexts, in the form the chosen decode attention reads.

    Kernel path (CPU float32): block_tables + context_lens, read straight from the pool.
    Torch path: slots of every context position padded to the longest, plus a key mask.
    """

    block_tables: torch.Tensor            # [B, max_blocks] int64, 0-padded
    context_lens: torch.Tensor            # [B] int64, the query token included
    block_size: int
    slots: torch.Tensor | None = None     # [B, max_context] (torch path only)
    mask: torch.Tensor | None = None      # [B, 1, 1, max_context] True where a key is real; None if unpadded


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each batch token's K/V goes and what each query attends to; built once per step."""

    slot_mapping: torch.Tensor            # [num_tokens] pool slot of each batch token
    num_decode_rows: int                  # rows [0, B) are single-token queries
    decode: DecodeBatch | None
    prefills: tuple[PrefillSpan, ...]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Store k/v into the pool, then attend. Changes k_pool/v_pool at meta.slot_mapping.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim];
    k_pool, v_pool: [num_slots, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim].
    """
    k_pool.index_copy_(0, meta.slot_mapping, k)
    v_pool.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.num_decode_rows:
        out[:meta.num_decode_rows] = _decode_attention(q[:meta.num_decode_rows], k_pool, v_pool, meta)
    for span in meta.prefills:
        out[span.start:span.end] = _prefill_attention(q, k, v, k_pool, v_pool, span)
    return out


def _decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
    # q: [B, num_heads, head_dim]
    decode = meta.decode
    if decode.slots is None:
        return paged_decode_cpu.paged_decode_attention(q, k_pool, v_pool, decode.block_tables,
                                                       decode.context_lens, decode.block_size)
    batch, max_len = decode.slots.shape
    flat = decode.slots.reshape(-1)
    k_ctx = k_pool.index_select(0, flat).view(batch, max_len, *k_pool.shape[1:])  # [B, L, kv_heads, D]
    v_ctx = v_pool.index_select(0, flat).view(batch, max_len, *v_pool.shape[1:])
    out = _sdpa(q.unsqueeze(2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                mask=decode.mask, causal=False)  # [B, num_heads, 1, D]
    return out.squeeze(2)


def _prefill_attention(q, k, v, k_pool, v_pool, span: PrefillSpan) -> torch.Tensor:
    q_span = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, D]
    if span.context_slots is None:
        k_ctx = k[span.start:span.end]  # [n, kv_heads, D]
        v_ctx = v[span.start:span.end]
        mask, causal = None, True
    else:
        k_ctx = k_pool.index_select(0, span.context_slots)  # [ctx, kv_heads, D]
        v_ctx = v_pool.index_select(0, span.context_slots)
        mask, causal = _offset_causal_mask(span, k_ctx.shape[0], q.device), False
    out = _sdpa(q_span, k_ctx.transpose(0, 1).unsqueeze(0), v_ctx.transpose(0, 1).unsqueeze(0),
                mask=mask, causal=causal)  # [1, num_heads, n, D]
    return out.squeeze(0).transpose(0, 1)


def _offset_causal_mask(span: PrefillSpan, context_len: int, device) -> torch.Tensor:
    # Query i sits at absolute position num_computed + i and sees keys 0..num_computed + i.
    query_pos = torch.arange(span.num_computed, span.num_computed + span.num_new, device=device)
    key_pos = torch.arange(context_len, device=device)
    return key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # [n, ctx]


def _sdpa(q, k, v, mask, causal) -> torch.Tensor:
    # q: [B, H, n, D]; k, v: [B, H_kv, L, D]. Grouped-query heads are expanded by SDPA itself.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])
