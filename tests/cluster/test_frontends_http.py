"""The OpenAI-compatible HTTP front end end to end: a real aiohttp server and client over loopback, in
front of a LocalEngineBackend on a tiny Llama checkpoint (real tokenizer and chat template), checked
against a second engine.LLM on the same checkpoint."""
from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api.http_server import HttpServerConfig, start_http_server
from engine import LLM
from tests.support.frontend_rig import greedy, local_backend, wait_until_busy, wait_until_idle

MODEL = "tiny-llama"
KV_BYTES = 8 << 20
API_KEY = "s3cret-key"
MAX_BODY_BYTES = 64 * 1024
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, friend"}]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def served(checkpoint):
    return LLM(model=checkpoint, kv_cache_memory=KV_BYTES).engine


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLM(model=checkpoint, kv_cache_memory=KV_BYTES)


@contextlib.asynccontextmanager
async def http_client(engine, *, api_key=None, **backend_fields):
    async with local_backend(engine, model_name=MODEL, **backend_fields) as backend:
        config = HttpServerConfig(api_key=api_key, max_body_bytes=MAX_BODY_BYTES)
        runner, port = await start_http_server(backend, config)
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                yield session
                await wait_until_idle(engine)
        finally:
            await runner.cleanup()


async def post(session, path: str, body, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(path, data=data, headers=headers) as response:
        return response.status, await response.json()


async def stream_events(session, path: str, body) -> list:
    """The SSE `data:` payloads of a streamed response, JSON-decoded except the final [DONE]."""
    async with session.post(path, json=body) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        events = [line.decode().strip() async for line in response.content]
    payloads = [e[len("data: "):] for e in events if e]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def completion_body(prompt, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def test_completions_equal_the_offline_llm(served, reference):
    text_prompt, id_prompt = "The quick brown fox", [5, 77, 200, 31, 9, 150]
    by_text = reference.generate([text_prompt], greedy(12))[0]
    by_ids = reference.generate(prompt_token_ids=[id_prompt], sampling_params=greedy(12))[0].outputs[0]

    async def scenario():
        async with http_client(served) as session:
            return (await post(session, "/v1/completions", completion_body(text_prompt, 12)),
                    await post(session, "/v1/completions", completion_body(id_prompt, 12)))

    (status_text, text), (status_ids, ids) = asyncio.run(scenario())
    assert status_text == status_ids == 200
    choice = text["choices"][0]
    assert choice["token_ids"] == by_text.outputs[0].token_ids and choice["text"] == by_text.outputs[0].text
    assert ids["choices"][0]["token_ids"] == by_ids.token_ids and ids["choices"][0]["text"] == by_ids.text
    assert text["object"] == "text_completion" and text["id"].startswith("cmpl-") and text["model"] == MODEL
    assert isinstance(text["created"], int) and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert text["usage"] == {"prompt_tokens": len(by_text.prompt_token_ids), "completion_tokens": 12,
                             "total_tokens": len(by_text.prompt_token_ids) + 12}
    timing = text["tandem_timing"]
    assert timing["ttft_ms"] > 0 and timing["transfer_ms"] == 0 and timing["decode_worker"] == "local"


def test_streamed_completion_concatenates_to_the_whole(served):
    body = completion_body("It was the best of times", 10, stop=["zzz"])

    async def scenario():
        async with http_client(served) as session:
            whole = (await post(session, "/v1/completions", body))[1]
            events = await stream_events(session, "/v1/completions",
                                         {**body, "stream": True, "stream_options": {"include_usage": True}})
        return whole, events

    whole, events = asyncio.run(scenario())
    *content, usage_event = events
    assert usage_event["choices"] == [] and usage_event["usage"] == whole["usage"]
    assert len(content) > 1 and all(e["object"] == "text_completion" for e in content)
    assert "".join(e["choices"][0]["text"] for e in content) == whole["choices"][0]["text"]
    assert [t for e in content for t in e["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert [e["choices"][0]["finish_reason"] for e in content[:-1]] == [None] * (len(content) - 1)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert content[-1]["tandem_timing"]["ttft_ms"] > 0 and "tandem_timing" not in content[0]


def test_chat_completions_equal_the_offline_chat(served, reference):
    expected = reference.chat(CHAT, greedy(10))[0].outputs[0]
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}

    async def scenario():
        async with http_client(served) as session:
            return (await post(session, "/v1/chat/completions", body),
                    await stream_events(session, "/v1/chat/completions", {**body, "stream": True}))

    (status, whole), events = asyncio.run(scenario())
    assert status == 200 and whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    choice = whole["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 10
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == expected.text
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "tandem_timing" in events[-1]


def test_concurrent_requests_all_complete_correctly(served, reference):
    prompts = [f"Request number {i} asks about {'the sea ' * (1 + i % 3)}" for i in range(16)]
    lengths = [3 + i % 5 for i in range(16)]
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, [greedy(n) for n in lengths])]

    async def one(session, index: int) -> list[int]:
        body = completion_body(prompts[index], lengths[index])
        if index % 2:
            events = await stream_events(session, "/v1/completions", {**body, "stream": True})
            return [t for e in events for t in e["choices"][0]["token_ids"]]
        return (await post(session, "/v1/completions", body))[1]["choices"][0]["token_ids"]

    async def scenario():
        async with http_client(served) as session:
            return await asyncio.gather(*(one(session, i) for i in range(16)))

    assert asyncio.run(scenario()) == expected


def test_client_disconnect_mid_stream_frees_every_block(served):
    async def scenario():
        async with http_client(served) as session:
            body = completion_body("Rain in the morning " * 8, 5000, stream=True)
            response = await session.post("/v1/completions", json=body)
            for _ in range(3):
                assert (await response.content.readline()).startswith(b"data: ")
                await response.content.readline()
            assert served.num_free_blocks < served.num_total_blocks
            response.close()  # drop the connection mid-stream
            await wait_until_idle(served)
            status, again = await post(session, "/v1/completions", completion_body("Hello", 2))
            assert status == 200 and len(again["choices"][0]["token_ids"]) == 2

    asyncio.run(scenario())


BAD_COMPLETIONS = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "invalid_json"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "invalid_type"),
    ({"prompt": "x", "stream": "yes"}, 400, "invalid_type"),
    ({"prompt": "x", "n": 2}, 400, "unsupported_parameter"),
    ({"prompt": "x", "best_of": 3}, 400, "unsupported_parameter"),
    ({"prompt": "x", "logprobs": 1}, 400, "unsupported_parameter"),
    ({"prompt": "x", "frequency_penalty": 0.5}, 400, "unsupported_parameter"),
    ({"prompt": "x", "mystery_knob": 1}, 400, "unknown_parameter"),
    ({"prompt": ["a", "b"]}, 400, "unsupported_value"),
    ({"prompt": {"text": "x"}}, 400, "invalid_value"),
    ({"max_tokens": 3}, 400, "invalid_value"),
    ({"prompt": []}, 400, "invalid_value"),
    ({"prompt": [1, 100000]}, 400, "invalid_value"),
    ({"prompt": "x", "max_tokens": 0}, 400, "invalid_value"),
    ({"prompt": "x", "temperature": -1}, 400, "invalid_value"),
    ({"prompt": "x", "top_p": 2}, 400, "invalid_value"),
    ({"prompt": "x", "top_k": 0}, 400, "invalid_value"),
    ({"prompt": "x", "stop": [1]}, 400, "invalid_type"),
    ({"prompt": "x", "seed": 2 ** 70}, 400, "invalid_value"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model_not_found"),
    (b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}', 413, "request_too_large"),
]
BAD_CHATS = [
    ({"messages": []}, 400, "invalid_value"),
    ({"messages": [{"content": "no role"}]}, 400, "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value"),  # the template refuses
    ({"messages": CHAT, "tools": [{"type": "function"}]}, 400, "unsupported_parameter"),
]


def assert_openai_error(status: int, body: dict, expected_status: int, expected_code: str) -> None:
    assert status == expected_status, body
    error = body["error"]
    assert error["code"] == expected_code, body
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served):
    async def scenario():
        async with http_client(served) as session:
            for body, status, code in BAD_COMPLETIONS:
                assert_openai_error(*await post(session, "/v1/completions", body), status, code)
            for body, status, code in BAD_CHATS:
                assert_openai_error(*await post(session, "/v1/chat/completions", body), status, code)
            async with session.get("/v1/nowhere") as response:
                assert_openai_error(response.status, await response.json(), 404, "not_found")
            async with session.get("/v1/completions") as response:
                assert_openai_error(response.status, await response.json(), 405, "method_not_allowed")
            status, good = await post(session, "/v1/completions", completion_body("Still fine", 3))
            assert status == 200 and len(good["choices"][0]["token_ids"]) == 3

    asyncio.run(scenario())


