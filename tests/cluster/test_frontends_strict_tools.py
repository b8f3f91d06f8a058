"""`strict` on response_format and tools, and forced tool calls streamed as OpenAI streams them, through the HTTP
front end and the official `openai` SDK on the tiny random-weight Llama checkpoint: a schema strict mode cannot
honour is a 400 naming the field (the same schema without strict is served, as before); a streamed call opens with
its id, type and name (empty arguments), its arguments follow in fragments, and an empty delta with
finish_reason "tool_calls" ends it; the accumulated arguments validate against the tool's parameters."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import jsonschema
import pytest

from engine import LLM
from tests.support.http_rig import CHAT, KV_BYTES, MODEL, http_server, openai_client, post

CITY = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}
LOOSE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": True}}
CLOCK = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping", "strict": True}}
PARAMETERS = {"get_weather": CITY, "get_time": CLOCK["function"]["parameters"]}


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


def json_schema(schema: dict, strict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": strict}}


def loose_tool(strict) -> dict:
    return {"type": "function", "function": {"name": "look", "parameters": LOOSE, "strict": strict}}


@pytest.mark.parametrize("path, extra, param, words", [
    ("/v1/chat/completions", {"response_format": json_schema(LOOSE, True)}, "response_format.json_schema.schema",
     "'additionalProperties' is required"),
    ("/v1/completions", {"response_format": json_schema({**CITY, "required": ["city"]}, True)},
     "response_format.json_schema.schema", "Missing 'unit'"),
    ("/v1/chat/completions", {"response_format": json_schema({"anyOf": [CITY]}, True)},
     "response_format.json_schema.schema", "root of a strict schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "strict": True}}},
     "response_format.json_schema.schema", "needs a schema"),
    ("/v1/chat/completions", {"tools": [WEATHER, loose_tool(True)]}, "tools[1].function.parameters",
     "Invalid schema for function \"look\""),
    ("/v1/chat/completions", {"tools": [loose_tool(True)], "tool_choice": "required"},
     "tools[0].function.parameters", "'additionalProperties' is required"),
    ("/v1/chat/completions", {"tools": [loose_tool("yes")]}, "tools[0].function.strict", "boolean"),
])
def test_schemas_strict_mode_cannot_honour_are_400s_naming_the_field(served, path, extra, param, words):
    async def scenario():
        async with http_server(served) as url, aiohttp.ClientSession(url) as session:
            body = {"model": MODEL, "max_tokens": 4, **extra}
            body.update({"messages": CHAT} if "chat" in path else {"prompt": "x"})
            return await post(session, path, body)

    status, body = asyncio.run(scenario())
    assert status == 400 and body["error"]["param"] == param and words in body["error"]["message"], body
    assert served.num_live_requests == 0 and served.num_free_blocks == served.num_total_blocks


def test_without_strict_the_same_schemas_are_served_as_before(served):
    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            loose = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, seed=1,
                                                         response_format=json_schema(LOOSE, False))
            tool = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, seed=2,
                                                        tools=[loose_tool(False)], tool_choice="required")
            empty = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=40, seed=3, tools=[PING],
                tool_choice={"type": "function", "function": {"name": "ping"}})
            return loose, tool, empty

    loose, tool, empty = asyncio.run(scenario())
    if loose.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(loose.choices[0].message.content), LOOSE)
    assert tool.choices[0].finish_reason in ("tool_calls", "length")
    call = empty.choices[0].message.tool_calls[0]  # a strict tool without parameters takes none
    assert empty.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {}


def accumulated(chunks) -> tuple[dict[int, dict], list, list]:
    """Each call's {"id", "name", "arguments"} accumulated from the streamed deltas of choice 0, the tool-call
    deltas in order, and the choice's deltas."""
    deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
    pieces = [piece for delta in deltas for piece in (delta.delta.tool_calls or ())]
    calls: dict[int, dict] = {}
    for piece in pieces:
        if piece.id is not None:
            assert piece.index not in calls and piece.type == "function" and piece.function.arguments == ""
            calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
        else:
            assert piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments
    return calls, pieces, deltas


def test_forced_tool_calls_stream_their_header_then_argument_fragments_then_the_finish(served):
    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            streams = []
            for seed, extra in enumerate([{"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                                          {"tool_choice": "required"},
                                          {"tool_choice": "required", "parallel_tool_calls": False}]):
                stream = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=160, seed=seed,
                                                              tools=[WEATHER, CLOCK], stream=True, **extra)
                streams.append([chunk async for chunk in stream])
            return streams

    for number, chunks in enumerate(asyncio.run(scenario())):
        calls, pieces, deltas = accumulated(chunks)
        assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == "tool_calls", deltas[-1]
        assert deltas[-1].delta.tool_calls is None and deltas[-1].delta.content is None
        assert pieces[0].id is not None and pieces[0].id.startswith("call_")
        assert sum(piece.id is None for piece in pieces) > 1  # the arguments come in fragments
        if number == 0:
            assert [call["name"] for call in calls.values()] == ["get_weather"]
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
        assert len(calls) >= 1 and (number != 2 or len(calls) == 1)


def test_a_streamed_call_cut_by_max_tokens_ends_with_length(served):
    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=3, seed=1, tools=[WEATHER], stream=True,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            return [chunk async for chunk in stream]

    calls, pieces, deltas = accumulated(asyncio.run(scenario()))
    assert deltas[-1].finish_reason == "length" and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"].startswith("{")
