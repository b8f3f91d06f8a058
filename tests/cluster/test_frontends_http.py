"""The OpenAI-compatible HTTP front end end to end: a real aiohttp server and client over loopback, in
front of a LocalEngineBackend on a tiny Llama checkpoint (real tokenizer and chat template), checked
against a second engine.LLM on the same checkpoint. Errors, auth, overload, health: test_frontends_http_errors.py."""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM
from tests.support.frontend_rig import greedy, wait_until_idle
from tests.support.http_rig import CHAT, KV_BYTES, MODEL, completion_body, http_client, post, stream_events


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def served(checkpoint):
    return LLM(model=checkpoint, kv_cache_memory=KV_BYTES).engine


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLM(model=checkpoint, kv_cache_memory=KV_BYTES)


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
            body = completion_body("Rain in the morning " * 8, served.max_model_len - 100, stream=True)
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
