"""Forced tool calls answered as OpenAI answers them, whole and streamed (ToolCallShape).

Whole: `message.tool_calls` (content null) and `finish_reason: "tool_calls"`. Streamed, as OpenAI streams a call:
a delta carrying the call's `index`, `id`, `type` and `function.name` with empty `arguments`, then deltas of
`function.arguments` fragments as they are generated, then a last chunk with an empty delta and
`finish_reason: "tool_calls"`. A named function's header is in the choice's first chunk (with the role); with
"required" (the output a JSON array of {"name", "parameters"}, openai_tools.py) each call's header goes out once
its name is read and its `parameters` text follows as its arguments (CallsReader); the chunks of the text around
them (`[{"name": ...`) carry an empty delta (with their token_ids and logprobs when asked). A choice cut by max_tokens
ends with its finish_reason ("length") after the fragments sent: whole, it is answered as plain content.
"""
from __future__ import annotations

import dataclasses
import json
import uuid

from cluster.api.openai_responses import ChatShape
from cluster.api.openai_tools import ToolForcing, tool_calls
from cluster.backend import GenerationChunk


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallsReader:
    """Reads a "required" output ([{"name": ..., "parameters": ...}, ...]) as its text grows. `feed(text)` returns
    what the new text completes: ("name", call, name) once a call's name is read, ("arguments", call, fragment)
    for the text of its parameters (held until its name is read). Any JSON layout and key order is read."""

    def __init__(self) -> None:
        self._stack: list[str] = []       # the open arrays and objects
        self._in_string = self._escaped = False
        self._key: str | None = None      # the call object's member whose value comes next (None: a key comes)
        self._chars: list[str] | None = None   # a string of the call object being read (a key, the name)
        self._arguments: list[str] | None = None  # the parameters' text being read
        self._call = -1
        self._named = False
        self._held: list[str] = []        # parameters' text read before the call's name

    def feed(self, text: str) -> list[tuple]:
        """The events completed by `text`, the output's next characters (see the class docstring)."""
        events: list[tuple] = []
        for char in text:
            self._read(char, events)
        if self._arguments:
            self._emit_arguments("".join(self._arguments), events)
            self._arguments.clear()
        return events

    def _read(self, char: str, events: list) -> None:
        depth = len(self._stack)
        if self._arguments is not None and not self._in_string and depth == 2 and char in ",}":
            self._emit_arguments("".join(self._arguments), events)
            self._arguments, self._key = None, None
        if self._arguments is not None:
            self._arguments.append(char)
        elif depth == 2 and self._in_string and self._chars is not None:
            if char == '"' and not self._escaped:
                self._string_read(events)
            else:
                self._chars.append(char)
        elif depth == 2 and not self._in_string:
            self._member(char)
        elif depth == 1 and char == "{" and not self._in_string:
            self._call, self._named, self._key, self._held = self._call + 1, False, None, []
        self._track(char)

    def _member(self, char: str) -> None:
        """A character of the call object outside strings and values read elsewhere."""
        if char == '"':
            self._chars = []
        elif char == ":" and self._key == "parameters":
            self._arguments = []
        elif char == ",":
            self._key = None

    def _string_read(self, events: list) -> None:
        text = json.loads('"' + "".join(self._chars) + '"')
        self._chars = None
        if self._key is None:
            self._key = text
        elif self._key == "name" and not self._named:
            self._named = True
            events.append(("name", self._call, text))
            if self._held:
                events.append(("arguments", self._call, "".join(self._held)))
                self._held = []

    def _emit_arguments(self, fragment: str, events: list) -> None:
        if not fragment:
            return
        if self._named:
            events.append(("arguments", self._call, fragment))
        else:
            self._held.append(fragment)

    def _track(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "[{":
            self._stack.append(char)
        elif char in "]}" and self._stack:
            self._stack.pop()


class ToolCallShape(ChatShape):
    """ChatShape whose choices are tool calls (see the module docstring); `forcing` says how they are forced."""

    def __init__(self, *args, forcing: ToolForcing, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forcing = forcing
        self._readers: dict[int, CallsReader] = {}
        self._outputs: dict[int, list[str]] = {}  # each streamed choice's text so far

    def _full_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        calls = tool_calls(text, self.forcing) if finish_reason == "stop" else None
        if calls is None:
            return super()._full_choice(index, text, finish_reason)
        return {"index": index, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "logprobs": None, "finish_reason": "tool_calls"}

    def stream_opening(self, num_choices: int) -> list[dict]:
        """Each choice's role, and a named function's call header."""
        openings = []
        for index in range(num_choices):
            delta = {"role": "assistant", "content": None}
            if self.forcing.name is not None:
                delta["tool_calls"] = [_header(0, self.forcing.name)]
            openings.append(self._envelope(self.chunk_object_name, [{"index": index, "delta": delta,
                                                                     "logprobs": None, "finish_reason": None}]))
        return openings

    def stream_objects(self, index: int, chunk: GenerationChunk, include_usage: bool, prompt: int = 0) -> list[dict]:
        """A choice's last chunk with text is sent as two: its fragments, then the empty delta that ends it."""
        if chunk.finish_reason is None or not (chunk.text or chunk.token_ids):
            return [self.stream_chunk(index, chunk, include_usage, prompt)]
        fragments = dataclasses.replace(chunk, finish_reason=None, timing=None)
        ending = GenerationChunk((), "", chunk.finish_reason, chunk.timing, () if chunk.logprobs is not None else None,
                                 chunk.index)
        return [self.stream_chunk(index, fragments, include_usage, prompt),
                self.stream_chunk(index, ending, include_usage, prompt)]

    def _delta_choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        output = self._outputs.setdefault(index, [])
        output.append(text)
        if self.forcing.name is not None:
            deltas = [_arguments(0, text)] if text else []
        else:
            reader = self._readers.setdefault(index, CallsReader())
            deltas = [_header(call, value) if kind == "name" else _arguments(call, value)
                      for kind, call, value in reader.feed(text)]
        if finish_reason == "stop" and tool_calls("".join(output), self.forcing) is not None:
            finish_reason = "tool_calls"
        if finish_reason is not None:
            self._readers.pop(index, None)
            self._outputs.pop(index, None)
        return {"index": index, "delta": {"tool_calls": deltas} if deltas else {}, "logprobs": None,
                "finish_reason": finish_reason}


def _header(call: int, name: str) -> dict:
    return {"index": call, "id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}


def _arguments(call: int, fragment: str) -> dict:
    return {"index": call, "function": {"arguments": fragment}}
