"""A decode worker whose process hangs (SIGSTOP: alive to the OS, silent to everyone) is found by the
coordinator's health monitor within the stall timeout and killed; its requests continue on the other
decode worker token for token, and /health says "degraded" and names it while the survivors serve."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import aiohttp
import pytest

from cluster.api.http_server import HttpServerConfig, start_http_server
from engine import LLM
from tests.support.cluster_rig import (SMALL_ENGINE, cluster_config, collect, greedy, request, running_cluster,
                                       wait_until_idle)
from tests.support.engine_checks import random_prompts

VOCAB = 256
STALL_S = 3.0


@pytest.fixture(scope="module")
def one_by_two():
    with running_cluster(dataclasses.replace(cluster_config(1, 2), worker_stall_timeout_s=STALL_S)) as coordinator:
        yield coordinator


def process_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":  # a zombie is dead
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_hung_decode_worker_is_declared_lost_and_its_requests_migrate(one_by_two):
    prompts = random_prompts([20, 21, 22, 23], VOCAB, seed=31)
    params = greedy(200)
    colocated = LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory)
    expected = [o.outputs[0].token_ids for o in colocated.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                    use_tqdm=False)]
    victim = one_by_two.workers["decode-1"]

    async def scenario():
        runner, port = await start_http_server(one_by_two, HttpServerConfig())
        try:
            started: asyncio.Queue = asyncio.Queue()
            runs = [asyncio.ensure_future(collect(one_by_two, request(f"h{i}", p, params), started))
                    for i, p in enumerate(prompts)]
            for _ in prompts:  # all four decoding, two on each decode worker
                await asyncio.wait_for(started.get(), 30)
            os.kill(victim.pid, signal.SIGSTOP)
            results = await asyncio.wait_for(asyncio.gather(*runs), 120)
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                async with session.get("/health") as response:
                    health = (response.status, await response.json())
            await wait_until_idle(one_by_two)
            return results, health
        finally:
            await runner.cleanup()

    try:
        results, (status, health) = asyncio.run(scenario())
    finally:
        try:
            os.kill(victim.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert [tokens for tokens, _ in results] == expected
    assert [last.timing.decode_worker for _, last in results] == ["decode-0"] * 4
    assert status == 200 and health["status"] == "degraded" and health["decode_workers"] == 1
    assert "health check" in health["lost_workers"]["decode-1"]
    assert process_gone(victim.pid, 30), "the hung worker was declared lost but its process lives on"
