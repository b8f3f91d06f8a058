"""Thin Ray actor wrappers around PrefillWorker and DecodeWorker (placement: cluster/workers/placement.py).

An actor builds its engine in its own process (on the GPU Ray gave it, or on CPU with a fixed thread
count; a tensor-parallel worker's actor is rank 0 of its group and starts the other ranks: tp_group.py), wraps the
plain worker, and turns its calls into async actor methods: a prefill is one awaited
call returning the PrefillReport; a decode worker's expect() calls and events travel on its direct channel
(open_channel, cluster/workers/decode_channel.py), past Ray. Everything that crosses a process is a typed
dataclass.

Control calls (info, stats, cancel, stop) run in their own concurrency group (CONTROL_GROUP: Ray gives it
its own thread and event loop), so they answer even while the default group is full of prefill calls
(an async actor runs at most 1,000 calls at once; the rest wait in Ray's queue). A cancel can therefore
overtake the call it is about: the decode worker keeps such early cancels itself, the prefill actor keeps
them for its worker (PrefillCalls).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import ray

from cluster.workers.decode_channel import ChannelAddress, ChannelServer
from cluster.workers.startup_heap import freeze_startup_heap
from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine.config import EngineConfig
from kv_transfer.config import ReceiverAddress
from prefill_worker import PrefillReport, PrefillStatus, PrefillTask, PrefillWorker, PrefillWorkerConfig

logger = logging.getLogger("tandem.cluster.workers")
CONTROL_GROUP = "control"
CONTROL_CONCURRENCY = 8
EARLY_CANCEL_TTL_S = 120.0      # how long a cancel waits for the prefill call it is about
MAX_EARLY_CANCELS = 100_000


@dataclass(frozen=True)
class EngineSpec:
    """How a worker builds its engine, in its own process."""

    model: str | None
    dtype: str
    device: str              # "cpu" or "cuda" (the one GPU Ray gave the actor)
    engine: EngineConfig     # tensor_parallel_size > 1: the worker is a group of that many ranks (tp_group.py)
    cpu_threads: int
    tokenizer: str | None = None  # a Hugging Face tokenizer directory instead of the model's own


@dataclass(frozen=True)
class WorkerInfo:
    """What a started worker reports about itself."""

    name: str
    role: str                # "prefill" | "decode" | "replica"
    device: str
    node_id: str
    pid: int
    accelerator_ids: tuple[str, ...]
    max_model_len: int
    block_size: int
    total_blocks: int
    kv_address: ReceiverAddress | None  # decode workers: where prefill workers send KV
    node_ip: str = ""                    # the address of the Ray node it runs on
    torch_threads: int = 0               # the intra-op threads its engine's torch runs with
    rank_pids: tuple[int, ...] = ()      # a tensor-parallel worker: every rank's pid, rank 0 (pid) first


def _build_engine(spec: EngineSpec, worker_name: str, lanes=None):
    """The worker's engine, built in its process; on a GPU its Triton kernels compile into a cache directory of the
    worker's own (engine/core/warmup.py triton_cache_dir: a restarted worker finds them compiled). lanes: a
    tensor-parallel worker's KV lanes (GroupLanes), which its followers start with."""
    import torch

    from engine.builder import build_engine
    from engine.core.warmup import use_triton_cache_dir
    _log_engine_info()
    torch.set_num_threads(spec.cpu_threads)
    if spec.device != "cpu":
        use_triton_cache_dir(worker_name)
    if spec.engine.tensor_parallel_size > 1:  # rank 0 of a group: its followers are actors it starts
        from cluster.workers.tp_group import build_group_engine
        return build_group_engine(spec, rank_service=None if lanes is None else lanes.spec)
    return build_engine(spec.model, spec.engine, dtype=spec.dtype, device=spec.device, tokenizer=spec.tokenizer)


