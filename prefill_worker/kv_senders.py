"""KVSenders: a prefill worker's ways to ship a request's KV, chosen per transfer.

Its transport's sender always exists (for a tensor-parallel engine it reads a full-head staging pool on rank 0:
kv_transfer/group_pool.py). A worker started with lanes (kv_transfer/lanes/: a tensor-parallel engine, or one rank in
a cluster whose decode groups have another size) also has a LaneSender: a transfer to a decode worker with lanes goes
by lanes, each rank's heads straight to the ranks that hold them (split or merged between layouts), unless both
sides have one rank; any other peer takes the transport's sender (through the staging pool).
"""
from __future__ import annotations

from typing import Any

from kv_transfer import KVSender, ReceiverAddress, TransferHandle, create_sender
from kv_transfer.engine_pool import sender_pool, ship_prefilled
from kv_transfer.lanes import GroupLanes, LaneSender
from prefill_worker.config import PrefillWorkerConfig


class KVSenders:
    """Build it on the thread that built the engine; ship() on the step thread, the rest from any thread."""

    def __init__(self, engine: Any, config: PrefillWorkerConfig, lanes: GroupLanes | None = None) -> None:
        """lanes: what the engine's followers were started with (GroupLanes.open); None without lanes."""
        self.engine = engine
        pool, self.staging = sender_pool(engine)  # a tensor-parallel engine's: a full-head staging pool
        self.sender: KVSender = create_sender(config.transfer, pool, config.transport, config.rendezvous)
        self.lanes = None if lanes is None else LaneSender(engine, lanes.hub, lanes.spec)

    def by_lanes(self, peer: ReceiverAddress) -> bool:
        """Whether a whole-request transfer to peer goes by lanes."""
        return self.lanes is not None and self.lanes.reaches(peer)

    def ship(self, peer: ReceiverAddress, request_id: str, first_logprobs: Any = None,
             prefix_blocks: int = 0) -> TransferHandle:
        """kv_transfer.engine_pool.ship_prefilled by lanes or by the staging path (see by_lanes)."""
        if self.by_lanes(peer):
            return ship_prefilled(self.engine, self.lanes, peer, request_id, first_logprobs, prefix_blocks)
        return ship_prefilled(self.engine, self.sender, peer, request_id, first_logprobs, prefix_blocks,
                              self.staging)

    @property
    def lane_transfers(self) -> int:
        """Transfers delivered by lanes so far."""
        return 0 if self.lanes is None else self.lanes.delivered

    def forget_peer(self, peer: ReceiverAddress) -> None:
        self.sender.forget_peer(peer)
        if self.lanes is not None:
            self.lanes.forget_peer(peer)

    def close(self) -> None:
        """Closes both senders (their transfers in flight end first; their blocks are freed)."""
        self.sender.close()
        if self.lanes is not None:
            self.lanes.close()
