"""Logprobs and logits processors through disaggregated serving on a real local Ray (1 prefill + 2 decode
workers, KV over gRPC, prompts under 10 tokens prefilled on their decode worker): tokens and logprobs equal
a colocated engine's, the first token's (sampled on the prefill worker, carried in the KV manifest or the
prefill report) as the later ones'; the OpenAI shapes and gRPC through the front ends equal colocated
serving's; bad values are 400 naming the field; a request whose decode worker is killed mid-stream keeps
one logprobs entry per token, the colocated ones. Every test ends with every alive worker's pool empty."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from contextlib import aclosing

import aiohttp
import grpc
import pytest

from cluster.api.grpc_server import start_grpc_server
from cluster.api.http_server import start_http_server
from engine import LLM, SamplingParams
from proto import tandem_pb2, tandem_pb2_grpc
from tests.support.cluster_rig import SMALL_ENGINE, cluster_config, request, running_cluster, wait_until_idle
from tests.support.engine_checks import random_prompts
from tests.support.frontend_rig import local_backend

VOCAB = 256  # byte ids of the default model's tokenizer
EOS = 257
LOCAL_BELOW = 10
ATOL = 1e-4
PROCESSED = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={65: 2.0})
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5, **PROCESSED),
    SamplingParams(max_tokens=12, temperature=0.9, min_p=0.05, top_k=50, seed=3, ignore_eos=True, logprobs=2,
                   **PROCESSED),
    SamplingParams(max_tokens=12, temperature=0, logprobs=0, min_tokens=3, logit_bias={EOS: 12.0}),
    SamplingParams(max_tokens=1, temperature=0, logprobs=3, frequency_penalty=1.0),  # ends on the prefill worker
]


@pytest.fixture(scope="module")
def cluster():
    config = dataclasses.replace(cluster_config(1, 2), local_prefill_tokens=LOCAL_BELOW)
    with running_cluster(config) as coordinator:
        yield coordinator


@pytest.fixture(scope="module")
def colocated():
    return LLM("tiny", kv_cache_memory=SMALL_ENGINE.kv_cache_memory)


def colocated_run(llm, prompts, params) -> list[tuple[list[int], list]]:
    """(tokens, TokenLogprobs) of each request, stepped together on the colocated engine."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"c{i}", prompt, p)
    out = {f"c{i}": ([], []) for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id][0].extend(delta.new_token_ids)
            out[delta.request_id][1].extend(delta.logprobs or ())
    return list(out.values())


async def backend_run(backend, request_id: str, prompt, params) -> tuple[list[int], list, object]:
    tokens, logprobs, last = [], [], None
    async with aclosing(backend.generate(request(request_id, prompt, params))) as chunks:
        async for chunk in chunks:
            assert chunk.logprobs is None or len(chunk.logprobs) == len(chunk.token_ids)
            tokens += chunk.token_ids
            logprobs += chunk.logprobs or ()
            last = chunk
    return tokens, logprobs, last


def assert_same_logprobs(expected, got) -> None:
    assert [lp.token_id for lp in got] == [lp.token_id for lp in expected]
    for a, b in zip(expected, got):
        assert (a.top_ids, a.rank) == (b.top_ids, b.rank)
        assert abs(a.logprob - b.logprob) < ATOL
        assert all(abs(x - y) < ATOL for x, y in zip(a.top_logprobs, b.top_logprobs))


def test_tokens_and_logprobs_equal_colocated_on_both_prefill_paths(cluster, colocated):
    prompts = random_prompts([4, 30, 7, 45, 33, 6, 28, 5], VOCAB, seed=21)  # each params: one under 10 (prefilled
    # on its decode worker), one over (prefilled on the prefill worker, its KV and first logprobs shipped)
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    expected = colocated_run(colocated, prompts, params)

    async def run():
        results = await asyncio.gather(*(backend_run(cluster, f"s{i}", p, q)
                                         for i, (p, q) in enumerate(zip(prompts, params))))
        await wait_until_idle(cluster)
        return results

    for (tokens, logprobs, last), (want_tokens, want_logprobs), p in zip(asyncio.run(run()), expected, params):
        assert tokens == want_tokens and len(logprobs) == len(tokens)
        assert_same_logprobs(want_logprobs, logprobs)
        assert all(len(lp.top_ids) == p.logprobs for lp in logprobs)
    min_tokens_runs = [tokens for (tokens, _), p in zip(expected, params) if p.min_tokens]
    assert all(len(t) == 4 and t[-1] == EOS and EOS not in t[:3] for t in min_tokens_runs)


def _http_bodies():
    return [
        ("/v1/completions", {"prompt": "The cache", "max_tokens": 6, "temperature": 0, "logprobs": 3,
                             "repetition_penalty": 1.2, "logit_bias": {"101": 3}, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "temperature": 0, "logprobs": 0, "stream": True,
                             "presence_penalty": 1.0, "min_tokens": 2, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there, friend"}],
                                  "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2,
                                  "frequency_penalty": 0.5, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                  "temperature": 0.7, "seed": 5, "min_p": 0.1, "logprobs": True, "stream": True,
                                  "ignore_eos": True}),
    ]


BAD_BODIES = [
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"), ({"prompt": "x", "min_p": -0.1}, "min_p"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"), ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "logit_bias": {"100000": 1}}, "logit_bias"),  # the engine's check
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
]


