"""Soak: 300 streaming requests of mixed lengths at ~20 requests/s through a 1 prefill + 2 decode cluster,
about 20% cancelled by their client at random points, and one decode worker SIGKILLed half way.
Bounded to about two minutes. Nothing hangs, no request that was not cancelled fails, every one of
those gets the colocated engine's greedy tokens (migrated ones included), and every pool ends whole."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from contextlib import aclosing

import pytest

from engine import LLM, SamplingParams
from tests.support.cluster_rig import SMALL_ENGINE, cluster_config, request, running_cluster, wait_until_idle

NUM_REQUESTS = 300
RATE = 20.0                 # requests per second (exponential gaps)
CANCEL_SHARE = 0.2
KILL_AT = NUM_REQUESTS // 2
DEADLINE_S = 150.0          # the whole soak; a hang fails the test instead of the CI run
VOCAB = 256


@pytest.fixture(scope="module")
def one_by_two():
    with running_cluster(cluster_config(1, 2)) as coordinator:
        yield coordinator


def workload(seed: int):
    """(prompt, max_tokens, cancel after n tokens or None) per request: mostly short prompts, some long."""
    rng = random.Random(seed)
    plan = []
    for _ in range(NUM_REQUESTS):
        length = rng.choice([rng.randint(4, 40)] * 4 + [rng.randint(100, 300)])
        max_tokens = rng.randint(4, 32)
        cancel_after = rng.randint(0, max_tokens - 1) if rng.random() < CANCEL_SHARE else None
        plan.append(([rng.randrange(VOCAB) for _ in range(length)], max_tokens, cancel_after))
    return plan


async def one(coordinator, index: int, prompt, max_tokens: int, cancel_after: int | None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = []
    async with aclosing(coordinator.generate(request(f"s{index}", prompt, params))) as chunks:
        async for chunk in chunks:
            tokens += chunk.token_ids
            if cancel_after is not None and len(tokens) >= cancel_after:
                return None  # the client goes away mid-stream
    return tokens


def test_soak_with_cancels_and_a_decode_worker_killed_half_way(one_by_two):
    plan = workload(seed=2024)
    victim = one_by_two.workers["decode-1"]
    gaps = random.Random(7)

    async def soak():
        runs = []
        for index, (prompt, max_tokens, cancel_after) in enumerate(plan):
            if index == KILL_AT:
                os.kill(victim.pid, signal.SIGKILL)
            runs.append(asyncio.ensure_future(one(one_by_two, index, prompt, max_tokens, cancel_after)))
            await asyncio.sleep(gaps.expovariate(RATE))
        results = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), DEADLINE_S)
        return results, await wait_until_idle(one_by_two, timeout_s=30)

    started = time.monotonic()
    results, stats = asyncio.run(soak())
    errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} requests failed, e.g. {errors[:3]}"
    kept = [i for i, (_, _, cancel_after) in enumerate(plan) if cancel_after is None]
    colocated = LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory)
    expected = colocated.generate(prompt_token_ids=[plan[i][0] for i in kept], use_tqdm=False,
                                  sampling_params=[SamplingParams(max_tokens=plan[i][1], temperature=0.0,
                                                                  ignore_eos=True) for i in kept])
    assert [results[i] for i in kept] == [out.outputs[0].token_ids for out in expected]
    assert set(stats) == {"prefill-0", "decode-0"}   # the survivors, idle with every block free
    assert time.monotonic() - started < DEADLINE_S
