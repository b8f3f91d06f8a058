"""KV-aware routing of disaggregated requests to decode workers (as Dynamo's KV router scores them).

A decode worker keeps the KV of what it decoded in its prefix cache (the prompt, and the blocks its generated
tokens completed), and a request whose prompt starts with those blocks ships only the rest (decoder-side
prefix reuse, docs/kv_transfer.md). The coordinator keeps an approximate index of which decode worker was
given which leading blocks (DecodePrefixIndex: the prompt once the worker accepted it, prompt + output when
the request finished there); it is a hint: the worker's own match at expect() decides what travels. The
decode workers are ordered by a cost in blocks, lowest first:

    cost = kv_overlap_weight * (prompt blocks - blocks the worker is known to hold) - its free blocks

(Dynamo: overlap_score_weight * prefill blocks + active blocks). So the holder of the longest prefix wins
unless its free blocks (the pool less what the requests routed there may hold) trail another worker's by
more than weight x the blocks its prefix saves: then load wins. Workers that cannot hold the request go
last; ties go to fewer running requests, then the name. With no overlap anywhere this is the plain load
order (most free blocks first).
"""
from __future__ import annotations

from cluster.coordinator.prefix_affinity import PrefixAffinity
from cluster.coordinator.worker_loads import DecodeLoad

DECODE_INDEX_BLOCKS = 1024      # leading blocks of a prompt the index remembers (16k tokens of 16)
DECODE_INDEX_CAPACITY = 1 << 18  # chained block hashes kept (LRU)


class DecodePrefixIndex:
    """Which decode workers were given which leading blocks; see the module docstring."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._index = PrefixAffinity(block_size, max_blocks=DECODE_INDEX_BLOCKS, capacity=DECODE_INDEX_CAPACITY)

    def overlaps(self, token_ids: tuple[int, ...]) -> dict[str, int]:
        """Decode worker -> the leading blocks of token_ids it is known to hold (never the last token's)."""
        return self._index.overlaps(self._index.keys(token_ids))

    def holds(self, token_ids: tuple[int, ...], worker: str) -> None:
        """`worker` holds the KV of token_ids (all but the last token: its KV is computed by the next step)."""
        self._index.remember(self._index.keys(token_ids), worker)

    def forget(self, worker: str) -> None:
        self._index.forget(worker)


def kv_aware_order(loads: list[DecodeLoad], overlaps: dict[str, int], prompt_blocks: int, blocks: int,
                   weight: float) -> list[str]:
    """Names of `loads` (alive decode workers), best first, by the cost of the module docstring. blocks:
    what the request may hold on its decode worker; prompt_blocks: its prompt's blocks."""
    def cost(load: DecodeLoad) -> tuple:
        uncached = prompt_blocks - overlaps.get(load.name, 0)
        return (load.free_blocks < blocks, weight * uncached - load.free_blocks, load.running, load.name)
    return [load.name for load in sorted(loads, key=cost)]
