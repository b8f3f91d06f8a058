"""PrefillWorkerConfig: how a prefill worker names itself and ships KV (frozen, picklable)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.config import IMPLEMENTED_TRANSPORTS, DistRendezvous, TransferConfig
from kv_transfer.layer_stream import check_streaming_mode


@dataclass(frozen=True)
class PrefillWorkerConfig:
    """name: shows up in reports and Timing.prefill_worker. transport: a concrete kv_transfer transport
    (grpc, gloo, nccl); gloo/nccl need `rendezvous` (this worker's sender rank).
    max_transfers_per_peer: transfers in flight to one decode worker; more prefilled requests wait,
    holding their blocks in the engine, for a slot (None: the gRPC receiver's concurrent-transfer
    limit for grpc, which refuses calls past it; unlimited for gloo/nccl, which queue per peer).
    kv_streaming: "layer" sends each prompt's KV layer by layer while the step that completes it runs
    (not over ipc, which always sends whole requests); "request" sends it once the step is done.
    kv_lanes: open KV lanes (kv_transfer/lanes/) even with one rank: the cluster's decode workers are
    tensor-parallel groups (a group of its own size opens them anyway)."""

    name: str = "prefill-0"
    transport: str = "grpc"
    transfer: TransferConfig = field(default_factory=TransferConfig)
    rendezvous: DistRendezvous | None = None
    max_transfers_per_peer: int | None = None
    kv_streaming: str = "layer"
    kv_lanes: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a prefill worker needs a name")
        if self.transport not in IMPLEMENTED_TRANSPORTS:
            raise ValueError(f"transport must be one of {IMPLEMENTED_TRANSPORTS}, got {self.transport!r}")
        if self.transport != "grpc" and self.rendezvous is None:
            raise ValueError(f"transport {self.transport!r} needs a DistRendezvous")
        check_streaming_mode(self.kv_streaming)
        if self.max_transfers_per_peer is not None and self.max_transfers_per_peer < 1:
            raise ValueError("max_transfers_per_peer must be >= 1 or None")

    @property
    def transfer_slots_per_peer(self) -> int | None:
        """The effective per-peer limit (None: unlimited)."""
        if self.max_transfers_per_peer is not None:
            return self.max_transfers_per_peer
        return self.transfer.grpc_max_concurrent_transfers if self.transport == "grpc" else None
