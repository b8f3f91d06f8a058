"""KV blocks between a tensor-parallel group's ranks and one full-head tensor on rank 0.

Each rank's pool holds the KV heads of its layout (engine/parallel/layout.py: kv_heads), under the same block ids
on every rank. A KV transfer from or to a group goes through rank 0 (kv_transfer/group_pool.py): before a prefill
group ships a request, `gather_kv_heads` writes the blocks' full heads on rank 0, straight into the staging pool's
blocks when given one (`out`, `out_blocks`); when a decode group admits one, `scatter_kv_heads` writes each rank's
heads of a full-head tensor (or of a staging pool's blocks: `full_blocks`) into its own blocks. Both are
collectives: rank 0 announces them with one KVMove on the step channel (engine/parallel/step_message.py) and its
followers, which run rank 0's messages in order, take part (`run_kv_move`). A step whose message names
stream_blocks gathers every layer of those blocks to rank 0 as soon as the forward has written it
(`gather_layer_heads`, on every rank from the forward's layer callback): a prefill group's layer-streamed transfer.
Heads replicated on several ranks (fewer KV heads than ranks) are taken from the first rank that holds them
(written once) and written to every rank holding them.

Bytes on rank 0: a gather receives every rank's heads (the collective's buffers) and writes each head once into
its destination, no merged tensor between; a scatter reads each rank's heads of the source blocks once into that
rank's part, and each rank receives and writes only its own heads.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import ModelConfig
from engine.kv.kv_cache import KVCache
from engine.parallel.group import TPGroup
from engine.parallel.layout import tp_layout
from engine.parallel.step_message import KV_GATHER, KV_SCATTER, KVMove, StepChannel

Blocks = Sequence[int] | torch.Tensor  # block ids of a pool: a list, or [n] long on the pool's device
BlockIndex = int | torch.Tensor  # the first of n consecutive blocks (a slice), or their ids [n]


def full_head_shape(kv_cache: KVCache, num_kv_heads: int, num_blocks: int) -> tuple[int, ...]:
    """[L, 2, num_blocks, block_size, num_kv_heads, head_dim]: num_blocks blocks of the model's every KV head."""
    layers, _, _, block_size, _, head_dim = kv_cache.kv.shape
    return (layers, 2, num_blocks, block_size, num_kv_heads, head_dim)


def gather_kv_heads(channel: StepChannel, kv_cache: KVCache, model_config: ModelConfig, block_ids: list[int],
                    copies: tuple[list[int], list[int]] = ((), ()), out: torch.Tensor | None = None,
                    out_blocks: Blocks | None = None) -> torch.Tensor:
    """Rank 0: the KV of block_ids with every head of the model, on the group's device; returns it.
    Without out: a new [L, 2, n, block_size, num_kv_heads, head_dim]. With out, a full-head pool on the group's
    device ([L, 2, N, block_size, num_kv_heads, head_dim], e.g. GroupStaging.kv) and out_blocks (n of its block
    ids): every head of block_ids[i] is written once, straight into out's block out_blocks[i] (no merged tensor
    between), the rest of out is unchanged, and out is returned. copies: block copies rank 0 made since its last
    message, which the followers make first. Reads every rank's pool, changes none (but the copies)."""
    channel.send_kv_move(KVMove(KV_GATHER, list(block_ids), copies))
    parts = channel.group.gather(_read_blocks(kv_cache, block_ids))  # size x [L, 2, n, bs, h, D]
    if out is None:
        out = parts[0].new_empty(full_head_shape(kv_cache, model_config.num_kv_heads, len(block_ids)))
    _write_heads(parts, model_config, out, 2, _block_index(out_blocks, len(block_ids), out.device))
    return out


def scatter_kv_heads(channel: StepChannel, kv_cache: KVCache, model_config: ModelConfig, block_ids: list[int],
                     full: torch.Tensor, copies: tuple[list[int], list[int]] = ((), ()),
                     full_blocks: Blocks | None = None) -> None:
    """Rank 0: write the full-head KV of n = len(block_ids) blocks into block_ids of every rank's pool, each rank
    its own heads (copies as gather_kv_heads). full: [L, 2, n, block_size, num_kv_heads, head_dim], or with
    full_blocks a full-head pool [L, 2, N, ...] (e.g. GroupStaging.kv) whose blocks full_blocks[i] go to
    block_ids[i]. Each rank's heads are read once into its part of a scatter (each rank receives only its
    heads: 1/size of the bytes a broadcast of every head would send it). Changes only block_ids of the pools;
    full is unchanged."""
    channel.send_kv_move(KVMove(KV_SCATTER, list(block_ids), copies))
    group, n = channel.group, len(block_ids)
    index = _block_index(full_blocks, n, full.device)
    parts = []
    for rank in range(group.size):
        lo, hi = tp_layout(model_config, rank, group.size).kv_heads
        heads = _read_pool(full[..., lo:hi, :], 2, index, n)  # [L, 2, n, bs, h, D]: a view, or one index_select
        parts.append(heads.to(kv_cache.kv.device).contiguous())
    group.scatter(parts, torch.empty_like(parts[0]))
    _write_blocks(kv_cache, block_ids, parts[0])


