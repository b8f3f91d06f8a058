"""Structured outputs through the HTTP front end and the official `openai` SDK: response_format (json_object,
json_schema, and `parse` with a pydantic model), vLLM's structured_outputs and guided_* extras, streamed too,
on the tiny random-weight Llama checkpoint, whose output must still parse, validate and match; bad specs are
400s naming the field, and the engine is left with nothing allocated."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import aiohttp
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine import LLM
from tests.support.http_rig import CHAT, KV_BYTES, MODEL, http_server, openai_client, post, stream_events

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 8},
    "rooms": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1, "maxItems": 3},
    "open": {"type": "boolean"}},
    "required": ["city", "rooms", "open"], "additionalProperties": False}


class Pet(BaseModel):
    name: str = Field(min_length=1, max_length=6)
    legs: int = Field(ge=0, le=8)
    kind: Literal["cat", "dog", "bird"]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


def test_response_format_json_schema_json_object_and_parse_with_a_pydantic_model(served):
    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            schema = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=80, temperature=1.0, seed=3,
                response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA,
                                                                        "strict": True}})
            anything = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, seed=4,
                                                            response_format={"type": "json_object"})
            parsed = await client.chat.completions.parse(model=MODEL, messages=CHAT, max_tokens=80, temperature=0.8,
                                                         seed=5, n=2, response_format=Pet)
            return schema, anything, parsed

    schema, anything, parsed = asyncio.run(scenario())
    jsonschema.validate(json.loads(schema.choices[0].message.content), SCHEMA)
    assert schema.choices[0].finish_reason == "stop"
    if anything.choices[0].finish_reason == "stop":  # an open object may run to max_tokens; if not, it parses
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.startswith("{")
    assert len(parsed.choices) == 2
    for choice in parsed.choices:
        assert isinstance(choice.message.parsed, Pet)
        assert choice.message.parsed == Pet.model_validate_json(choice.message.content)


def test_structured_outputs_and_guided_extras_on_completions_and_chat_streamed_too(served):
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            answers = [await client.completions.create(model=MODEL, prompt="Code:", max_tokens=100, temperature=1.0,
                                                       seed=seed, extra_body=extra)
                       for seed, extra in enumerate([{"structured_outputs": {"regex": regex}},
                                                     {"guided_regex": regex},
                                                     {"structured_outputs": {"choice": ["alpha", "beta"]}},
                                                     {"guided_choice": ["up", "down"]},
                                                     {"guided_json": SCHEMA},
                                                     {"guided_grammar": 'root ::= "x" ("," "x")*'}])]
            chat = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, seed=9,
                                                        extra_body={"structured_outputs": {"json": SCHEMA}})
            async with aiohttp.ClientSession(url) as session:
                events = await stream_events(session, "/v1/completions", {
                    "model": MODEL, "prompt": "Stream:", "max_tokens": 60, "seed": 2, "stream": True,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}})
            return answers, chat, events

    answers, chat, events = asyncio.run(scenario())
    texts = [a.choices[0].text for a in answers]
    assert all(a.choices[0].finish_reason == "stop" for a in answers), texts
    assert re.fullmatch(regex, texts[0]) and re.fullmatch(regex, texts[1])
    assert texts[2] in ("alpha", "beta") and texts[3] in ("up", "down")
    jsonschema.validate(json.loads(texts[4]), SCHEMA)
    assert re.fullmatch(r"x(,x)*", texts[5])
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    jsonschema.validate(json.loads("".join(e["choices"][0]["text"] for e in events if e["choices"])), SCHEMA)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "json schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"dependentSchemas": {}}}}},
     "response_format.json_schema.schema", "dependentSchemas"),
    ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar", "grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml", "not supported"),
    ({"guided_choice": []}, "guided_choice", "empty"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "[0-9]+", "response_format": {"type": "json_object"}}, "response_format", "combined"),
    ({"guided_regex": "[0-9]+", "min_tokens": 2}, "min_tokens", "min_tokens"),
])
def test_bad_specs_are_400s_naming_the_field_before_anything_runs(served, extra, param, words):
    async def scenario():
        async with http_server(served) as url, aiohttp.ClientSession(url) as session:
            chat = await post(session, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                                **extra})
            completion = await post(session, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                                                                 **extra})
            return chat, completion

    for status, body in asyncio.run(scenario()):
        assert status == 400, body
        assert body["error"]["param"] == param and words in body["error"]["message"], body
    assert served.num_live_requests == 0 and served.num_free_blocks == served.num_total_blocks


def test_the_sdk_raises_bad_request_for_a_bad_schema(served):
    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, response_format={
                    "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}})
            return error.value

    error = asyncio.run(scenario())
    assert error.status_code == 400 and "nowhere" in error.message


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}


def test_tool_choice_named_and_required_answer_validated_tool_calls_whole_and_streamed(served):
    async def scenario():
        async with http_server(served) as url, openai_client(url) as client:
            named = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=80, seed=1, tools=[WEATHER, CLOCK],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            required = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=120, seed=2, tools=[WEATHER, CLOCK], tool_choice="required",
                parallel_tool_calls=False)
            stream = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=120, seed=3, tools=[WEATHER, CLOCK], tool_choice="required",
                parallel_tool_calls=False, stream=True)
            streamed = [chunk async for chunk in stream]
            return named, required, streamed

    named, required, streamed = asyncio.run(scenario())
    for response in (named, required):
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
    call = named.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])
    call = required.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    deltas = [c.choices[0] for c in streamed if c.choices]
    assert deltas[-1].finish_reason == "tool_calls"
    header, *fragments = [t for d in deltas for t in (d.delta.tool_calls or ())]  # streamed as OpenAI does
    arguments = "".join(fragment.function.arguments for fragment in fragments)
    jsonschema.validate(json.loads(arguments), PARAMETERS[header.function.name])


@pytest.mark.parametrize("extra, words", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "not one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "not supported"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strin"}}}}}], "tool_choice": "required"}, "parameters"),
])
def test_bad_tool_choices_and_tools_are_400s_naming_the_field(served, extra, words):
    async def scenario():
        async with http_server(served) as url, aiohttp.ClientSession(url) as session:
            return await post(session, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                                **extra})

    status, body = asyncio.run(scenario())
    param = "tools" if words == "parameters" else "tool_choice"
    assert status == 400 and body["error"]["param"] == param and words in body["error"]["message"], body
