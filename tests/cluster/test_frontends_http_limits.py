"""No input stalls the HTTP front end: over raw sockets on loopback, a body announced over the limit is refused
before it is read (413), a body that stalls is answered 408 and its connection closed, `Expect: 100-continue`
gets its 100 only when the body will be read, connections past the cap get 503 and are closed, and what
aiohttp's parser refuses comes back as OpenAI's error JSON. After each, the server still serves, and no KV
block is left taken."""
from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from cluster.api.http_server import HttpServerConfig, start_http_server
from engine import LLM
from tests.support.frontend_rig import local_backend, wait_until_idle
from tests.support.http_rig import API_KEY, KV_BYTES, MAX_BODY_BYTES, MODEL, completion_body

ANSWER_TIMEOUT_S = 10.0   # generous: every answer here comes at once, or right after a 0.5 s deadline
READ_TIMEOUT_S = 0.5      # the servers' --request-read-timeout-s
BODY = json.dumps(completion_body("Hello", 2)).encode()
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), kv_cache_memory=KV_BYTES).engine


@contextlib.asynccontextmanager
async def http_port(engine, **config_fields):
    """The HTTP front end over a LocalEngineBackend of `engine` on a free loopback port, with a small body
    limit and read deadline; at the end every KV block must be free."""
    fields = {"max_body_bytes": MAX_BODY_BYTES, "request_read_timeout_s": READ_TIMEOUT_S, **config_fields}
    async with local_backend(engine, model_name=MODEL) as backend:
        runner, port = await start_http_server(backend, HttpServerConfig(**fields))
        try:
            yield port
            await wait_until_idle(engine)
        finally:
            await runner.cleanup()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def send(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    with contextlib.suppress(ConnectionError):  # the server may answer and close before all of it is taken
        await writer.drain()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The next response on the connection (a 100 Continue included): status, headers (lower-case), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_TIMEOUT_S)
    status_line, *lines = head.decode("latin-1").strip().split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), ANSWER_TIMEOUT_S)
    return int(status_line.split()[1]), headers, body


async def exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Sends `data` on a new connection and returns the answer; the connection is closed after."""
    reader, writer = await connect(port)
    try:
        await send(writer, data)
        return await read_response(reader)
    finally:
        writer.close()


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server closes the connection (within ANSWER_TIMEOUT_S), whatever it still sent."""
    with contextlib.suppress(ConnectionError):
        while await asyncio.wait_for(reader.read(65536), ANSWER_TIMEOUT_S):
            pass
    return True


def assert_openai_error(status: int, headers: dict, body: bytes, expected_status: int, expected_code: str) -> None:
    assert status == expected_status, (status, body)
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == ERROR_FIELDS and error["code"] == expected_code and error["message"], error


async def assert_still_serves(port: int, headers: dict | None = None) -> None:
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        async with session.post("/v1/completions", data=BODY, headers=headers) as response:
            assert response.status == 200, await response.text()
            assert len((await response.json())["choices"][0]["token_ids"]) == 2


