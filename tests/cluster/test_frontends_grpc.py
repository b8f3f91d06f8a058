"""The public gRPC front end end to end: a real grpc.aio server and client over loopback, in front of
a LocalEngineBackend on the embedded default model, checked against a second engine.LLM."""
from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest

from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
from cluster.backend import GenerationRequest
from engine import LLM, SamplingParams
from proto import tandem_pb2, tandem_pb2_grpc
from tests.support.frontend_rig import (assert_pool_free, fail_next_step, greedy, grpc_stub, local_backend,
                                        wait_until_busy, wait_until_idle)

KV_BYTES = 8 << 20
API_KEY = "s3cret-key"


@pytest.fixture(scope="module")
def served():
    """The engine behind the server (owned by one backend per test)."""
    return LLM("tiny", kv_cache_memory=KV_BYTES).engine


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny", kv_cache_memory=KV_BYTES)


async def collect(stub, metadata=None, **fields) -> list[tandem_pb2.GenerateResponse]:
    return [r async for r in stub.Generate(tandem_pb2.GenerateRequest(**fields), metadata=metadata)]


def tokens_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_greedy_streams_what_the_offline_llm_generates(served, reference):
    prompt_ids = [72, 101, 108, 108, 111, 44, 32, 119]
    expected_ids = reference.generate(prompt_token_ids=[prompt_ids], sampling_params=greedy(12))[0].outputs[0]
    expected_text = reference.generate(["Tandem serves"], greedy(12))[0].outputs[0]
    seeded = SamplingParams(temperature=0.5, top_k=40, seed=7, max_tokens=10, ignore_eos=True)
    expected_seeded = reference.generate(prompt_token_ids=[prompt_ids], sampling_params=seeded)[0].outputs[0]

    async def scenario():
        async with grpc_stub(served) as stub:
            by_ids = await collect(stub, prompt_token_ids=prompt_ids, max_tokens=12, temperature=0,
                                   ignore_eos=True, request_id="mine")
            by_text = await collect(stub, prompt="Tandem serves", max_tokens=12, temperature=0, ignore_eos=True)
            sampled = await collect(stub, prompt_token_ids=prompt_ids, max_tokens=10, temperature=0.5,
                                    top_k=40, seed=7, ignore_eos=True)
        return by_ids, by_text, sampled

    by_ids, by_text, sampled = asyncio.run(scenario())
    assert len(by_ids) > 1 and tokens_of(by_ids) == expected_ids.token_ids
    assert "".join(r.text for r in by_ids) == expected_ids.text
    assert tokens_of(by_text) == expected_text.token_ids
    assert "".join(r.text for r in by_text) == expected_text.text
    assert tokens_of(sampled) == expected_seeded.token_ids
    assert all(r.request_id == "mine" for r in by_ids) and by_text[0].request_id.startswith("grpc-")
    assert [r.finish_reason for r in by_ids[:-1]] == [""] * (len(by_ids) - 1)
    last = by_ids[-1]
    assert last.finish_reason == "length" and last.HasField("timing")
    assert not any(r.HasField("timing") for r in by_ids[:-1])
    timing = last.timing
    assert timing.ttft_ms > 0 and timing.queue_ms >= 0 and timing.prefill_ms > 0
    assert timing.ttft_ms >= timing.queue_ms and timing.transfer_ms == 0 and timing.kv_bytes == 0
    assert timing.prefill_worker == timing.decode_worker == "local"


def test_concurrent_requests_all_complete_correctly(served, reference):
    prompts = [[65 + i, 66 + (i * 7) % 50, 67, 68 + i % 5] * (1 + i % 3) for i in range(32)]
    lengths = [4 + i % 6 for i in range(32)]
    params = [greedy(n) for n in lengths]
    expected = [o.outputs[0].token_ids for o in reference.generate(prompt_token_ids=prompts, sampling_params=params)]

    async def scenario():
        async with grpc_stub(served) as stub:
            return await asyncio.gather(*(collect(stub, prompt_token_ids=p, max_tokens=n, temperature=0,
                                                  ignore_eos=True) for p, n in zip(prompts, lengths)))

    results = asyncio.run(scenario())
    assert [tokens_of(r) for r in results] == expected
    assert all(r[-1].finish_reason == "length" for r in results)


def test_n_samples_stream_with_their_index(served, reference):
    """n=3 seeded samples in one stream: each message names its sample; each sample's tokens are the offline
    engine's sample of that index, and each sample's last message has its finish_reason and timing."""
    prompt_ids = [72, 101, 108, 108, 111, 44, 32, 119]
    params = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=11, ignore_eos=True)
    want = reference.generate(prompt_token_ids=[prompt_ids], sampling_params=params)[0].outputs

    async def scenario():
        async with grpc_stub(served) as stub:
            return await collect(stub, prompt_token_ids=prompt_ids, n=3, max_tokens=6, temperature=0.8, seed=11,
                                 ignore_eos=True)

    responses = asyncio.run(scenario())
    for j in range(3):
        mine = [r for r in responses if r.index == j]
        assert tokens_of(mine) == list(want[j].token_ids)
        assert [r.finish_reason for r in mine if r.finish_reason] == ["length"]
        assert mine[-1].finish_reason == "length" and mine[-1].timing.ttft_ms > 0