def run_kv_move(move: KVMove, group: TPGroup, kv_cache: KVCache, model_config: ModelConfig) -> None:
    """A follower's part of rank 0's gather_kv_heads / scatter_kv_heads."""
    if move.copies[0]:
        kv_cache.copy_blocks(list(move.copies[0]), list(move.copies[1]))
    if move.kind == KV_GATHER:
        group.gather(_read_blocks(kv_cache, move.block_ids))
        return
    lo, hi = kv_cache.head_range
    mine = torch.empty(full_head_shape(kv_cache, hi - lo, len(move.block_ids)), dtype=kv_cache.kv.dtype,
                       device=kv_cache.kv.device)  # [L, 2, n, bs, h, D]: this rank's heads
    group.scatter(None, mine)
    _write_blocks(kv_cache, move.block_ids, mine)


def gather_layer_heads(group: TPGroup, kv_cache: KVCache, model_config: ModelConfig, layer: int,
                       ids: torch.Tensor, out: torch.Tensor | None = None,
                       out_blocks: Blocks | None = None) -> torch.Tensor | None:
    """Every rank, at the same layer of the same forward: layer `layer` of blocks `ids` ([n] on the pool's device)
    with every head of the model, on rank 0; None on the others. Rank 0 returns a new [2, n, block_size,
    num_kv_heads, head_dim], or with out (one layer of a full-head pool, [2, N, block_size, num_kv_heads, head_dim])
    writes every head once straight into its blocks out_blocks (n ids) and returns out (the rest unchanged)."""
    parts = group.gather(kv_cache.kv[layer].index_select(1, ids))  # size x [2, n, bs, h, D] on rank 0
    if parts is None:
        return None
    if out is None:
        out = parts[0].new_empty(parts[0].shape[:-2] + (model_config.num_kv_heads, parts[0].shape[-1]))
    _write_heads(parts, model_config, out, 1, _block_index(out_blocks, len(ids), out.device))
    return out


def _write_heads(parts: list[torch.Tensor], model_config: ModelConfig, out: torch.Tensor, dim: int,
                 index: BlockIndex) -> None:
    """Every rank's heads (parts: [..., n, ..., h, D] each, rank order, blocks on dim `dim`) into out's blocks
    `index` ([..., N, ..., num_kv_heads, D]): one copy per rank, of the heads no earlier rank holds (a replicated
    head is written once, from its first holder)."""
    written = 0  # heads [0, written) are in out; a rank's heads start at or after its predecessor's
    for rank, part in enumerate(parts):
        lo, hi = tp_layout(model_config, rank, len(parts)).kv_heads
        if hi > written:
            # [..., N, ..., hi - written, D] of out <- [..., n, ..., hi - written, D] of the rank's part
            _write_pool(out[..., written:hi, :], dim, index, part[..., written - lo:hi - lo, :])
            written = hi


def _block_index(blocks: Blocks | None, n: int, device: torch.device) -> BlockIndex:
    """Where n blocks are in a pool: the first one when they are consecutive (None: blocks 0..n-1), else their ids
    as a long tensor on `device` (a tensor is taken as it is: its values are not read back)."""
    if blocks is None or isinstance(blocks, torch.Tensor):
        return 0 if blocks is None else blocks
    blocks = list(blocks)
    first = blocks[0] if blocks else 0
    if blocks == list(range(first, first + len(blocks))):
        return first
    return torch.tensor(blocks, dtype=torch.long, device=device)  # [n]


def _read_pool(pool: torch.Tensor, dim: int, index: BlockIndex, n: int) -> torch.Tensor:
    """n blocks of pool along dim: a view when they are consecutive, else one index_select (a copy)."""
    return pool.narrow(dim, index, n) if isinstance(index, int) else pool.index_select(dim, index)


def _write_pool(pool: torch.Tensor, dim: int, index: BlockIndex, values: torch.Tensor) -> None:
    """values' blocks (along dim) into pool's blocks `index`, in place: one copy (a slice, or one index_copy_)."""
    if isinstance(index, int):
        pool.narrow(dim, index, values.shape[dim]).copy_(values)
    else:
        pool.index_copy_(dim, index, values)


def _read_blocks(kv_cache: KVCache, block_ids: list[int]) -> torch.Tensor:
    index = _block_index(block_ids, len(block_ids), kv_cache.kv.device)
    return _read_pool(kv_cache.kv, 2, index, len(block_ids)).contiguous()  # [L, 2, n, bs, h, D]


def _write_blocks(kv_cache: KVCache, block_ids: list[int], heads: torch.Tensor) -> None:
    """This rank's heads of n blocks ([L, 2, n, bs, h, D]) into block_ids of its pool."""
    index = _block_index(block_ids, len(block_ids), kv_cache.kv.device)
    _write_pool(kv_cache.kv, 2, index, heads.to(kv_cache.kv.device))
