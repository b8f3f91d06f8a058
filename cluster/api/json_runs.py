"""Parsing a large JSON text without holding the GIL for long: its long arrays of scalars are parsed in slices.

json.loads is one C call: on a 4 MiB body of token ids (a million of them) it holds the GIL for ~100 ms, and every
other thread, the event loop answering the probes included, waits that long. A text over LARGE_TEXT_BYTES is
parsed here instead. Each run of array elements that are numbers, true, false or null, RUN_BYTES long or more,
is found with bytes operations (a few milliseconds each on 4 MiB), outside strings; it is cut out of the text and
a marker string (a random nonce: no client can write it) put in its place; the rest, short now, is parsed with
json.loads; each run is parsed by slices of about SLICE_BYTES (~1 ms each), the GIL offered to other threads
between slices, and its elements take the marker's place in its array. The result equals json.loads's for every
valid text; an invalid one raises ValueError (json.JSONDecodeError), as json.loads does.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

LARGE_TEXT_BYTES = 256 * 1024  # smaller texts take one json.loads (~6 ms at most)
RUN_BYTES = 32 * 1024
SLICE_BYTES = 64 * 1024
_RUN_CHARS = b"0123456789+-.eE,truefalsn \t\r\n"
_CLASSES = bytes(1 if byte in _RUN_CHARS else 0 for byte in range(256))
_RUN = b"\x01" * RUN_BYTES


def loads_in_slices(raw: bytes, loads: Callable[[bytes], object]) -> object:
    """The value of the JSON text `raw` (UTF-8), as `loads` (json.loads with the caller's options) parses it,
    with no call holding the GIL for more than a few milliseconds (see the module docstring)."""
    if len(raw) <= LARGE_TEXT_BYTES:
        return loads(raw)
    spans = _element_runs(raw)
    if not spans:
        return loads(raw)
    nonce = uuid.uuid4().hex
    parts, start, runs = [], 0, {}
    for index, (first, end) in enumerate(spans):
        marker = f"tandem-run-{nonce}-{index}"
        parts += [raw[start:first], b'"', marker.encode(), b'"']
        runs[marker], start = (first, end), end
    parts.append(raw[start:])
    value = loads(b"".join(parts))
    elements = {marker: _elements(raw, first, end, loads) for marker, (first, end) in runs.items()}
    _splice(value, elements)  # a marker not found was under a key given again later: dropped, as json.loads does
    return value


def _element_runs(raw: bytes) -> list[tuple[int, int]]:
    """(first, end) of each long run of scalar array elements outside strings: raw[first:end] is a list of
    elements (commas between, none before or after), preceded in raw by '[' or ',' and followed by ']' or ','."""
    classes = raw.translate(_CLASSES)
    time.sleep(0)
    quotes = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")  # the quotes left delimit strings
    spans, position, parity_at, parity = [], 0, 0, 0
    while True:
        found = classes.find(_RUN, position)
        if found < 0:
            return spans
        start = classes.rfind(b"\x00", 0, found) + 1
        end = classes.find(b"\x00", found)
        end = len(raw) if end < 0 else end
        parity = (parity + quotes.count(b'"', parity_at, start)) % 2
        parity_at, position = start, end
        time.sleep(0)
        if parity == 0:  # outside a string
            span = _elements_span(raw, start, end)
            if span is not None:
                spans.append(span)


def _elements_span(raw: bytes, start: int, end: int) -> tuple[int, int] | None:
    """The part of the run raw[start:end] that is whole elements of one array, None when there is none."""
    if start == 0 or end == len(raw):
        return None
    first = start if raw[start - 1] == ord("[") else raw.find(b",", start, end) + 1
    if first == 0:
        return None
    last = end if raw[end] == ord("]") else raw.rfind(b",", first, end)
    return (first, last) if last - first >= RUN_BYTES // 2 else None


def _elements(raw: bytes, first: int, end: int, loads) -> list:
    """The elements of raw[first:end], parsed a slice at a time, the GIL offered between slices."""
    elements, position = [], first
    bracketed = raw[first - 1] == ord("[") and raw[end] == ord("]")  # may be empty: "[ ]"
    while True:
        cut = raw.find(b",", min(position + SLICE_BYTES, end), end)
        cut = end if cut < 0 else cut
        piece = raw[position:cut]
        if not piece.strip() and not (bracketed and position == first and cut == end):
            raise json.JSONDecodeError("Expecting value", raw.decode("utf-8", "replace"), position)
        elements.extend(loads(b"[" + piece + b"]"))
        time.sleep(0)
        if cut == end:
            return elements
        position = cut + 1


def _splice(value, elements: dict[str, list]) -> None:
    """Replaces each marker in the arrays under `value` by its elements, removing it from `elements`."""
    stack = [value]
    while stack and elements:
        node = stack.pop()
        items = node.values() if isinstance(node, dict) else node
        stack.extend(item for item in items if isinstance(item, (dict, list)))  # before the elements come in
        if isinstance(node, list):
            places = [index for index, item in enumerate(node) if isinstance(item, str) and item in elements]
            for index in reversed(places):
                node[index:index + 1] = elements.pop(node[index])
