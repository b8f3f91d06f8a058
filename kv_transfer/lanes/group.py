"""GroupLanes: what a tensor-parallel worker opens before it builds its engine, so that its followers start with
their lanes (engine/parallel/rank_service.py): rank 0's hub and the LaneSpec every rank runs."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer.config import DistRendezvous, TransferConfig
from kv_transfer.lanes.hub import LaneHub
from kv_transfer.lanes.rank_lane import LaneSpec

LANE_TRANSPORTS = ("gloo", "nccl", "grpc")  # ipc (one device) keeps the full-head staging path


@dataclass(frozen=True)
class GroupLanes:
    hub: LaneHub
    spec: LaneSpec

    @classmethod
    def open(cls, role: str, transport: str, config: TransferConfig, rendezvous: DistRendezvous | None = None,
             peers: Sequence[int] = (), host: str = "127.0.0.1") -> "GroupLanes | None":
        """The lanes of a worker of `role` ("send": prefill, "receive": decode) over `transport`; None for a
        transport lanes do not take. Close hub if the engine does not start (LaneSender / LaneReceiver own it
        after)."""
        if transport not in LANE_TRANSPORTS:
            return None
        hub = LaneHub()
        return cls(hub, LaneSpec(role, transport, config, hub.address, rendezvous, tuple(peers), host))