def _open_lanes(spec: EngineSpec, role: str, worker_config, peers=(), host="127.0.0.1"):
    """A worker's KV lanes (kv_transfer/lanes/), opened before its engine: a tensor-parallel worker's, or one rank's
    when worker_config.kv_lanes (the other role's workers are groups); None otherwise, or for a transport without
    lanes."""
    if spec.engine.tensor_parallel_size == 1 and not worker_config.kv_lanes:
        return None
    from kv_transfer.lanes import GroupLanes
    return GroupLanes.open(role, worker_config.transport, worker_config.transfer, worker_config.rendezvous, peers, host)


def _build_with_lanes(spec: EngineSpec, worker_name: str, lanes):
    """_build_engine; lanes' hub is closed if the engine does not start."""
    try:
        return _build_engine(spec, worker_name, lanes)
    except BaseException:
        if lanes is not None:
            lanes.hub.close()
        raise


def _group_step_failure(engine):
    """A tensor-parallel worker's reaction to a failed step (its end: tp_group.py); None for one rank."""
    if engine.tp_leader is None:
        return None
    from cluster.workers.tp_group import step_failure_exit
    return step_failure_exit(engine)


def _log_engine_info() -> None:
    """The engine's INFO lines (its memory plan at start, its step summary at stop) reach the actor's stderr, which
    Ray copies to the driver: a worker process has no logging configured of its own."""
    engine_logger = logging.getLogger("tandem.engine")
    if not engine_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        engine_logger.addHandler(handler)
        engine_logger.setLevel(logging.INFO)
        engine_logger.propagate = False


def _info(name: str, role: str, engine, kv_address: ReceiverAddress | None) -> WorkerInfo:
    import torch
    context = ray.get_runtime_context()
    gpu_ids = tuple(str(i) for i in context.get_accelerator_ids().get("GPU", []))
    ranks = tuple(engine.tp_leader.pids()) if engine.tp_leader is not None else ()
    return WorkerInfo(name, role, str(engine.device), context.get_node_id(), os.getpid(), gpu_ids,
                      engine.max_model_len, engine.config.block_size, engine.num_total_blocks, kv_address,
                      ray.util.get_node_ip_address(), torch.get_num_threads(), ranks)


