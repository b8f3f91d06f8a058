"""Scaling: workers added and drained while the coordinator serves (cluster.backend.WorkerScaling).

Adding k workers of a role (`POST /admin/workers`, `tandem scale`, the autoscaler): each is a new member
of the WorkerSet (starting), placed in a free bundle of the start group or a small placement group of its
own that follows the cluster's placement strategy (cluster/workers/added_placement.py), its engine loaded,
its KV plane wired (a new prefill worker's rank is added to every decode worker's receiver for
gloo/nccl/ipc; a new decode worker listens to every prefill rank; gRPC needs only the address each decode
worker reports), and only then routed to (serving). If any of the k does not start, all k are released and
nothing changes.

Draining k: the least loaded serving workers of the role leave routing at once (draining); each keeps
running what it holds, and once the coordinator's claims on it are gone (its requests ended) its KV peers
forget it, its actor stops, and its resources are released (stopped). A drain that runs past
drain_timeout_s declares the worker lost, so that what it still held migrates to the other workers
(cluster/coordinator/migration.py): a scale-down fails no request. Changes are serialized (one lock) and
shielded from their caller's cancellation (an admin client that disconnects leaves nothing half done).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ray.exceptions import RayActorError

from cluster.backend import BackendUnavailable, ScaleRefused
from cluster.coordinator.autoscale_loop import AutoscaleLoop
from cluster.coordinator.autoscaler import AutoscalePolicy, ScaleSnapshot
from cluster.coordinator.latency_window import LatencyWindow
from cluster.coordinator.routing import Router
from cluster.coordinator.scale_snapshot import role_snapshot
from cluster.coordinator.worker_set import Member, Worker, WorkerSet, WorkerState
from cluster.workers.added_placement import place_added_bundles, room_for_added
from cluster.workers.added_worker import BundleSlot, StartedWorker, release_added_worker, start_added_worker
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.placement import stop_actors
from cluster.workers.placement_check import PlacementInfeasible
from cluster.workers.worker_template import WorkerTemplate

logger = logging.getLogger("tandem.cluster.scaling")
DRAIN_POLL_S = 0.05
MAX_DELTA = 64
BOUND_FLAGS = {"prefill": "prefill-workers", "decode": "decode-workers", "replica": "replicas"}
SERVING, STARTING, DRAINING = WorkerState.SERVING, WorkerState.STARTING, WorkerState.DRAINING


@dataclass(frozen=True)
class ScalingHooks:
    """What scaling needs of its coordinator: declare a worker lost (stop routing, kill it, its requests
    migrate), every alive worker's stats, and the latency window the coordinator records into."""

    declare_lost: Callable[[str, str], None]
    worker_stats: Callable[[], Awaitable[dict]]
    latency: LatencyWindow


