"""What rank 0 and its followers' lanes say to each other over the hub's links (kv_transfer/lanes/hub.py)."""
from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.config import ReceiverAddress
from kv_transfer.layer_stream import StreamTail
from kv_transfer.results import SendRequest
from kv_transfer.status import TransferStatus


@dataclass(frozen=True)
class Hello:
    """Follower -> rank 0, first on its link: who it is, where its lane receiver listens ("" for a sender) and which
    of the model's KV heads its pool holds."""

    rank: int
    target: str
    heads: tuple[int, int]


@dataclass(frozen=True)
class Ship:
    """Rank 0 -> a prefill follower: send heads `heads` (of this rank's) of request.block_ids to peer (a receiving
    rank's lane), as part number `part` of the request (kv_transfer/lanes/parts.py). stream_step: layer-streamed, each
    layer as the forward of step number stream_step writes it (the tail comes in an EndStream); None: whole
    (request.stream is always None here)."""

    request: SendRequest
    peer: ReceiverAddress
    heads: tuple[int, int]
    part: int = 0
    stream_step: int | None = None


@dataclass(frozen=True)
class EndStream:
    """Rank 0 -> a prefill follower, for its streamed Ships of request_id: the first token came (tail: the streams
    finish) or they abort (tail None: reason)."""

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
    """Follower -> rank 0, exactly once per Ship and per Expect: how that rank's lane of request_id ended (part: the
    Ship's part; 0 for an Expect, which ends once every part of the request landed on that rank)."""

    rank: int
    request_id: str
    status: TransferStatus
    message: str = ""
    part: int = 0