def test_api_key_is_required_when_set(served):
    async def scenario():
        async with http_client(served, api_key=API_KEY) as session:
            body = completion_body("Hello", 2)
            for headers in (None, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}):
                assert_openai_error(*await post(session, "/v1/completions", body, headers), 401, "invalid_api_key")
            async with session.get("/v1/models") as response:
                assert response.status == 401
            status, ok = await post(session, "/v1/completions", body, {"Authorization": f"Bearer {API_KEY}"})
            assert status == 200 and len(ok["choices"][0]["token_ids"]) == 2
            async with session.get("/health") as response:  # probes need no key
                assert response.status == 200

    asyncio.run(scenario())


def test_overload_is_429(served):
    async def scenario():
        async with http_client(served, max_pending_requests=1) as session:
            holder = await session.post("/v1/completions", json=completion_body("Hold", 5000, stream=True))
            assert (await holder.content.readline()).startswith(b"data: ")
            assert_openai_error(*await post(session, "/v1/completions", completion_body("More", 2)), 429, "overloaded")
            holder.close()
            await wait_until_idle(served)
            assert (await post(session, "/v1/completions", completion_body("Room", 2)))[0] == 200

    asyncio.run(scenario())


def test_models_health_and_metrics(served):
    async def scenario():
        async with http_client(served) as session:
            await post(session, "/v1/completions", completion_body("Count me", 4))
            async with session.get("/v1/models") as response:
                models = await response.json()
            async with session.get("/health") as response:
                health = (response.status, await response.json())
            async with session.get("/metrics") as response:
                assert response.status == 200 and response.content_type == "text/plain"
                metrics = await response.text()
        return models, health, metrics

    models, health, metrics = asyncio.run(scenario())
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert health == (200, {"status": "ok", "model": MODEL, "prefill_workers": 1, "decode_workers": 1})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics) for s in family.samples}
    assert samples[("tandem_requests_total", (("frontend", "http"), ("outcome", "length")))] == 1
    assert samples[("tandem_time_to_first_token_seconds_count", ())] == 1
    assert samples[("tandem_inter_token_latency_seconds_count", ())] == 3
    assert samples[("tandem_generation_tokens_total", ())] == 4
    assert samples[("tandem_kv_free_blocks", ())] == samples[("tandem_kv_total_blocks", ())] > 0
    assert samples[("tandem_running_requests", ())] == samples[("tandem_waiting_requests", ())] == 0
    for name in ("tandem_queue_time_seconds_count", "tandem_prefill_time_seconds_count",
                 "tandem_kv_transfer_time_seconds_count", "tandem_e2e_request_latency_seconds_count"):
        assert samples[(name, ())] == 1


def test_backend_gone_means_503(served):
    async def scenario():
        async with local_backend(served, model_name=MODEL) as backend:
            runner, port = await start_http_server(backend, HttpServerConfig())
            try:
                async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                    streaming = await session.post("/v1/completions", json=completion_body("Long", 5000, stream=True))
                    await streaming.content.readline()
                    await wait_until_busy(served)
                    await backend.shutdown()
                    tail = (await streaming.read()).decode()
                    assert '"backend_unavailable"' in tail and tail.endswith("data: [DONE]\n\n")
                    async with session.get("/health") as response:
                        assert response.status == 503
                    status, body = await post(session, "/v1/completions", completion_body("x", 2))
                    assert_openai_error(status, body, 503, "backend_unavailable")
            finally:
                await runner.cleanup()

    asyncio.run(scenario())

