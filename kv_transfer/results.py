"""What the two sides get back: a handle on a send, and delivered or failed receives in an inbox."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

from kv_transfer.manifest import Manifest
from kv_transfer.status import KVTransferError, TransferStatus
from kv_transfer.token_logprobs import FirstTokenLogprobs

if TYPE_CHECKING:
    from kv_transfer.layer_stream import LayerStream


@dataclass(frozen=True)
class SendRequest:
    """One request's KV to ship: its sender-side blocks, the number of valid tokens, the first token
    (and its logprobs when the request asked for them: they travel in the manifest). prefix_blocks: the
    leading prompt blocks the receiver already holds, which do not travel: block_ids are the prompt's
    blocks after them (num_tokens still counts the whole prompt).

    stream set: a layer-streamed send started before the step that computes the KV: layer l goes once
    stream.clock says it is written, first_token/first_logprobs come later (stream.finish, sent after the
    last layer), and the blocks belong to the transfer only once handed over (kv_transfer/layer_stream.py)."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int | None
    first_logprobs: FirstTokenLogprobs | None = None
    prefix_blocks: int = 0
    stream: "LayerStream | None" = None


@dataclass(frozen=True)
class SendResult:
    request_id: str
    kv_bytes: int
    seconds: float


@dataclass(frozen=True)
class ReceivedKV:
    """A verified transfer written into the receiver's own blocks, which now belong to the caller."""

    manifest: Manifest
    block_ids: tuple[int, ...]
    kv_bytes: int
    seconds: float

    @property
    def request_id(self) -> str:
        return self.manifest.request_id


@dataclass(frozen=True)
class ReceiveFailed:
    """A transfer the receiver gave up on; any blocks it had allocated are already freed."""

    request_id: str
    status: TransferStatus
    message: str


ReceiveOutcome = Union[ReceivedKV, ReceiveFailed]


class CancelFlag:
    """Whether a send was asked to stop: set() once, is_set() from any thread (threading.Event's two calls, without
    the Condition an Event builds: a handle is made per send, on the caller's thread)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class TransferHandle:
    """Future-like handle on one send. The transfer owns the sender's blocks until it ends."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.future: Future[SendResult] = Future()
        self.cancel_requested = CancelFlag()
        self._cancel_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Asks the transfer to stop; it ends with CANCELLED (both sides free) unless already done."""
        with self._lock:
            self.cancel_requested.set()
            hooks = list(self._cancel_hooks)
        for hook in hooks:
            hook()

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Transport side: hook runs (on the cancelling thread) when cancel() is called, or at once if it was."""
        with self._lock:
            self._cancel_hooks.append(hook)
            cancelled = self.cancel_requested.is_set()
        if cancelled:
            hook()

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> SendResult:
        """Blocks until the receiver acked; raises KVTransferError if the transfer failed."""
        return self.future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.future.exception(timeout)

    def add_done_callback(self, fn: Callable[["TransferHandle"], None]) -> None:
        self.future.add_done_callback(lambda _: fn(self))

    def succeed(self, result: SendResult) -> None:
        self.future.set_result(result)

    def fail(self, status: TransferStatus, message: str) -> None:
        self.future.set_exception(KVTransferError(status, message, self.request_id))

    def settle(self, result: "SendResult | KVTransferError") -> None:
        """Transport side, after it freed the blocks: resolves the handle with the transfer's result or error."""
        if isinstance(result, SendResult):
            self.succeed(result)
        else:
            self.fail(result.status, result.message)


class ReceiveInbox:
    """Thread-safe hand-off of finished receives from transfer threads to the decode step loop, plus the
    receiver's memory of cancel(id) calls.

    A cancel is remembered until an outcome for that id is put, or for cancel_ttl_s (then it is forgotten: a
    transfer arriving later is accepted), and at most max_cancels ids are kept (the oldest go first)."""

    def __init__(self, cancel_ttl_s: float = 600.0, max_cancels: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._outcomes: queue.SimpleQueue[ReceiveOutcome] = queue.SimpleQueue()
        self._cancelled: dict[str, float] = {}  # request id -> expiry on clock, oldest first
        self._ttl, self._max_cancels, self._clock = cancel_ttl_s, max_cancels, clock
        self._lock = threading.Lock()
        self._sink: Callable[[ReceiveOutcome], None] | None = None

    def put(self, outcome: ReceiveOutcome) -> None:
        """Hands outcome to the sink (forward_to), else queues it for poll()/wait(); forgets any cancel of
        its request id."""
        with self._lock:
            self._cancelled.pop(outcome.request_id, None)
            sink = self._sink
            if sink is None:
                self._outcomes.put(outcome)
        if sink is not None:
            sink(outcome)

    def forward_to(self, sink: Callable[[ReceiveOutcome], None]) -> None:
        """From now on every outcome goes straight to sink(outcome), called on the transfer's own thread (it
        must not block), instead of waiting for poll()/wait(); outcomes already queued go to it at once."""
        with self._lock:
            self._sink = sink
            waiting = self.poll()
        for outcome in waiting:
            sink(outcome)

    def poll(self) -> list[ReceiveOutcome]:
        """All outcomes that finished since the last poll, without blocking."""
        outcomes = []
        while True:
            try:
                outcomes.append(self._outcomes.get_nowait())
            except queue.Empty:
                return outcomes

    def wait(self, timeout: float | None = None) -> ReceiveOutcome | None:
        """The next outcome, or None after timeout seconds."""
        try:
            return self._outcomes.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel(self, request_id: str) -> None:
        """Remembers request_id as cancelled for cancel_ttl_s from now (renewed by a repeated cancel)."""
        with self._lock:
            self._expire()
            self._cancelled.pop(request_id, None)
            self._cancelled[request_id] = self._clock() + self._ttl
            while len(self._cancelled) > self._max_cancels:
                del self._cancelled[next(iter(self._cancelled))]

    def is_cancelled(self, request_id: str) -> bool:
        """Whether request_id was cancelled and the cancel has neither expired nor been consumed by put()."""
        with self._lock:
            self._expire()
            return request_id in self._cancelled

    @property
    def num_cancels(self) -> int:
        """How many cancels are remembered right now (expired ones excluded)."""
        with self._lock:
            self._expire()
            return len(self._cancelled)

    def _expire(self) -> None:
        """Drops expired cancels; insertion order is expiry order (same ttl), so only the front is checked."""
        now = self._clock()
        while self._cancelled:
            oldest = next(iter(self._cancelled))
            if self._cancelled[oldest] > now:
                return
            del self._cancelled[oldest]
