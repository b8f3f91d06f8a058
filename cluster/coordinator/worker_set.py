"""WorkerSet: the coordinator's workers over time, each in one state, and their decode event pumps.

    starting --(engine loaded, KV wired)--> serving --(drain)--> draining --(its requests ended)--> stopped
        \\--(failed to start)--> stopped              \\--(died, wedged, drain timed out)--> lost

A worker is routed to only while serving (the Router keeps that view); a draining worker still runs the
requests it holds (it is alive: cancels reach it, the health monitor checks it, a death migrates its
requests); a stopped worker is gone from the set, its bundle released or kept for the next worker of its
role; a lost one stays listed (with why) for /health. Names and KV-plane ranks are never reused: an added
worker is `<role>-<next index>` and takes the next rank. Used from the coordinator's asyncio loop only.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from cluster.coordinator.decode_events import DecodeEventPump
from cluster.coordinator.request_flow import WorkerRef
from cluster.workers.actors import WorkerInfo
from cluster.workers.added_worker import BundleSlot


class WorkerState(str, Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"
    LOST = "lost"


SHOWN_STATES = (WorkerState.STARTING, WorkerState.SERVING, WorkerState.DRAINING, WorkerState.LOST)
_NEXT = {WorkerState.STARTING: {WorkerState.SERVING, WorkerState.STOPPED},
         WorkerState.SERVING: {WorkerState.DRAINING, WorkerState.LOST},
         WorkerState.DRAINING: {WorkerState.STOPPED, WorkerState.LOST}}


@dataclass(frozen=True)
class Worker:
    """A started worker actor and what it said about itself."""

    info: WorkerInfo
    actor: object

    @property
    def ref(self) -> WorkerRef:
        return WorkerRef(self.info.name, self.actor)


@dataclass
class Member:
    """One worker of the set: its role, KV-plane rank, state (since when), bundle, and once started its
    actor; `reason` says why it was lost."""

    name: str
    role: str
    rank: int
    state: WorkerState
    since: float
    slot: BundleSlot | None
    worker: Worker | None = None
    reason: str = ""


class WorkerSet:
    def __init__(self, started: list[tuple[Worker, int, BundleSlot]]) -> None:
        """started: the workers that serve from the start, each with its rank and its bundle of the start group."""
        self._members: dict[str, Member] = {}
        self.workers: dict[str, Worker] = {}  # every member with an actor (serving, draining, lost): a live view
        self._free_slots: list[tuple[str, BundleSlot]] = []   # bundles of the start group drained workers left
        self._next_index: dict[str, int] = {}
        self._next_rank = 0
        self._pumps: dict[str, DecodeEventPump] = {}
        now = time.monotonic()
        for worker, rank, slot in started:
            role = worker.info.role
            name = worker.info.name
            self._members[name] = Member(name, role, rank, WorkerState.SERVING, now, slot, worker)
            self.workers[name] = worker
            self._next_index[role] = self._next_index.get(role, 0) + 1
            self._next_rank = max(self._next_rank, rank + 1)

    # ---- reading --------------------------------------------------------------------------------
    def state(self, name: str) -> WorkerState:
        """The state of `name` (STOPPED once it left the set, or if it never was in it)."""
        member = self._members.get(name)
        return WorkerState.STOPPED if member is None else member.state

    def is_alive(self, name: str) -> bool:
        """Its actor runs and holds or may hold requests: serving or draining."""
        return self.state(name) in (WorkerState.SERVING, WorkerState.DRAINING)

    def member(self, name: str) -> Member:
        return self._members[name]

    def names(self, role: str | None = None, *states: WorkerState) -> list[str]:
        """Members of `role` (None: any) in any of `states` (none given: any state), in start order."""
        return [m.name for m in self._members.values()
                if (role is None or m.role == role) and (not states or m.state in states)]

    def count(self, role: str, *states: WorkerState) -> int:
        return len(self.names(role, *states))

    def states(self) -> dict[str, dict[str, str]]:
        """name -> {"role", "state"} of every member (the /metrics state gauges, GET /admin/workers)."""
        return {m.name: {"role": m.role, "state": m.state.value} for m in self._members.values()}

    def failures(self) -> dict[str, str]:
        """Why each lost worker was declared lost."""
        return {m.name: m.reason for m in self._members.values() if m.state is WorkerState.LOST}

    def held_bundles(self, free: bool = False) -> list[str]:
        """The role of every bundle the cluster holds: each member's (a lost one's until lost_bundles) and
        each free bundle of the start group; free=True: of the free ones only."""
        taken = [] if free else [m.role for m in self._members.values() if m.slot is not None]
        return taken + [r for r, _ in self._free_slots]

    def held_slots(self) -> list[tuple[str, BundleSlot]]:
        """(role, bundle) of every bundle the cluster holds, as held_bundles() counts them (where an added
        worker may go depends on their nodes: cluster/workers/added_placement.py)."""
        taken = [(m.role, m.slot) for m in self._members.values() if m.slot is not None]
        return taken + list(self._free_slots)

    def owned_groups(self) -> list:
        """The placement groups of added workers (released at shutdown with the start group)."""
        return [m.slot.group for m in self._members.values() if m.slot is not None and m.slot.owned]

    # ---- changing -------------------------------------------------------------------------------
    def reserve(self, role: str) -> Member:
        """A new member of `role`, STARTING, with the next name and rank, and a free start-group bundle of
        its role if there is one (else its slot is None: it gets a group of its own)."""
        index = self._next_index.get(role, 0)
        self._next_index[role] = index + 1
        rank, self._next_rank = self._next_rank, self._next_rank + 1
        slot = next((s for r, s in self._free_slots if r == role), None)
        self._free_slots = [(r, s) for r, s in self._free_slots if s is not slot]
        member = Member(f"{role}-{index}", role, rank, WorkerState.STARTING, time.monotonic(), slot)
        self._members[member.name] = member
        return member

    def started(self, name: str, worker: Worker, slot: BundleSlot) -> None:
        """STARTING -> SERVING: its engine is loaded and its KV wired; the caller routes to it next."""
        member = self._move(name, WorkerState.SERVING)
        member.worker, member.slot = worker, slot
        self.workers[name] = worker

    def drain(self, name: str) -> None:
        """SERVING -> DRAINING (the caller stops routing to it)."""
        self._move(name, WorkerState.DRAINING)

    def stopped(self, name: str) -> None:
        """STARTING or DRAINING -> STOPPED: the member leaves the set; a start-group bundle it held is kept
        for the next worker of its role (the caller releases an owned group)."""
        member = self._move(name, WorkerState.STOPPED)
        del self._members[name]
        self.workers.pop(name, None)
        self.stop_pump(name)
        if member.slot is not None and not member.slot.owned:
            self._free_slots.append((member.role, member.slot))

    def mark_lost(self, name: str, reason: str) -> bool:
        """SERVING or DRAINING -> LOST; False (nothing changes) in any other state."""
        member = self._members.get(name)
        if member is None or member.state not in (WorkerState.SERVING, WorkerState.DRAINING):
            return False
        self._move(name, WorkerState.LOST).reason = reason
        return True

    def lost_bundles(self) -> list[BundleSlot]:
        """Takes the bundles of lost workers (their actors are killed): a start-group bundle goes back to
        the free ones of its role; the groups of their own are returned, for the caller to remove."""
        owned = []
        for member in self._members.values():
            if member.state is WorkerState.LOST and member.slot is not None:
                if member.slot.owned:
                    owned.append(member.slot)
                else:
                    self._free_slots.append((member.role, member.slot))
                member.slot = None
        return owned

    def _move(self, name: str, state: WorkerState) -> Member:
        member = self._members[name]
        if state not in _NEXT.get(member.state, set()):
            raise ValueError(f"worker {name} cannot go from {member.state.value} to {state.value}")
        member.state, member.since = state, time.monotonic()
        return member

    # ---- decode event pumps -----------------------------------------------------------------------
    def pump(self, name: str, on_lost: Callable[[str, BaseException], None]) -> DecodeEventPump:
        """The holder of decode worker `name`'s channel on the running loop, opened on first use (a new
        one takes the worker's events over if the caller's loop changed, as in tests that call asyncio.run
        per test)."""
        pump = self._pumps.get(name)
        if pump is None or not pump.on_running_loop():  # first use, or the caller moved to a new loop
            actor = self.workers[name].actor
            pump = self._pumps[name] = DecodeEventPump(name, lambda: actor.open_channel.remote(), on_lost)
        return pump

    def close_mailbox(self, name: str, request_id: str) -> None:
        pump = self._pumps.get(name)
        if pump is not None:
            pump.close(request_id)

    def stop_pump(self, name: str) -> None:
        """Stop reading `name`'s stream (before its actor stops, so that the end is no loss)."""
        pump = self._pumps.pop(name, None)
        if pump is not None:
            pump.stop()

    def stop_pumps(self) -> None:
        for name in list(self._pumps):
            self.stop_pump(name)
