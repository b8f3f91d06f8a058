"""Large inputs prepared without long GIL holds (issue 32): a large JSON body's long arrays of scalars are parsed a
slice at a time (cluster/api/json_runs.py) with the very result json.loads gives, invalid bodies still refused;
/tokenize of a large text is tokenized in a child process (cluster/api/tokenize_process.py) with the very ids the
tokenizer gives, and a child that dies is replaced."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import pytest

from cluster.api import json_runs
from cluster.api.json_body import load_json_object
from cluster.api.tokenize_process import TokenizerProcess
from cluster.api.utility_routes import IN_PROCESS_CHARS
from engine import LLM
from tests.support.http_rig import KV_BYTES, http_client, post


def strict_loads(text: bytes):
    return json.loads(text.decode("utf-8"))


def test_a_body_of_a_million_ids_is_parsed_in_slices_to_what_json_loads_gives():
    rng = random.Random(0)
    body = {"model": "m", "prompt": [rng.randrange(50_000) for _ in range(1_000_000)], "nested": [[1.5, True, None],
            [rng.randrange(-99, 99) for _ in range(100_000)], "s[1,2]\\\"", {"k": list(range(30_000))}]}
    raw = json.dumps(body).encode()
    sizes = []

    def spy(text: bytes):
        sizes.append(len(text))
        return strict_loads(text)

    assert json_runs.loads_in_slices(raw, spy) == body == load_json_object(raw)
    assert len(sizes) > 50 and max(sizes) < 2 * json_runs.SLICE_BYTES  # no call parses more than about a slice


def scalars(rng: random.Random, depth: int = 0):
    """A random JSON value rich in arrays of scalars, with strings that look like them."""
    roll = rng.random()
    if depth > 3 or roll < 0.3:
        return rng.choice([rng.randrange(-10 ** 6, 10 ** 6), rng.random() * 1e5, True, False, None])
    if roll < 0.45:
        return rng.choice(["a", 'q"[1,2,3,4,5,6,7]\\', "\\\\", "x, 1, 2, 3, 4, 5", "\u00e9[1,2,3,4,5,6,7,8,9]"])
    if roll < 0.75:
        return [scalars(rng, depth + 1) for _ in range(rng.randrange(0, 12))]
    return {rng.choice(["k", "[1,2,3,4,5,6,7,8]", 'z\\"']) + str(i): scalars(rng, depth + 1)
            for i in range(rng.randrange(0, 5))}


def outcome(loads, text: bytes):
    try:
        return loads(text)
    except ValueError:
        return "invalid"


def test_any_text_parses_to_what_json_loads_gives_and_invalid_ones_are_refused(monkeypatch):
    """Tiny thresholds make every array of 8 scalars a run; each text is checked as is and with a byte changed."""
    monkeypatch.setattr(json_runs, "LARGE_TEXT_BYTES", 0)
    monkeypatch.setattr(json_runs, "RUN_BYTES", 8)
    monkeypatch.setattr(json_runs, "_RUN", b"\x01" * 8)
    monkeypatch.setattr(json_runs, "SLICE_BYTES", 5)
    rng, with_runs = random.Random(1), 0
    for _ in range(800):
        separators = rng.choice([(",", ":"), (", ", ": "), (" ,\n", " : ")])
        text = json.dumps({"x": scalars(rng)}, separators=separators, ensure_ascii=rng.random() < 0.5).encode()
        with_runs += bool(json_runs._element_runs(text))
        assert json_runs.loads_in_slices(text, strict_loads) == strict_loads(text), text
        position = rng.randrange(len(text))
        changed = text[:position] + rng.choice([b",", b"", b",,", b" ", b"]", b"[", b"1"]) + text[position + 1:]
        assert outcome(lambda t: json_runs.loads_in_slices(t, strict_loads), changed) == \
            outcome(strict_loads, changed), changed
    assert with_runs > 150


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


def test_the_tokenizer_process_gives_the_tokenizers_ids_and_replaces_a_child_that_died(llama):
    native = llama.tokenizer.native
    process = TokenizerProcess(native.to_str())
    try:
        text = "Hello, w\u00f6rld! " * 5000
        for add_special in (True, False):
            count, payload = process.ids_json(text, add_special)
            ids = native.encode(text, add_special_tokens=add_special).ids
            assert json.loads(payload) == ids and count == len(ids)
        dead = process._child
        os.kill(dead.pid, signal.SIGKILL)  # the child this test started
        dead.wait()
        assert process.ids_json("abc", False) == (len(native.encode("abc", add_special_tokens=False).ids),
                                                  json.dumps(native.encode("abc", add_special_tokens=False).ids,
                                                             separators=(",", ":")).encode())
        assert process._child is not dead
    finally:
        process.close()
    with pytest.raises(RuntimeError, match="closed"):
        process.ids_json("abc", True)


def test_tokenize_of_a_large_text_or_chat_answers_the_ids_the_tokenizer_gives(llama):
    text = "many words, " * (IN_PROCESS_CHARS // 10)
    chat = [{"role": "user", "content": text}]

    async def scenario():
        async with http_client(llama, max_body_bytes=4 << 20) as session:
            prompt = await post(session, "/tokenize", {"prompt": text})
            messages = await post(session, "/tokenize", {"messages": chat})
            return prompt, messages

    (status, prompt), (chat_status, messages) = asyncio.run(scenario())
    ids = llama.tokenizer.encode(text)
    assert status == 200 and prompt["tokens"] == ids and prompt["count"] == len(ids) and prompt["token_strs"] is None
    rendered = llama.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert chat_status == 200 and messages["tokens"] == llama.tokenizer.encode(rendered, add_special_tokens=False)


def test_a_body_of_too_many_strings_is_refused_before_parsing_and_escaped_quotes_do_not_count():
    """Strings cannot be parsed in slices: a body holding more than MAX_JSON_STRINGS is refused from a count of its
    raw quotes, before json.loads could hold the GIL for it; quotes escaped inside one long prompt are not strings."""
    from cluster.api.json_body import MAX_JSON_STRINGS
    many = json.dumps({"model": "m", "prompt": ["ab"] * (MAX_JSON_STRINGS + 1)}).encode()
    with pytest.raises(ValueError, match="strings"):
        load_json_object(many)
    quoted = {"model": "m", "prompt": 'say "hi" ' * (MAX_JSON_STRINGS * 2)}  # 4x the bound of escaped quotes
    assert load_json_object(json.dumps(quoted).encode()) == quoted
    batch = {"model": "m", "prompt": ["ab"] * (MAX_JSON_STRINGS - 10)}
    assert load_json_object(json.dumps(batch).encode()) == batch
