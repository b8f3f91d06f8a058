"""EngineLoop: the one thread that owns an LLMEngine and runs its step loop.

Other threads never touch the engine: they put commands (submit, abort, stop) on a thread-safe queue.
The thread blocks on that queue while the engine has no work (no busy spin) and otherwise drains it
between steps. Each request's chunks leave through its ChunkSink, which hands them to the asyncio
loop of the consumer. The thread also measures each request's queue and prefill time.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from cluster.backend import BackendUnavailable, GenerationChunk, GenerationRequest, Timing
from engine.core.command_queue import take_commands
from engine.core.llm_engine import LLMEngine
from engine.outputs import StepDelta
from engine.runner.openmp_pools import start_stepping_thread

logger = logging.getLogger("tandem.cluster.engine_loop")


class ChunkSink:
    """Delivers one request's items (GenerationChunk, or an exception that ends it) from the engine
    thread to an asyncio.Queue owned by `loop`. Safe to call from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, chunks: asyncio.Queue) -> None:
        self._loop, self._chunks = loop, chunks

    def put(self, item: GenerationChunk | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._chunks.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody listens any more
            pass


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot the engine thread publishes after every iteration (read from any thread)."""

    running_requests: int
    waiting_requests: int
    free_blocks: int
    total_blocks: int


@dataclass(frozen=True)
class _Submit:
    engine_id: str
    request: GenerationRequest
    sink: ChunkSink


@dataclass(frozen=True)
class _Abort:
    engine_id: str


class _Stop:
    pass


@dataclass
class _LiveRequest:
    """Engine-thread bookkeeping of one admitted request (times are time.perf_counter())."""

    sink: ChunkSink
    arrival_time: float
    samples_left: int = 1  # SamplingParams.n: the request ends with its last sample
    scheduled_at: float | None = None
    first_token_at: float | None = None


class EngineLoop:
    """Owns `engine` from construction until stop(); starts its thread at once."""

    def __init__(self, engine: LLMEngine, worker_name: str) -> None:
        self._engine, self._worker_name = engine, worker_name
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[str, _LiveRequest] = {}
        self._unscheduled: set[str] = set()
        self.load = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="tandem-engine-loop", daemon=True)
        start_stepping_thread(self._thread)  # this thread built the engine; that one steps it

    # ---- called from other threads -----------------------------------------------------------
    def submit(self, engine_id: str, request: GenerationRequest, sink: ChunkSink) -> None:
        """Queue a request for admission. The sink then receives its chunks (the last one with
        finish_reason and timing), or exactly one exception: ValueError if the engine rejects it,
        BackendUnavailable if the loop stops first, or the error of a failed step."""
        self._commands.put(_Submit(engine_id, request, sink))

    def abort(self, engine_id: str) -> None:
        """Queue an abort: the request leaves the engine and its blocks are freed; its sink gets
        nothing more. A no-op for a request that already ended."""
        self._commands.put(_Abort(engine_id))

    def stop(self) -> None:
        """Abort every request (their sinks get BackendUnavailable) and join the thread. Blocks."""
        self._commands.put(_Stop())
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._apply(self._next_commands()):
                if self._engine.has_unfinished_requests():
                    self._step()
                self.load = self._snapshot()
        finally:
            self._end_all(BackendUnavailable("the backend is shutting down"))
            self._reject_queued()
            self.load = self._snapshot()
            logger.info("%s", self._engine.step_log.summary())

    def _next_commands(self) -> list:
        """Waits for a command while the engine is idle; otherwise takes whatever is queued."""
        return take_commands(self._commands, block=not self._engine.has_unfinished_requests())

    def _apply(self, commands: list) -> bool:
        """Runs the commands in order; False once a stop command was seen."""
        for command in commands:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Submit):
                self._admit(command)
            else:
                self._abort(command.engine_id)
        return True

    def _admit(self, command: _Submit) -> None:
        request = command.request
        try:
            self._engine.add_request(command.engine_id, request.prompt_token_ids, request.params,
                                     arrival_time=request.arrival_time)
        except Exception as error:  # ValueError for bad input; nothing was admitted either way
            command.sink.put(error)
            return
        self._live[command.engine_id] = _LiveRequest(command.sink, request.arrival_time, request.params.n)
        self._unscheduled.add(command.engine_id)

    def _abort(self, engine_id: str) -> None:
        if self._live.pop(engine_id, None) is not None:
            self._unscheduled.discard(engine_id)
            self._engine.abort(engine_id)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            deltas = self._engine.step()
        except Exception as error:
            logger.exception("engine step failed; ending every request in flight")
            self._end_all(error)
            return
        finished = time.perf_counter()
        self._mark_scheduled(started)
        outgoing = [item for item in (self._chunk_of(delta, finished) for delta in deltas) if item is not None]
        self.load = self._snapshot()  # published before any consumer can see this step's chunks
        for sink, chunk in outgoing:
            sink.put(chunk)

    def _mark_scheduled(self, step_started: float) -> None:
        """A request was first scheduled in this step if it has computed tokens now (or ended)."""
        for engine_id in list(self._unscheduled):
            seq = self._engine.get_sequence(engine_id)
            if seq is None or seq.num_computed_tokens > 0:
                self._live[engine_id].scheduled_at = step_started
                self._unscheduled.discard(engine_id)

    def _chunk_of(self, delta: StepDelta, now: float) -> tuple[ChunkSink, GenerationChunk] | None:
        """The chunk of `delta` and where it goes; a request whose last sample finished leaves the live set."""
        live = self._live.get(delta.request_id)
        if live is None:
            return None
        if live.first_token_at is None and delta.new_token_ids:
            live.first_token_at = now
        timing = None
        if delta.finish_reason is not None:
            live.samples_left -= 1
            if not live.samples_left:
                del self._live[delta.request_id]
            timing = self._timing(live, now)
        return live.sink, GenerationChunk(delta.new_token_ids, delta.new_text, delta.finish_reason, timing,
                                          delta.logprobs, delta.index, delta.prompt_logprobs)

    def _timing(self, live: _LiveRequest, now: float) -> Timing:
        scheduled = live.scheduled_at if live.scheduled_at is not None else live.arrival_time
        first_token = live.first_token_at if live.first_token_at is not None else now
        return Timing(queue_ms=(scheduled - live.arrival_time) * 1e3,
                      prefill_ms=(first_token - scheduled) * 1e3,
                      ttft_ms=(first_token - live.arrival_time) * 1e3,
                      prefill_worker=self._worker_name, decode_worker=self._worker_name)

    def _end_all(self, error: BaseException) -> None:
        """Aborts every live request and hands each consumer `error`."""
        for engine_id, live in list(self._live.items()):
            try:
                self._engine.abort(engine_id)
            except Exception:
                logger.exception("abort of %s failed", engine_id)
            live.sink.put(error)
        self._live.clear()
        self._unscheduled.clear()

    def _reject_queued(self) -> None:
        for command in take_commands(self._commands, block=False):
            if isinstance(command, _Submit):
                command.sink.put(BackendUnavailable("the backend is shutting down"))

    def _snapshot(self) -> EngineLoad:
        waiting = len(self._unscheduled)
        return EngineLoad(running_requests=len(self._live) - waiting, waiting_requests=waiting,
                          free_blocks=self._engine.num_free_blocks,
                          total_blocks=self._engine.num_total_blocks)
