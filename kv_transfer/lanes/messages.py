"""What rank 0 and its followers' lanes say to each other over the hub's links (kv_transfer/lanes/hub.py)."""
from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.config import ReceiverAddress
from kv_transfer.layer_stream import StreamTail
from kv_transfer.results import SendRequest
from kv_transfer.status import TransferStatus


@dataclass(frozen=True)
class Hello:
    """Follower -> rank 0, first on its link: who it is and where its lane receiver listens ("" for a sender)."""

    rank: int
    target: str


@dataclass(frozen=True)
class Ship:
    """Rank 0 -> a prefill follower: send this rank's heads of request.block_ids to peer (that rank's lane).
    stream_step: layer-streamed, each layer as the forward of step number stream_step writes it (the tail comes in
    an EndStream); None: whole (request.stream is always None here)."""

    request: SendRequest
    peer: ReceiverAddress
    stream_step: int | None = None


@dataclass(frozen=True)
class EndStream:
    """Rank 0 -> a prefill follower, for a streamed Ship: the first token came (tail: the stream finishes) or the
    stream aborts (tail None: reason)."""

    request_id: str
    tail: StreamTail | None
    reason: str = ""


@dataclass(frozen=True)
class Expect:
    """Rank 0 -> a decode follower: request_id's KV lands in block_ids (reserved by rank 0 for it)."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Forget:
    """Rank 0 -> a decode follower: drop request_id (an Expect not taken yet ends at once; one in flight is
    cancelled). Rank 0 -> a prefill follower: cancel its Ship of request_id."""

    request_id: str


@dataclass(frozen=True)
class SetPeer:
    """Rank 0 -> a decode follower: listen to sender `rank` (listen) or stop (rank transports)."""

    rank: int
    listen: bool


@dataclass(frozen=True)
class ForgetPeer:
    """Rank 0 -> a prefill follower: the decode worker whose lane of this rank is at peer left for good."""

    peer: ReceiverAddress


@dataclass(frozen=True)
class LaneEnded:
    """Follower -> rank 0, exactly once per Ship and per Expect: how that rank's lane of request_id ended."""

    rank: int
    request_id: str
    status: TransferStatus
    message: str = ""
