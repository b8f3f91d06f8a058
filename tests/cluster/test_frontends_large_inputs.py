"""Large bodies stall no one (issue 32, item 1): while 8 requests of 3.9 MB arrive at once, over HTTP and gRPC on
one loop, the probes (/health, /ping, /version, /metrics, gRPC Health and grpc.health.v1) keep answering, every
large request gets its proper answer (400 / INVALID_ARGUMENT past the context, 413 past the body limit, 200 for
/tokenize), and afterwards the server serves and no KV block is left taken. Past the InputPool's waiting bound a
large request is refused at once (429 / RESOURCE_EXHAUSTED) while small ones are served. The first test runs in
every serving mode: over the in-process engine, over colocated replicas on a real local Ray (one replica actor: the
same front ends, the Coordinator as their backend, the probes reading its health from the actor) and over one
prefill and one decode worker (the KV over gloo).

PROBE_BOUND_S is generous (CI's 2-core machines, client and server sharing one loop); the issue's target of
100 ms is measured outside the tests, against a server in its own process."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import grpc
import pytest

from cluster.api.http_server import HttpServerConfig
from cluster.api.input_pool import InputLimits, InputPool
from cluster.bench.probes import Prober
from engine import LLM
from proto import tandem_pb2
from tests.support.cluster_rig import cluster_config, running_cluster
from tests.support.http_rig import KV_BYTES, FrontEnds, completion_body, front_ends

PROBE_BOUND_S = 1.0
JSON = {"Content-Type": "application/json"}
ISSUE_PROMPT = "ab " * 1_300_000  # 3.9 MB, as in the issue


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    """A byte-level BPE tokenizer: a prompt's characters alone can prove it past the context."""
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    """NFC normalizes: no characters-per-token bound, every large prompt is tokenized (on the pool's thread)."""
    return LLM(model=str(tiny_checkpoint("qwen2")), kv_cache_memory=KV_BYTES).engine


@pytest.fixture(scope="module")
def replicas(tiny_checkpoint):
    """Colocated replicas on a real local Ray (`tandem serve --replicas 1`): one replica actor of the same
    checkpoint behind the Coordinator."""
    config = dataclasses.replace(cluster_config(1, 1), num_prefill_workers=0, transport="auto",
                                 model=str(tiny_checkpoint("llama")))
    with running_cluster(config) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def disaggregated(tiny_checkpoint):
    """One prefill and one decode worker on a real local Ray, the KV over gloo (`tandem serve`'s default
    disaggregated mode), behind the Coordinator."""
    config = dataclasses.replace(cluster_config(1, 1, "gloo"), model=str(tiny_checkpoint("llama")))
    with running_cluster(config) as coordinator:
        yield coordinator


async def under_probes(fronts: FrontEnds, requests) -> tuple[list, dict[str, float]]:
    """Runs the `requests` (coroutines) at once with the probes (cluster/bench/probes.py's, HTTP and both gRPC
    health services) polling until all are answered; every probe must have said the server serves. Returns the
    answers and each probe's slowest answer (s)."""
    done = asyncio.Event()
    probing = asyncio.ensure_future(Prober(fronts.session, fronts.base_url, fronts.channel).poll(done))
    await asyncio.sleep(0.05)
    try:
        answers = await asyncio.gather(*requests)
    finally:
        done.set()
    samples = await probing
    assert not samples.failures, samples.failures
    return answers, {name: max(values) for name, values in samples.latencies.items()}


async def post(session, path: str, body: bytes, **options) -> tuple[int, bytes]:
    async with session.post(path, data=body, headers=JSON, **options) as response:
        return response.status, await response.read()


async def generate(stub, **fields) -> grpc.StatusCode:
    try:
        async for _ in stub.Generate(tandem_pb2.GenerateRequest(**fields)):
            pass
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def error_of(answer: tuple[int, bytes]) -> tuple[int, str, str | None]:
    status, body = answer
    error = json.loads(body)["error"]
    return status, error["message"], error["param"]


async def assert_still_serves(session, stub) -> None:
    async with session.post("/v1/completions", json=completion_body("Hello", 2)) as response:
        assert response.status == 200 and len((await response.json())["choices"][0]["token_ids"]) == 2
    assert await generate(stub, prompt="Hello", max_tokens=2, ignore_eos=True) == grpc.StatusCode.OK


