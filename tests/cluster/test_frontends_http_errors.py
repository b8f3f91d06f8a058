"""The OpenAI-compatible HTTP front end's answers besides generation: OpenAI-shaped errors for bad input
(the server keeps serving), the API key, overload (429), models / health / metrics, a backend gone (503)."""
from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api.http_server import HttpServerConfig, start_http_server
from cluster.api.prompt_encoder import PromptEncoder
from engine import LLM
from tests.support.frontend_rig import fail_next_step, local_backend, wait_until_busy, wait_until_idle
from tests.support.http_rig import API_KEY, CHAT, KV_BYTES, MAX_BODY_BYTES, MODEL, completion_body, http_client, post


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


BAD_COMPLETIONS = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "invalid_json"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "invalid_type"),
    ({"prompt": "x", "stream": "yes"}, 400, "invalid_type"),
    ({"prompt": "x", "n": 0}, 400, "invalid_value"),
    ({"prompt": "x", "n": 129}, 400, "invalid_value"),
    ({"prompt": "x", "best_of": 3}, 400, "unsupported_parameter"),
    ({"prompt": "x", "echo": "yes"}, 400, "invalid_type"),
    ({"prompt": "x", "logprobs": 21}, 400, "invalid_value"),
    ({"prompt": "x", "frequency_penalty": 2.5}, 400, "invalid_value"),
    ({"prompt": "x", "mystery_knob": 1}, 400, "unknown_parameter"),
    ({"prompt": ["a", 3]}, 400, "invalid_value"),
    ({"prompt": {"text": "x"}}, 400, "invalid_value"),
    ({"max_tokens": 3}, 400, "invalid_value"),
    ({"prompt": []}, 400, "invalid_value"),
    ({"prompt": [1, 100000]}, 400, "invalid_value"),
    ({"prompt": "x", "max_tokens": 0}, 400, "invalid_value"),
    ({"prompt": "x", "temperature": -1}, 400, "invalid_value"),
    ({"prompt": "x", "top_p": 2}, 400, "invalid_value"),
    ({"prompt": "x", "top_k": 0}, 400, "invalid_value"),
    ({"prompt": "x", "stop": [1]}, 400, "invalid_type"),
    ({"prompt": "x", "stop_token_ids": list(range(65))}, 400, "invalid_value"),
    ({"prompt": "x", "seed": 2 ** 70}, 400, "invalid_value"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model_not_found"),
    (b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}', 413, "request_too_large"),
]
BAD_CHATS = [
    ({"messages": []}, 400, "invalid_value"),
    ({"messages": [{"content": "no role"}]}, 400, "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value"),  # the template refuses
    ({"messages": CHAT, "tools": [{"type": "function"}]}, 400, "invalid_value"),  # a tool without its function
    ({"messages": CHAT, "tool_choice": "required"}, 400, "invalid_value"),  # forcing a call needs tools
    ({"messages": CHAT, "tool_choice": "sometimes"}, 400, "unsupported_parameter"),
    ({"messages": CHAT, "echo": True}, 400, "unsupported_parameter"),  # echo is for completions
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
            body = completion_body("Hold", served.max_model_len - 50, stream=True)
            holder = await session.post("/v1/completions", json=body)
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
                    body = completion_body("Long", served.max_model_len - 50, stream=True)
                    streaming = await session.post("/v1/completions", json=body)
                    await streaming.content.readline()
                    await wait_until_busy(served)
                    await backend.shutdown()
                    tail = (await streaming.read()).decode()
                    assert '"backend_unavailable"' in tail and tail.endswith("data: [DONE]\n\n")
                    async with session.get("/health") as response:
                        assert response.status == 503
                    async with session.get("/ping") as response:
                        assert response.status == 503
                    status, body = await post(session, "/v1/completions", completion_body("x", 2))
                    assert_openai_error(status, body, 503, "backend_unavailable")
            finally:
                await runner.cleanup()

    asyncio.run(scenario())



def test_a_failed_engine_step_is_a_500_without_the_exception_text(served, monkeypatch):
    fail_next_step(served, monkeypatch, "simulated device fault at /secret/path")

    async def scenario():
        async with http_client(served) as session:
            status, body = await post(session, "/v1/completions", completion_body("doomed", 4))
            assert_openai_error(status, body, 500, "internal_error")
            assert "incident" in body["error"]["message"] and "secret" not in body["error"]["message"]
            await wait_until_idle(served)
            status, ok = await post(session, "/v1/completions", completion_body("after", 3))
            assert status == 200 and len(ok["choices"][0]["token_ids"]) == 3

    asyncio.run(scenario())


def test_a_large_body_is_prepared_off_the_event_loop(served, monkeypatch):
    """One big input must not stall the other streams: a body above OFF_LOOP_INPUT_CHARS is parsed and its prompt
    encoded on a thread of the InputPool (small ones stay on the loop: a thread hop costs more than they do)."""
    threads, real_encode_prompt = [], PromptEncoder.encode_prompt

    def recording_encode_prompt(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return real_encode_prompt(self, *args, **kwargs)

    monkeypatch.setattr(PromptEncoder, "encode_prompt", recording_encode_prompt)

    async def scenario():
        async with http_client(served) as session:
            small, _ = await post(session, "/v1/completions", completion_body("short", 2))
            big, _ = await post(session, "/v1/completions", completion_body("many words " * 1000, 2))
            return threading.current_thread(), small, big

    loop_thread, small, big = asyncio.run(scenario())
    assert small == 200 and big == 400  # longer than the context
    assert threads[0] is loop_thread and threads[1].name.startswith("tandem-input")
