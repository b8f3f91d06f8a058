"""LocalEngineBackend: one LLMEngine in this process behind the Backend protocol.

The colocated single-worker case (prefill and decode in one engine) and the front ends' tests. The
engine is driven by an EngineLoop thread; this class is the asyncio side: one asyncio.Queue per request fed
by the engine thread, and abort when a consumer stops early. How many requests it takes at once is bounded
above it, as for every backend (cluster/api/admission.py, `--max-pending-requests`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cluster.backend import BackendHealth, BackendUnavailable, GenerationChunk, GenerationRequest
from cluster.local.engine_loop import ChunkSink, EngineLoad, EngineLoop
from engine.core.llm_engine import LLMEngine


@dataclass(frozen=True)
class LocalBackendConfig:
    """model_name: what the front ends serve it as (OpenAI `model`); worker_name: the worker named in
    its Timing."""

    model_name: str = "tandem-default"
    worker_name: str = "local"

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")


def load_details(load: EngineLoad) -> dict:
    """BackendHealth.details of a colocated engine (the keys ServingMetrics reads as gauges)."""
    return {"mode": "colocated", "running_requests": load.running_requests,
            "waiting_requests": load.waiting_requests, "free_kv_blocks": load.free_blocks,
            "total_kv_blocks": load.total_blocks}


class LocalEngineBackend:
    """Serves `engine`, which it owns from here on (its thread steps it) until shutdown().

    Use from one asyncio loop. Timing: queue_ms = arrival -> first scheduled step, prefill_ms = first
    scheduled -> first token sampled, ttft_ms = arrival -> first token handed to the consumer,
    transfer_ms = kv_bytes = 0, both worker names `config.worker_name`.
    """

    def __init__(self, engine: LLMEngine, config: LocalBackendConfig = LocalBackendConfig()) -> None:
        self.model_name = config.model_name
        self.max_model_len = engine.max_model_len
        self._tokenizer = engine.tokenizer
        self._engine_loop = EngineLoop(engine, config.worker_name)
        self._live: set[str] = set()
        self._request_numbers = itertools.count()
        self._closed = False

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def num_live_requests(self) -> int:
        """Requests admitted and not yet ended (as this loop sees them)."""
        return len(self._live)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the chunks of `request`; see Backend.generate. Raises BackendUnavailable after
        shutdown, ValueError (before any chunk) when the engine rejects the input. Closing the iterator
        early aborts the request."""
        engine_id = self._admit(request)
        chunks: asyncio.Queue = asyncio.Queue()
        self._engine_loop.submit(engine_id, request, ChunkSink(asyncio.get_running_loop(), chunks))
        ended = False
        samples_left = request.params.n  # the engine samples them all (one prefill, shared KV)
        first_delivered: float | None = None
        try:
            while not ended:
                item = await chunks.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                if first_delivered is None and item.token_ids:
                    first_delivered = time.perf_counter()
                if item.finish_reason is not None:
                    samples_left -= 1
                    ended = not samples_left
                    item = _with_delivery_ttft(item, request.arrival_time, first_delivered)
                yield item
        finally:
            self._live.discard(engine_id)
            if not ended:
                self._engine_loop.abort(engine_id)

    def _admit(self, request: GenerationRequest) -> str:
        if self._closed or not self._engine_loop.alive:
            raise BackendUnavailable("the backend is shut down")
        engine_id = f"{request.request_id}#{next(self._request_numbers)}"
        self._live.add(engine_id)
        return engine_id

    async def health(self) -> BackendHealth:
        """Serving until shutdown (or if the engine thread died); details carry the engine's load as
        of its last step (running / waiting requests, free / total KV blocks). Changes nothing."""
        serving = not self._closed and self._engine_loop.alive
        return BackendHealth(serving=serving, model=self.model_name, prefill_workers=1, decode_workers=1,
                             details=load_details(self._engine_loop.load))

    async def shutdown(self) -> None:
        """Abort everything in flight (consumers get BackendUnavailable), free all blocks and join
        the engine thread. Idempotent."""
        self._closed = True
        await asyncio.to_thread(self._engine_loop.stop)


def _with_delivery_ttft(chunk: GenerationChunk, arrival_time: float,
                        first_delivered: float | None) -> GenerationChunk:
    if chunk.timing is None:
        return chunk
    delivered = first_delivered if first_delivered is not None else time.perf_counter()
    timing = dataclasses.replace(chunk.timing, ttft_ms=(delivered - arrival_time) * 1e3)
    return dataclasses.replace(chunk, timing=timing)
