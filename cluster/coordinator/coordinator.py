"""Coordinator: the Backend of disaggregated serving, over prefill and decode worker actors on Ray, and of
colocated replicas (decode worker actors that prefill every prompt themselves, no prefill workers).

Per request (on the front end's asyncio loop): pick a decode worker (cluster.coordinator.routing), ask it to
expect the request (it accepts or refuses: backpressure, the next one is tried), pick a prefill worker, then
let a RequestFlow drive prefill -> KV transfer -> decode and stream the chunks back. Decode events come back
on one stream per decode worker (cluster/coordinator/decode_events.py), routed to per-request mailboxes. The
coordinator keeps the load accounting, and stops routing to a worker as soon as any call finds it dead. A
request whose prefill worker dies before the request delivered anything starts over on a surviving prefill
worker. With replicas every request takes the local-prefill flow on the replica the router picks (by
load, with prefix affinity), so migration, health, cancel, metrics and timing are the same code. The
workers are a WorkerSet (cluster/coordinator/worker_set.py) that changes while serving: `scaling`
(cluster/coordinator/scaling.py) adds and drains workers, by admin call or by the autoscaler.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import ray

from cluster.backend import BackendHealth, BackendOverloaded, BackendUnavailable, GenerationChunk, GenerationRequest
from cluster.coordinator.decode_admission import DecodeAdmissions
from cluster.coordinator.disagg_policy import DisaggPolicy, PrefillPlacer
from cluster.coordinator.health_monitor import HealthMonitor, collect_stats, health_details
from cluster.coordinator.stats_snapshot import StatsSnapshot
from cluster.coordinator.latency_window import LatencyWindow
from cluster.coordinator.local_prefill_flow import LocalPrefillFlow
from cluster.coordinator.migration import StreamProgress, resume_refusal
from cluster.coordinator.request_flow import FlowHooks, RequestFlow, WorkerLost
from cluster.coordinator.routing import Router
from cluster.coordinator.samples import SampleGroup, request_chunks
from cluster.coordinator.scaling import Scaling, ScalingHooks
from cluster.coordinator.worker_set import Worker, WorkerSet
from cluster.workers.actors import WorkerInfo
from cluster.workers.added_worker import BundleSlot
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.placement import ClusterResources, release_cluster, stop_actors
from cluster.workers.worker_template import WorkerTemplate
from decode_worker import ExpectedRequest

logger = logging.getLogger("tandem.cluster.coordinator")


class Coordinator:
    """Implements cluster.backend.Backend. Use from one asyncio loop; built by start_cluster()."""

    def __init__(self, config: ClusterConfig, tokenizer, workers: list[Worker], resources: ClusterResources,
                 template: WorkerTemplate, slots: tuple[BundleSlot, ...] = ()) -> None:
        """workers: the start group's, in bundle (and KV-plane rank) order. slots: where each sits (empty:
        bundle i of the start group; tensor-parallel workers: a group of their own each, owned)."""
        self.model_name = config.served_name
        self.max_model_len = min(w.info.max_model_len for w in workers)
        self._tokenizer, self._config, self._resources = tokenizer, config, resources
        slots = slots or tuple(BundleSlot(resources.placement_group, i, False) for i in range(len(workers)))
        self._set = WorkerSet([(w, i, slot) for i, (w, slot) in enumerate(zip(workers, slots))])
        self._workers = self._set.workers  # a live view: every started worker by name
        self._replicas, self._decode_role = config.replicas, config.decode_role
        decode_blocks = {w.info.name: w.info.total_blocks for w in workers if w.info.role == config.decode_role}
        kv_weight = config.kv_overlap_weight if config.decode_prefix_reuse and not config.replicas else None
        self._block_size = workers[0].info.block_size
        self._router = Router([w.info.name for w in workers if w.info.role == "prefill"], decode_blocks,
                              self._block_size, kv_overlap_weight=kv_weight)
        self._placer = PrefillPlacer(DisaggPolicy(config.disagg_policy, config.local_prefill_tokens))
        self._decoders = DecodeAdmissions(self._router, self._set, bool(config.replicas), self._worker_lost,
                                          self._stream_lost, config.decode_room_wait_s)
        self._numbers = itertools.count()
        self._monitor: HealthMonitor | None = None
        self._health_stats = StatsSnapshot(self.worker_stats)  # the loads health() reports
        self._latency = LatencyWindow()
        self.scaling = Scaling(config, template, self._set, self._router,
                               ScalingHooks(self._declare_lost, self.worker_stats, self._latency))
        self._closed = False

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        return {name: worker.info for name, worker in self._workers.items()}

    def is_alive(self, name: str) -> bool:
        """Whether `name` runs and may hold requests (serving, or draining: no longer routed to)."""
        return self._set.is_alive(name)

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """See Backend.generate (and _generate_one). n > 1: each sample a request of its own, the prompt's KV
        shipped once (samples.py)."""
        return request_chunks(self._generate_one, request)

    async def _generate_one(self, request: GenerationRequest,
                            samples: SampleGroup | None = None) -> AsyncIterator[GenerationChunk]:
        """One sample (of `samples`, the request's SampleGroup, when n > 1). BackendUnavailable when no
        prefill or decode worker is alive, BackendOverloaded when every decode worker refuses, ValueError for
        input a worker rejects;
        mid-stream: WorkerLost (a BackendUnavailable) or RequestFailed.

        If a worker of the request is lost (its prefill worker before the KV landed, or its decode worker
        at any point) or its KV transfer fails, the request migrates (cluster/coordinator/migration.py):
        it continues, with a new decode admission, as prompt + the tokens streamed so far on the
        surviving workers, and the consumer sees only a longer gap. A request migrates at most as many
        times as there are workers; WorkerLost once no worker of the needed role is left."""
        if self._closed:
            raise BackendUnavailable("the coordinator is shut down")
        self._watch_health()
        progress, clock = StreamProgress(request), self._latency.request(request.arrival_time)
        while True:
            try:
                attempt = self._attempt(progress.next_attempt(), progress.num_resumed_tokens, samples)
                async with aclosing(attempt) as chunks:
                    async for chunk in chunks:
                        yield clock.delivered(progress.delivered(chunk))
                return
            except WorkerLost as lost:
                refusal = resume_refusal(lost.role, *self._router.alive_counts(), progress, len(self._workers),
                                         self._replicas)
                if refusal is not None:
                    raise WorkerLost(f"{lost}; {refusal}", lost.role) from lost
                progress.migrations += 1
                logger.warning("request %s: %s; it continues on the surviving workers after %d streamed tokens",
                               request.request_id, lost, progress.num_resumed_tokens)

    async def _attempt(self, request: GenerationRequest, resumed: int = 0,
                       samples: SampleGroup | None = None) -> AsyncIterator[GenerationChunk]:
        """One try at the request under a new internal id: decode admission (the decode worker matches the
        prompt in its prefix cache and, by the disaggregation policy, may prefill it itself), then prefill,
        transfer of the blocks it lacks and decode (or prefill and decode on the decode worker). `resumed`:
        the last that many prompt tokens were streamed by an earlier attempt. A follower of `samples` asks
        the leader's decode worker first and is prefilled there when that worker holds all but its prompt's
        last block. Whatever way it ends, the router's claims for it are released and no worker keeps it."""
        prompt = request.prompt_token_ids
        forced = bool(self._replicas) or self._placer.forced_local(len(prompt))
        if not forced and self._router.alive_counts()[0] == 0:
            raise BackendUnavailable("no prefill worker is alive")
        request_id = f"{request.request_id}#{next(self._numbers)}"
        blocks = self._router.decode_blocks_for(min(len(prompt) - resumed + request.params.max_tokens,
                                                    self.max_model_len))
        queued = len(prompt) if forced else 0  # prefilled on the decode worker itself
        bound = 0 if forced else self._placer.local_bound(self._router.prefill_queue_tokens())
        follows = samples is not None and not samples.leads(request)
        if follows and not forced:  # the leader's KV is there: at most the last block is left to compute
            bound = max(bound, self._block_size + 1)
        expected = ExpectedRequest(request_id, prompt, request.params, prefill_locally=forced,
                                   num_resumed_tokens=resumed, local_below_uncached_tokens=bound)
        decode, mailbox, admission = await self._decoders.open(expected, blocks, queued,
                                                             samples.decode_worker if follows else None)
        if samples is not None and not follows:
            samples.decode_worker = decode.info.name
        outputs: list[int] = []
        try:
            source = LocalPrefillFlow(request, request_id, decode.ref, mailbox, self._worker_lost,
                                      self.is_alive, self._decode_role).chunks() \
                if admission.prefill_locally else \
                self._disaggregated(request, request_id, decode, mailbox, resumed, admission.cached_blocks)
            cached = admission.cached_blocks * self._block_size
            async with aclosing(source) as chunks:
                async for chunk in chunks:
                    if chunk.token_ids and queued:  # the first token: its prompt no longer waits
                        self._router.prefilled(decode.info.name, queued)
                        queued = 0
                    outputs += chunk.token_ids
                    if chunk.timing is not None:  # where it was prefilled, what the decode worker held
                        timing = self._placer.decided(chunk.timing, admission.prefill_locally, cached, len(prompt))
                        chunk = dataclasses.replace(chunk, timing=timing)
                    yield chunk
            self._router.decode_holds(prompt + tuple(outputs), decode.info.name)
        finally:
            self._decoders.release(decode.info.name, request_id, blocks, queued)

    async def _disaggregated(self, request: GenerationRequest, request_id: str, decode: Worker, mailbox: asyncio.Queue,
                             resumed: int, cached_blocks: int) -> AsyncIterator[GenerationChunk]:
        """Prefill on a prefill worker, the KV the decode worker lacks to `decode` (which accepted the
        request and holds its first cached_blocks blocks), decode there."""
        prompt_tokens = len(request.prompt_token_ids)
        prefill_name = self._router.pick_prefill(request.prompt_token_ids)
        if prefill_name is None:  # the last one died while the decode worker was asked
            decode.actor.cancel.remote(request_id)
            raise BackendUnavailable("no prefill worker is alive")
        refusal = self._router.prefill_refusal(prompt_tokens, self._config.max_prefill_queue_tokens)
        if refusal is not None:
            decode.actor.cancel.remote(request_id)
            raise BackendOverloaded(refusal)
        prefill = self._workers[prefill_name]
        self._router.claim_prefill(prefill.info.name, prompt_tokens)
        release_prefill = _once(lambda: self._router.prefill_done(prefill.info.name, prompt_tokens))
        observe = lambda report: self._placer.observe_remote(prompt_tokens - report.num_cached_tokens,  # noqa: E731
                                                             report.prefill_ms)
        hooks = FlowHooks(self._worker_lost, self.is_alive, release_prefill, observe)
        flow = RequestFlow(request, request_id, prefill.ref, decode.ref, decode.info.kv_address, mailbox, hooks,
                           num_resumed_tokens=resumed, decode_cached_blocks=cached_blocks)
        try:
            async with aclosing(flow.chunks()) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            release_prefill()

    def _stream_lost(self, name: str, error: BaseException) -> None:
        if not self._closed:
            self._worker_lost(name, error)

    def _worker_lost(self, name: str, error: BaseException | None = None) -> None:
        self._declare_lost(name, f"it died or its event stream broke: {error}")

    def _declare_lost(self, name: str, reason: str) -> None:
        """Worker `name` no longer serves: stop routing to it and kill it, so that nothing of it keeps
        running unread and every request it held fails over (and migrates). Once per worker, and only for
        a worker that serves or drains."""
        if not self._set.mark_lost(name, reason):
            return
        self._router.mark_dead(name)
        logger.error("worker %s is lost (%s); no longer routing to it", name, reason)
        if not self._closed:
            try:
                ray.kill(self._workers[name].actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _watch_health(self) -> None:
        """Starts the health monitor on the running loop (first use, or the caller's loop changed; none once shut
        down)."""
        if not self._closed and (self._monitor is None or not self._monitor.on_running_loop()):
            stall = self._config.worker_stall_timeout_s
            self._monitor = HealthMonitor(self._workers, self.is_alive, self._declare_lost, stall,
                                          interval_s=min(5.0, stall / 3))

    async def worker_stats(self) -> dict:
        """PrefillStats / DecodeStats of every alive worker, by name (a worker that does not answer
        because it died is marked dead and left out). Changes nothing on the workers."""
        return await collect_stats(self._workers, [name for name in self._workers if self.is_alive(name)],
                                   self._worker_lost)

    async def health(self) -> BackendHealth:
        """Serving while at least one prefill and one decode worker (or one replica) are alive; details sum
        the decode workers' (replicas') load (the keys ServingMetrics reads), give each alive worker's load
        under "workers", and list the dead workers; "waiting_for_room": requests no decode worker has room for yet
        (in waiting_requests too). Who is alive is read now; the loads are the last round's
        when the workers take over 25 ms to answer (StatsSnapshot: a probe does not wait for busy workers)."""
        self._watch_health()
        stats = {name: s for name, s in (await self._health_stats.get()).items() if self.is_alive(name)}
        num_prefill, num_decode = self._router.alive_counts()
        infos = {name: worker.info for name, worker in self._workers.items()}
        details = health_details(infos, stats, [n for n in infos if not self.is_alive(n)], self._set.failures())
        details["scaling"] = self.scaling.describe()  # every worker's state, the bounds, autoscale decisions
        details["waiting_for_room"] = self._decoders.waiting_for_room  # counted among the waiting requests too
        details["waiting_requests"] += self._decoders.waiting_for_room
        serving = not self._closed and (num_prefill > 0 or self._replicas) and num_decode > 0
        return BackendHealth(serving, self.model_name, num_prefill, num_decode, details)

    async def shutdown(self) -> None:
        """Stop every worker (requests in flight end; transfers finish or fail and free their blocks),
        kill the actors, remove the placement group, and stop Ray if start_cluster started it (a local
        Ray's RayHost: every process of it). Bounded: a worker that has not stopped within
        config.worker_stop_timeout_s is killed with the others, and every Ray call of the release has a
        timeout (cluster/workers/placement.py), so a Ray that is going away itself cannot hold this up.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.scaling.close()
        self._health_stats.close()
        if self._monitor is not None:  # a worker that stops in order (its step thread ended) is not lost
            self._monitor.stop()
        # Decode workers first: their receivers let go of the prefill workers' pools they mapped (ipc)
        # before those workers exit, so no process ends while another still holds its memory.
        alive = [w for name, w in self._workers.items() if self.is_alive(name)]
        for group in ([w for w in alive if w.info.role != "prefill"], [w for w in alive if w.info.role == "prefill"]):
            await stop_actors([w.actor for w in group], self._config.worker_stop_timeout_s)
        self._set.stop_pumps()  # the stopped workers already ended every request
        await asyncio.to_thread(release_cluster, [w.actor for w in self._workers.values()], self._resources,
                                groups=tuple(self._set.owned_groups()))


def _once(action):
    done = []

    def run() -> None:
        if not done:
            done.append(True)
            action()
    return run
