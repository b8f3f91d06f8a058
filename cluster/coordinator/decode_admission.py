"""DecodeAdmissions: the coordinator asks decode workers (or replicas), in routing order, to expect a request.

The first worker that accepts keeps it: the request's blocks (and, when that worker prefills it, its prompt
tokens) are claimed on it in the router, and its mailbox on the worker's event stream is open. A worker that
refuses (backpressure) is released and the next is asked; one that died is declared lost. Every claim is
released with `release` once the request ends, whichever way.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from cluster.backend import BackendOverloaded, BackendUnavailable
from cluster.coordinator.decode_events import WorkerStreamLost
from cluster.coordinator.routing import Router
from cluster.coordinator.worker_set import Worker, WorkerSet
from decode_worker import Admission, ExpectedRequest


class DecodeAdmissions:
    def __init__(self, router: Router, worker_set: WorkerSet, replicas: bool,
                 worker_lost: Callable[[str, BaseException], None],
                 stream_lost: Callable[[str, BaseException], None]) -> None:
        """replicas: the decode side are colocated replicas (routed by load with prefix affinity).
        worker_lost: a worker's expect() found it dead; stream_lost: its event stream broke."""
        self._router, self._set, self._replicas = router, worker_set, replicas
        self._worker_lost, self._stream_lost = worker_lost, stream_lost

    async def open(self, expected: ExpectedRequest, blocks: int, queued: int,
                   first_choice: str | None = None) -> tuple[Worker, asyncio.Queue, Admission]:
        """The first worker (in routing order; `first_choice` before the others) that accepts the request,
        the request's mailbox on that worker's event stream, and its Admission. The request's blocks (and,
        prefilled there, its `queued` prompt tokens) stay claimed on that worker until `release`.
        BackendUnavailable when no worker is alive, BackendOverloaded when every one refused."""
        prompt, request_id = expected.prompt_token_ids, expected.request_id
        order = self._router.replica_order(prompt, blocks) if self._replicas else \
            self._router.decode_order(prompt, blocks)
        if first_choice in order:
            order = [first_choice] + [name for name in order if name != first_choice]
        refusals = []
        for name in order:
            if not self._router.is_alive(name):  # drained or lost while an earlier one was asked
                continue
            admission, worker, mailbox = await self._ask(name, expected, blocks, queued)
            if admission is not None and admission.accepted:
                self._router.decode_holds(prompt, name)  # its KV will be there: prompts sharing it follow
                return worker, mailbox, admission
            self.release(name, request_id, blocks, queued)
            if admission is not None:
                refusals.append(f"{name}: {admission.reason}")
        role = "replica" if self._replicas else "decode worker"
        if not refusals:
            raise BackendUnavailable(f"no {role} is alive")
        raise BackendOverloaded(f"every {role} refused the request: " + "; ".join(refusals))

    async def _ask(self, name: str, expected: ExpectedRequest, blocks: int, queued: int):
        """Claims on `name` and its expect() answer (None: it died); a caller that left meanwhile releases
        the claims and cancels what the worker may have accepted."""
        worker, pump = self._set.workers[name], self._set.pump(name, self._stream_lost)
        self._router.claim_decode(name, blocks, queued)
        if self._replicas:  # at once, so that the prompts right behind it with its prefix follow it
            self._router.served_prefix(expected.prompt_token_ids, name)
        mailbox = pump.open(expected.request_id)
        try:
            return await pump.expect(expected), worker, mailbox
        except WorkerStreamLost as error:  # the channel broke (or never opened): the worker is lost
            self._worker_lost(name, error)
            return None, worker, mailbox
        except BaseException:  # the consumer left meanwhile: drop what the worker may have accepted
            worker.actor.cancel.remote(expected.request_id)
            self.release(name, expected.request_id, blocks, queued)
            raise

    def release(self, name: str, request_id: str, blocks: int, queued: int) -> None:
        """Drops the request's claims on worker `name` and closes its mailbox there."""
        self._router.prefilled(name, queued)
        self._router.decode_done(name, blocks)
        self._set.close_mailbox(name, request_id)
