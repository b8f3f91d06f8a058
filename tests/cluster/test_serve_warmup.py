"""The serving warm-up (cluster/serve_warmup.py): its requests run through a private front end over a real
engine's backend to the end and leave no block held; refusals and a timeout are reported, not raised, and free
what they held; bad plans are ValueErrors. That `tandem serve` runs it before it listens, and keeps it out of
/metrics: tests/cluster/test_serve_cli.py."""
from __future__ import annotations

import asyncio
import logging

import pytest

from cluster.serve_warmup import WarmupPlan, default_warmup_requests, warm_up, warmup_bodies
from engine import LLM
from tests.support.frontend_rig import local_backend
from tests.support.http_rig import KV_BYTES


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


def test_one_request_per_pair_per_replica_or_for_the_engine_in_process():
    assert default_warmup_requests(2, 3, 0) == 6
    assert default_warmup_requests(1, 1, 0) == 1
    assert default_warmup_requests(0, 1, 0) == 1  # colocated in this process
    assert default_warmup_requests(0, 4, 4) == 4


def test_requests_have_prompts_of_their_own_within_the_vocabulary():
    bodies = warmup_bodies(WarmupPlan(5, prompt_tokens=16), vocab_size=300)
    prompts = [tuple(body["prompt"]) for body in bodies]
    assert len(set(prompts)) == 5 and all(len(p) == 16 and 0 < min(p) and max(p) < 300 for p in prompts)
    assert all(b["max_tokens"] == 2 and b["temperature"] == 0 and b["ignore_eos"] and b["stream"] for b in bodies)


@pytest.mark.parametrize("fields", [{"requests": -1}, {"requests": 1, "prompt_tokens": 0},
                                    {"requests": 1, "max_tokens": 0}, {"requests": 1, "timeout_s": 0}])
def test_bad_plans_are_value_errors(fields):
    with pytest.raises(ValueError, match="warm-up needs"):
        WarmupPlan(**fields)


def test_warm_up_runs_every_request_to_the_end_through_a_real_engine(served, caplog):
    async def scenario():
        async with local_backend(served) as backend:  # checks the pool is free at the end
            caplog.set_level(logging.INFO, "tandem.serve")
            assert await warm_up(backend, WarmupPlan(3, prompt_tokens=20, max_tokens=3))
            assert await warm_up(backend, WarmupPlan(0))  # none asked: nothing runs
            assert await warm_up(backend, WarmupPlan(1), api_key="sk-warm")  # asked for there, and sent
    asyncio.run(scenario())
    assert "3 of 3 request(s) of 20 prompt tokens done" in caplog.text


def test_a_warm_up_past_its_timeout_is_cancelled_and_frees_what_it_held(served, caplog):
    async def scenario():
        async with local_backend(served) as backend:  # waits for the engine to drop the cancelled requests
            plan = WarmupPlan(2, prompt_tokens=8, max_tokens=served.max_model_len - 8, timeout_s=0.2)
            assert not await warm_up(backend, plan)
    asyncio.run(scenario())
    assert "not done within" in caplog.text


def test_refused_requests_are_logged_and_the_server_still_starts(served, caplog):
    """Prompts longer than the model's context: the front end answers 400, the warm-up says so and returns."""
    async def scenario():
        async with local_backend(served) as backend:
            assert not await warm_up(backend, WarmupPlan(2, prompt_tokens=served.max_model_len + 1))
    asyncio.run(scenario())
    assert "a request failed: HTTP 400" in caplog.text and "0 of 2 request(s)" in caplog.text
