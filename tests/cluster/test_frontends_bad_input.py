"""Hostile and malformed input gets 400 / INVALID_ARGUMENT naming the field, never a 500, and the server
keeps serving: every bad request here is followed by one that succeeds. Lone surrogates, text the tokenizer
cannot take, JSON nested 100k levels deep, unknown chat roles, too many chat messages, sampling values past the
server's bounds (infinities, int64, stop strings and ids, logit_bias keys), the /tokenize and /detokenize fields,
and over gRPC strings that are not UTF-8 and token ids outside the vocabulary."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from cluster.api.grpc_server import GrpcServerConfig, start_grpc_server
from cluster.api.grpc_wire import OFF_LOOP_MESSAGE_BYTES
from cluster.api.json_body import MAX_JSON_DEPTH, MAX_JSON_STRINGS
from cluster.api.openai_chat import MAX_CHAT_MESSAGES
from cluster.api.request_validation import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from cluster.api.request_validation import check_chat_roles
from engine import LLM
from proto import tandem_pb2, tandem_pb2_grpc
from tests.support.frontend_rig import local_backend, wait_until_idle
from tests.support.http_rig import CHAT, KV_BYTES, completion_body, http_client, post


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    """A Hugging Face tokenizer (the `tokenizers` library: a lone surrogate used to be a TypeError, 500)."""
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


@pytest.fixture(scope="module")
def chatml(tiny_checkpoint):
    """A ChatML template, which renders any role it is given."""
    return LLM(model=str(tiny_checkpoint("qwen2")), kv_cache_memory=KV_BYTES).engine


def deep(levels: int) -> bytes:
    return b'{"prompt": "x", "stop": ' + b"[" * levels + b"]" * levels + b"}"


# (path, raw body, expected status, expected param: the field named)
BAD_HTTP = [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["ok", "\\udfff"]}', 400, "stop[1]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', 400,
     "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     400, "messages[0].content[0].text"),
    ("/v1/completions", b'{"\\ud800": 1}', 400, "a key of the request body"),
    ("/v1/completions", deep(100_000), 400, None),
    ("/v1/completions", deep(MAX_JSON_DEPTH + 1), 400, None),
    ("/v1/completions", json.dumps({"prompt": ["ab"] * (MAX_JSON_STRINGS + 1)}).encode(), 400, None),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400,
     "messages[0].role"),
    ("/v1/chat/completions", json.dumps({"messages": [*CHAT, {"role": "", "content": "hi"}]}).encode(), 400,
     "messages[2].role"),
    ("/v1/chat/completions", json.dumps({"messages": CHAT[1:] * (MAX_CHAT_MESSAGES + 1)}).encode(), 400, "messages"),
    ("/tokenize", json.dumps({"messages": CHAT[1:] * (MAX_CHAT_MESSAGES + 1)}).encode(), 400, "messages"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),  # past the context
    ("/v1/completions", b'{"prompt": ["x", "y"], "max_tokens": 100000}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100000}',
     400, "max_completion_tokens"),
    ("/v1/completions", b'{"prompt": "x", "skip_special_tokens": "no"}', 400, "skip_special_tokens"),
    ("/v1/completions", b'{"prompt": "x", "include_stop_str_in_output": 1}', 400, "include_stop_str_in_output"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),  # JSON's 1e999 is inf
    ("/v1/completions", b'{"prompt": "x", "top_p": -1e999}', 400, "top_p"),
    ("/v1/completions", json.dumps({"prompt": "x", "top_k": 2 ** 31}).encode(), 400, "top_k"),
    ("/v1/completions", json.dumps({"prompt": "x", "seed": 2 ** 64}).encode(), 400, "seed"),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}).encode(), 400, "stop"),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": ["ok", "s" * 257]}).encode(), 400, "stop[1]"),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": "s" * 257}).encode(), 400, "stop"),
    ("/v1/chat/completions", json.dumps({"messages": CHAT, "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}
                                        ).encode(), 400, "stop_token_ids"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"100000": 5}}', 400, "logit_bias"),  # past the vocabulary
    *[("/v1/completions", json.dumps({"prompt": "x", "logit_bias": {key: 5}}).encode(), 400, "logit_bias")
      for key in ("\uff11\uff12", "+5", " 5", "5 ", "5_0", "-1", "0x5", "", "1" * 400)],  # only ASCII digits
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("/tokenize", deep(100_000).replace(b'"stop"', b'"messages"'), 400, None),
    ("/tokenize", b'{"prompt": "x", "messages": []}', 400, "prompt"),
    ("/tokenize", b"{}", 400, "prompt"),
    ("/tokenize", b'{"prompt": 12}', 400, "prompt"),
    ("/tokenize", b'{"prompt": "x", "add_special_tokens": "yes"}', 400, "add_special_tokens"),
    ("/tokenize", b'{"prompt": "x", "return_token_strs": true}', 400, "return_token_strs"),
    ("/tokenize", b'{"prompt": "x", "truncate": 3}', 400, "truncate"),
    ("/tokenize", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages[0].role"),
    ("/tokenize", b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
    ("/detokenize", b"{}", 400, "tokens"),
    ("/detokenize", b'{"tokens": "1 2"}', 400, "tokens"),
    ("/detokenize", b'{"tokens": [1, -1]}', 400, "tokens[1]"),
    ("/detokenize", b'{"tokens": [1, 100000]}', 400, "tokens[1]"),
    ("/detokenize", b'{"tokens": [true]}', 400, "tokens[0]"),
    ("/detokenize", b'{"tokens": [1.5]}', 400, "tokens[0]"),
]


def test_bad_http_input_names_the_field_and_the_next_request_succeeds(served):
    async def scenario():
        answers = []
        async with http_client(served, max_body_bytes=1 << 20) as session:
            for path, body, _, _ in BAD_HTTP:
                answers.append(await post(session, path, body))
                status, good = await post(session, "/v1/completions", completion_body("Still fine", 2))
                assert status == 200 and len(good["choices"][0]["token_ids"]) == 2, good
        return answers

    for (path, body, status, param), (got_status, answer) in zip(BAD_HTTP, asyncio.run(scenario())):
        assert got_status == status, (path, body[:80], answer)
        assert answer["error"]["param"] == param, (path, body[:80], answer)
        if param is not None and param != "model":
            assert param.split("[")[0].split(".")[0] in answer["error"]["message"], answer


def test_text_the_tokenizer_raises_on_is_a_400(served, monkeypatch):
    real_encode = served.tokenizer.encode

    def picky_encode(text, **kwargs):
        if "forbidden" in text:
            raise Exception("the Rust side refuses this")  # what the tokenizers library raises
        return real_encode(text, **kwargs)

    monkeypatch.setattr(served.tokenizer, "encode", picky_encode)

    async def scenario():
        async with http_client(served) as session:
            refused = await post(session, "/v1/completions", completion_body("a forbidden text", 2))
            chat = await post(session, "/v1/chat/completions", {"messages": [{"role": "user", "content": "forbidden"}]})
            ok, _ = await post(session, "/v1/completions", completion_body("fine", 2))
        return refused, chat, ok

    (status, body), (chat_status, chat_body), ok = asyncio.run(scenario())
    assert (status, body["error"]["param"]) == (400, "prompt") and "Rust" not in body["error"]["message"]
    assert (chat_status, chat_body["error"]["param"]) == (400, "messages")
    assert ok == 200


def test_standard_roles_pass_and_unknown_ones_only_where_the_template_names_them(chatml):
    async def scenario():
        async with http_client(chatml) as session:
            roles = ("system", "user", "assistant", "tool", "developer", "wizard")
            return [await post(session, "/v1/chat/completions",
                               {"messages": [{"role": role, "content": "Hi"}], "max_tokens": 1}) for role in roles]

    statuses = [status for status, _ in asyncio.run(scenario())]
    assert statuses == [200, 200, 200, 200, 200, 400]  # ChatML would render "wizard": refused anyway

    class Templated:
        chat_template = "{% if message['role'] == 'ipython' %}{{ message['content'] }}{% endif %}"

    check_chat_roles([{"role": "ipython"}, {"role": "user"}], Templated())
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        check_chat_roles([{"role": "wizard"}], Templated())


def test_grpc_strings_that_are_not_utf8_and_ids_outside_the_vocabulary_are_invalid_argument(served):
    ok_request = tandem_pb2.GenerateRequest(prompt="fine", max_tokens=2, ignore_eos=True)
    raw_cases = {  # field number 2: prompt, 9: stop, 1: request_id (wire type 2), then bytes that are not UTF-8
        "prompt": b"\x12\x03a\xed\xa0", "stop": ok_request.SerializeToString() + b"\x4a\x02\xff\xfe",
        "request_id": b"\x0a\x01\x80" + ok_request.SerializeToString(), "not a valid": b"\x12\xff",
    }
    large = tandem_pb2.GenerateRequest(prompt_token_ids=[5] * 300_000, max_tokens=2).SerializeToString()
    assert len(large) > OFF_LOOP_MESSAGE_BYTES  # parsed on the InputPool, not on the loop: the same answers
    raw_cases.update({"stop is not valid": large + b"\x4a\x02\xff\xfe", "model's context": large})

    async def scenario():
        codes = {}
        async with local_backend(served) as backend:
            server, port = await start_grpc_server(backend, GrpcServerConfig())
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    raw = channel.unary_stream("/tandem.v1.Tandem/Generate", request_serializer=lambda b: b,
                                               response_deserializer=tandem_pb2.GenerateResponse.FromString)
                    stub = tandem_pb2_grpc.TandemStub(channel)
                    cases = [(name, raw(body)) for name, body in raw_cases.items()]
                    cases.append(("prompt token id", stub.Generate(tandem_pb2.GenerateRequest(
                        prompt_token_ids=[1, 100_000], max_tokens=2))))
                    for name, call in cases:
                        codes[name] = await _status(call)
                        assert len([t for r in [m async for m in stub.Generate(ok_request)] for t in r.token_ids]) == 2
                await wait_until_idle(served)
            finally:
                await server.stop(None)
        return codes

    for name, (code, details) in asyncio.run(scenario()).items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT and name in details, (name, code, details)


async def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    return caught.value.code(), caught.value.details()
