"""DecodeWorkerConfig: naming, the KV receiver, admission limits (frozen, picklable)."""
from __future__ import annotations

from dataclasses import dataclass, field

from decode_worker.no_receiver import NO_TRANSPORT
from kv_transfer.config import IMPLEMENTED_TRANSPORTS, DistRendezvous, TransferConfig


@dataclass(frozen=True)
class DecodeWorkerConfig:
    """name: shows up in Timing.decode_worker. transport: a concrete kv_transfer transport; grpc binds
    `host`:0 (a free port), gloo/nccl need `rendezvous` (this worker's receiver rank) and `peer_ranks`
    (the prefill workers' sender ranks). transport "none" (NO_TRANSPORT): no KV receiver at all; every
    request must be expected with prefill_locally (a colocated replica, which prefills every prompt itself).

    Admission (backpressure): expect() refuses a request when `max_live_requests` (or the engine's
    max_num_seqs, if lower) are live, or when the pool cannot spare its prompt's blocks plus
    `headroom_blocks`; an accepted request's prompt blocks are reserved until its KV arrives.
    An expected request whose KV has not landed `expect_timeout_s` after its transfer started ends with
    TIMEOUT (before the transfer starts it waits as long as the coordinator keeps it: a long prefill queue
    is no reason to give up).

    prefix_reuse: expect() matches the prompt's leading full blocks in the engine's prefix cache and pins
    them for the request, so the KV transfer skips them (off: every transfer carries the whole prompt).
    kv_lanes: open KV lanes (kv_transfer/lanes/) even with one rank: the cluster's prefill workers are
    tensor-parallel groups (a group of its own size opens them anyway)."""

    name: str = "decode-0"
    transport: str = "grpc"
    transfer: TransferConfig = field(default_factory=TransferConfig)
    host: str = "127.0.0.1"
    rendezvous: DistRendezvous | None = None
    peer_ranks: tuple[int, ...] = ()
    max_live_requests: int = 256
    headroom_blocks: int = 1
    expect_timeout_s: float = 60.0
    prefix_reuse: bool = True
    kv_lanes: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a decode worker needs a name")
        if self.transport not in (*IMPLEMENTED_TRANSPORTS, NO_TRANSPORT):
            raise ValueError(f"transport must be one of {(*IMPLEMENTED_TRANSPORTS, NO_TRANSPORT)}, "
                             f"got {self.transport!r}")
        if self.transport not in ("grpc", NO_TRANSPORT) and self.rendezvous is None:
            raise ValueError(f"transport {self.transport!r} needs a DistRendezvous")
        if self.max_live_requests < 1 or self.headroom_blocks < 0 or self.expect_timeout_s <= 0:
            raise ValueError("max_live_requests >= 1, headroom_blocks >= 0, expect_timeout_s > 0")