@pytest.mark.parametrize("mode", ["llama", "replicas", "disaggregated"])  # in process, on Ray: replicas, 1P1D
def test_the_probes_answer_while_8_large_requests_arrive_at_once(mode, request):
    served = request.getfixturevalue(mode)
    completion = json.dumps(completion_body(ISSUE_PROMPT, 2)).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": ISSUE_PROMPT}], "max_tokens": 2}).encode()
    tokenize = json.dumps({"prompt": ISSUE_PROMPT}).encode()
    over_limit = completion + b" " * (HttpServerConfig().max_body_bytes - len(completion) + 1)

    async def scenario():
        async with front_ends(served, InputPool()) as fronts:
            session, stub = fronts.session, fronts.stub
            requests = [post(session, "/v1/completions", completion), post(session, "/v1/completions", completion),
                        post(session, "/v1/chat/completions", chat), post(session, "/v1/chat/completions", chat),
                        post(session, "/tokenize", tokenize), generate(stub, prompt=ISSUE_PROMPT, max_tokens=2),
                        generate(stub, prompt=ISSUE_PROMPT, max_tokens=2),
                        post(session, "/v1/completions", over_limit, expect100=True)]
            answers, worst = await under_probes(fronts, requests)
            await assert_still_serves(session, stub)
            return answers, worst

    answers, worst = asyncio.run(scenario())
    assert max(worst.values()) < PROBE_BOUND_S, worst
    for answer, param in zip(answers[:4], ("prompt", "prompt", "messages", "messages")):
        status, message, field = error_of(answer)
        assert (status, field) == (400, param) and "more than the model's context of 1024 tokens" in message
    status, body = answers[4]
    counted = json.loads(body)
    assert status == 200 and counted["count"] == len(counted["tokens"]) > 2_000_000
    assert answers[5] == answers[6] == grpc.StatusCode.INVALID_ARGUMENT
    assert answers[7][0] == 413 and json.loads(answers[7][1])["error"]["code"] == "request_too_large"


def test_large_prompts_tokenized_on_the_pool_leave_the_probes_answering(qwen):
    prompt = "many words, " * 70_000  # 840 KB: tokenized (no bound), then found past the context
    tokens = len(qwen.tokenizer.encode(prompt))
    completion = json.dumps(completion_body(prompt, 2)).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()

    async def scenario():
        async with front_ends(qwen, InputPool(InputLimits(workers=1))) as fronts:
            session, stub = fronts.session, fronts.stub
            requests = [*(post(session, "/v1/completions", completion) for _ in range(3)),
                        *(post(session, "/v1/chat/completions", chat) for _ in range(2)),
                        post(session, "/tokenize", json.dumps({"prompt": prompt}).encode()),
                        *(generate(stub, prompt=prompt, max_tokens=2) for _ in range(2))]
            answers, worst = await under_probes(fronts, requests)
            await assert_still_serves(session, stub)
            return answers, worst

    answers, worst = asyncio.run(scenario())
    assert max(worst.values()) < PROBE_BOUND_S, worst
    for answer in answers[:3]:
        assert error_of(answer)[0] == 400 and f"has {tokens} tokens" in error_of(answer)[1]
    assert all(error_of(answer)[:1] == (400,) and error_of(answer)[2] == "messages" for answer in answers[3:5])
    assert answers[5][0] == 200 and json.loads(answers[5][1])["count"] == tokens
    assert answers[6] == answers[7] == grpc.StatusCode.INVALID_ARGUMENT


def test_past_the_waiting_bound_a_large_request_is_refused_at_once_and_small_ones_served(llama):
    completion = json.dumps(completion_body(ISSUE_PROMPT, 2)).encode()

    async def scenario():
        pool, release = InputPool(InputLimits(workers=1, max_waiting=0)), threading.Event()
        async with front_ends(llama, pool) as fronts:
            session, stub = fronts.session, fronts.stub
            holder = asyncio.ensure_future(pool.prepare(pool.limits.off_loop_bytes + 1, release.wait))
            try:
                refused = error_of(await post(session, "/v1/completions", completion))
                refused_grpc = await generate(stub, prompt=ISSUE_PROMPT, max_tokens=2)
                await assert_still_serves(session, stub)
            finally:
                release.set()
            await holder
            after = error_of(await post(session, "/v1/completions", completion))
        return refused, refused_grpc, after

    refused, refused_grpc, after = asyncio.run(scenario())
    assert refused[0] == 429 and "retry later" in refused[1]
    assert refused_grpc == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after[0] == 400 and after[2] == "prompt"
