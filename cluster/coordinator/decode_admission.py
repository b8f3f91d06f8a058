"""DecodeAdmissions: the coordinator asks decode workers (or replicas), in routing order, to expect a request.

The first worker that accepts keeps it: the request's blocks (and, when that worker prefills it, its prompt
tokens) are claimed on it in the router, and its mailbox on the worker's event stream is open. A worker that
refuses (backpressure) is released and the next is asked; one that died is declared lost. Every claim is
released with `release` once the request ends, whichever way.

When no alive worker accepts and some refused for lack of room (Admission.for_room: a full KV pool, the live-request
limit; not a worker that is stopping), the request waits for room in a RoomQueue (cluster/coordinator/room_queue.py),
first come first served, up to the room wait; then it is refused as overloaded.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from cluster.backend import BackendOverloaded, BackendUnavailable
from cluster.coordinator.decode_events import WorkerStreamLost
from cluster.coordinator.room_queue import RoomQueue
from cluster.coordinator.routing import Router
from cluster.coordinator.worker_set import Worker, WorkerSet
from decode_worker import Admission, ExpectedRequest


class DecodeAdmissions:
    def __init__(self, router: Router, worker_set: WorkerSet, replicas: bool,
                 worker_lost: Callable[[str, BaseException], None],
                 stream_lost: Callable[[str, BaseException], None], room_wait_s: float = 0.0) -> None:
        """replicas: the decode side are colocated replicas (routed by load with prefix affinity).
        worker_lost: a worker's expect() found it dead; stream_lost: its event stream broke. room_wait_s: how long
        a request no worker took, some for lack of room, waits for room (ClusterConfig.decode_room_wait_s)."""
        self._router, self._set, self._replicas = router, worker_set, replicas
        self._worker_lost, self._stream_lost = worker_lost, stream_lost
        self._room_wait_s, self._room = room_wait_s, RoomQueue()
        self._role = "replica" if replicas else "decode worker"

    @property
    def waiting_for_room(self) -> int:
        """Requests waiting in the room queue now."""
        return len(self._room)

    async def open(self, expected: ExpectedRequest, blocks: int, queued: int,
                   first_choice: str | None = None) -> tuple[Worker, asyncio.Queue, Admission]:
        """The first worker (in routing order; `first_choice` before the others) that accepts the request,
        the request's mailbox on that worker's event stream, and its Admission. The request's blocks (and,
        prefilled there, its `queued` prompt tokens) stay claimed on that worker until `release`.
        BackendUnavailable when no worker is alive, BackendOverloaded when every one refused, for lack of room
        after the room wait."""
        deadline = time.monotonic() + self._room_wait_s
        refusals: list[tuple[str, Admission]] = []
        if not self._room:  # nobody waits for room: ask at once
            accepted, refusals = await self._ask_in_order(expected, blocks, queued, first_choice)
            if accepted is not None:
                return accepted
            self._check_refusals(refusals, deadline)
        async with self._room.joined() as turn:
            while await turn(deadline):
                accepted, refusals = await self._ask_in_order(expected, blocks, queued, first_choice)
                if accepted is not None:
                    return accepted
                self._check_refusals(refusals, deadline)
        raise self._overloaded(refusals)

    def _check_refusals(self, refusals: list[tuple[str, Admission]], deadline: float) -> None:
        """Returns when the request may wait on for room (some worker refused it for lack of room, which a request
        ending there lifts, and the deadline has not passed); else raises BackendUnavailable (no worker answered) or
        BackendOverloaded."""
        if not refusals:
            raise BackendUnavailable(f"no {self._role} is alive")
        if time.monotonic() < deadline and any(admission.for_room for _, admission in refusals):
            return
        raise self._overloaded(refusals)

    def _overloaded(self, refusals: list[tuple[str, Admission]]) -> BackendOverloaded:
        """The refusal of a request no worker took (refusals: their last answers; none: it waited behind others)."""
        waited = f" (after waiting {self._room_wait_s:g} s for room)" if self._room_wait_s > 0 else ""
        reasons = "; ".join(f"{name}: {admission.reason}" for name, admission in refusals) or \
            "earlier requests still wait for room"
        return BackendOverloaded(f"every {self._role} refused the request{waited}: {reasons}")

    async def _ask_in_order(self, expected: ExpectedRequest, blocks: int, queued: int, first_choice: str | None
                            ) -> tuple[tuple[Worker, asyncio.Queue, Admission] | None, list[tuple[str, Admission]]]:
        """One round over the alive workers in routing order: ((worker, mailbox, admission), []) from the first that
        accepts, else (None, [(name, its refusal)] of those that answered)."""
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
                return (worker, mailbox, admission), []
            self.release(name, request_id, blocks, queued, room_freed=False)
            if admission is not None:
                refusals.append((name, admission))
        return None, refusals

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

    def release(self, name: str, request_id: str, blocks: int, queued: int, room_freed: bool = True) -> None:
        """Drops the request's claims on worker `name` and closes its mailbox there; room_freed (the request had
        been accepted there): the requests waiting for room are asked again."""
        self._router.prefilled(name, queued)
        self._router.decode_done(name, blocks)
        self._set.close_mailbox(name, request_id)
        if room_freed:
            self._room.notify()
