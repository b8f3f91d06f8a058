"""Forced tool calls on /v1/chat/completions: `tool_choice` "required" or a named function constrains the output
to a call (structured outputs) and answers it as OpenAI's `tool_calls` with `finish_reason: "tool_calls"`.

A named function: the output is the function's `arguments`, a JSON object following its `parameters` schema
(an object when it has none). "required": the output is a JSON array of {"name", "parameters"} calls, each name
one of the tools' and its parameters following that tool's schema (vLLM's shape), at least one call and, with
`parallel_tool_calls: false`, exactly one. A choice cut by max_tokens cannot be read as calls: it is answered as
plain content with its finish_reason ("length").
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from cluster.api.openai_fields import bad_request
from cluster.api.openai_responses import ChatShape
from engine.structured import check_spec
from engine.structured_params import StructuredOutputsParams


@dataclass(frozen=True)
class ToolForcing:
    """How a request forces tool calls: `name` for a named function, None for "required"."""

    name: str | None


def forced_tools(body: dict) -> tuple[ToolForcing, StructuredOutputsParams] | None:
    """The forcing and the output's spec when `tool_choice` forces a call (None for none / auto / absent);
    400 naming tool_choice for a choice without tools or naming a tool the request does not have."""
    choice, tools = body.get("tool_choice"), body.get("tools") or []
    if choice is None or choice in ("none", "auto"):
        return None
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}  # openai_chat checked their shape
    if not functions:
        raise bad_request(f"tool_choice={json.dumps(choice)} needs tools", param="tool_choice")
    if choice == "required":
        single = body.get("parallel_tool_calls") is False
        return ToolForcing(None), _checked(_calls_schema(functions, single))
    name = choice["function"]["name"]
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, which is not one of the tools ({', '.join(functions)})",
                          param="tool_choice")
    return ToolForcing(name), _checked(_parameters(functions[name]))


def _checked(schema: dict) -> StructuredOutputsParams:
    """The spec of a call's schema; 400 naming `tools` when a tool's parameters are not a usable schema."""
    try:
        spec = StructuredOutputsParams(json=schema)
        check_spec(spec)
    except ValueError as error:
        raise bad_request(f"a tool's parameters cannot constrain its call: {error}", param="tools") from error
    return spec


def _parameters(function: dict) -> dict:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


def _calls_schema(functions: dict, single: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                               "parameters": _parameters(function)},
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


class ToolCallShape(ChatShape):
    """ChatShape whose choices are tool calls: whole, `message.tool_calls` (content null); streamed, empty deltas
    until a choice ends, then one delta with all its calls. Set `forcing` before use."""

    forcing: ToolForcing = ToolForcing(None)

    def _full_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        calls = tool_calls(text, self.forcing) if finish_reason == "stop" else None
        if calls is None:
            return super()._full_choice(index, text, finish_reason)
        return {"index": index, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "logprobs": None, "finish_reason": "tool_calls"}

    def _delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        buffers = self.__dict__.setdefault("_buffers", {})
        buffers[index] = buffers.get(index, "") + text
        if finish_reason is None:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": None}
        whole = buffers.pop(index)
        calls = tool_calls(whole, self.forcing) if finish_reason == "stop" else None
        if calls is None:
            return super()._delta_choice(index, whole, finish_reason)
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        return {"index": index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": "tool_calls"}
