"""The way in of an HTTP request body: no read without a bound on its size and its time.

A body whose Content-Length is over the limit is refused (413) before a byte of it is read; any other body is
read whole, within a deadline, before the route's handler runs (which then gets it from `request.read()`): one
that has not arrived by then, announced by a Content-Length or sent in chunks, is answered 408 and its
connection closed. `Expect: 100-continue` gets its 100 only here, that is once the request was routed,
authorized (the middlewares before this one) and found within the limit; a request refused earlier gets its
final status straight away and the client never sends the body. (A path no route serves is aiohttp's own:
its 404 / 405 comes after aiohttp's 100, whose expect handler a route added here cannot replace.)
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from cluster.api.openai_fields import OpenAIError, error_response

logger = logging.getLogger("tandem.cluster.http")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass(frozen=True)
class BodyLimits:
    """A body may have at most max_bytes and must arrive whole within read_timeout_s of its first read
    (HttpServerConfig checks both)."""

    max_bytes: int
    read_timeout_s: float


class RequestBodyGate:
    """The middleware that reads each request body under `limits`, and the expect handler of every route."""

    def __init__(self, limits: BodyLimits) -> None:
        self._limits = limits

    async def expect_handler(self, request: web.Request) -> web.StreamResponse | None:
        """aiohttp calls this before the middlewares when a request carries `Expect`; it sends nothing (the
        100 comes from the middleware, once the body is wanted), and answers 417 to any expectation other
        than 100-continue."""
        expectation = request.headers.get(hdrs.EXPECT, "")
        if expectation.lower() == "100-continue":
            return None
        return error_response(OpenAIError(417, f"Expect: {expectation[:64]!r} is not supported (only 100-continue)",
                                          code="expectation_failed"), close_connection=True)

    @web.middleware
    async def read_body_first(self, request: web.Request, handler) -> web.StreamResponse:
        """Answers the request with `handler` once its body (if it has one) is read whole; the refusal
        (413, 408, 400 for a malformed chunked body) when it cannot be. A refused request's connection
        closes: what is left of its body is never read as a request."""
        if request.body_exists:
            refusal = await self._read(request)
            if refusal is not None:
                return refusal
        return await handler(request)

    async def _read(self, request: web.Request) -> web.StreamResponse | None:
        """Reads the body into the request (None), or returns the answer that refuses it."""
        limit = self._limits.max_bytes
        if (request.content_length or 0) > limit:
            return _too_large(limit, f"announces {request.content_length} bytes")
        if request.version >= (1, 1) and request.headers.get(hdrs.EXPECT, "").lower() == "100-continue":
            await request.writer.write(CONTINUE)
            request.writer.output_size = 0  # the response proper has not started (as aiohttp's own handler)
        try:
            await asyncio.wait_for(request.read(), self._limits.read_timeout_s)
        except asyncio.TimeoutError:
            return await _timed_out(request, self._limits.read_timeout_s)
        except web.HTTPRequestEntityTooLarge:  # a chunked body, or one that sent more than it announced
            return _too_large(limit, "sent more")
        except (web.RequestPayloadError, HttpProcessingError) as error:
            return error_response(OpenAIError(400, f"the request body is malformed: {error}", code="invalid_body"),
                                  close_connection=True)
        return None


def _too_large(limit: int, what: str) -> web.Response:
    return error_response(OpenAIError(413, f"the request body {what}: more than this server's limit of {limit} "
                                           f"bytes", code="request_too_large"), close_connection=True)


async def _timed_out(request: web.Request, timeout_s: float) -> web.Response:
    """Sends the 408 and closes the connection at once: the client stalled, so there is no body to drain
    (aiohttp's lingering read would hold the connection up to 10 s more)."""
    logger.debug("request body from %s did not arrive within %g s", request.remote, timeout_s)
    response = error_response(OpenAIError(408, f"the request body did not arrive within {timeout_s:g} s",
                                          code="request_timeout"), close_connection=True)
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response
