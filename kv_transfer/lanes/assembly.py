"""PartAssembler: one receiving rank's lane, taking each request's KV in one or more parts (kv_transfer/lanes/parts.py)
and ending it once: delivered when its parts together brought every head this rank holds, failed otherwise.

Every part of a request lands in the same blocks: the first part to arrive takes them (allocate_for: rank 0's
reservation, or a follower's Expect); a later one that names other heads lands in its own heads of those blocks
(`pool.windows`: the pool narrowed to them). A part whose heads overlap what the request already has, or that comes
after the request ended, is refused without touching a block (its refusal is not the request's end). The request
ends once no part can write its blocks any more: delivered (one ReceivedKV: the first part's, with every part's
bytes) when its heads are covered, or failed (released(blocks), then one ReceiveFailed) after the first failure or
forget(). Between groups of one layout every request is one part, and this passes each outcome straight through.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceivedKV, ReceiveFailed, ReceiveOutcome
from kv_transfer.status import TransferStatus

Span = tuple[int, int]
TAKE_WAIT_S = 60.0  # at most this long a part waits for the first part of its request to take the blocks


def _refuse(num_blocks: int) -> None:
    return None  # a lane allocates only through allocate_for


@dataclass
class _Assembly:
    """One request's parts so far."""

    blocks: list[int] | None  # None while the first part takes them
    heads: list[Span]  # the heads of every part that took the blocks
    open: int = 1  # parts that took the blocks and have not ended
    covered: int = 0  # heads of the parts delivered
    received: ReceivedKV | None = None  # the first part delivered
    nbytes: int = 0
    failure: tuple[TransferStatus, str] | None = None
    started: float = field(default_factory=time.monotonic)