class Scaling:
    def __init__(self, config: ClusterConfig, template: WorkerTemplate, workers: WorkerSet, router: Router,
                 hooks: ScalingHooks) -> None:
        self._config, self._template, self._set, self._router, self._hooks = config, template, workers, router, hooks
        self.roles: tuple[str, ...] = ("replica",) if config.replicas else ("prefill", "decode")
        self._locks: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._drains: dict[str, asyncio.Task] = {}   # draining worker -> the task that stops it
        self._autoscaler: AutoscaleLoop | None = None
        self._closed = False

    def describe(self) -> dict:
        """See cluster.backend.WorkerScaling.describe; with the autoscaler's decisions when it runs."""
        bounds = {role: dict(zip(("min", "max"), self._config.bounds.of(role))) for role in self.roles}
        described = {"workers": self._set.states(), "bounds": bounds}
        if self._autoscaler is not None:
            described["autoscale_decisions"] = [
                {"role": role, "action": action, "outcome": outcome, "count": count}
                for (role, action, outcome), count in sorted(self._autoscaler.decisions.items())]
        return described

    async def scale(self, role: str, delta: int) -> dict:
        """See cluster.backend.WorkerScaling.scale."""
        if role not in self.roles:
            raise ScaleRefused(f"role must be one of {list(self.roles)} in this cluster, got {role!r}", "role")
        if isinstance(delta, bool) or not isinstance(delta, int) or delta == 0 or abs(delta) > MAX_DELTA:
            raise ScaleRefused(f"delta must be a non-zero integer within +-{MAX_DELTA}, got {delta!r}", "delta")
        return await asyncio.shield(asyncio.ensure_future(self._scale_locked(role, delta)))

    def _lock(self) -> asyncio.Lock:
        """The lock that serializes changes, on the running loop (a new one if the caller's loop changed,
        as in tests that call asyncio.run per test; a drain left behind on the old loop resumes)."""
        loop = asyncio.get_running_loop()
        if self._locks is None or self._locks[0] is not loop:
            self._locks = (loop, asyncio.Lock())
            for name in self._set.names(None, DRAINING):
                self._start_retiring(name)
        return self._locks[1]

    async def _scale_locked(self, role: str, delta: int) -> dict:
        async with self._lock():
            if self._closed:
                raise BackendUnavailable("the coordinator is shut down")
            for slot in self._set.lost_bundles():  # lost workers' actors are gone: their bundles too
                await asyncio.to_thread(release_added_worker, None, slot)
            await self._check_bounds(role, delta)
            if delta > 0:
                changed = {"started": await self._add(role, delta)}
            else:
                changed = {"draining": self._drain(role, -delta)}
        return {"role": role, "delta": delta, **changed, **self.describe()}

    async def _check_bounds(self, role: str, delta: int) -> None:
        """ScaleRefused when the role's serving and starting workers would pass a bound, or (no maximum
        given) the alive nodes cannot hold the new bundles beside those held by the placement strategy."""
        low, high = self._config.bounds.of(role)
        active = self._set.count(role, STARTING, SERVING)
        target, flag = active + delta, BOUND_FLAGS[role]
        if target < low:
            raise ScaleRefused(f"draining {-delta} of the {active} {role} workers would leave {target}, below the "
                               f"minimum of {low} (--min-{flag})", "delta")
        if high is not None and target > high:
            raise ScaleRefused(f"adding {delta} {role} workers to the {active} would make {target}, above the "
                               f"maximum of {high} (--max-{flag})", "delta")
        if high is None and delta > 0:   # free start-group bundles of the role are reused, the rest are new
            held = self._set.held_slots()
            new = max(0, delta - self._set.held_bundles(free=True).count(role))
            bundles = {r: self._template.group_bundle(r) for r in self.roles}  # a TP worker's ranks together
            try:
                await asyncio.to_thread(room_for_added, self._config.placement_strategy, role, new, held, bundles)
            except PlacementInfeasible as error:
                raise ScaleRefused(f"{delta} more {role} workers are more than the Ray cluster can hold beside "
                                   f"the {len(held)} it holds (--max-{flag} lets them wait for nodes the Ray "
                                   f"autoscaler adds): {error}", "delta") from None

    async def _add(self, role: str, count: int) -> list[str]:
        """Place `count` workers of `role`, start them, wire their KV, then route to them; on any failure
        release them all and raise ScaleRefused or BackendUnavailable (nothing changed)."""
        members = [self._set.reserve(role) for _ in range(count)]
        started: list[StartedWorker] = []
        try:
            slots, peers = await self._place(role, members), self._peer_ranks(role)
            results = await asyncio.gather(*(asyncio.to_thread(start_added_worker, self._template, role, m.name,
                                                               m.rank, peers, slot, self._config.worker_start_timeout_s)
                                             for m, slot in zip(members, slots)), return_exceptions=True)
            started = [r for r in results if isinstance(r, StartedWorker)]
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None or self._closed:
                raise failure or BackendUnavailable("the coordinator is shutting down")
            await self._wire(role, [m.rank for m in members])
        except Exception as error:
            await asyncio.to_thread(lambda: [release_added_worker(s.actor, s.slot) for s in started])
            for member in members:
                self._set.stopped(member.name)
            if isinstance(error, PlacementInfeasible):   # no alive node can ever hold one
                raise ScaleRefused(f"no {role} worker can be added: {error}", "delta") from error
            raise BackendUnavailable(f"could not add {count} {role} worker(s), nothing changed: {error}") from error
        for member, worker in zip(members, started):
            self._set.started(member.name, Worker(worker.info, worker.actor), worker.slot)
            if role == "prefill":
                self._router.add_prefill(member.name)
            else:
                self._router.add_decode(member.name, worker.info.total_blocks)
            logger.info("%s serves (added; %d %s workers serving)", member.name, self._set.count(role, SERVING), role)
        return [m.name for m in members]

    async def _place(self, role: str, members: list[Member]) -> list[BundleSlot]:
        """Each new member's bundle: the free start-group bundle it reserved, or a group of its own placed by
        the cluster's placement strategy beside every bundle the cluster holds (added_placement.py)."""
        held, count = [slot for _, slot in self._set.held_slots()], sum(m.slot is None for m in members)
        placed = iter(await asyncio.to_thread(place_added_bundles, role, self._template.bundle(role),
                                              self._config.placement_strategy, held, count,
                                              self._config.worker_start_timeout_s, self._template.tp_size(role)))
        return [m.slot or next(placed) for m in members]

    def _peer_ranks(self, role: str) -> tuple[int, ...]:
        """A new decode worker's prefill peers (rank transports): every prefill worker that runs."""
        if role == "prefill" or not self._template.ranked:
            return ()
        return tuple(self._set.member(n).rank for n in self._set.names("prefill", SERVING, DRAINING))

    async def _wire(self, role: str, ranks: list[int]) -> None:
        """New prefill workers' ranks on every running decode worker's receiver (rank transports)."""
        if role != "prefill" or not self._template.ranked:
            return
        calls = [self._set.workers[name].actor.add_kv_peer.remote(rank)
                 for name in self._set.names(self._config.decode_role, SERVING, DRAINING) for rank in ranks]
        await _ignoring_dead(calls)

    def _drain(self, role: str, count: int) -> list[str]:
        """The `count` least loaded serving workers of `role` (newest first among equals) stop being routed
        to at once; each stops in the background once its requests have ended."""
        serving = self._set.names(role, SERVING)
        order = {name: index for index, name in enumerate(serving)}
        victims = sorted(serving, key=lambda name: (self._held(name), -order[name]))[:count]
        for name in victims:
            self._set.drain(name)
            self._router.mark_dead(name)
            logger.info("%s drains: no new requests; it stops once its %d running end", name, self._held(name)[0])
            self._start_retiring(name)
        return victims

    def _start_retiring(self, name: str) -> None:
        task = self._drains[name] = asyncio.get_running_loop().create_task(self._retire(name))
        task.add_done_callback(lambda done: self._drains.pop(name, None) if self._drains.get(name) is done else None)

    def _held(self, name: str) -> tuple[int, int]:
        """(requests, prompt tokens) the coordinator has routed to `name` that have not ended."""
        load = self._router.load(name)
        return (getattr(load, "running", 0), load.queued_tokens) if load is not None else (0, 0)

    async def _retire(self, name: str) -> None:
        """Waits for a draining worker's requests to end, then stops it (or, past drain_timeout_s, declares it
        lost so that what it holds migrates)."""
        deadline = time.monotonic() + self._config.drain_timeout_s
        while self._set.state(name) is DRAINING and any(self._held(name)) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self._set.state(name) is not DRAINING:   # lost meanwhile: its requests migrated
            return
        if any(self._held(name)):
            self._hooks.declare_lost(name, f"its drain ran past {self._config.drain_timeout_s:g}s; the "
                                           f"{self._held(name)[0]} requests it held continue on other workers")
            return
        async with self._lock():
            if self._set.state(name) is DRAINING and not self._closed:
                await self._stop(name)

    async def _stop(self, name: str) -> None:
        """A drained worker leaves: the set (no routing, no health checks, its stream's end is no loss), its
        KV peers' links, its actor, its resources."""
        member = self._set.member(name)
        self._set.stopped(name)
        self._router.remove(name)
        await self._unwire(member)
        await stop_actors([member.worker.actor], self._config.worker_stop_timeout_s)
        await asyncio.to_thread(release_added_worker, member.worker.actor, member.slot)
        logger.info("%s stopped (drained; %d %s workers serving)", name, self._set.count(member.role, SERVING),
                    member.role)

    async def _unwire(self, member: Member) -> None:
        """The KV peers of a worker that left close what they kept for it."""
        if member.role == "prefill" and self._template.ranked:
            calls = [self._set.workers[n].actor.remove_kv_peer.remote(member.rank)
                     for n in self._set.names(self._config.decode_role, SERVING, DRAINING)]
        elif member.role == "decode":
            address = member.worker.info.kv_address
            calls = [self._set.workers[n].actor.forget_kv_peer.remote(address)
                     for n in self._set.names("prefill", SERVING, DRAINING)]
        else:
            calls = []
        await _ignoring_dead(calls)

    async def settled(self) -> None:
        """Returns once no drain is under way (every draining worker stopped or was lost)."""
        self._lock()
        while self._drains:
            await asyncio.gather(*self._drains.values(), return_exceptions=True)

    async def snapshot(self) -> ScaleSnapshot:
        """The autoscaler's view now: every role's workers and load, the latency p90s over its window."""
        stats = await self._hooks.worker_stats()
        policy = self._autoscaler_policy or AutoscalePolicy()
        latency = self._hooks.latency.summary(time.perf_counter(), policy.window_s, policy.min_samples)
        roles = tuple(role_snapshot(role, self._set, self._config, self._held, stats) for role in self.roles)
        return ScaleSnapshot(time.monotonic(), roles, latency.ttft_p90_ms, latency.itl_p90_ms, latency.queue_p90_ms)

    @property
    def _autoscaler_policy(self) -> AutoscalePolicy | None:
        return None if self._autoscaler is None else self._autoscaler.policy

    def start_autoscaler(self, policy: AutoscalePolicy) -> AutoscaleLoop:
        """Start deciding every policy.interval_s (on the running loop); replaces one that runs."""
        self.stop_autoscaler()
        self._autoscaler = AutoscaleLoop(policy, self.snapshot, self.scale)
        logger.info("autoscaling %s every %gs within %s", ", ".join(self.roles), policy.interval_s,
                    self.describe()["bounds"])
        return self._autoscaler

    def stop_autoscaler(self) -> None:
        if self._autoscaler is not None:
            self._autoscaler.stop()

    def close(self) -> None:
        """No more changes (the coordinator shuts down): the autoscaler and the drains stop; a start under
        way releases what it started."""
        self._closed = True
        self.stop_autoscaler()
        for task in list(self._drains.values()):
            if not task.get_loop().is_closed():
                task.cancel()


async def _ignoring_dead(calls: list) -> None:
    """Awaits actor calls; one whose actor died meanwhile is left to the health monitor."""
    for result in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(result, BaseException) and not isinstance(result, RayActorError):
            raise result
