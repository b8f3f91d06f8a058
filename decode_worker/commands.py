"""What other threads put on a decode worker's command queue, and what it keeps for a waiting request.

The step thread is the only one that touches the engine: expect() / cancel() (any thread), the inbox
pump (receiver outcomes) and the receiver's threads (a transfer starting) talk to it through these.
"""
from __future__ import annotations

from dataclasses import dataclass

from decode_worker.messages import EmitEvent, ExpectedRequest
from kv_transfer import ReceiveOutcome


@dataclass(frozen=True)
class Expect:
    request: ExpectedRequest
    emit: EmitEvent


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Delivered:
    outcome: ReceiveOutcome
    by_lanes: bool = False  # in the engine's blocks already (kv_transfer/lanes/), not in a staging pool


@dataclass(frozen=True)
class TransferStarted:
    """The receiver took the request's reserved blocks for its incoming KV: its deadline starts now."""

    request_id: str


class Stop:
    pass


@dataclass(frozen=True)
class Waiting:
    """An expected request whose KV has not been admitted yet. deadline (time.monotonic()) is None until
    its transfer starts: a request waits for its prefill as long as the coordinator keeps it."""

    request: ExpectedRequest
    emit: EmitEvent
    deadline: float | None = None
