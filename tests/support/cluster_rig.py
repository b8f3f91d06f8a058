"""Shared by the cluster tests: a local Ray on 127.0.0.1, small worker pools, and the end-of-test
check that every worker's pool is empty."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from contextlib import aclosing

import ray

from cluster.backend import GenerationChunk, GenerationRequest
from cluster.workers.cluster_config import ClusterConfig
from engine import EngineConfig, SamplingParams
from tests.support.fake_nodes import live_placement_groups
from tests.support.ray_start import start_ray
from tests.support.serve_process import descendants, live_processes

POOL_BYTES = 16 << 20           # 256 blocks of the default model per worker
SMALL_ENGINE = EngineConfig(kv_cache_memory=POOL_BYTES)
IDLE_WORKER = "ray::IDLE"       # the command line of a worker process Ray keeps pooled for the next task or actor


def start_local_ray() -> None:
    """The session's local Ray on 127.0.0.1: started by the first test that needs it and kept for the next ones
    (a Ray start costs ~5 s on the 2-core CI machine, its stop ~1 s); tests/conftest.py stops it at the end of the
    session. Each cluster started on it is checked released when it stops (running_cluster, stopped_cluster). A
    test that needs a Ray of its own (other nodes, other resources) calls ray.shutdown() first."""
    if not ray.is_initialized():
        start_ray(lambda: ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                                   num_cpus=8, log_to_driver=False))


def cluster_config(num_prefill: int, num_decode: int, transport: str = "grpc") -> ClusterConfig:
    return ClusterConfig(model="tiny", device="cpu", num_prefill_workers=num_prefill, num_decode_workers=num_decode,
                         transport=transport, engine=SMALL_ENGINE, expect_timeout_s=30.0,
                         worker_start_timeout_s=60.0)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def request(request_id: str, prompt: list[int], params: SamplingParams) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(prompt), params, time.perf_counter())


@contextlib.contextmanager
def running_cluster(config: ClusterConfig):
    """A cluster (the Coordinator) started on the session's local Ray; at the end it is shut down and checked
    released (stopped_cluster)."""
    from cluster.coordinator.start import start_cluster
    start_local_ray()
    before = RayFootprint.now()
    coordinator = start_cluster(config)
    try:
        yield coordinator
    finally:
        stopped_cluster(coordinator, before)


@dataclasses.dataclass(frozen=True)
class RayFootprint:
    """What runs in the session's Ray at one moment: live actors, placement groups, and this process's
    descendants (Ray's own processes and its workers)."""
    actors: frozenset[str]
    groups: frozenset[str]
    processes: frozenset[int]

    @classmethod
    def now(cls) -> RayFootprint:
        actors = ray._private.state.actors()
        return cls(frozenset(a for a, info in actors.items() if info["State"] != "DEAD"),
                   frozenset(g["placement_group_id"] for g in live_placement_groups()),
                   frozenset(descendants(os.getpid())))


def stopped_cluster(coordinator, before: RayFootprint, timeout_s: float = 20.0) -> None:
    """Shuts the cluster down and fails unless all it added to the session's Ray since `before` is gone: its
    actors, its placement groups, and the processes started since (but the idle workers Ray keeps pooled for
    the next cluster)."""
    asyncio.run(coordinator.shutdown())
    deadline = time.monotonic() + timeout_s
    while (added := _added_since(before)) != ((), (), {}) and time.monotonic() < deadline:
        time.sleep(0.1)
    actors, groups, processes = added
    assert not (actors or groups or processes), \
        f"left by a stopped cluster: actors {actors}, placement groups {groups}, processes {processes}"


def _added_since(before: RayFootprint) -> tuple[tuple, tuple, dict[int, str]]:
    now = RayFootprint.now()
    commands = live_processes()
    processes = {pid: commands[pid].command for pid in now.processes - before.processes
                 if pid in commands and not commands[pid].command.startswith(IDLE_WORKER)}
    return tuple(sorted(now.actors - before.actors)), tuple(sorted(now.groups - before.groups)), processes


async def collect(backend, generation: GenerationRequest,
                  decoding: asyncio.Queue | None = None) -> tuple[list[int], GenerationChunk]:
    """All tokens of a request and its last chunk. `decoding` gets the request id once its first tokens
    arrived (for tests that act while requests decode)."""
    tokens, last = [], None
    async with aclosing(backend.generate(generation)) as chunks:
        async for chunk in chunks:
            if decoding is not None and not tokens and chunk.token_ids:
                decoding.put_nowait(generation.request_id)
            tokens += chunk.token_ids
            last = chunk
    return tokens, last


def is_idle(stats) -> bool:
    """A worker holds no request and no block (of its engine, nor of a tensor-parallel worker's staging pool)."""
    busy = getattr(stats, "running", 0) + getattr(stats, "waiting", 0) + getattr(stats, "live_requests", 0)
    return busy == 0 and stats.engine_requests == 0 and stats.free_blocks == stats.total_blocks \
        and stats.staging_free == stats.staging_total


async def wait_until_idle(coordinator, timeout_s: float = 15.0) -> dict:
    """Waits until every alive worker is idle; fails naming the busy ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await coordinator.worker_stats()
        if all(is_idle(s) for s in stats.values()):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"workers still hold requests or blocks: {stats}")
        await asyncio.sleep(0.05)


async def worker_running(coordinator, num_sequences: int, timeout_s: float = 30.0) -> str:
    """The name of a worker whose stats show num_sequences running. Stats are a snapshot a worker publishes after
    its step, so they can trail the tokens the client already has: read them again until one shows it."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await coordinator.worker_stats()
        name = next((name for name, s in stats.items() if getattr(s, "running", 0) == num_sequences), None)
        if name is not None:
            return name
        if time.monotonic() > deadline:
            raise AssertionError(f"no worker runs {num_sequences} sequences: {stats}")
        await asyncio.sleep(0.005)


async def kill_under_load(coordinator, requests: list[GenerationRequest], kill) -> tuple[list, object]:
    """Streams `requests`, calls kill() once each has its first chunk, waits for them all and for the workers to
    be idle; returns (each request's (tokens, last chunk), the coordinator's health right after)."""
    first_chunks: asyncio.Queue = asyncio.Queue()
    runs = [asyncio.ensure_future(collect(coordinator, generation, first_chunks)) for generation in requests]
    for _ in requests:
        await asyncio.wait_for(first_chunks.get(), 60)
    kill()
    results = await asyncio.gather(*runs)
    health = await coordinator.health()
    await wait_until_idle(coordinator)
    return results, health
