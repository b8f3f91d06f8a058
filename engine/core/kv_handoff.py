"""The engine's side of a KV hand-off: the block calls that prefill and decode workers make around a transfer.

A decode worker reserves blocks for incoming KV (reserve_blocks) and pins the cached prefix it already holds
(pin_cached_prefix), then admits the request with LLMEngine.add_prefilled_request or gives the blocks back
(free_blocks). A prefill worker's prefill-only request keeps its blocks after its first token until the
transfer takes them (take_prefilled_blocks) or it is dropped (release_prefilled). A tensor-parallel engine's block
ids name the same blocks on every rank (each holding its KV heads); its KV leaves and lands through rank 0
(engine/runner/group_kv.py, kv_transfer/group_pool.py).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.config import EngineConfig
from engine.core.live_requests import LiveRequests
from engine.kv.kv_cache import KVCache
from engine.sequence import Sequence, SequenceStatus


class KVHandoff:
    """Mixed into LLMEngine, which provides these attributes and _check_open()."""

    config: EngineConfig
    kv_cache: KVCache | None
    _live: LiveRequests
    _closed: bool

    def _check_open(self) -> None:
        raise NotImplementedError

    def reserve_blocks(self, num_blocks: int) -> list[int] | None:
        """Allocate blocks for incoming KV (decode side of a transfer); None when the pool is short.
        Safe to call from a transfer thread while another thread steps the engine."""
        self._check_open()
        return self.kv_cache.allocator.allocate(num_blocks)

    def pin_cached_prefix(self, token_ids: Seq[int]) -> list[int]:
        """The cached blocks holding the longest run of token_ids' leading full blocks, never the block of
        the last token (the prefix cache's own rule), each with a reference taken: they cannot be evicted
        until the caller hands them to add_prefilled_request or frees them with free_blocks. Empty without
        prefix caching. Safe to call from any thread (a decode worker matches at expect())."""
        self._check_open()
        max_blocks = (len(token_ids) - 1) // self.config.block_size
        block_ids, _ = self.kv_cache.allocator.lookup_prefix(token_ids, max_blocks)
        return block_ids

    def free_blocks(self, block_ids: Seq[int]) -> None:
        """Return blocks this caller owns: reserved ones never handed to add_prefilled_request, or
        ones taken with take_prefilled_blocks. Safe to call from any thread. A closed engine has nothing
        left to free: the call returns."""
        if self._closed:
            return
        self.kv_cache.allocator.free(block_ids)

    def release_prefilled(self, request_id: str) -> bool:
        """Free the KV blocks a prefill-only request kept for its transfer; False if there are none."""
        seq = self._prefilled(request_id)
        if seq is None:
            return False
        self.kv_cache.allocator.free(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        self._live.remove(seq)
        return True

    def take_prefilled_blocks(self, request_id: str) -> list[int]:
        """Hand a prefill-only result's blocks to the caller (a KV transfer), which must free them
        with free_blocks() once the receiver acknowledged. The request leaves the engine."""
        self._check_open()
        seq = self._prefilled(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} has no prefilled KV blocks to hand over")
        block_ids, seq.block_table = seq.block_table, []
        seq.status = SequenceStatus.FINISHED
        self._live.remove(seq)
        return block_ids

    def _prefilled(self, request_id: str) -> Sequence | None:
        seq = self._live.first(request_id)
        return seq if seq is not None and seq.status == SequenceStatus.PREFILLED else None
