"""Forced tool calls on /v1/chat/completions: `tool_choice` "required" or a named function constrains the output
to a call (structured outputs) and answers it as OpenAI's `tool_calls` with `finish_reason: "tool_calls"`
(openai_tool_stream.py shapes the answer, whole and streamed).

A named function: the output is the function's `arguments`, a JSON object following its `parameters` schema
(an object when it has none; `{}` for a strict function without parameters). "required": the output is a JSON
array of {"name", "parameters"} calls, each name one of the tools' and its parameters following that tool's
schema (vLLM's shape), at least one call and, with `parallel_tool_calls: false`, exactly one. A tool's
`function.strict` true holds its parameters to OpenAI's strict mode (openai_strict.py: checked for every tool,
whatever the tool_choice; 400 naming tools[i].function.parameters). A choice cut by max_tokens cannot be read as
calls: it is answered as plain content with its finish_reason ("length").
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from cluster.api.openai_fields import bad_request
from cluster.api.openai_strict import check_strict_schema, empty_parameters
from engine.structured import check_spec
from engine.structured_params import StructuredOutputsParams


@dataclass(frozen=True)
class ToolForcing:
    """How a request forces tool calls: `name` for a named function, None for "required"."""

    name: str | None


def forced_tools(body: dict) -> tuple[ToolForcing, StructuredOutputsParams] | None:
    """The forcing and the output's spec when `tool_choice` forces a call (None for none / auto / absent);
    400 naming tool_choice for a choice without tools or naming a tool the request does not have, and naming
    tools[i].function.parameters for a strict tool whose parameters strict mode cannot honour (whatever the
    tool_choice, as OpenAI checks them)."""
    choice, tools = body.get("tool_choice"), body.get("tools") or []
    functions = _functions(tools)
    if choice is None or choice in ("none", "auto"):
        return None
    if not functions:
        raise bad_request(f"tool_choice={json.dumps(choice)} needs tools", param="tool_choice")
    if choice == "required":
        single = body.get("parallel_tool_calls") is False
        return ToolForcing(None), _checked(_calls_schema(functions, single))
    name = choice["function"]["name"]
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, which is not one of the tools ({', '.join(functions)})",
                          param="tool_choice")
    return ToolForcing(name), _checked(functions[name]["parameters"])


def _checked(schema: dict) -> StructuredOutputsParams:
    """The spec of a call's schema; 400 naming `tools` when a tool's parameters are not a usable schema."""
    try:
        spec = StructuredOutputsParams(json=schema)
        check_spec(spec)
    except ValueError as error:
        raise bad_request(f"a tool's parameters cannot constrain its call: {error}", param="tools") from error
    return spec


def _functions(tools: list) -> dict[str, dict]:
    """Each tool's function by name (openai_chat checked their shape), `parameters` replaced by the schema its
    arguments follow; a strict one's checked (openai_strict.py)."""
    functions = {}
    for index, tool in enumerate(tools):
        function = tool["function"]
        strict, parameters = function.get("strict"), function.get("parameters")
        where = f"tools[{index}].function"
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"{where}.strict must be a boolean", code="invalid_type", param=f"{where}.strict")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema object", code="invalid_type",
                              param=f"{where}.parameters")
        if strict and parameters is None:
            parameters = empty_parameters()
        elif strict:
            try:
                check_strict_schema(parameters)
            except ValueError as error:
                raise bad_request(f"Invalid schema for function {json.dumps(function['name'])}: {error}",
                                  param=f"{where}.parameters") from error
        functions[function["name"]] = {**function, "parameters": parameters or {"type": "object"}}
    return functions


def _calls_schema(functions: dict, single: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "parameters": function["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, function in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return {**schema, "maxItems": 1} if single else schema


def tool_calls(text: str, forcing: ToolForcing) -> list[dict] | None:
    """OpenAI's tool_calls of a finished output, None when the text is not a complete call (cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    pairs = [(forcing.name, value)] if forcing.name is not None else \
        [(call["name"], call["parameters"]) for call in value]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in pairs]