def test_client_cancel_mid_stream_frees_every_block(served):
    async def scenario():
        async with grpc_stub(served) as stub:
            call = stub.Generate(tandem_pb2.GenerateRequest(prompt="cancel me " * 20, max_tokens=2000,
                                                            temperature=0, ignore_eos=True))
            received = 0
            async for _ in call:
                received += 1
                if received == 3:
                    break
            assert served.num_free_blocks < served.num_total_blocks  # it holds KV right now
            call.cancel()
            await wait_until_idle(served)  # freed by the cancel, not by shutting anything down
            again = await collect(stub, prompt="still serving", max_tokens=3, temperature=0)
            assert again[-1].finish_reason in ("stop", "length")

    asyncio.run(scenario())


BAD_REQUESTS = [
    ({"prompt": "x", "prompt_token_ids": [1, 2]}, "exactly one"),
    ({}, "exactly one"),
    ({"prompt_token_ids": [1, 100000]}, "vocabulary"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1.0}, "temperature"),
    ({"prompt": "x", "temperature": math.nan}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": 0}, "top_k"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "request_id": "r" * 300}, "request_id"),
    ({"prompt": "x", "n": 0}, "n must be"),
    ({"prompt": "x", "n": 1000}, "n must be"),
]


def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(served):
    async def scenario():
        async with grpc_stub(served) as stub:
            too_long = [65] * (served.max_model_len + 1)
            for fields, needle in BAD_REQUESTS + [({"prompt_token_ids": too_long}, "context")]:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await collect(stub, **fields)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
                assert needle in caught.value.details(), (fields, caught.value.details())
            good = await collect(stub, prompt="fine", max_tokens=4, temperature=0, ignore_eos=True)
            assert len(tokens_of(good)) == 4

    asyncio.run(scenario())


def test_oversized_message_is_refused(served):
    async def scenario():
        async with grpc_stub(served, max_message_bytes=4096) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(stub, prompt="y" * 8000, max_tokens=2)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(tokens_of(await collect(stub, prompt="small", max_tokens=2, ignore_eos=True))) == 2

    asyncio.run(scenario())


def test_api_key_is_required_when_set(served):
    async def scenario():
        async with grpc_stub(served, api_key=API_KEY) as stub:
            for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", API_KEY)]):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await collect(stub, metadata=metadata, prompt="hi", max_tokens=2)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for metadata in ([("authorization", f"Bearer {API_KEY}")], [("x-api-key", API_KEY)]):
                ok = await collect(stub, metadata=metadata, prompt="hi", max_tokens=2, ignore_eos=True)
                assert len(tokens_of(ok)) == 2
            health = await stub.Health(tandem_pb2.HealthRequest())  # probes need no key
            assert health.status == "SERVING"

    asyncio.run(scenario())


def test_overload_is_resource_exhausted(served):
    async def scenario():
        async with grpc_stub(served, max_pending_requests=2) as stub:
            calls = [stub.Generate(tandem_pb2.GenerateRequest(prompt=f"hold {i}", max_tokens=2000,
                                                              ignore_eos=True)) for i in range(2)]
            for call in calls:
                await call.read()  # both admitted and streaming
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(stub, prompt="one too many", max_tokens=2)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in calls:
                call.cancel()
            await wait_until_idle(served)
            assert len(tokens_of(await collect(stub, prompt="room again", max_tokens=2, ignore_eos=True))) == 2

    asyncio.run(scenario())


def test_health_reports_the_backend(served):
    async def scenario():
        async with grpc_stub(served, model_name="tiny") as stub:
            health = await stub.Health(tandem_pb2.HealthRequest())
            assert (health.status, health.model) == ("SERVING", "tiny")
            assert health.prefill_workers == health.decode_workers == 1

    asyncio.run(scenario())
    assert_pool_free(served)


def test_shutdown_with_a_request_in_flight_answers_unavailable(served):
    async def scenario():
        async with local_backend(served) as backend:
            server, port = await start_grpc_server(backend, GrpcServerConfig())
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = tandem_pb2_grpc.TandemStub(channel).Generate(
                    tandem_pb2.GenerateRequest(prompt="long", max_tokens=5000, ignore_eos=True))
                await call.read()
                await wait_until_busy(served)
                await backend.shutdown()
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                health = await tandem_pb2_grpc.TandemStub(channel).Health(tandem_pb2.HealthRequest())
                assert health.status == "NOT_SERVING"
            await server.stop(None)

    asyncio.run(scenario())
    assert_pool_free(served)


def test_engine_rejection_reaches_the_caller_before_any_chunk(served):
    """Input that only the engine checks (here: past the front end) is a ValueError from the
    backend's first step of iteration, and nothing stays behind."""
    async def scenario():
        async with local_backend(served) as backend:
            bad = GenerationRequest("bad", (1, 10 ** 6), greedy(2), time.perf_counter())
            with pytest.raises(ValueError, match="vocabulary"):
                await anext(backend.generate(bad))
            good = GenerationRequest("good", (1, 2, 3), greedy(2), time.perf_counter())
            chunks = [chunk async for chunk in backend.generate(good)]
            assert [len(c.token_ids) for c in chunks] == [1, 1] and chunks[-1].timing.ttft_ms > 0

    asyncio.run(scenario())


def test_a_failed_engine_step_fails_its_requests_and_the_server_keeps_serving(served, monkeypatch):
    fail_next_step(served, monkeypatch, "simulated device fault")

    async def scenario():
        async with grpc_stub(served) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(stub, prompt="doomed", max_tokens=4)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert "incident" in caught.value.details()  # the exception text stays in the server log
            assert "simulated device fault" not in caught.value.details()
            await wait_until_idle(served)
            assert len(tokens_of(await collect(stub, prompt="after", max_tokens=3, ignore_eos=True))) == 3

    asyncio.run(scenario())
