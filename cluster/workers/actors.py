"""Thin Ray actor wrappers around PrefillWorker and DecodeWorker (placement: cluster/workers/placement.py).

An actor builds its engine in its own process (on the GPU Ray gave it, or on CPU with a fixed thread
count), wraps the plain worker, and turns its calls into async actor methods: a prefill is one awaited
call returning the PrefillReport; a decode is an expect() call returning the Admission, after which the
request's DecodeChunk / DecodeEnded events come on the worker's one events() stream. Everything that crosses a process is a typed dataclass.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass

import ray

from cluster.workers.event_batcher import EventBatcher
from decode_worker import Admission, DecodeWorker, DecodeWorkerConfig, ExpectedRequest
from engine.config import EngineConfig
from kv_transfer.config import ReceiverAddress
from prefill_worker import PrefillTask, PrefillWorker, PrefillWorkerConfig

logger = logging.getLogger("tandem.cluster.workers")


@dataclass(frozen=True)
class EngineSpec:
    """How a worker builds its engine, in its own process."""

    model: str | None
    dtype: str
    device: str              # "cpu" or "cuda" (the one GPU Ray gave the actor)
    engine: EngineConfig
    cpu_threads: int


@dataclass(frozen=True)
class WorkerInfo:
    """What a started worker reports about itself."""

    name: str
    role: str                # "prefill" | "decode"
    device: str
    node_id: str
    pid: int
    accelerator_ids: tuple[str, ...]
    max_model_len: int
    block_size: int
    total_blocks: int
    kv_address: ReceiverAddress | None  # decode workers: where prefill workers send KV


def _build_engine(spec: EngineSpec):
    import torch

    from engine.builder import build_engine
    torch.set_num_threads(spec.cpu_threads)
    return build_engine(spec.model, spec.engine, dtype=spec.dtype, device=spec.device)


def _info(name: str, role: str, engine, kv_address: ReceiverAddress | None) -> WorkerInfo:
    context = ray.get_runtime_context()
    gpu_ids = tuple(str(i) for i in context.get_accelerator_ids().get("GPU", []))
    return WorkerInfo(name, role, str(engine.device), context.get_node_id(), os.getpid(), gpu_ids,
                      engine.max_model_len, engine.config.block_size, engine.num_total_blocks, kv_address)


class _WorkerActor:
    """What both actors answer the same way, over `self._worker` (a PrefillWorker or DecodeWorker)."""

    _worker: PrefillWorker | DecodeWorker
    _info: WorkerInfo

    async def info(self) -> WorkerInfo:
        return self._info

    async def cancel(self, request_id: str) -> None:
        self._worker.cancel(request_id)

    async def stats(self):
        return self._worker.stats()

    async def health(self, stall_timeout_s: float):
        """StepHealth: unhealthy when the worker's step thread died or is stuck in a step."""
        return self._worker.health(stall_timeout_s)

    async def stop(self) -> None:
        """End every request, wait for transfers in flight, stop the worker's threads."""
        await asyncio.to_thread(self._worker.stop)


@ray.remote(max_restarts=0)
class PrefillActor(_WorkerActor):
    """A PrefillWorker in a Ray actor process."""

    def __init__(self, spec: EngineSpec, config: PrefillWorkerConfig) -> None:
        engine = _build_engine(spec)
        self._worker = PrefillWorker(engine, config)
        self._info = _info(config.name, "prefill", engine, None)

    async def prefill(self, task: PrefillTask):
        """The task's PrefillReport, once its KV is acknowledged (or the task ended otherwise)."""
        return await asyncio.wrap_future(self._worker.submit(task))


@ray.remote(max_restarts=0)
class DecodeActor(_WorkerActor):
    """A DecodeWorker (with its KV receiver) in a Ray actor process. A gRPC receiver binds this node's
    address as Ray knows it (127.0.0.1 on a local Ray started on loopback, the node's routable address
    in a multi-node cluster), whatever config.host says."""

    def __init__(self, spec: EngineSpec, config: DecodeWorkerConfig) -> None:
        engine = _build_engine(spec)
        config = dataclasses.replace(config, host=ray.util.get_node_ip_address())
        self._worker = DecodeWorker(engine, config)
        self._info = _info(config.name, "decode", engine, self._worker.address)
        self._batcher: EventBatcher | None = None

    def _outbox(self) -> EventBatcher:
        """The batcher behind events(), made on first use on the actor's event loop."""
        if self._batcher is None:
            self._batcher = EventBatcher(asyncio.get_running_loop())
        return self._batcher

    async def expect(self, request: ExpectedRequest) -> Admission:
        """Accept (the request's events will come on events()) or refuse (backpressure)."""
        return self._worker.expect(request, self._outbox().put)

    async def events(self):
        """Streaming generator, one per worker: lists of the DecodeChunk / DecodeEnded events of every
        accepted request, in order, batched (about one list per engine step); ends after stop()."""
        async for batch in self._outbox().batches():
            yield batch

    async def stop(self) -> None:
        """End every request (SHUTDOWN), wait for transfers in flight, stop the threads, end events()."""
        await super().stop()
        self._outbox().close()
