"""LaneReceiver: a decode worker's KVReceiver over lanes. Each rank's lane takes that rank's heads of a request straight
into its own pool, in the blocks rank 0 reserved, in one part or several (a sending group of another layout:
assembly.py): rank 0's lane takes the blocks when its first manifest arrives (allocate_for, the worker's reservation)
and tells every follower the same ids (Expect). The request is delivered (rank 0's ReceivedKV: the engine's blocks,
now the caller's) once every rank's lane landed; if any lane fails, the others are cancelled and the request fails,
its blocks freed once no lane can write them any more. A worker of one rank has one too when prefill groups of
another size send to it (its one lane merges their parts).

A follower that never reports (its sender never came) is told to forget the request past twice the transfer timeout
(its lane then ends CANCELLED); past four times, or when its link ends, it counts as failed without a report.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kv_transfer.config import ReceiverAddress
from kv_transfer.connector import KVReceiver
from kv_transfer.lanes.group_sender import JOIN_TIMEOUT_S
from kv_transfer.lanes.hub import LaneHub
from kv_transfer.lanes.messages import Expect, Forget, SetPeer
from kv_transfer.lanes.rank_lane import LaneSpec, ReceiveLane, ending
from kv_transfer.lanes.tally import LaneTally
from kv_transfer.results import ReceivedKV, ReceiveFailed, ReceiveInbox, ReceiveOutcome
from kv_transfer.status import TransferStatus

SWEEP_S = 0.5


@dataclass
class _Landing(LaneTally):
    block_ids: list[int]
    waiting: set[int]  # ranks whose lane has not ended yet
    tracked: float = field(default_factory=time.monotonic)
    received: ReceivedKV | None = None  # rank 0's delivery
    released: bool = False  # rank 0's transfer gave its blocks back (it failed): its outcome is the lane's end
    failure: tuple[TransferStatus, str] | None = None
    forgotten: bool = False  # the followers still waiting were told to forget it


class LaneReceiver(KVReceiver):
    """The KVReceiver of a decode engine's rank 0 (of a tensor-parallel engine whose followers run `spec`, role
    "receive", as their rank service, or of a one-rank engine); hub is the one spec names, owned from now on.
    allocate_for(request_id, n): the blocks reserved for the request (a decode worker's reservation); default: fresh
    blocks from the engine."""

    def __init__(self, engine: Any, hub: LaneHub, spec: LaneSpec,
                 allocate_for: Callable[[str, int], list[int] | None] | None = None,
                 join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        if spec.role != "receive":
            raise ValueError("LaneReceiver is for a decode engine's rank 0 and a 'receive' LaneSpec")
        self.size = 1 if engine.tp_leader is None else engine.tp_leader.group.size
        self.hub, self.timeout_s = hub, spec.config.kv_transfer_timeout_s
        hub.wait_followers(range(1, self.size), join_timeout_s)
        self.inbox = ReceiveInbox(spec.config.cancel_ttl_s)
        self._allocate = allocate_for or (lambda request_id, n: engine.reserve_blocks(n))
        self._free = engine.free_blocks
        self._landing: dict[str, _Landing] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        hub.on_ended = lambda ended: self._lane_ended(ended.rank, ended.request_id, ended.status, ended.message)
        hub.on_lost = self._lost
        self.lane = ReceiveLane(spec, engine.kv_cache.kv, engine.kv_cache.head_range, self._allocate_for,
                                self._delivered_here, self._released)
        self._sweeper = threading.Thread(target=self._sweep, name="kv-lanes-sweep", daemon=True)
        self._sweeper.start()

    @property
    def address(self) -> ReceiverAddress:
        """Rank 0's lane, with every rank's lane target and KV heads in rank order."""
        own = self.lane.receiver.address
        targets = tuple(own.target if rank == 0 else self.hub.targets[rank] for rank in range(self.size))
        heads = tuple(self.lane.parts.heads if rank == 0 else self.hub.heads[rank] for rank in range(self.size))
        return ReceiverAddress(own.transport, own.rank, own.target, targets, heads)

    def _allocate_for(self, request_id: str, num_blocks: int) -> list[int] | None:
        """Rank 0's lane: the request's manifest arrived. Its blocks, from now on tracked, named to the followers. A
        second transfer of a request already landing here is refused (None)."""
        with self._lock:
            if request_id in self._landing:
                return None
            self._landing[request_id] = landing = _Landing([], set(range(self.size)))
        blocks = self._allocate(request_id, num_blocks)
        with self._lock:
            if blocks is None:
                del self._landing[request_id]
                return None
            landing.block_ids = list(blocks)
        for rank in range(1, self.size):
            if not self.hub.send(rank, Expect(request_id, tuple(blocks))):
                self._lane_ended(rank, request_id, TransferStatus.PEER_FAILED, f"rank {rank}'s lane is gone")
        return blocks

    def _released(self, block_ids) -> None:
        """Rank 0's lane gave back the blocks its transfer took (it failed); they are freed once every lane ended."""
        with self._lock:
            for landing in self._landing.values():
                if landing.block_ids == list(block_ids):
                    landing.released = True

    def _delivered_here(self, outcome: ReceiveOutcome) -> None:
        """Rank 0's lane ended. A request it never allocated for (refused) fails at once; followers forget it. The
        refusal of a second transfer of a request already landing here is not that request's end."""
        request_id, status, message = ending(outcome)
        with self._lock:
            landing = self._landing.get(request_id)
            ours = landing is not None and (isinstance(outcome, ReceivedKV) or landing.released)
            if ours and isinstance(outcome, ReceivedKV):
                landing.received = outcome
        if landing is None:
            for rank in range(1, self.size):
                self.hub.send(rank, Forget(request_id))
            self.inbox.put(outcome)
        elif ours:
            self._lane_ended(0, request_id, status, message)

    def _lane_ended(self, rank: int, request_id: str, status: TransferStatus, message: str) -> None:
        """One rank's lane of request_id ended; the last one delivers it or fails it (freeing its blocks)."""
        with self._lock:
            landing = self._landing.get(request_id)
            first_failure = None if landing is None else landing.count_end(rank, status, message)
            if first_failure is None:
                return
            done = not landing.waiting
            if done:
                del self._landing[request_id]
        if first_failure and not done:
            self._forget(request_id)
        if done:
            self._settle(request_id, landing)

    def _settle(self, request_id: str, landing: _Landing) -> None:
        if landing.failure is None and landing.received is not None:
            self.inbox.put(landing.received)
            return
        self._free(landing.block_ids)
        status, message = landing.failure or (TransferStatus.INTERNAL, "no delivery on rank 0")
        self.inbox.put(ReceiveFailed(request_id, status, message))

    def _forget(self, request_id: str) -> None:
        """Every lane of request_id still under way is told to drop it (each then ends and reports)."""
        with self._lock:
            landing = self._landing.get(request_id)
            waiting = set() if landing is None else set(landing.waiting)
            if landing is not None:
                landing.forgotten = True
        for rank in waiting - {0}:
            self.hub.send(rank, Forget(request_id))
        if 0 in waiting:
            self.lane.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        """As KVReceiver.cancel, on every rank's lane."""
        self.inbox.cancel(request_id)
        self.lane.cancel(request_id)
        with self._lock:
            tracked = request_id in self._landing
        if tracked:
            self._forget(request_id)
        else:
            for rank in range(1, self.size):
                self.hub.send(rank, Forget(request_id))

    def _lost(self, rank: int) -> None:
        with self._lock:
            waiting = [rid for rid, landing in self._landing.items() if rank in landing.waiting]
        for request_id in waiting:
            self._lane_ended(rank, request_id, TransferStatus.PEER_FAILED, f"rank {rank} is gone")

    def _sweep(self) -> None:
        """Past 2x the transfer timeout the lanes still waiting are told to forget; past 4x they count as failed."""
        while not self._stopped.wait(SWEEP_S):
            now = time.monotonic()
            with self._lock:
                late = [(rid, landing) for rid, landing in self._landing.items()
                        if now - landing.tracked > 2 * self.timeout_s]
            for request_id, landing in late:
                if not landing.forgotten:
                    self._forget(request_id)
                elif now - landing.tracked > 4 * self.timeout_s:
                    for rank in list(landing.waiting):
                        self._lane_ended(rank, request_id, TransferStatus.TIMEOUT, "no report")

    def add_peer(self, rank: int) -> None:
        self.lane.receiver.add_peer(rank)
        for follower in range(1, self.size):
            self.hub.send(follower, SetPeer(rank, True))

    def remove_peer(self, rank: int) -> None:
        self.lane.receiver.remove_peer(rank)
        for follower in range(1, self.size):
            self.hub.send(follower, SetPeer(rank, False))

    @property
    def dropped_connections(self) -> dict[str, int]:
        return self.lane.receiver.dropped_connections

    def close(self) -> None:
        """Stops rank 0's lane (waiting for its transfers in flight) and the hub; requests still landing fail and
        their blocks are freed."""
        self._stopped.set()
        self.lane.close()
        self.hub.close()
        with self._lock:
            left = list(self._landing.items())
            self._landing.clear()
        for request_id, landing in left:
            landing.failure = landing.failure or (TransferStatus.CANCELLED, "the receiver closed")
            self._settle(request_id, landing)
