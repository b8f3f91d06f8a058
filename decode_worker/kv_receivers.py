"""KVReceivers: a decode worker's KV receivers, which the worker sees as one.

Its transport's receiver always exists (NoReceiver for a colocated replica; for a tensor-parallel engine it lands in
a full-head staging pool on rank 0, scattered to every rank on admission: kv_transfer/group_pool.py). A
worker started with lanes (kv_transfer/lanes/: a tensor-parallel engine, or one rank in a cluster whose prefill groups
have another size) also has a LaneReceiver: a prefill group sends each of its ranks' heads straight to the ranks
that hold them, so its deliveries are already in the engine's blocks. The address names both: the staging
receiver's target, and every rank's lane target and KV heads.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from decode_worker.config import DecodeWorkerConfig
from decode_worker.no_receiver import NO_TRANSPORT, NoReceiver
from kv_transfer import ReceivedKV, ReceiveOutcome, ReceiverAddress, create_receiver
from kv_transfer.engine_pool import drop_delivered, land_delivered, receiver_pool
from kv_transfer.lanes import GroupLanes, LaneReceiver

Deliver = Callable[[ReceiveOutcome, bool], None]  # (outcome, by_lanes): must not block


class KVReceivers:
    """Build it on the thread that built the engine; land/drop on the step thread, the rest from any thread."""

    def __init__(self, engine: Any, config: DecodeWorkerConfig, blocks_for: Callable[[str, int], list[int] | None],
                 lanes: GroupLanes | None = None) -> None:
        """blocks_for(request_id, n): the blocks reserved for a request's KV (both receivers take them from it).
        lanes: what the engine's followers were started with (GroupLanes.open); None without lanes."""
        self.engine = engine
        pool, self.staging = (None, None) if config.transport == NO_TRANSPORT else receiver_pool(engine, blocks_for)
        self.receiver = NoReceiver() if pool is None else create_receiver(
            config.transfer, pool, config.transport, rendezvous=config.rendezvous, peers=config.peer_ranks,
            host=config.host)
        self.lanes = None if lanes is None else LaneReceiver(engine, lanes.hub, lanes.spec, blocks_for)

    @property
    def receives_kv(self) -> bool:
        return not isinstance(self.receiver, NoReceiver)

    @property
    def address(self) -> ReceiverAddress | None:
        """Where prefill workers send this worker's KV (with its lanes' targets when it has lanes)."""
        if self.lanes is None:
            return self.receiver.address
        lanes = self.lanes.address
        return dataclasses.replace(self.receiver.address, lanes=lanes.lanes, lane_heads=lanes.lane_heads)

    def deliver_to(self, deliver: Deliver) -> None:
        """Every outcome of either receiver goes to deliver(outcome, by_lanes) on a transport thread."""
        self.receiver.deliver_to(lambda outcome: deliver(outcome, False))
        if self.lanes is not None:
            self.lanes.deliver_to(lambda outcome: deliver(outcome, True))

    def land(self, received: ReceivedKV, by_lanes: bool) -> ReceivedKV:
        """The delivery in the engine's own blocks (a staged one scattered to every rank first)."""
        return land_delivered(received, None if by_lanes else self.staging)

    def drop(self, received: ReceivedKV, by_lanes: bool) -> None:
        """Frees a delivery nobody waits for."""
        drop_delivered(self.engine, received, None if by_lanes else self.staging)

    def cancel(self, request_id: str) -> None:
        for receiver in self._all():
            receiver.cancel(request_id)

    def add_peer(self, rank: int) -> None:
        for receiver in self._all():
            receiver.add_peer(rank)

    def remove_peer(self, rank: int) -> None:
        for receiver in self._all():
            receiver.remove_peer(rank)

    @property
    def dropped_connections(self) -> int:
        return sum(sum(receiver.dropped_connections.values()) for receiver in self._all())

    def close(self) -> None:
        """Closes both (each waits for its transfers in flight: their outcomes are delivered by then)."""
        for receiver in self._all():
            receiver.close()

    def _all(self) -> list:
        return [self.receiver] + ([self.lanes] if self.lanes is not None else [])
