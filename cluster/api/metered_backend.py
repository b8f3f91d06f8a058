"""MeteredBackend: a Backend that records every request flowing through it into ServingMetrics.

A front end wraps the backend it serves so that the per-request series (outcomes, TTFT, ITL,
end-to-end, queue / prefill / transfer, tokens) come from what the front end actually sees, for any
backend (local engine or coordinator). Two front ends sharing one ServingMetrics count into the same
series, labelled by front end.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from cluster.api.metrics import ServingMetrics
from cluster.backend import (Backend, BackendHealth, BackendOverloaded, BackendUnavailable, GenerationChunk,
                             GenerationRequest)


class MeteredBackend:
    """Delegates to `backend`; generate() also records the request under label `frontend`."""

    def __init__(self, backend: Backend, metrics: ServingMetrics, frontend: str) -> None:
        self.model_name = backend.model_name
        self.max_model_len = backend.max_model_len
        self._backend, self._metrics, self._frontend = backend, metrics, frontend

    @property
    def tokenizer(self):
        return self._backend.tokenizer

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The backend's chunks, unchanged; the request is counted once whatever way it ends."""
        outcome = "cancelled"
        previous: float | None = None
        samples_left = request.params.n  # the request finishes with its last sample
        try:
            async with aclosing(self._backend.generate(request)) as chunks:
                async for chunk in chunks:
                    now = time.perf_counter()
                    if previous is None:
                        self._metrics.observe_admitted(len(request.prompt_token_ids))
                        self._metrics.observe_first_token(now - request.arrival_time)
                    self._metrics.observe_chunk(len(chunk.token_ids), None if previous is None else now - previous)
                    previous = now
                    if chunk.finish_reason is not None:
                        samples_left -= 1
                        if not samples_left:
                            outcome = chunk.finish_reason
                            self._metrics.observe_finished(chunk.timing, now - request.arrival_time)
                    yield chunk
        except Exception as error:
            outcome = _outcome_of(error)
            raise
        finally:
            self._metrics.observe_outcome(self._frontend, outcome)

    async def health(self) -> BackendHealth:
        return await self._backend.health()

    async def shutdown(self) -> None:
        await self._backend.shutdown()


def _outcome_of(error: Exception) -> str:
    if isinstance(error, BackendOverloaded):
        return "overloaded"
    if isinstance(error, BackendUnavailable):
        return "unavailable"
    if isinstance(error, ValueError):
        return "invalid"
    return "error"
