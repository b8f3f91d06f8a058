"""End to end against transformers: a tiny real Llama checkpoint served through both public front ends
(gRPC per proto/tandem.proto, OpenAI HTTP /v1/completions) in both modes (colocated: one engine behind
a LocalEngineBackend; disaggregated: 1 prefill + 1 decode worker on a real local Ray, KV over gRPC on
127.0.0.1), real servers and clients on loopback.

Prompts of 1 to 100 tokens (the longest spans 7 KV blocks), given as token ids, sent concurrently;
greedy output must equal transformers' generate() token for token. The gRPC test also checks the final
message's Timing; every test ends with no request live and every KV block free (both workers' pools in
disaggregated mode, the engine's pool in colocated mode). Both front ends send the same prompts, so the
second one to run is served partly from the prefix caches (prefill and decode side): still exact.
"""
from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import grpc
import pytest

from cluster.api.grpc_server import start_grpc_server
from cluster.api.http_server import start_http_server
from engine import LLM
from proto import tandem_pb2, tandem_pb2_grpc
from tests.cluster.shared_pair import POOL_BYTES
from tests.support.cluster_rig import wait_until_idle
from tests.support.engine_checks import random_prompts
from tests.support.frontend_rig import local_backend
from tests.support.timing_checks import assert_remote_prefill_timing

MAX_TOKENS = 12
PROMPT_LENGTHS = (1, 5, 16, 17, 40, 100)   # block size 16: 1, 1, 1, 2, 3 and 7 blocks
TOKENIZER_VOCAB = 360                      # the tiny checkpoint's tokenizer (the model's vocab is 384)
MODES = ("colocated", "disaggregated")


@pytest.fixture(scope="module")
def checkpoint(llama_checkpoint) -> str:
    return llama_checkpoint


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(list(PROMPT_LENGTHS), TOKENIZER_VOCAB, seed=11)


@pytest.fixture(scope="module")
def expected(checkpoint, prompts, hf_greedy) -> list[list[int]]:
    """transformers' greedy continuations (EOS ignored), the oracle of every test here."""
    return hf_greedy(checkpoint, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def colocated_engine(checkpoint):
    return LLM(model=checkpoint, kv_cache_memory=POOL_BYTES).engine


@pytest.fixture(scope="module")
def cluster(llama_pair):
    """1 prefill + 1 decode worker on the session's local Ray, KV over gRPC, POOL_BYTES each: the package's
    (conftest.py)."""
    return llama_pair


@pytest.fixture(params=MODES)
def serving(request, colocated_engine):
    """`serving()`: an async context manager giving the mode's Backend; on a clean exit it checks that
    nothing is live and every KV block is free."""
    mode = request.param
    if mode == "colocated":
        @contextlib.asynccontextmanager
        async def colocated():
            async with local_backend(colocated_engine) as backend:  # waits for an empty pool, then checks it
                yield backend
            assert colocated_engine.num_free_blocks == colocated_engine.num_total_blocks
        return mode, colocated
    coordinator = request.getfixturevalue("cluster")

    @contextlib.asynccontextmanager
    async def disaggregated():
        yield coordinator
        stats = await wait_until_idle(coordinator)  # fails naming the worker that still holds something
        assert set(stats) == {"prefill-0", "decode-0"}
    return mode, disaggregated


def check_timing(mode: str, timing: dict) -> None:
    """The final message's Timing (gRPC fields, or HTTP tandem_timing: the same names)."""
    assert timing["ttft_ms"] > 0 and timing["queue_ms"] >= 0 and timing["prefill_ms"] >= 0
    if mode == "colocated":
        assert timing["transfer_ms"] == 0 and timing["kv_bytes"] == 0
        assert timing["prefill_worker"] == timing["decode_worker"] == "local"
        assert (timing["prefill_location"], timing["decode_cached_tokens"]) == ("", 0)   # no decision to make
    else:
        assert_remote_prefill_timing(timing)
        assert (timing["prefill_worker"], timing["decode_worker"]) == ("prefill-0", "decode-0")
        assert timing["prefill_location"] == "remote" and timing["decode_cached_tokens"] % 16 == 0


def grpc_timing(response: tandem_pb2.GenerateResponse) -> dict:
    t = response.timing
    return {"queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "transfer_ms": t.transfer_ms, "ttft_ms": t.ttft_ms,
            "kv_bytes": t.kv_bytes, "prefill_worker": t.prefill_worker, "decode_worker": t.decode_worker,
            "prefill_location": t.prefill_location, "decode_cached_tokens": t.decode_cached_tokens}


async def grpc_generate(stub, index: int, prompt: list[int]) -> list[tandem_pb2.GenerateResponse]:
    request = tandem_pb2.GenerateRequest(request_id=f"e2e-{index}", prompt_token_ids=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0.0, ignore_eos=True)
    return [response async for response in stub.Generate(request)]


def test_grpc_front_end_equals_transformers(serving, prompts, expected):
    mode, backend_scope = serving

    async def scenario():
        async with backend_scope() as backend:
            server, port = await start_grpc_server(backend)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            try:
                stub = tandem_pb2_grpc.TandemStub(channel)
                return await asyncio.gather(*(grpc_generate(stub, i, p) for i, p in enumerate(prompts)))
            finally:
                await channel.close()
                await server.stop(None)

    results = asyncio.run(scenario())
    for index, (prompt, want, responses) in enumerate(zip(prompts, expected, results)):
        tokens = [t for r in responses for t in r.token_ids]
        assert tokens == want, f"{mode}: the {len(prompt)}-token prompt differs from transformers"
        *streamed, last = responses
        assert all(r.request_id == f"e2e-{index}" for r in responses)
        assert [r.finish_reason for r in streamed] == [""] * len(streamed) and last.finish_reason == "length"
        assert not any(r.HasField("timing") for r in streamed) and last.HasField("timing")
        check_timing(mode, grpc_timing(last))


async def http_complete(session: aiohttp.ClientSession, prompt: list[int], stream: bool) -> tuple[list[int], dict]:
    """The completion's token ids and its last object (whole response, or the last SSE chunk)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    async with session.post("/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        if not stream:
            whole = await response.json()
            assert whole["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                                      "total_tokens": len(prompt) + MAX_TOKENS}
            return whole["choices"][0]["token_ids"], whole
        lines = [line.decode().strip() async for line in response.content]
    payloads = [line[len("data: "):] for line in lines if line]
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    return [t for e in events for t in e["choices"][0]["token_ids"]], events[-1]


def test_http_completions_equal_transformers(serving, prompts, expected):
    mode, backend_scope = serving

    async def scenario():
        async with backend_scope() as backend:
            runner, port = await start_http_server(backend)
            try:
                async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                    return await asyncio.gather(*(http_complete(session, p, stream=i % 2 == 1)
                                                  for i, p in enumerate(prompts)))
            finally:
                await runner.cleanup()

    results = asyncio.run(scenario())
    for index, (prompt, want, (tokens, last)) in enumerate(zip(prompts, expected, results)):
        streamed = "streamed " if index % 2 else ""
        assert tokens == want, f"{mode}: the {streamed}{len(prompt)}-token prompt differs from transformers"
        assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] == "length"
        check_timing(mode, last["tandem_timing"])

