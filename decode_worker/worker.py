"""DecodeWorker: receives prompt KV from prefill workers and decodes with continuous batching.

Threads:
- the step thread owns the engine: it registers expected requests, admits delivered KV
  (kv_transfer.engine_pool.admit_received), steps the engine and emits each request's events;
- the receivers' own threads (kv_transfer; decode_worker/kv_receivers.py) allocate blocks for incoming KV, land
  it, and put each outcome straight into the step thread's command queue (no thread between).
A request expected with prefill_locally (conditional disaggregation: a short prompt) skips the KV
transfer: the step thread adds it to the engine, which prefills it between decode steps.
The engine's prefix cache holds the blocks of every request decoded here (prompt, and the blocks its
generated tokens completed), so a chat's next turn finds them: expect() pins the prompt's cached leading
blocks (decoder-side prefix reuse, config.prefix_reuse), the transfer carries only the rest, and admission
links the pinned blocks before the received ones. A worker of transport "none" (a colocated replica) has no KV
receiver and takes only such requests.
expect() / cancel() / stats() may be called from any thread. Every accepted request gets exactly one
final event (a DecodeChunk with finish_reason, or a DecodeEnded); whatever way it ends, its blocks are
freed: a delivery for a request that is no longer expected (cancelled, timed out) is freed on arrival.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from decode_worker.admission import AdmissionControl
from decode_worker.commands import Cancel, Delivered, Expect, Stop, TransferStarted
from decode_worker.config import DecodeWorkerConfig
from decode_worker.kv_receivers import KVReceivers
from decode_worker.messages import (Admission, DecodeChunk, DecodeEnded, DecodeEvent, DecodeStats, DecodeStatus,
                                    EmitEvent, ExpectedRequest)
from decode_worker.no_receiver import NO_TRANSPORT
from decode_worker.waiting import WaitingRequests
from engine.core.command_queue import take_commands
from engine.core.llm_engine import LLMEngine
from engine.core.step_watch import StepHealth, StepWatch
from engine.runner.openmp_pools import start_stepping_thread
from kv_transfer import ReceivedKV, ReceiverAddress, TransferStatus
from kv_transfer.engine_pool import admit_received
from kv_transfer.lanes import GroupLanes

logger = logging.getLogger("tandem.decode_worker")

class DecodeWorker:
    """Owns `engine` from construction until stop(); starts its KV receiver and threads at once."""

    def __init__(self, engine: LLMEngine, config: DecodeWorkerConfig,
                 on_step_failure: Callable[[BaseException], None] | None = None,
                 lanes: GroupLanes | None = None) -> None:
        """on_step_failure(error): called on the step thread, instead of ending the running requests with FAILED,
        when an engine step raises: for a worker whose process ends then (a tensor-parallel group whose ranks
        diverged, cluster/workers/tp_group.py), so that its requests migrate as on a worker death. lanes: a
        tensor-parallel engine's, when its followers were started with them (decode_worker/kv_receivers.py)."""
        self.name, self._engine, self._config = config.name, engine, config
        self._on_step_failure = on_step_failure
        max_live = min(config.max_live_requests, engine.config.max_num_seqs)  # transferred requests count too
        # A replica's reservations only bound admission (no KV is handed to it): they come from the pool itself.
        reserve = engine.kv_cache.allocator.allocate if config.transport == NO_TRANSPORT else engine.reserve_blocks
        self._admission = AdmissionControl(engine.config.block_size, lambda: engine.num_free_blocks,
                                           reserve, engine.free_blocks, max_live, config.headroom_blocks,
                                           engine.pin_cached_prefix if config.prefix_reuse else None)
        self._receiver = KVReceivers(engine, config, self._blocks_for_transfer, lanes)
        self._commands: queue.Queue = queue.Queue()
        self._receiver.deliver_to(lambda outcome, by_lanes: self._commands.put(Delivered(outcome, by_lanes)))
        self._waiting = WaitingRequests(config.expect_timeout_s)  # accepted, KV not admitted yet
        self._running: dict[str, EmitEvent] = {}
        self._stats = self._snapshot()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-step", daemon=True)
        self._watch = StepWatch(self._thread)
        start_stepping_thread(self._thread)  # this thread built the engine; that one steps it

    # ---- any thread ----------------------------------------------------------------------------
    @property
    def address(self) -> ReceiverAddress:
        """Where prefill workers send this worker's KV."""
        return self._receiver.address

    def expect(self, request: ExpectedRequest, emit: EmitEvent) -> Admission:
        """Register a request before its KV arrives. Refused (nothing registered, emit never called)
        when the worker is full or stopping; accepted: `emit` then receives the request's events on the
        step thread (it must not block), the last one final (messages.is_final). The prompt's cached
        leading blocks are pinned for it until it ends (Admission.cached_blocks); Admission.prefill_locally
        says whether it is prefilled here (ExpectedRequest.local_below_uncached_tokens)."""
        admission = self._admission.reserve(request.request_id, request.prompt_token_ids)
        if admission.accepted:
            uncached = len(request.prompt_token_ids) - admission.cached_blocks * self._engine.config.block_size
            local = request.prefill_locally or uncached < request.local_below_uncached_tokens
            admission = dataclasses.replace(admission, prefill_locally=local)
            self._commands.put(Expect(dataclasses.replace(request, prefill_locally=local), emit))
        return admission

    def add_kv_peer(self, rank: int) -> None:
        """Receive KV from sender rank `rank` too (a prefill worker added while serving; gloo/nccl/ipc only)."""
        self._receiver.add_peer(rank)

    def remove_kv_peer(self, rank: int) -> None:
        """Stop listening to sender rank `rank` (a prefill worker that left with nothing in flight)."""
        self._receiver.remove_peer(rank)

    def cancel(self, request_id: str) -> None:
        """Queue a cancel: the request leaves the engine (blocks freed) or stops waiting (KV arriving
        later is freed on delivery); it gets DecodeEnded(CANCELLED). No-op once it ended."""
        self._commands.put(Cancel(request_id))

    def stats(self) -> DecodeStats:
        """The load as of the step thread's last iteration. Changes nothing."""
        return self._stats

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def health(self, stall_timeout_s: float) -> StepHealth:
        """Unhealthy when the step thread died or is stuck in a step for stall_timeout_s. Changes nothing."""
        return self._watch.health(stall_timeout_s)

    def stop(self) -> None:
        """End every request (DecodeEnded(SHUTDOWN)), wait for transfers in flight, free whatever they
        delivered, join the threads, then close the engine (its model and KV pool let go; stats() keeps the
        last snapshot, taken before). Blocks; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._admission.close()
        self._commands.put(Stop())
        self._thread.join()
        self._receiver.close()  # waits for the transfers in flight: their outcomes are in the queue then
        self._settle_leftovers(take_commands(self._commands, block=False))
        self._stats = self._snapshot()
        self._engine.close()

    # ---- the step thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._apply(self._next_commands()):
                self._expire(time.monotonic())
                if self._engine.has_unfinished_requests():
                    self._step()
                self._stats = self._snapshot()
                self._watch.beat()
        finally:
            self._end_all(DecodeStatus.SHUTDOWN, "the decode worker is stopping")
            self._stats = self._snapshot()

    def _next_commands(self) -> list:
        """While the engine is idle, sleeps until a command arrives or the next wait deadline."""
        deadline = self._waiting.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        return take_commands(self._commands, block=not self._engine.has_unfinished_requests(), timeout=timeout,
                             watch=self._watch)

    def _apply(self, commands: list) -> bool:
        for command in commands:
            if isinstance(command, Stop):
                return False
            if isinstance(command, Expect):
                self._register(command)
            elif isinstance(command, Cancel):
                self._cancel(command.request_id)
            elif isinstance(command, TransferStarted):
                self._waiting.start_deadline(command.request_id, time.monotonic())
            else:
                self._deliver(command)
        return True

    def _register(self, command: Expect) -> None:
        request_id = command.request.request_id
        if self._waiting.cancelled_early(request_id):
            self._end(request_id, command.emit, DecodeStatus.CANCELLED, "cancelled before it was registered")
            return
        if command.request.prefill_locally:
            self._prefill_here(command.request, command.emit)
            return
        if not self._receiver.receives_kv:
            self._end(request_id, command.emit, DecodeStatus.INVALID, "this worker receives no KV: it prefills "
                      "every prompt itself (expect it with prefill_locally)")
            return
        self._waiting.add(command.request, command.emit)

    def _prefill_here(self, request: ExpectedRequest, emit: EmitEvent) -> None:
        """Conditional disaggregation: the engine prefills the prompt itself (chunked, mixed with the
        running decodes) and decodes on; no KV is expected."""
        self._admission.unreserve(request.request_id)  # the engine allocates the prompt's blocks itself
        try:
            self._engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                     arrival_time=time.perf_counter(),
                                     num_resumed_tokens=request.num_resumed_tokens)
        except ValueError as error:
            self._end(request.request_id, emit, DecodeStatus.INVALID, str(error))
            return
        self._running[request.request_id] = emit

    def _blocks_for_transfer(self, request_id: str, num_blocks: int) -> list[int] | None:
        """On a receiver thread, when a transfer's manifest arrived: the blocks reserved for the request,
        and the request's expect deadline starts."""
        self._commands.put(TransferStarted(request_id))
        return self._admission.take_reserved(request_id, num_blocks)

    def _cancel(self, request_id: str) -> None:
        if request_id in self._running:
            self._engine.abort(request_id)
            self._end(request_id, self._running.pop(request_id), DecodeStatus.CANCELLED, "cancelled")
        elif request_id in self._waiting:  # its KV may be on the wire: the receiver drops it, both sides free
            self._receiver.cancel(request_id)
            self._end(request_id, self._waiting.pop(request_id).emit, DecodeStatus.CANCELLED, "cancelled")
        else:  # not registered yet (or already ended): remember it for a late expect
            self._waiting.remember_cancel(request_id, time.monotonic())

    def _deliver(self, delivered: Delivered) -> None:
        outcome = delivered.outcome
        waiting = self._waiting.pop(outcome.request_id)
        if not isinstance(outcome, ReceivedKV):  # ReceiveFailed: the receiver freed everything
            if waiting is not None:
                message = f"{outcome.status.name}: {outcome.message}"
                status = DecodeStatus.NO_ROOM if outcome.status is TransferStatus.REJECTED_NO_BLOCKS \
                    else DecodeStatus.TRANSFER_FAILED
                self._end(outcome.request_id, waiting.emit, status, message)
            return
        if waiting is None:  # cancelled or timed out meanwhile: nobody wants these blocks
            self._receiver.drop(outcome, delivered.by_lanes)
            return
        request = waiting.request
        cached = self._admission.take_pinned(request.request_id)  # the sequence owns these pins from here on
        try:  # on failure admit_received frees the blocks (received and cached) itself
            landed = self._receiver.land(outcome, delivered.by_lanes)
            delta = admit_received(self._engine, landed, request.prompt_token_ids, request.params,
                                   arrival_time=time.perf_counter(), num_resumed_tokens=request.num_resumed_tokens,
                                   cached_block_ids=cached)
        except ValueError as error:
            self._end(request.request_id, waiting.emit, DecodeStatus.INVALID, str(error))
            return
        self._running[request.request_id] = waiting.emit
        self._emit_chunk(DecodeChunk.of(delta))

    def _expire(self, now: float) -> None:
        for request_id, waiting in self._waiting.expire(now):
            message = f"its KV did not land within {self._config.expect_timeout_s}s of its transfer's start"
            self._receiver.cancel(request_id)
            self._end(request_id, waiting.emit, DecodeStatus.TIMEOUT, message)

    def _step(self) -> None:
        try:
            deltas = self._engine.step()
        except Exception as error:
            logger.exception("%s: engine step failed%s", self.name,
                             "" if self._on_step_failure else "; ending every running request")
            if self._on_step_failure is not None:
                self._on_step_failure(error)  # the process ends here (a group worker); if not, as without it
            for request_id, emit in list(self._running.items()):
                self._engine.abort(request_id)
                self._end(request_id, emit, DecodeStatus.FAILED, f"engine step failed: {error}")
            self._running.clear()
            return
        for delta in deltas:
            if delta.request_id in self._running:
                self._emit_chunk(DecodeChunk.of(delta))

    def _emit_chunk(self, chunk: DecodeChunk) -> None:
        emit = self._running[chunk.request_id]
        if chunk.finish_reason is not None:  # the engine already freed the request's blocks
            del self._running[chunk.request_id]
            self._admission.release(chunk.request_id)
        _safe_emit(emit, chunk)

    def _end(self, request_id: str, emit: EmitEvent, status: DecodeStatus, message: str) -> None:
        self._admission.release(request_id)
        _safe_emit(emit, DecodeEnded(request_id, status, message))

    def _end_all(self, status: DecodeStatus, message: str) -> None:
        for request_id, emit in list(self._running.items()):
            self._engine.abort(request_id)
            self._end(request_id, emit, status, message)
        for request_id, waiting in self._waiting.take_all():
            self._end(request_id, waiting.emit, status, message)
        self._running.clear()

    def _settle_leftovers(self, commands: list) -> None:
        """After the step thread ended: free what was delivered, end what was accepted meanwhile."""
        for command in commands:
            if isinstance(command, Delivered) and isinstance(command.outcome, ReceivedKV):
                self._receiver.drop(command.outcome, command.by_lanes)
            elif isinstance(command, Expect):
                self._end(command.request.request_id, command.emit, DecodeStatus.SHUTDOWN, "the decode worker stopped")

    def _snapshot(self) -> DecodeStats:
        engine = self._engine
        return DecodeStats(self.name, len(self._running), len(self._waiting), engine.num_live_requests,
                           engine.num_free_blocks, engine.num_total_blocks, self._admission.promised_blocks,
                           self._receiver.dropped_connections,
                           *((staging.num_free, staging.num_blocks) if (staging := self._receiver.staging) else ()))


def _safe_emit(emit: EmitEvent, event: DecodeEvent) -> None:
    try:
        emit(event)
    except Exception:  # a broken consumer must not take the step thread down
        logger.exception("emitting %s failed", type(event).__name__)