class PartAssembler:
    """pool: the view this rank's lane receiver lands in (its kv [L, 2, N, bs, H_rank, D], heads `heads`; it takes
    windows of them). allocate_for(request_id, n): the request's blocks, once per request; deliver(outcome): once per
    request (on a transport thread; must not block); released(blocks): a failed request's blocks, right before its
    ReceiveFailed. allocation_waits: allocate_for may block (the pool says so: KVPoolView.allocation_waits)."""

    def __init__(self, kv: torch.Tensor, heads: Span, allocate_for: Callable[[str, int], list[int] | None],
                 deliver: Callable[[ReceiveOutcome], None], released: Callable[[Sequence[int]], None],
                 failed_ttl_s: float = 600.0, allocation_waits: bool = False) -> None:
        self.heads, self.failed_ttl_s = heads, failed_ttl_s
        self._allocate_for, self._deliver, self._released = allocate_for, deliver, released
        self._assemblies: dict[str, _Assembly] = {}
        self._ended: dict[str, float] = {}  # request id -> when it failed: its late parts are refused
        self._refused: dict[str, int] = {}  # refusals of ours whose outcome is still to come, per request
        self._windows: dict[Span, KVPoolView] = {}
        self._changed = threading.Condition()
        self.pool = KVPoolView(kv, _refuse, self._freed, self._allocator(heads), kv_heads=heads, windows=self._window,
                               allocation_waits=allocation_waits)

    def _allocator(self, heads: Span) -> Callable[[str, int], list[int] | None]:
        return lambda request_id, num_blocks: self._allocate(request_id, num_blocks, heads)

    def _window(self, heads: Span) -> KVPoolView:
        """The view a part of `heads` (within this rank's) lands in: the same blocks, narrowed to those heads."""
        with self._changed:
            window = self._windows.get(heads)
            if window is None:
                window = self._windows[heads] = KVPoolView(self.pool.head_window(heads), _refuse, self._freed,
                                                           self._allocator(heads), kv_heads=heads)
            return window

    def _allocate(self, request_id: str, num_blocks: int, heads: Span) -> list[int] | None:
        """A part's blocks: the first part takes the request's (allocate_for, outside the lock: a follower's waits
        for its Expect); a later one waits for that, then lands in the same blocks if it joins them."""
        with self._changed:
            assembly = self._assemblies.get(request_id)
            first = assembly is None and request_id not in self._ended
            if first:
                assembly = self._assemblies[request_id] = _Assembly(None, [heads], open=0)
            elif assembly is not None:
                self._changed.wait_for(lambda: assembly.blocks is not None, TAKE_WAIT_S)
            if not first:
                if assembly is None or self._assemblies.get(request_id) is not assembly \
                        or not self._joins(assembly, num_blocks, heads):
                    self._refused[request_id] = self._refused.get(request_id, 0) + 1
                    return None
                assembly.heads.append(heads)
                assembly.open += 1
                return list(assembly.blocks)
        blocks = self._allocate_for(request_id, num_blocks)
        with self._changed:
            if blocks is None:
                assembly.blocks = []  # parts waiting on it are refused; this one's refusal is the request's end
                del self._assemblies[request_id]
            else:
                assembly.blocks, assembly.open = list(blocks), 1
            self._changed.notify_all()
        return None if blocks is None else list(blocks)

    @staticmethod
    def _joins(assembly: _Assembly, num_blocks: int, heads: Span) -> bool:
        """Whether a part of `heads` over num_blocks blocks may land in the request's blocks: they are taken, the
        request has not failed, and no part took any of these heads."""
        return len(assembly.blocks or ()) == num_blocks and assembly.failure is None \
            and all(heads[1] <= start or stop <= heads[0] for start, stop in assembly.heads)

    def _freed(self, block_ids: Sequence[int]) -> None:
        """A part that took the blocks failed (the transport gives them back): the request waits for its others."""
        blocks = list(block_ids)
        with self._changed:
            found = next(((rid, a) for rid, a in self._assemblies.items() if a.blocks == blocks and a.open), None)
            if found is None:
                return
            found[1].open -= 1
        self._settle(*found)

    def outcome(self, outcome: ReceiveOutcome) -> None:
        """The receiver's outcome of one part (its deliver_to)."""
        request_id = outcome.request_id
        with self._changed:
            if isinstance(outcome, ReceiveFailed) and outcome.status == TransferStatus.REJECTED_NO_BLOCKS \
                    and self._refused.get(request_id):
                self._refused[request_id] -= 1  # a refusal of ours: not the request's end
                if not self._refused[request_id]:
                    del self._refused[request_id]
                return
            assembly = self._assemblies.get(request_id)
            if assembly is not None:
                self._count(assembly, outcome)
            elif isinstance(outcome, ReceiveFailed):  # refused before it took any block: the request's end
                self._remember_failed(request_id)
        if assembly is None:
            self._deliver(outcome)
        else:
            self._settle(request_id, assembly)

    @staticmethod
    def _count(assembly: _Assembly, outcome: ReceiveOutcome) -> None:
        if isinstance(outcome, ReceiveFailed):
            assembly.failure = assembly.failure or (outcome.status, outcome.message)
            return
        assembly.open -= 1
        heads = outcome.manifest.kv_heads
        assembly.covered += heads[1] - heads[0]
        assembly.received = assembly.received or outcome
        assembly.nbytes += outcome.kv_bytes

    def forget(self, request_id: str) -> None:
        """The request is dropped: it fails (CANCELLED) once its parts under way end; a later part is refused."""
        with self._changed:
            assembly = self._assemblies.get(request_id)
            if assembly is None:
                return
            assembly.failure = assembly.failure or (TransferStatus.CANCELLED, "dropped before all its parts came")
        self._settle(request_id, assembly)

    def _settle(self, request_id: str, assembly: _Assembly) -> None:
        """Ends the request if it is over: failed with no part under way, or every head delivered."""
        with self._changed:
            done = assembly.open == 0 and (assembly.failure is not None
                                           or assembly.covered == self.heads[1] - self.heads[0])
            if not done or self._assemblies.get(request_id) is not assembly:
                return
            del self._assemblies[request_id]
            if assembly.failure is not None:
                self._remember_failed(request_id)
        if assembly.failure is None:
            self._deliver(dataclasses.replace(assembly.received, kv_bytes=assembly.nbytes,
                                              seconds=time.monotonic() - assembly.started))
            return
        self._released(assembly.blocks)
        self._deliver(ReceiveFailed(request_id, *assembly.failure))

    def _remember_failed(self, request_id: str) -> None:
        """Its parts still to come are refused for failed_ttl_s. Under the lock."""
        now = time.monotonic()
        self._ended = {rid: at for rid, at in self._ended.items() if now - at < self.failed_ttl_s}
        self._ended[request_id] = now