def post_head(path: str = "/v1/completions", *extra: str, length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: tandem", "Content-Type: application/json",
             *([f"Content-Length: {length}"] if length is not None else []), *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_body_announced_over_the_limit_is_413_before_it_is_read(served):
    """Content-Length 10 GB with 62 bytes sent: the answer comes at once (the read deadline is 30 s here); a
    chunked body past the limit is refused too."""
    async def scenario():
        async with http_port(served, request_read_timeout_s=30.0) as port:
            reader, writer = await connect(port)
            await send(writer, post_head(length=10_000_000_000) + b"x" * 62)
            status, headers, body = await read_response(reader)
            assert_openai_error(status, headers, body, 413, "request_too_large")
            assert headers["connection"] == "close"
            writer.close()
            chunk = b"x" * (MAX_BODY_BYTES + 1)  # no length announced: refused once it reads past the limit
            chunked = post_head("/v1/completions", "Transfer-Encoding: chunked") + b"%x\r\n%s\r\n" % (len(chunk), chunk)
            assert_openai_error(*await exchange(port, chunked), 413, "request_too_large")
            await assert_still_serves(port)

    asyncio.run(scenario())


@pytest.mark.parametrize("request_start", [
    post_head(length=len(BODY)) + BODY[:10],                                    # 10 of the announced bytes
    post_head("/v1/completions", "Transfer-Encoding: chunked") + b"5\r\n{\"pro\r\n",  # one chunk, then nothing
    post_head("/tokenize", length=100),                                          # the head alone
], ids=["content-length", "chunked", "head-only"])
def test_a_body_that_stalls_is_408_and_the_connection_closes(served, request_start):
    async def scenario():
        async with http_port(served) as port:
            reader, writer = await connect(port)
            await send(writer, request_start)
            status, headers, body = await read_response(reader)
            assert_openai_error(status, headers, body, 408, "request_timeout")
            assert await closed_by_server(reader)
            writer.close()
            await assert_still_serves(port)

    asyncio.run(scenario())


def test_expect_100_continue_is_answered_100_only_when_the_body_will_be_read(served):
    key = f"Authorization: Bearer {API_KEY}"

    async def scenario():
        async with http_port(served, api_key=API_KEY) as port:
            reader, writer = await connect(port)
            await send(writer, post_head("/v1/completions", key, "Expect: 100-continue", length=len(BODY)))
            assert (await read_response(reader))[0] == 100  # before any byte of the body was sent
            await send(writer, BODY)
            status, _, body = await read_response(reader)
            assert status == 200 and len(json.loads(body)["choices"][0]["token_ids"]) == 2
            writer.close()
            refusals = [((key, "Expect: 100-continue"), 10 * MAX_BODY_BYTES, 413, "request_too_large"),
                        (("Expect: 100-continue",), len(BODY), 401, "invalid_api_key"),
                        ((key, "Expect: something-else"), len(BODY), 417, "expectation_failed")]
            for extra, length, status, code in refusals:  # the final status first, no 100
                head = post_head("/v1/completions", *extra, length=length)
                assert_openai_error(*await exchange(port, head), status, code)
            await assert_still_serves(port, {"Authorization": f"Bearer {API_KEY}"})

    asyncio.run(scenario())


def test_connections_past_the_cap_get_503_and_are_closed(served):
    ping = b"GET /ping HTTP/1.1\r\nHost: tandem\r\n\r\n"

    async def scenario():
        async with http_port(served, max_connections=2) as port:
            held = [await connect(port) for _ in range(2)]
            for reader, writer in held:  # each served and kept open: the server is full
                await send(writer, ping)
                assert (await read_response(reader))[0] == 200
            reader, writer = await connect(port)
            await send(writer, post_head(length=len(BODY)) + BODY)
            status, headers, body = await read_response(reader)
            assert_openai_error(status, headers, body, 503, "too_many_connections")
            assert headers["retry-after"] == "1" and await closed_by_server(reader)
            silent, _ = await connect(port)  # refused, and sends nothing: closed after the read deadline
            assert await closed_by_server(silent)
            for _, held_writer in held:
                held_writer.close()
            await _until_served(port)
            await assert_still_serves(port)

    asyncio.run(scenario())


async def _until_served(port: int) -> None:
    """Waits (at most ANSWER_TIMEOUT_S) until the closed connections are counted out and /ping answers 200."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ANSWER_TIMEOUT_S
    while (await exchange(port, b"GET /ping HTTP/1.1\r\nHost: tandem\r\n\r\n"))[0] != 200:
        assert loop.time() < deadline, "the cap never freed the closed connections"
        await asyncio.sleep(0.05)


PARSER_REFUSALS = [  # (raw request, status, code): refused by aiohttp's parser before any route
    (b"GET /v1/models HTTP/1.1\r\nHost: tandem\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431, "header_too_large"),
    (b"GET /v1/models HTTP/1.1\r\nHost: tandem\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(1000)) + b"\r\n",
     431, "too_many_headers"),
    (b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: tandem\r\n\r\n", 414, "uri_too_long"),
    (post_head("/v1/completions", "Transfer-Encoding: chunked", length=3) + b"0\r\n\r\n", 400, "invalid_http_request"),
    (post_head(length=-1), 400, "invalid_http_request"),
    (post_head("/v1/completions", "Transfer-Encoding: chunked") + b"zz\r\nhello\r\n", 400, "invalid_http_request"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, 400, "invalid_http_request"),  # TLS hello
]


@pytest.mark.parametrize("raw,status,code", PARSER_REFUSALS,
                         ids=["header-9KB", "1000-headers", "url-100KB", "length-and-chunked", "length--1",
                              "bad-chunk", "tls-on-http"])
def test_what_aiohttp_refuses_is_openai_json(served, raw, status, code):
    async def scenario():
        async with http_port(served) as port:
            answer = await exchange(port, raw)
            assert_openai_error(*answer, status, code)
            await assert_still_serves(port)

    asyncio.run(scenario())


def test_the_serve_flags_reach_the_http_config():
    import argparse

    from cluster.serve import add_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = config_from_args(parser.parse_args([]))
    assert (default.request_read_timeout_s, default.max_connections) == (30.0, 1024)
    given = config_from_args(parser.parse_args(["--request-read-timeout-s", "0.5", "--max-connections", "8"]))
    assert (given.request_read_timeout_s, given.max_connections) == (0.5, 8)
    for flags, flag in ((["--request-read-timeout-s", "0"], "--request-read-timeout-s"),
                        (["--max-connections", "0"], "--max-connections")):
        with pytest.raises(ValueError, match=flag):
            config_from_args(parser.parse_args(flags))
    with pytest.raises(ValueError, match="request_read_timeout_s"):
        HttpServerConfig(request_read_timeout_s=float("inf"))
