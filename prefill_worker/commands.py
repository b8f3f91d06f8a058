"""What other threads put on a prefill worker's command queue, and what its step thread keeps per task.

The step thread is the only one that touches the engine: submit() / cancel() / stop() (any thread) and the
transfer handles' callbacks (transfer threads) talk to it through these.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from kv_transfer import TransferHandle
from kv_transfer.layer_stream import LayerStream
from prefill_worker.messages import PrefillReport, PrefillTask


@dataclass(frozen=True)
class Submit:
    task: PrefillTask
    future: Future
    received_at: float  # time.time() when submit() was called: the queue wait starts here


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class TransferDone:
    request_id: str
    handle: TransferHandle
    ended_at: float


class Stop:
    pass


@dataclass
class Live:
    """Step-thread bookkeeping of one task until its report goes out."""

    task: PrefillTask
    future: Future
    report: PrefillReport               # filled in as the task advances
    handle: TransferHandle | None = None   # set while its KV is on the wire
    stream: LayerStream | None = None      # set when its KV streams layer by layer under its last step
    cancelled: bool = False
    waiting_for_slot: bool = False          # prefilled, KV still in the engine, waiting for a transfer slot
