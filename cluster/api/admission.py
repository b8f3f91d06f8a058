"""AdmissionBound: at most N requests in the system at once, for any backend (`--max-pending-requests`).

`tandem serve` puts one around its backend, colocated engine, replicas and disaggregated coordinator alike,
under the DrainingBackend both front ends share, so one count covers gRPC and HTTP. A request counts from
its first step into generate() until its stream closes (finished, failed, cancelled by its client, or ended
by the stop); past the bound generate() raises BackendOverloaded before the backend sees the request, which
the front ends answer 429 / RESOURCE_EXHAUSTED. The backend's own refusals (a full decode pool, a prefill
queue past --max-prefill-queue-tokens) still apply beneath it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing

from cluster.backend import Backend, BackendHealth, BackendOverloaded, GenerationChunk, GenerationRequest


class AdmissionBound:
    """Delegates to `backend`, admitting at most `max_pending_requests` requests at once. Use from one
    asyncio loop (the count is not locked: nothing awaits between the check and the increment)."""

    def __init__(self, backend: Backend, max_pending_requests: int) -> None:
        if isinstance(max_pending_requests, bool) or not isinstance(max_pending_requests, int) \
                or max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be an integer >= 1, got {max_pending_requests!r}")
        self.model_name = backend.model_name
        self.max_model_len = backend.max_model_len
        self.max_pending_requests = max_pending_requests
        self._backend = backend
        self._in_flight = 0

    @property
    def tokenizer(self):
        return self._backend.tokenizer

    @property
    def in_flight(self) -> int:
        """Requests admitted whose stream is still open."""
        return self._in_flight

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The backend's chunks and errors, unchanged; BackendOverloaded (before the backend sees the
        request) while max_pending_requests are in flight."""
        if self._in_flight >= self.max_pending_requests:
            raise BackendOverloaded(f"{self._in_flight} requests in flight, the limit is "
                                    f"{self.max_pending_requests}; retry later")
        self._in_flight += 1
        try:
            async with aclosing(self._backend.generate(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._in_flight -= 1

    async def health(self) -> BackendHealth:
        """The backend's health; details also carry requests_in_flight and max_pending_requests (gauges
        of /metrics)."""
        health = await self._backend.health()
        details = {**health.details, "requests_in_flight": self._in_flight,
                   "max_pending_requests": self.max_pending_requests}
        return dataclasses.replace(health, details=details)

    async def shutdown(self) -> None:
        await self._backend.shutdown()
