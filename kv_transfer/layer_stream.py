"""Layer-wise streaming: a request's KV leaves the prefill worker layer by layer while its forward runs.

Two objects connect the thread that steps the engine with the transfer threads:

- `LayerClock`, one per engine step: the forward calls `layer_done(l)` after layer l has written its K/V
  (on CUDA it records an event on the compute stream), `step_failed()` if the forward raised. Transfer
  threads `wait(l, deadline)` for layer l before gathering it.
- `LayerStream`, one per streamed request: its step's clock, the first token (known only once the step has
  sampled: `finish()`), and who owns the sender's blocks. The engine owns them while the step runs;
  `finish()` hands them to the transfer (which frees them when it ends), `abort()` leaves them with the
  engine (the first token ended the request, the step failed, the request was cancelled). If the transfer
  ended first (the receiver died half way), `finish()` returns False and the caller frees the blocks.

Every block is freed exactly once: by the transfer (handed over before it ended) or by the caller.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from kv_transfer.status import KVTransferError, TransferStatus
from kv_transfer.token_logprobs import FirstTokenLogprobs

STREAMING_MODES = ("layer", "request")


class LayerClock:
    """How far one step's forward has come, layer by layer. Thread-safe."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.num_layers, self.device = num_layers, torch.device(device)
        self._done = 0
        self._failed: str | None = None
        self._events: list["torch.cuda.Event"] = []
        self.last_layer_at: float | None = None  # time.time() when the last layer was done (host side)
        self._cond = threading.Condition()

    def layer_done(self, layer: int) -> None:
        """The forward has issued the work that stores layer `layer`'s K/V (layers in order): they are in
        the pool once the event recorded here completes (CUDA) or at once (CPU)."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._cond:
            if layer != self._done:
                raise ValueError(f"layer {layer} reported done after {self._done} layers")
            if event is not None:
                self._events.append(event)
            self._done = layer + 1
            if self._done == self.num_layers:
                self.last_layer_at = time.time()
            self._cond.notify_all()

    def step_failed(self, reason: str) -> None:
        """The forward raised: every waiter fails (the streams abort)."""
        with self._cond:
            self._failed = reason
            self._cond.notify_all()

    def wait(self, layer: int, deadline: float) -> "torch.cuda.Event | None":
        """Blocks until layer `layer` is done; returns its CUDA event (None on CPU) for the copy stream to
        wait on. Raises KVTransferError: ABORTED_BY_SENDER if the step failed, TIMEOUT past deadline
        (time.monotonic())."""
        with self._cond:
            while self._done <= layer and self._failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferError(TransferStatus.TIMEOUT, f"layer {layer} was not computed in time")
                self._cond.wait(left)
            if self._done <= layer:
                raise KVTransferError(TransferStatus.ABORTED_BY_SENDER, f"the prefill step failed: {self._failed}")
            return self._events[layer] if self._events else None


@dataclass(frozen=True)
class StreamTail:
    """What follows the last layer: the first token and, if asked, its logprobs."""

    first_token: int
    first_logprobs: FirstTokenLogprobs | None = None


class LayerStream:
    """One request's streamed transfer, seen from both the step thread and the transfer thread."""

    def __init__(self, clock: LayerClock) -> None:
        self.clock = clock
        self._tail: StreamTail | None = None
        self._aborted: str | None = None
        self._owned_blocks: Sequence[int] | None = None  # handed to the transfer by finish()
        self._ended = False
        self._cond = threading.Condition()
        self._listeners: list[Callable[[StreamTail | None, str | None], None]] = []

    # ---- the step thread ------------------------------------------------------------------------
    def finish(self, tail: StreamTail, block_ids: Sequence[int]) -> bool:
        """The step sampled the first token and the blocks leave the engine: the transfer owns them from
        here (frees them when it ends). False if the transfer has already ended: the caller frees them."""
        with self._cond:
            if self._ended:
                return False
            self._tail, self._owned_blocks = tail, tuple(block_ids)
            self._cond.notify_all()
        for listener in self._listeners:
            listener(tail, None)
        return True

    def abort(self, reason: str) -> None:
        """Stop after the current layer, ABORT on the wire; the engine keeps (and frees) its blocks."""
        with self._cond:
            if self._tail is not None:
                return
            self._aborted = reason
            self._cond.notify_all()
        for listener in self._listeners:
            listener(None, reason)

    def add_listener(self, listener: Callable[[StreamTail | None, str | None], None]) -> None:
        """listener(tail, None) after a finish() that handed the blocks over, listener(None, reason) after an abort()
        (on the step thread; it must not block): a stream whose transfers are other streams' (KV lanes)."""
        self._listeners.append(listener)

    # ---- the transfer thread --------------------------------------------------------------------
    def wait_layer(self, layer: int, deadline: float) -> "torch.cuda.Event | None":
        """LayerClock.wait, failing early (ABORTED_BY_SENDER) once the stream was aborted."""
        if self._aborted is not None:
            raise KVTransferError(TransferStatus.ABORTED_BY_SENDER, self._aborted)
        return self.clock.wait(layer, deadline)

    def wait_tail(self, deadline: float) -> StreamTail:
        """Blocks until finish() or abort(); raises KVTransferError (ABORTED_BY_SENDER, TIMEOUT)."""
        with self._cond:
            while self._tail is None and self._aborted is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferError(TransferStatus.TIMEOUT, "the first token was not sampled in time")
                self._cond.wait(left)
            if self._tail is None:
                raise KVTransferError(TransferStatus.ABORTED_BY_SENDER, self._aborted or "aborted")
            return self._tail

    @property
    def aborted(self) -> bool:
        return self._aborted is not None

    def ended(self, free: Callable[[Sequence[int]], None]) -> None:
        """The transfer is over (either way): frees the blocks if they were handed over; after this,
        finish() returns False. Called once, by the transport."""
        with self._cond:
            self._ended, blocks = True, self._owned_blocks
        if blocks is not None:
            free(blocks)


def release_send_blocks(request, free: Callable[[Sequence[int]], None]) -> None:
    """A transport's one place to give back a finished send's blocks: all of them for a whole-request
    transfer; for a streamed one only if the step thread handed them over (LayerStream.ended)."""
    if request.stream is None:
        free(request.block_ids)
    else:
        request.stream.ended(free)


def check_streaming_mode(mode: str) -> str:
    if mode not in STREAMING_MODES:
        raise ValueError(f"kv streaming must be one of {STREAMING_MODES}, got {mode!r}")
    return mode
