"""The HTTP front end through the clients users have: the official `openai` SDK for the OpenAI routes and
served model names, plain HTTP for vLLM's /tokenize, /detokenize, /version and /ping. A real front end over
a LocalEngineBackend on the tiny Llama checkpoint (a Hugging Face tokenizer with a chat template)."""
from __future__ import annotations

import asyncio
from importlib import metadata

import aiohttp
import openai
import pytest

from cluster.api.http_server import HttpServerConfig
from engine import LLM
from tests.support.http_rig import API_KEY, CHAT, KV_BYTES, MODEL, http_client, http_server, openai_client, post

NAMES = (MODEL, "tiny", "org/llama-alias")


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


def test_every_served_name_is_listed_retrieved_and_accepted_as_model(served):
    async def scenario():
        async with http_server(served, served_model_names=NAMES) as url, openai_client(url) as client:
            listed = [model async for model in client.models.list()]
            retrieved = [await client.models.retrieve(name) for name in NAMES]
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("gpt-4")
            completions = [await client.completions.create(model=name, prompt="Hello there", max_tokens=3,
                                                           temperature=0, extra_body={"ignore_eos": True})
                           for name in NAMES]
            chat = await client.chat.completions.create(model=NAMES[2], messages=CHAT, max_tokens=2,
                                                        extra_body={"ignore_eos": True})
            with pytest.raises(openai.NotFoundError) as unknown:
                await client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
            default = await post_json(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            async with aiohttp.ClientSession(url) as session, session.get(f"/v1/models/{NAMES[2]}") as response:
                assert (response.status, (await response.json())["id"]) == (200, NAMES[2])  # "/" as curl sends it
        return listed, retrieved, completions, chat, unknown.value, default

    listed, retrieved, completions, chat, unknown, default = asyncio.run(scenario())
    assert [model.id for model in listed] == list(NAMES)
    assert [model.id for model in retrieved] == list(NAMES)
    assert all(model.object == "model" and model.owned_by == "tandem" for model in listed + retrieved)
    assert [c.model for c in completions] == list(NAMES)  # each answer names the model it was asked for
    assert len({c.choices[0].text for c in completions}) == 1  # one model under every name
    assert all(c.usage.completion_tokens == 3 for c in completions)
    assert chat.model == NAMES[2] and chat.usage.completion_tokens == 2
    assert unknown.status_code == 404 and "gpt-4" in unknown.message
    assert default["model"] == NAMES[0]  # no `model`: the first name is reported


async def post_json(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession(url) as session:
        status, answer = await post(session, path, body)
    assert status == 200, answer
    return answer


def test_tokenize_and_detokenize_round_trip_prompts_and_chats(served):
    tokenizer = served.tokenizer
    chat_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    long_prompt = "many words " * 700

    async def scenario():
        async with http_client(served, served_model_names=NAMES) as session:
            plain = await post(session, "/tokenize", {"prompt": "Hello there, friend", "add_special_tokens": False})
            with_bos = await post(session, "/tokenize", {"model": NAMES[1], "prompt": "Hello there, friend"})
            chat = await post(session, "/tokenize", {"messages": CHAT})
            long = await post(session, "/tokenize", {"prompt": long_prompt})
            back = [await post(session, "/detokenize", {"model": NAMES[2], "tokens": answer[1]["tokens"]})
                    for answer in (plain, chat)]
            unknown = await post(session, "/tokenize", {"model": "gpt-4", "prompt": "x"})
        return plain, with_bos, chat, long, back, unknown

    plain, with_bos, chat, long, back, unknown = asyncio.run(scenario())
    assert plain == (200, {"count": len(plain[1]["tokens"]), "max_model_len": served.max_model_len,
                           "tokens": tokenizer.encode("Hello there, friend", add_special_tokens=False),
                           "token_strs": None})
    assert with_bos[1]["tokens"] == [tokenizer.bos_token_id, *plain[1]["tokens"]]
    assert chat[1]["tokens"] == tokenizer.encode(chat_text, add_special_tokens=False)
    assert long[0] == 200 and long[1]["count"] > long[1]["max_model_len"]  # counted, not refused
    assert back == [(200, {"prompt": "Hello there, friend"}), (200, {"prompt": chat_text})]
    assert unknown[0] == 404 and unknown[1]["error"]["code"] == "model_not_found"


def test_version_and_ping_answer_without_the_api_key_tokenize_needs_it(served):
    async def scenario():
        async with http_client(served, api_key=API_KEY) as session:
            async with session.get("/version") as response:
                version = (response.status, await response.json())
            pings = []
            for method in (session.get, session.post):
                async with method("/ping") as response:
                    pings.append(response.status)
            refused, _ = await post(session, "/tokenize", {"prompt": "x"})
            allowed, _ = await post(session, "/tokenize", {"prompt": "x"}, {"Authorization": f"Bearer {API_KEY}"})
        return version, pings, refused, allowed

    version, pings, refused, allowed = asyncio.run(scenario())
    assert version == (200, {"version": metadata.version("tandem")})
    assert pings == [200, 200]
    assert (refused, allowed) == (401, 200)


def test_served_names_are_checked_when_the_front_end_is_configured():
    for names in (("a", "a"), ("",), (" ",), ["a"], ("a", 3)):
        with pytest.raises(ValueError, match="served_model_names"):
            HttpServerConfig(served_model_names=names)
    assert HttpServerConfig(served_model_names=NAMES).served_model_names == NAMES
