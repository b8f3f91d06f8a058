"""LocalPrefillFlow: a request its decode worker prefills itself (conditional disaggregation).

Requests the disaggregation policy keeps local (cluster/coordinator/disagg_policy.py: few tokens left
uncached on the decode worker, a short prompt, or a long prefill queue) skip the prefill worker and the KV
transfer: the decode worker's engine prefills them between its decode steps (a short prompt costs a decode
step little), so they do not pay the transfer and the prefill queue in their TTFT. The flow reads the
request's mailbox on the decode worker's event stream; its Timing has no transfer and no prefill worker.
Colocated replicas take this flow for every request (their decode workers are replicas, role "replica").
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Callable

from cluster.backend import GenerationChunk, GenerationRequest, Timing
from cluster.coordinator.decode_events import WorkerStreamLost
from cluster.coordinator.request_flow import WorkerLost, WorkerRef, decode_ended_error
from decode_worker import DecodeEnded


class LocalPrefillFlow:
    def __init__(self, request: GenerationRequest, request_id: str, decode: WorkerRef, mailbox: asyncio.Queue,
                 worker_lost: Callable[[str, BaseException], None], is_alive: Callable[[str], bool],
                 role: str = "decode") -> None:
        """role: the decode side's role ("decode", or "replica"), named in errors."""
        self._request, self._rid, self._decode, self._mailbox = request, request_id, decode, mailbox
        self._worker_lost, self._is_alive = worker_lost, is_alive
        self._role = "replica" if role == "replica" else "decode worker"

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """The request's chunks, the last with finish_reason and Timing. Raises what the decode worker's
        end or loss means (decode_ended_error, WorkerLost); a consumer that stops early
        cancels the request on the decode worker."""
        dispatched, first, ended = time.perf_counter(), None, False
        try:
            while not ended:
                event = await self._mailbox.get()
                if isinstance(event, (WorkerStreamLost, DecodeEnded)):
                    ended = True
                    raise self._failure(event)
                first = first if first is not None else time.perf_counter()
                ended = event.finish_reason is not None
                timing = self._timing(dispatched, first) if ended else None
                yield GenerationChunk(event.token_ids, event.text, event.finish_reason, timing, event.logprobs,
                                      prompt_logprobs=event.prompt_logprobs)
        finally:
            if not ended and self._is_alive(self._decode.name):
                self._decode.actor.cancel.remote(self._rid)

    def _failure(self, event: WorkerStreamLost | DecodeEnded) -> Exception:
        name = self._decode.name
        if isinstance(event, DecodeEnded):
            return decode_ended_error(event, name)
        self._worker_lost(name, event.error)
        return WorkerLost(f"{self._role} {name} is lost: {event.error}", role="decode")

    def _timing(self, dispatched: float, first: float) -> Timing:
        arrival = self._request.arrival_time
        return Timing(queue_ms=(dispatched - arrival) * 1e3, prefill_ms=(first - dispatched) * 1e3,
                      ttft_ms=(first - arrival) * 1e3, decode_worker=self._decode.name)
