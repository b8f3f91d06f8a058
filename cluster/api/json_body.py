"""A request body as a JSON object, with a bound on nesting and only text UTF-8 can carry.

json.loads recurses once per level and raises RecursionError (not ValueError) when a body nests past the
interpreter's recursion limit, so a body nested 100k levels deep used to be a 500; and "\\ud800" is valid
JSON that decodes to a lone surrogate no tokenizer takes. Here every failure is a ValueError naming what
is wrong, and InvalidField (a ValueError) names the field when one string is at fault. The checks after
parsing cost nothing for ordinary bodies: the walk runs only when the raw bytes could hold too deep a
nesting (more openers than the bound) or a surrogate escape. A large body is parsed with no call holding the
GIL for long (json_runs.py: its long arrays of numbers in slices), so that parsing it on an InputPool thread
leaves the event loop answering. Strings are what json_runs cannot slice: a 5 MB body of 800k short strings holds
the GIL ~75 ms in one json.loads, so a body may hold at most MAX_JSON_STRINGS of them (counted from the raw bytes
before parsing: ~15 ms of json.loads at most), far more than any request the API takes needs.
"""
from __future__ import annotations

import json
import re

from cluster.api.json_runs import loads_in_slices
from cluster.api.request_validation import check_text

MAX_JSON_DEPTH = 64  # levels of objects and arrays; OpenAI requests (tool schemas included) nest far less
MAX_JSON_STRINGS = 131_072  # strings (keys included) in one body: 32k chat messages, or a prompt batch of 100k
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def load_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """The body as a dict; ValueError for anything else (invalid UTF-8, invalid JSON, NaN or Infinity,
    not an object, nested deeper than max_depth, more than MAX_JSON_STRINGS strings), InvalidField for a string
    with a lone surrogate."""
    strings = (raw.count(b'"') - raw.count(b'\\"')) // 2  # unescaped quotes: two per string, before parsing
    if strings > MAX_JSON_STRINGS:
        raise ValueError(f"the request body holds {strings} strings (at most {MAX_JSON_STRINGS})")
    try:
        body = loads_in_slices(raw, _loads)
    except RecursionError:
        raise ValueError(f"the request body nests deeper than {max_depth} levels") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"the request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    deep = raw.count(b"{") + raw.count(b"[") > max_depth
    if deep or _SURROGATE_ESCAPE.search(raw):
        _walk(body, (), 1, max_depth)
    return body


def _loads(text: bytes):
    return json.loads(text.decode("utf-8"), parse_constant=_reject_constant)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _walk(value, path: tuple, depth: int, max_depth: int) -> None:
    """Checks the nesting and every string (keys included) under `value`, at `depth`."""
    if depth > max_depth:
        raise ValueError(f"the request body nests deeper than {max_depth} levels")
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(key, str):
            check_text(key, f"a key of {_field(path)}")
        if isinstance(item, str):
            check_text(item, _field((*path, key)))
        elif isinstance(item, (dict, list)):
            _walk(item, (*path, key), depth + 1, max_depth)


def _field(path: tuple) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text or "the request body"
