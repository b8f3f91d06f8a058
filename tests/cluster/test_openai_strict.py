"""OpenAI's strict mode rules (cluster/api/openai_strict.py) and the reader that streams "required" tool calls
(cluster/api/openai_tool_stream.py CallsReader), without a server."""
from __future__ import annotations

import json
from typing import Literal, Optional

import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from cluster.api.openai_strict import check_strict_schema
from cluster.api.openai_tool_stream import CallsReader


class Inner(BaseModel):
    a: int = Field(ge=0, le=9)


class Outer(BaseModel):
    name: str = Field(min_length=1, max_length=6)
    kind: Literal["cat", "dog"]
    inner: Optional[Inner]
    tags: list[Inner] = Field(max_length=3)


def strict_object(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def test_schemas_the_sdk_makes_strict_and_hand_written_strict_ones_pass():
    check_strict_schema(to_strict_json_schema(Outer))
    check_strict_schema(strict_object(a={"type": ["string", "null"], "format": "date"},
                                      b={"type": "array", "items": strict_object(c={"enum": [1, 2]}), "maxItems": 2}))
    check_strict_schema({"type": "object", "properties": {}, "additionalProperties": False})


@pytest.mark.parametrize("schema, words", [
    ({"anyOf": [strict_object(a={"type": "string"})]}, "root of a strict schema"),
    ({"type": "string"}, "root of a strict schema"),
    ([], "JSON schema object"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
     "In context=(), 'additionalProperties' is required to be supplied and to be false"),
    ({**strict_object(a={"type": "string"}, b={"type": "integer"}), "required": ["a"]}, "Missing 'b'"),
    ({**strict_object(a={"type": "string"}), "required": None}, "Missing 'a'"),
    (strict_object(a={"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}),
     "In context=('properties', 'a'), 'additionalProperties'"),
    (strict_object(a={"type": "array", "items": {"type": "object", "properties": {"x": {"type": "string"}},
                                                 "additionalProperties": False}}),
     "In context=('properties', 'a', 'items'), 'required'"),
    ({**strict_object(a={"$ref": "#/$defs/D"}), "$defs": {"D": {"type": "object", "properties": {}}}},
     "In context=('$defs', 'D'), 'additionalProperties'"),
    (strict_object(a={"anyOf": [{"type": "string"}, {"allOf": [{"type": "string"}]}]}),
     "In context=('properties', 'a', 'anyOf', 1), 'allOf' is not permitted"),
    (strict_object(a={"type": "array", "uniqueItems": True}), "'uniqueItems' is not permitted"),
    (strict_object(a={"type": "object", "patternProperties": {}, "additionalProperties": False}),
     "'patternProperties' is not permitted"),
    (strict_object(a={"type": "string", "format": "uri"}), "format \"uri\" is not supported"),
    (strict_object(a=[1]), "a schema must be an object"),
])
def test_schemas_strict_mode_cannot_honour_raise_naming_the_rule_and_where(schema, words):
    with pytest.raises(ValueError) as error:
        check_strict_schema(schema)
    assert words in str(error.value)


CALLS = [{"name": "get_weather", "parameters": {"city": "P\"a]r}\\", "unit": "C"}},
         {"name": "get_time", "parameters": {"zone": -3, "list": [{"a": None}]}}]


def read_calls(pieces) -> tuple[list[tuple], dict[int, tuple[str, str]]]:
    """All events of feeding `pieces`, and each call's (name, arguments text) from them."""
    reader, events, calls = CallsReader(), [], {}
    for piece in pieces:
        events += reader.feed(piece)
    for kind, call, value in events:
        if kind == "name":
            assert call not in calls, events
            calls[call] = (value, "")
        else:
            calls[call] = (calls[call][0], calls[call][1] + value)
    return events, calls


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_the_calls_reader_streams_each_call_name_first_then_its_parameters_in_fragments(step):
    text = json.dumps(CALLS, separators=(",", ":"))
    events, calls = read_calls([text[i:i + step] for i in range(0, len(text), step)])
    assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == \
        [(call["name"], call["parameters"]) for call in CALLS]
    assert events[0] == ("name", 0, "get_weather")
    if step == 1:  # one event per piece of the parameters' text: streamed as generated
        assert sum(kind == "arguments" for kind, _, _ in events) > 20


def test_the_calls_reader_takes_any_layout_and_holds_parameters_read_before_the_name():
    events, calls = read_calls(['  [ { "parameters" : {"a": [1, ', '2]} , "na', 'me" : "f\\u00e9" } ]'])
    assert events[0] == ("name", 0, "f\u00e9") and calls == {0: ("f\u00e9", ' {"a": [1, 2]} ')}
