"""Configuration and addressing for the KV transfer plane (frozen, picklable, no torch state)."""
from __future__ import annotations

from dataclasses import dataclass, field

TRANSPORTS = ("auto", "gloo", "nccl", "grpc", "ipc")
IMPLEMENTED_TRANSPORTS = ("gloo", "nccl", "grpc", "ipc")


@dataclass(frozen=True)
class TransferConfig:
    """Knobs shared by both sides of a transfer.

    kv_transfer_timeout_s bounds one transfer from the moment the receiver has allocated blocks for it
    (or the sender has started it) until the ack; past it both sides fail the transfer and free blocks. A gRPC
    receiver may first queue a transfer for up to as long again, so a gRPC sender waits up to twice that.
    """

    transport: str = "auto"
    kv_transfer_timeout_s: float = 30.0
    connect_timeout_s: float = 60.0
    grpc_chunk_bytes: int = 1 << 20
    grpc_max_message_bytes: int = 64 << 20
    # gRPC sender/receiver: raise glibc's mmap/trim thresholds for the whole process so per-message buffers
    # are reused instead of page-faulted in anew (kv_transfer/grpc/heap.py). Opt-in: it changes malloc for
    # everything else in the process too.
    grpc_keep_heap: bool = False
    grpc_max_concurrent_transfers: int = 8  # gRPC receiver: transfers holding blocks and streaming at once
    # gRPC receiver: transfers past the limit above wait (manifest read, nothing allocated) in a FIFO queue of
    # at most this many, each for up to kv_transfer_timeout_s; one more is rejected with REJECTED_BUSY.
    grpc_max_queued_transfers: int = 64
    # gloo/nccl/ipc: channels (two-rank process groups) per sender/receiver pair, each with its own thread at
    # both ends: a pair carries this many transfers at once (a step's layer-streamed transfers to one decode
    # worker go side by side instead of one after the other).
    dist_lanes: int = 4
    cancel_ttl_s: float = 600.0  # how long a receiver remembers cancel(id) for a transfer that has not arrived
    staging_cache_bytes: int = 1 << 30
    max_run_bytes: int = 16 << 20  # longer runs are split so gather / wire / scatter pipeline
    # A run whose per-(layer, K/V) plane has at least this many bytes goes straight from the sender's pool
    # (no gather; gloo sends 2 * num_layers messages, each costing ~25 us) when the pool is on the wire's
    # device; smaller runs are gathered into one message. None: every run is gathered. The receiver takes a
    # direct run (gloo/nccl) or any run (gRPC) straight into its blocks when their ids are consecutive.
    direct_min_plane_bytes: int | None = 256 << 10
    # gloo: a transfer of at most this many bytes of KV (whole or layer-streamed) travels inline, behind its
    # TRANSFER frame on the pair's authenticated control connection (kv_transfer/dist/inline.py), not on a gloo
    # process group, whose listener nothing authenticates; None (the default): every transfer, so no pair ever
    # opens a group; 0: none. A receiver reads at most its own value so: both ends should agree.
    inline_max_bytes: int | None = None
    # The cluster's KV secret (gRPC): a sender sends it with every Push stream; a receiver that has one
    # refuses, before reading anything, a stream without it (UNAUTHENTICATED); gloo/nccl/ipc: both ends of a
    # control connection prove it in the handshake (kv_transfer/control/handshake.py). None: a sender proves
    # none and a receiver accepts any peer (tests, benchmarks). Never in repr or logs.
    cluster_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; expected one of {TRANSPORTS}")
        if self.kv_transfer_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.direct_min_plane_bytes is not None and self.direct_min_plane_bytes < 0:
            raise ValueError("direct_min_plane_bytes must be >= 0 or None")
        if self.inline_max_bytes is not None and (isinstance(self.inline_max_bytes, bool)
                                                  or not isinstance(self.inline_max_bytes, int)
                                                  or not 0 <= self.inline_max_bytes <= 1 << 30):
            raise ValueError(f"inline_max_bytes must be None or an int in [0, 2**30], got {self.inline_max_bytes!r}")
        if self.grpc_max_concurrent_transfers < 1 or self.grpc_max_queued_transfers < 0:
            raise ValueError("grpc_max_concurrent_transfers must be >= 1 and grpc_max_queued_transfers >= 0")
        if isinstance(self.dist_lanes, bool) or not isinstance(self.dist_lanes, int) or not 1 <= self.dist_lanes <= 64:
            raise ValueError(f"dist_lanes must be an int in [1, 64], got {self.dist_lanes!r}")
        if self.cancel_ttl_s <= 0:
            raise ValueError("cancel_ttl_s must be positive")
        if not 0 < self.grpc_chunk_bytes < self.grpc_max_message_bytes:
            raise ValueError("grpc_chunk_bytes must be positive and below grpc_max_message_bytes")
        if self.cluster_secret is not None and not _valid_secret(self.cluster_secret):  # the value never in a message
            raise ValueError("cluster_secret must be 16 to 256 printable ASCII characters without spaces")


def _valid_secret(secret: object) -> bool:
    """A secret gRPC can carry as a metadata value unchanged, long enough not to be guessed."""
    return isinstance(secret, str) and 16 <= len(secret) <= 256 and all(33 <= ord(c) <= 126 for c in secret)


@dataclass(frozen=True)
class DistRendezvous:
    """Who this process is on a rank transport's KV plane (gloo, nccl, ipc): its rank, the size of the rank
    space, and the cluster's namespace.

    Ranks identify processes on the KV plane; every (sender, receiver, lane) gets its own control
    connection and 2-rank process group, so one broken pair never takes the others down. A receiver only
    admits senders that name its namespace (and prove the cluster secret, when there is one).
    """

    rank: int
    world_size: int
    namespace: str = "tandem-kv"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")


@dataclass(frozen=True)
class ReceiverAddress:
    """How a sender reaches a receiver: a host:port target (the gRPC server, or a rank transport's control
    listener) and, for gloo/nccl/ipc, the receiver's rank. lanes: a receiver's KV lanes' per-rank targets (rank
    order, rank 0's first), each taking only its rank's KV heads (kv_transfer/lanes/), and lane_heads the model's KV
    heads [start, stop) each rank holds; () for a receiver without lanes."""

    transport: str
    rank: int = -1
    target: str = ""
    lanes: tuple[str, ...] = ()
    lane_heads: tuple[tuple[int, int], ...] = ()
