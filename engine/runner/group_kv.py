"""KV blocks between a tensor-parallel group's ranks and one full-head tensor on rank 0.

Each rank's pool holds the KV heads of its layout (engine/parallel/layout.py: kv_heads), under the same block ids
on every rank. A KV transfer from or to a group goes through rank 0 (kv_transfer/group_pool.py): before a prefill
group ships a request, `gather_kv_heads` assembles the blocks' full heads on rank 0; when a decode group admits
one, `scatter_kv_heads` writes each rank's heads of a full-head tensor into its own blocks. Both are collectives:
rank 0 announces them with one KVMove on the step channel (engine/parallel/step_message.py) and its followers,
which run rank 0's messages in order, take part (`run_kv_move`). A step whose message names stream_blocks gathers
every layer of those blocks to rank 0 as soon as the forward has written it (`gather_layer_heads`, on every rank
from the forward's layer callback): a prefill group's layer-streamed transfer. Heads replicated on several ranks
(fewer KV heads than ranks) are taken from the first rank that holds them and written to every rank holding them.
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kv.kv_cache import KVCache
from engine.parallel.group import TPGroup
from engine.parallel.layout import tp_layout
from engine.parallel.step_message import KV_GATHER, KV_SCATTER, KVMove, StepChannel


def full_head_shape(kv_cache: KVCache, num_kv_heads: int, num_blocks: int) -> tuple[int, ...]:
    """[L, 2, num_blocks, block_size, num_kv_heads, head_dim]: num_blocks blocks of the model's every KV head."""
    layers, _, _, block_size, _, head_dim = kv_cache.kv.shape
    return (layers, 2, num_blocks, block_size, num_kv_heads, head_dim)


def gather_kv_heads(channel: StepChannel, kv_cache: KVCache, model_config: ModelConfig, block_ids: list[int],
                    copies: tuple[list[int], list[int]] = ((), ())) -> torch.Tensor:
    """Rank 0: the KV of block_ids with every head of the model, [L, 2, n, block_size, num_kv_heads, head_dim], on
    the group's device. copies: block copies rank 0 made since its last message, which the followers make first.
    Reads every rank's pool, changes none (but the copies)."""
    group = channel.group
    channel.send_kv_move(KVMove(KV_GATHER, list(block_ids), copies))
    return _merge_heads(group.gather(_read_blocks(kv_cache, block_ids)), model_config)  # size x [L, 2, n, bs, h, D]


def scatter_kv_heads(channel: StepChannel, kv_cache: KVCache, block_ids: list[int], full: torch.Tensor,
                     copies: tuple[list[int], list[int]] = ((), ())) -> None:
    """Rank 0: write full ([L, 2, n, block_size, num_kv_heads, head_dim], n = len(block_ids)) into block_ids of
    every rank's pool, each rank its own heads (copies as gather_kv_heads). Changes only those blocks."""
    channel.send_kv_move(KVMove(KV_SCATTER, list(block_ids), copies))
    channel.group.broadcast_(full.to(kv_cache.kv.device).contiguous())
    _write_blocks(kv_cache, block_ids, full)


def run_kv_move(move: KVMove, group: TPGroup, kv_cache: KVCache, model_config: ModelConfig) -> None:
    """A follower's part of rank 0's gather_kv_heads / scatter_kv_heads."""
    if move.copies[0]:
        kv_cache.copy_blocks(list(move.copies[0]), list(move.copies[1]))
    if move.kind == KV_GATHER:
        group.gather(_read_blocks(kv_cache, move.block_ids))
        return
    full = torch.empty(full_head_shape(kv_cache, model_config.num_kv_heads, len(move.block_ids)),
                       dtype=kv_cache.kv.dtype, device=kv_cache.kv.device)
    group.broadcast_(full)
    _write_blocks(kv_cache, move.block_ids, full)


def gather_layer_heads(group: TPGroup, kv_cache: KVCache, model_config: ModelConfig, layer: int,
                       ids: torch.Tensor) -> torch.Tensor | None:
    """Every rank, at the same layer of the same forward: layer `layer` of blocks `ids` ([n] on the pool's device)
    with every head of the model, on rank 0 ([2, n, block_size, num_kv_heads, head_dim]); None on the others."""
    parts = group.gather(kv_cache.kv[layer].index_select(1, ids))  # size x [2, n, bs, h, D] on rank 0
    return None if parts is None else _merge_heads(parts, model_config)


def _merge_heads(parts: list[torch.Tensor], model_config: ModelConfig) -> torch.Tensor:
    """Every rank's heads ([..., h, D] each, rank order) as one tensor of the model's heads ([..., num_kv_heads, D]);
    a replicated head is taken from its first holder (written last)."""
    first = parts[0]
    full = first.new_empty(first.shape[:-2] + (model_config.num_kv_heads, first.shape[-1]))
    for rank in reversed(range(len(parts))):
        lo, hi = tp_layout(model_config, rank, len(parts)).kv_heads
        full[..., lo:hi, :] = parts[rank]
    return full


def _read_blocks(kv_cache: KVCache, block_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.kv.device)
    return kv_cache.kv.index_select(2, ids)  # [L, 2, n, bs, h, D]


def _write_blocks(kv_cache: KVCache, block_ids: list[int], full: torch.Tensor) -> None:
    lo, hi = kv_cache.head_range
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.kv.device)
    kv_cache.kv.index_copy_(2, ids, full[..., lo:hi, :].to(kv_cache.kv.device))  # [L, 2, n, bs, h, D]