async def _http_answers(backend) -> list:
    """Each body's answer (the JSON, or the SSE payloads) from an HTTP front end over `backend`."""
    runner, port = await start_http_server(backend)
    answers = []
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            for path, body in _http_bodies():
                async with session.post(path, json=body) as response:
                    assert response.status == 200, await response.text()
                    if body.get("stream"):
                        lines = [line.decode().strip() async for line in response.content]
                        answers.append([line[6:] for line in lines if line.startswith("data: {")])
                    else:
                        answers.append(await response.json())
            for body, field in BAD_BODIES:
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                async with session.post(path, json=body) as response:
                    error = (await response.json())["error"]
                    assert response.status == 400 and field in error["message"], error
                    assert error["param"] in (field, None)
    finally:
        await runner.cleanup()
    return answers


def _logprob_objects(answer) -> list:
    """The choices' logprobs objects of a whole answer or of a stream's events (JSON text)."""
    events = [json.loads(e) for e in answer] if isinstance(answer, list) else [answer]
    return [choice["logprobs"] for event in events for choice in event.get("choices", []) if choice["logprobs"]]


def _assert_close_json(a, b) -> None:
    if isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) < ATOL
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_close_json(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_close_json(x, y)
    else:
        assert a == b


def test_openai_shapes_and_grpc_equal_colocated_serving(cluster, colocated):
    async def run():
        async with local_backend(colocated.engine, model_name=cluster.model_name) as local:
            expected = await _http_answers(local)
        got = await _http_answers(cluster)
        await wait_until_idle(cluster)
        return expected, got

    expected, got = asyncio.run(run())
    for want, have in zip(expected, got):
        _assert_close_json(_logprob_objects(want), _logprob_objects(have))
    whole = _logprob_objects(got[0])[0]
    assert set(whole) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"} and len(whole["tokens"]) == 6
    assert all(1 <= len(top) <= 4 for top in whole["top_logprobs"]) and whole["text_offset"][0] == 0
    streamed = _logprob_objects(got[3])
    assert len(streamed) == 4 and all(len(o["content"]) == 1 and o["content"][0]["top_logprobs"] == []
                                      for o in streamed)
    chat = _logprob_objects(got[2])[0]["content"]
    assert len(chat) == 5 and all(len(e["top_logprobs"]) == 2 and isinstance(e["bytes"], list) for e in chat)

    async def grpc_run():
        server, port = await start_grpc_server(cluster)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = tandem_pb2_grpc.TandemStub(channel)
                call = stub.Generate(tandem_pb2.GenerateRequest(
                    prompt_token_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], max_tokens=6, temperature=0,
                    logprobs=2, repetition_penalty=1.2, logit_bias={101: 3.0}, ignore_eos=True))
                responses = [r async for r in call]
                for bad, field in [(dict(logprobs=21), "logprobs"), (dict(presence_penalty=-3.0), "presence_penalty"),
                                   (dict(logit_bias={3: 150.0}), "logit_bias")]:
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        _ = [r async for r in stub.Generate(tandem_pb2.GenerateRequest(prompt="x", **bad))]
                    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.value.details()
                return responses
        finally:
            await server.stop(None)

    responses = asyncio.run(grpc_run())
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, repetition_penalty=1.2, logit_bias={101: 3.0},
                            ignore_eos=True)
    [(tokens, logprobs)] = colocated_run(colocated, [list(range(5, 17))], [params])
    assert [t for r in responses for t in r.token_ids] == tokens
    wire = [lp for r in responses for lp in r.logprobs]
    assert [(w.token_id, w.rank, list(w.top_ids)) for w in wire] == [(lp.token_id, lp.rank, list(lp.top_ids))
                                                                     for lp in logprobs]
    assert all(abs(w.logprob - lp.logprob) < ATOL for w, lp in zip(wire, logprobs))


def test_a_migrated_request_keeps_one_logprobs_entry_per_token(cluster, colocated):
    """SIGKILL of decode-1 while four requests decode: the ones on it resume on decode-0 as prompt +
    streamed tokens; each client gets the colocated tokens and logprobs, one entry per token."""
    prompts = random_prompts([20, 21, 22, 23], VOCAB, seed=22)
    params = [SamplingParams(max_tokens=160, temperature=t, seed=7, ignore_eos=True, logprobs=2, **PROCESSED)
              for t in (0, 0.8, 0, 0.8)]
    expected = colocated_run(colocated, prompts, params)
    victim = cluster.workers["decode-1"]

    async def run():
        started: asyncio.Queue = asyncio.Queue()

        async def one(i: int):
            tokens, logprobs, last = [], [], None
            async with aclosing(cluster.generate(request(f"m{i}", prompts[i], params[i]))) as chunks:
                async for chunk in chunks:
                    if not tokens:
                        started.put_nowait(i)
                    tokens += chunk.token_ids
                    logprobs += chunk.logprobs
                    last = chunk
            return tokens, logprobs, last

        runs = [asyncio.ensure_future(one(i)) for i in range(4)]
        for _ in runs:
            await asyncio.wait_for(started.get(), 30)
        os.kill(victim.pid, signal.SIGKILL)
        results = await asyncio.gather(*runs)
        await wait_until_idle(cluster)
        return results

    results = asyncio.run(run())
    assert sum(last.timing.migrations for _, _, last in results) >= 1
    for (tokens, logprobs, _), (want_tokens, want_logprobs) in zip(results, expected):
        assert tokens == want_tokens and len(logprobs) == len(tokens) == 160
        assert_same_logprobs(want_logprobs, logprobs)
