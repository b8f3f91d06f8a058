"""RequestFlow: one request across processes, driven from the coordinator's asyncio loop.

The decode worker has already accepted the request (its expect() answered with an Admission). The flow then
sends the PrefillTask to the prefill worker and merges two sources into one event queue: the prefill worker's
PrefillReport (first token, timings, KV bytes, or why it failed) and the request's mailbox on the decode
worker's event stream (DecodeChunk / DecodeEnded, cluster/coordinator/decode_events.py). Decode chunks go to
the consumer as they arrive; the final one waits for the report, whose timings it carries (with prompt logprobs
asked for, every chunk waits for it: they come back in the report and go out on the first chunk). A worker that dies
ends the request with WorkerLost (its `role` says which side), except a prefill worker that dies after the KV
landed (the decode worker already streams): the request then goes on and ends without prefill timings. Any
other failure ends it with RequestFailed (or ValueError for input a worker rejected); either way the other
worker is told to cancel. A transfer failure the decode worker reports before the prefill report waits for
it: a first token that ended the request aborted the transfer, and the report carries it. A consumer that
stops early cancels the request on both workers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Callable

from ray.exceptions import RayActorError

from cluster.backend import BackendOverloaded, BackendUnavailable, GenerationChunk, GenerationRequest, Timing
from cluster.coordinator.decode_events import WorkerStreamLost
from decode_worker import DecodeChunk, DecodeEnded, DecodeStatus, is_final
from kv_transfer.config import ReceiverAddress
from prefill_worker import PrefillReport, PrefillStatus, PrefillTask


class WorkerLost(BackendUnavailable):
    """A worker serving the request died; the coordinator no longer routes to it. `role`: "prefill" or
    "decode", the side that died, or "transfer": the KV transfer between them failed (the decode worker
    may have died under it); either way the request may continue elsewhere (coordinator/migration.py)."""

    def __init__(self, message: str, role: str) -> None:
        super().__init__(message)
        self.role = role


class RequestFailed(RuntimeError):
    """The request could not complete (KV transfer failed, timed out, an engine step failed)."""


def decode_ended_error(event: DecodeEnded, worker: str) -> Exception:
    """What a consumer sees of a request its decode worker ended without a finish_reason."""
    if event.status is DecodeStatus.INVALID:
        return ValueError(event.message)
    if event.status is DecodeStatus.SHUTDOWN:
        return BackendUnavailable(f"decode worker {worker} stopped: {event.message}")
    if event.status is DecodeStatus.NO_ROOM:
        return BackendOverloaded(f"decode worker {worker} had no room for the request's KV: {event.message}")
    return RequestFailed(f"decode worker {worker}: {event.status.value}: {event.message}")


@dataclass(frozen=True)
class WorkerRef:
    name: str
    actor: Any  # a Ray actor handle (cluster.workers.actors.PrefillActor / DecodeActor)


@dataclass(frozen=True)
class FlowHooks:
    """How a flow tells the coordinator about workers: one died; the prefill side is done with it."""

    worker_lost: Callable[[str], None]
    is_alive: Callable[[str], bool]
    prefill_done: Callable[[], None]
    prefill_reported: Callable[[PrefillReport], None] = lambda report: None  # sees every report first


@dataclass(frozen=True)
class _Broken:
    """A worker call failed: the actor died (lost) or raised."""

    role: str
    worker: str
    error: BaseException
    lost: bool


class RequestFlow:
    def __init__(self, request: GenerationRequest, request_id: str, prefill: WorkerRef, decode: WorkerRef,
                 decode_address: ReceiverAddress, decode_mailbox: asyncio.Queue, hooks: FlowHooks,
                 num_resumed_tokens: int = 0, decode_cached_blocks: int = 0) -> None:
        """decode_mailbox: this request's events from the decode worker's stream (a DecodeEventPump
        mailbox), ending with a final event or a WorkerStreamLost. num_resumed_tokens: the last that many
        prompt tokens were streamed by an earlier attempt (a migrated request). decode_cached_blocks: the
        prompt's leading blocks the decode worker holds (its Admission.cached_blocks): not shipped."""
        self._request, self._rid = request, request_id
        self._prefill, self._decode, self._mailbox, self._hooks = prefill, decode, decode_mailbox, hooks
        self._task = PrefillTask(request_id, request.prompt_token_ids, request.params, decode_address,
                                 num_resumed_tokens, decode_cached_blocks)
        self._report: PrefillReport | None = None
        self._held: DecodeChunk | None = None  # decoded before the report came: the chunks merged, in order
        self._wants_prompt_logprobs = request.params.prompt_logprobs is not None
        self._decoded_any = self._ended = self._decode_ended = False
        self._dispatched = self._first_delivered = None
        self._transfer_failure: DecodeEnded | None = None  # the decode side's, while the report is awaited

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """The request's chunks, the last with finish_reason and Timing (see the module docstring)."""
        events: asyncio.Queue = asyncio.Queue()
        self._dispatched = time.perf_counter()
        pumps = [asyncio.ensure_future(self._pump_prefill(events)), asyncio.ensure_future(self._pump_decode(events))]
        try:
            while not self._ended:
                chunk = self._handle(await events.get())
                if chunk is not None:
                    yield self._delivered(chunk)
        finally:
            for pump in pumps:
                pump.cancel()
            if not self._ended:  # the consumer went away: free everything on both workers
                self._cancel_prefill()
                self._cancel_decode()

    async def _pump_prefill(self, events: asyncio.Queue) -> None:
        try:
            report = await self._prefill.actor.prefill.remote(self._task)
            self._hooks.prefill_reported(report)
            events.put_nowait(report)
        except RayActorError as error:
            events.put_nowait(_Broken("prefill", self._prefill.name, error, lost=True))
        except Exception as error:
            events.put_nowait(_Broken("prefill", self._prefill.name, error, lost=False))
        finally:
            self._hooks.prefill_done()

    async def _pump_decode(self, events: asyncio.Queue) -> None:
        while True:
            event = await self._mailbox.get()
            if isinstance(event, WorkerStreamLost):
                events.put_nowait(_Broken("decode", self._decode.name, event.error, lost=True))
                return
            events.put_nowait(event)
            if is_final(event):
                return

    def _handle(self, event) -> GenerationChunk | None:
        """Applies one event; returns a chunk to deliver, or raises to end the request."""
        if isinstance(event, PrefillReport):
            return self._on_report(event)
        if isinstance(event, DecodeChunk):
            return self._on_decoded(event)
        if isinstance(event, _Broken):
            return self._on_broken(event)
        return self._on_decode_ended(event)

    def _on_decode_ended(self, event: DecodeEnded) -> None:
        """The decode worker ended the request (raises). A failed transfer before the prefill report waits
        for it instead: a first token that ends the request aborts its layer stream, which the decode side
        sees as a failed transfer, and the report (FINISHED) then carries that token."""
        self._decode_ended = True
        if event.status is DecodeStatus.TRANSFER_FAILED and self._report is None:
            self._transfer_failure = event
            return None
        self._ended = True
        self._cancel_prefill()
        raise decode_ended_error(event, self._decode.name)

    def _on_report(self, report: PrefillReport) -> GenerationChunk | None:
        self._report = report
        if self._transfer_failure is not None and report.status is PrefillStatus.SHIPPED:
            self._ended = True  # the prefill side saw an ack the decode side did not give: trust the failure
            raise decode_ended_error(self._transfer_failure, self._decode.name)
        if report.status is PrefillStatus.SHIPPED or self._decoded_any:  # a late failure after the KV landed
            return self._release_held()
        self._cancel_decode()
        if report.status is PrefillStatus.FINISHED:  # the first token ended it: nothing was shipped
            self._ended = True
            logprobs = None if report.first_logprobs is None else (report.first_logprobs,)
            chunk = GenerationChunk((report.first_token,), report.text, report.finish_reason, logprobs=logprobs,
                                    prompt_logprobs=report.prompt_logprobs)
            return dataclasses.replace(chunk, timing=dataclasses.replace(self._timing(), decode_worker=""))
        self._ended = True
        if report.status is PrefillStatus.INVALID:
            raise ValueError(report.error)
        if report.status is PrefillStatus.CANCELLED:  # not by this flow: the worker is stopping
            raise BackendUnavailable(f"prefill worker {self._prefill.name} stopped: {report.error}")
        if report.status is PrefillStatus.TRANSFER_FAILED:  # e.g. the decode worker died under it: retryable
            raise WorkerLost(f"the KV transfer from {self._prefill.name} to {self._decode.name} failed: "
                             f"{report.error}", role="transfer")
        raise RequestFailed(f"prefill worker {self._prefill.name}: {report.status.value}: {report.error}")

    def _on_decoded(self, chunk: DecodeChunk) -> GenerationChunk | None:
        first = not self._decoded_any
        self._decoded_any = True
        if chunk.finish_reason is not None:
            self._decode_ended = True
        if self._report is None and (chunk.finish_reason is not None or self._wants_prompt_logprobs):
            self._held = chunk if self._held is None else _merged(self._held, chunk)  # the report is on its way
            return None
        if chunk.finish_reason is not None:
            return self._final(chunk, first)
        return GenerationChunk(chunk.token_ids, chunk.text, logprobs=chunk.logprobs,
                               prompt_logprobs=self._report.prompt_logprobs if first and self._report else None)

    def _release_held(self) -> GenerationChunk | None:
        """The chunks decoded before the report came, as one, final if the request ended meanwhile; None if
        there are none. With prompt logprobs asked for, every chunk before the report is held, so this is
        the request's first and carries them; without, the report has none to give."""
        held, self._held = self._held, None
        if held is None:
            return None
        if held.finish_reason is not None:
            return self._final(held, first=True)
        return GenerationChunk(held.token_ids, held.text, logprobs=held.logprobs,
                               prompt_logprobs=self._report.prompt_logprobs)

    def _on_broken(self, broken: _Broken) -> GenerationChunk | None:
        """A worker call failed: ends the request (raises), unless the prefill worker died after its KV
        landed (see the module docstring): then returns the held final chunk, if any, or None."""
        if broken.lost:
            self._hooks.worker_lost(broken.worker)
        if broken.role == "prefill" and broken.lost and self._decoded_any:
            self._report = _no_report(self._rid, broken.worker)
            return self._release_held()
        self._ended = True
        if broken.role == "decode":
            self._decode_ended = True
            self._cancel_prefill()
        else:
            self._report = self._report or _no_report(self._rid, broken.worker)
            self._cancel_decode()
        if broken.lost:
            raise WorkerLost(f"{broken.role} worker {broken.worker} died: {broken.error}", broken.role)
        raise RequestFailed(f"{broken.role} worker {broken.worker} failed: {broken.error}")

    def _final(self, chunk: DecodeChunk, first: bool) -> GenerationChunk:
        """`chunk` is the request's last (first: and the first of its decoded ones)."""
        self._ended = True
        return GenerationChunk(chunk.token_ids, chunk.text, chunk.finish_reason, self._timing(), chunk.logprobs,
                               prompt_logprobs=self._report.prompt_logprobs if first else None)

    def _timing(self) -> Timing:
        """Everything but ttft_ms, which is set when the chunk is handed to the consumer."""
        report, dispatch_ms = self._report, (self._dispatched - self._request.arrival_time) * 1e3
        return Timing(queue_ms=dispatch_ms + report.queue_ms, prefill_ms=report.prefill_ms,
                      transfer_ms=report.transfer_ms, transfer_exposed_ms=report.transfer_exposed_ms,
                      kv_bytes=report.kv_bytes,
                      prefill_worker=self._prefill.name, decode_worker=self._decode.name)

    def _delivered(self, chunk: GenerationChunk) -> GenerationChunk:
        now = time.perf_counter()
        if self._first_delivered is None and chunk.token_ids:
            self._first_delivered = now
        if chunk.timing is None:
            return chunk
        first = self._first_delivered if self._first_delivered is not None else now
        timing = dataclasses.replace(chunk.timing, ttft_ms=(first - self._request.arrival_time) * 1e3)
        return dataclasses.replace(chunk, timing=timing)

    def _cancel_prefill(self) -> None:
        if self._report is None and self._hooks.is_alive(self._prefill.name):
            self._prefill.actor.cancel.remote(self._rid)

    def _cancel_decode(self) -> None:
        if not self._decode_ended and self._hooks.is_alive(self._decode.name):
            self._decode_ended = True
            self._decode.actor.cancel.remote(self._rid)


def _merged(earlier: DecodeChunk, later: DecodeChunk) -> DecodeChunk:
    """Two consecutive chunks of one request as one."""
    logprobs = None if earlier.logprobs is None else earlier.logprobs + (later.logprobs or ())
    return DecodeChunk(earlier.request_id, earlier.token_ids + later.token_ids, earlier.text + later.text,
                       later.finish_reason, logprobs)


def _no_report(request_id: str, worker: str) -> PrefillReport:
    return PrefillReport(request_id, PrefillStatus.FAILED, worker, 0.0, error="no report")