class _WorkerActor:
    """What both actors answer the same way, over `self._worker` (a PrefillWorker or DecodeWorker)."""

    _worker: PrefillWorker | DecodeWorker
    _info: WorkerInfo

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def info(self) -> WorkerInfo:
        return self._info

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def cancel(self, request_id: str) -> None:
        self._worker.cancel(request_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def stats(self):
        return self._worker.stats()

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def health(self, stall_timeout_s: float):
        """StepHealth: unhealthy when the worker's step thread died or is stuck in a step."""
        return self._worker.health(stall_timeout_s)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def stop(self) -> None:
        """End every request, wait for transfers in flight, stop the worker's threads."""
        await asyncio.to_thread(self._worker.stop)


class PrefillCalls:
    """The prefill calls a PrefillActor is running, and cancels that came before their call (a cancel runs
    in the control group and can overtake the prefill call it follows). Any thread."""

    def __init__(self, worker: PrefillWorker) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._early: OrderedDict[str, float] = OrderedDict()  # request id -> when its cancel came

    def submit(self, task: PrefillTask):
        """The worker's Future for `task`, or None if a cancel for it already came (nothing submitted)."""
        with self._lock:
            if self._early.pop(task.request_id, None) is not None:
                return None
            self._running.add(task.request_id)
            future = self._worker.submit(task)
        future.add_done_callback(lambda _, rid=task.request_id: self._ended(rid))
        return future

    def cancel(self, request_id: str) -> None:
        """Cancels the request on the worker; one whose call has not come yet is remembered for
        EARLY_CANCEL_TTL_S (at most MAX_EARLY_CANCELS), so that its call ends at once."""
        now = time.monotonic()
        with self._lock:
            if request_id in self._running:
                self._worker.cancel(request_id)
                return
            self._early[request_id] = now
            self._early.move_to_end(request_id)
            while self._early and (len(self._early) > MAX_EARLY_CANCELS
                                   or next(iter(self._early.values())) < now - EARLY_CANCEL_TTL_S):
                self._early.popitem(last=False)

    def _ended(self, request_id: str) -> None:
        with self._lock:
            self._running.discard(request_id)


@ray.remote(max_restarts=0, concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY})
class PrefillActor(_WorkerActor):
    """A PrefillWorker in a Ray actor process."""

    def __init__(self, spec: EngineSpec, config: PrefillWorkerConfig) -> None:
        lanes = _open_lanes(spec, "send", config)
        engine = _build_with_lanes(spec, config.name, lanes)
        self._worker = PrefillWorker(engine, config, lanes)
        self._calls = PrefillCalls(self._worker)
        self._info = _info(config.name, "prefill", engine, None)
        freeze_startup_heap()

    async def prefill(self, task: PrefillTask):
        """The task's PrefillReport, once its KV is acknowledged (or the task ended otherwise);
        CANCELLED at once if its cancel came first."""
        future = self._calls.submit(task)
        if future is None:
            return PrefillReport(task.request_id, PrefillStatus.CANCELLED, self._info.name, time.time(),
                                 error="cancelled before it started")
        return await asyncio.wrap_future(future)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def cancel(self, request_id: str) -> None:
        self._calls.cancel(request_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def forget_kv_peer(self, peer: ReceiverAddress) -> None:
        """A decode worker drained away: close what the KV sender keeps for it."""
        await asyncio.to_thread(self._worker.forget_kv_peer, peer)


@ray.remote(max_restarts=0, concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY})
class DecodeActor(_WorkerActor):
    """A DecodeWorker (with its KV receiver) in a Ray actor process. A gRPC receiver binds this node's
    address as Ray knows it (127.0.0.1 on a local Ray started on loopback, the node's routable address
    in a multi-node cluster), whatever config.host says. role: "decode", or "replica" for a colocated
    replica (a worker of transport "none" that prefills every prompt itself)."""

    def __init__(self, spec: EngineSpec, config: DecodeWorkerConfig, role: str = "decode") -> None:
        config = dataclasses.replace(config, host=ray.util.get_node_ip_address())
        lanes = _open_lanes(spec, "receive", config, config.peer_ranks, config.host)
        engine = _build_with_lanes(spec, config.name, lanes)
        self._worker = DecodeWorker(engine, config, on_step_failure=_group_step_failure(engine), lanes=lanes)
        self._info = _info(config.name, role, engine, self._worker.address)
        self._channel = ChannelServer(self._worker.expect)
        freeze_startup_heap()

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def stats(self):
        """The worker's stats, its channel's dropped connections counted in."""
        stats = self._worker.stats()
        return dataclasses.replace(stats, dropped_connections=stats.dropped_connections
                                   + sum(self._channel.drops.values()))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def add_kv_peer(self, rank: int) -> None:
        """A prefill worker of sender rank `rank` joined: receive its KV too (returns once listening)."""
        await asyncio.to_thread(self._worker.add_kv_peer, rank)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def remove_kv_peer(self, rank: int) -> None:
        """The prefill worker of sender rank `rank` left: stop listening to it."""
        await asyncio.to_thread(self._worker.remove_kv_peer, rank)

    async def open_channel(self) -> ChannelAddress:
        """Where this worker's channel listens (cluster/workers/decode_channel.py: expect() calls in, the
        events of every accepted request out, batched about one list per engine step, in order; the
        connection ends after stop()). Listens from the first call on."""
        return await self._channel.start(self._info.node_ip)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def stop(self) -> None:
        """End every request (SHUTDOWN), wait for transfers in flight, stop the threads, end the channel."""
        await asyncio.to_thread(self._worker.stop)
        self._channel.close()  # from the control group's thread
