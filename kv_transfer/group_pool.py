"""A tensor-parallel engine's KV as the transfer plane sees it: a pool of full-head blocks on the group's rank 0.

Rank 0's engine pool holds only its own KV heads (its followers hold the others, engine/runner/group_kv.py), so the
plane cannot read or write a request's whole KV there. A group's transfers go through GroupStaging instead, a pool
of blocks with every head of the model on rank 0's device:

    prefill group   stage_out(engine blocks): every rank's heads of the blocks are gathered into staging blocks
                    (one collective), the engine blocks go back to the engine (its prefix cache keeps them), and the
                    transfer sends the staging blocks and frees them when it ends (sender_view).
    decode group    a transfer lands in staging blocks, each paired when allocated with an engine block reserved for
                    the request (receiver_view); land() writes them into the engine blocks, every rank its own heads
                    (one collective), frees the staging blocks and hands the engine blocks on. A transfer that fails,
                    or a delivery nobody waits for (discard), frees both.

Manifests describe the model's full heads, so a prefill group of A ranks, a decode group of B ranks and single-rank
workers all exchange KV, over every transport: each decode rank ends with exactly the heads it owns. The staging pool
is sized in blocks (staging_blocks: enough for STAGED_REQUESTS requests of the engine's longest length by default);
a transfer that finds it full waits for blocks to come back: a prefill group's step thread up to STAGING_WAIT_S
(the transfers in flight free theirs: the backpressure of a group's hand-off), a decode group's receiver up to
RECEIVE_WAIT_S (its thread serves other transfers too; a delivery's blocks come back when the step thread lands
it); past that it is refused as one that finds the engine full (REJECTED_NO_BLOCKS on the decode side). On a GPU
the pool takes memory beside the engine's (the headroom gpu_memory_utilization leaves).
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceivedKV

STAGED_REQUESTS = 4
STAGING_WAIT_S = 30.0
RECEIVE_WAIT_S = 1.0


def staging_blocks(engine: Any, requests: int = STAGED_REQUESTS) -> int:
    """The default size of a group's staging pool: `requests` requests of the engine's longest length."""
    return requests * -(-engine.max_model_len // engine.config.block_size)


class GroupStaging:
    """The staging pool of a tensor-parallel engine's rank 0 (engine.tp_leader set). Its allocate/free are
    thread-safe (transfer threads call them); stage_out and land run collectives: call them on the thread that
    steps the engine."""

    def __init__(self, engine: Any, num_blocks: int | None = None) -> None:
        if engine.tp_leader is None:
            raise ValueError("GroupStaging is for a tensor-parallel engine's rank 0 (tensor_parallel_size > 1)")
        self.engine = engine
        layers, _, _, block_size, _, head_dim = engine.kv_cache.kv.shape
        num_blocks = num_blocks or staging_blocks(engine)
        kv = engine.kv_cache.kv
        # [L, 2, num_blocks, block_size, num_kv_heads (all of the model's), head_dim]
        self.kv = torch.zeros((layers, 2, num_blocks, block_size, engine.model_config.num_kv_heads, head_dim),
                              dtype=kv.dtype, device=kv.device)
        self._lock = threading.Condition()
        self.wait_s, self.receive_wait_s = STAGING_WAIT_S, RECEIVE_WAIT_S
        self._free = list(range(num_blocks - 1, -1, -1))
        self._engine_block_of: dict[int, int] = {}  # decode side: staging block -> the engine block it lands in

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def allocate(self, num_blocks: int, wait_s: float = 0.0) -> list[int] | None:
        """num_blocks staging blocks, waiting up to wait_s for others to be freed; None (nothing taken) when fewer
        are free by then, or at once when the pool is smaller than num_blocks. The blocks of the last free() come
        first, in the order it listed them: a run of consecutive blocks is handed out again as one (a slice)."""
        with self._lock:
            if num_blocks > self.num_blocks or not self._lock.wait_for(lambda: len(self._free) >= num_blocks,
                                                                         wait_s):
                return None
            return [self._free.pop() for _ in range(num_blocks)]

    def free(self, block_ids: Sequence[int]) -> None:
        """Give staging blocks back, and the engine blocks paired with them (a decode transfer that failed)."""
        with self._lock:
            paired = [self._engine_block_of.pop(b) for b in block_ids if b in self._engine_block_of]
            self._free.extend(reversed(block_ids))  # popped back in this order: a consecutive run stays one
            self._lock.notify_all()
        if paired:
            self.engine.free_blocks(paired)

    def sender_view(self) -> KVPoolView:
        """The pool a prefill group's KVSender reads: staging blocks that stage_out filled."""
        return KVPoolView(self.kv, self.allocate, self.free)

    def receiver_view(self, allocate_for: Callable[[str, int], list[int] | None] | None = None) -> KVPoolView:
        """The pool a decode group's KVReceiver lands in: each staging block paired with an engine block, from
        allocate_for(request_id, n) (the worker's reservation) or, without it, the engine's reserve_blocks."""
        def paired(engine_blocks: list[int] | None) -> list[int] | None:
            if engine_blocks is None:
                return None
            staged = self.allocate(len(engine_blocks), self.receive_wait_s)
            if staged is None:
                self.engine.free_blocks(engine_blocks)
                return None
            with self._lock:
                self._engine_block_of.update(zip(staged, engine_blocks))
            return staged

        allocate_for_paired = None if allocate_for is None else (lambda rid, n: paired(allocate_for(rid, n)))
        return KVPoolView(self.kv, lambda n: paired(self.engine.reserve_blocks(n)), self.free, allocate_for_paired)

    def stage_out(self, engine_blocks: Sequence[int]) -> list[int]:
        """Prefill side: gather engine_blocks' KV (every rank's heads) into new staging blocks and return them (each
        head written once, straight into the staging blocks: no full-head tensor between); the engine blocks are
        freed either way. Waits up to wait_s for room (transfers in flight free theirs); ValueError when there is
        none by then (nothing else changes)."""
        staged = self.allocate(len(engine_blocks), self.wait_s)
        try:
            if staged is None:
                raise ValueError(f"the tensor-parallel staging pool has {self.num_free} free blocks, "
                                 f"{len(engine_blocks)} needed")
            self.engine.tp_leader.gather_kv_heads(list(engine_blocks), out=self.kv, out_blocks=staged)
        except BaseException:
            if staged is not None:
                self.free(staged)
            raise
        finally:
            self.engine.free_blocks(engine_blocks)
        return staged

    def land(self, received: ReceivedKV) -> ReceivedKV:
        """Decode side: write a delivered transfer's staging blocks into their paired engine blocks (every rank its
        heads; the staging blocks are read once, into the broadcast's buffer) and free the staging blocks; the
        result names the engine blocks, which the caller now owns."""
        staged = list(received.block_ids)
        with self._lock:
            engine_blocks = [self._engine_block_of.pop(b) for b in staged]
        try:
            self.engine.tp_leader.scatter_kv_heads(engine_blocks, self.kv, full_blocks=staged)
        except BaseException:
            self.engine.free_blocks(engine_blocks)
            raise
        finally:
            self.free(staged)
        return dataclasses.replace(received, block_ids=tuple(engine_blocks))

    def discard(self, received: ReceivedKV) -> None:
        """Decode side: a delivery nobody waits for any more: its staging and engine blocks are freed."""
        self.free(received.block_ids)
