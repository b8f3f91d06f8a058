"""Shared by the cluster tests: a local Ray on 127.0.0.1, small worker pools, and the end-of-test
check that every worker's pool is empty."""
from __future__ import annotations

import asyncio
import contextlib
import time
from contextlib import aclosing

import ray

from cluster.backend import GenerationChunk, GenerationRequest
from cluster.workers.cluster_config import ClusterConfig
from engine import EngineConfig, SamplingParams
from tests.support.ray_start import start_ray

POOL_BYTES = 16 << 20           # 256 blocks of the default model per worker
SMALL_ENGINE = EngineConfig(kv_cache_memory=POOL_BYTES)


def start_local_ray() -> None:
    start_ray(lambda: ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=8,
                               log_to_driver=False))


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
    """A local Ray with a cluster started on it (the Coordinator); both shut down at the end."""
    from cluster.coordinator.start import start_cluster
    start_local_ray()
    coordinator = start_cluster(config)
    try:
        yield coordinator
    finally:
        asyncio.run(coordinator.shutdown())
        ray.shutdown()


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
