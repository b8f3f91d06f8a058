"""The serving warm-up: a few short requests through the whole serving path before `tandem serve` listens.

Each engine warms its own kernels and graphs at start (engine/core/warmup.py), but the first request through a
server still paid for what only a request makes: the first KV transfer of a prefill -> decode pair (the
connection, and on ipc the mapping of the sender's pool), Ray's first calls of each actor method, the first
decode event stream, the HTTP front end's first request. On an H200 (1P1D on one card) that made the first
request's TTFT 5.9x the tenth's (61.6 against 10.5 ms). These requests pay it before any user.

They go through a private OpenAI front end on a free loopback port, over the same backend chain (admission
bound, draining) the server's front ends use, as streamed completions; it has metrics of its own and is closed
once they are done, so the served /metrics count users only (the workers' own counters, steps and prefix
cache, do see them). Then the server's front ends start and it prints its banner.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass

import aiohttp

from cluster.api.http_server import HttpServerConfig, start_http_server
from cluster.backend import Backend

logger = logging.getLogger("tandem.serve")


@dataclass(frozen=True)
class WarmupPlan:
    """How many requests, of how many prompt tokens (each its own random ids, so no prefix cache answers them),
    each generating `max_tokens` tokens; `timeout_s` bounds the whole warm-up."""

    requests: int
    prompt_tokens: int = 48
    max_tokens: int = 2
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.requests < 0 or self.prompt_tokens < 1 or self.max_tokens < 1 or not self.timeout_s > 0:
            raise ValueError(f"a warm-up needs requests >= 0, prompt_tokens >= 1, max_tokens >= 1 and a timeout "
                             f"above 0, not {self}")


def default_warmup_requests(prefill_workers: int, decode_workers: int, replicas: int) -> int:
    """One request per prefill -> decode pair of the start group (sent together, the router spreads them by
    load), one per replica, one for the engine in this process."""
    if replicas:
        return replicas
    return max(prefill_workers, 1) * max(decode_workers, 1)


def warmup_bodies(plan: WarmupPlan, vocab_size: int) -> list[dict]:
    """The plan's requests as completion bodies: streamed, greedy, EOS ignored, prompts of token ids below
    min(vocab_size, 1000)."""
    top = max(2, min(vocab_size, 1000))
    bodies = []
    for index in range(plan.requests):
        rng = random.Random(index)
        bodies.append({"prompt": [rng.randrange(1, top) for _ in range(plan.prompt_tokens)],
                       "max_tokens": plan.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True})
    return bodies


async def warm_up(backend: Backend, plan: WarmupPlan, api_key: str | None = None) -> bool:
    """Sends the plan's requests at once through a private front end over `backend` (on 127.0.0.1, asking for
    `api_key` as the server's do) and waits for all of them (at most plan.timeout_s). Returns whether every one
    completed; a failure or the timeout is logged as a warning, never raised (the server still starts: its health
    check and first requests tell the rest). At the timeout the connections close, which cancels what still runs
    and frees what it held; the private front end is closed before this returns."""
    if plan.requests == 0:
        return True
    started = time.perf_counter()
    bodies = warmup_bodies(plan, backend.tokenizer.vocab_size)
    runner, port = await start_http_server(backend, HttpServerConfig(host="127.0.0.1", port=0, api_key=api_key))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", headers=headers) as session:
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(_complete(session, body) for body in bodies), return_exceptions=True), plan.timeout_s)
    except asyncio.TimeoutError:
        logger.warning("serving warm-up: %d request(s) not done within %.0f s; serving anyway", plan.requests,
                       plan.timeout_s)
        return False
    finally:
        await runner.cleanup()
    failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    for error in failed[:3]:
        logger.warning("serving warm-up: a request failed: %s", error)
    logger.log(logging.WARNING if failed else logging.INFO,
               "serving warm-up: %d of %d request(s) of %d prompt tokens done in %.0f ms",
               len(outcomes) - len(failed), plan.requests, plan.prompt_tokens, (time.perf_counter() - started) * 1e3)
    return not failed


async def _complete(session: aiohttp.ClientSession, body: dict) -> None:
    """One streamed completion read to its end. RuntimeError unless the answer is 200 and its events end with
    [DONE], none of them an error."""
    async with session.post("/v1/completions", json=body) as response:
        text = await response.text()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {text[:300]}")
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]" or any("error" in json.loads(event) for event in events[:-1]):
        raise RuntimeError(f"the stream did not end cleanly: {text[-300:]}")
