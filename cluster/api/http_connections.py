"""The connection layer of the HTTP front end: aiohttp's protocol with a cap on open connections, and its own
refusals in OpenAI's error JSON.

aiohttp's HTTP parser refuses some requests before any route or middleware sees them: a request line or a
header past its size, too many headers, Content-Length beside Transfer-Encoding, a Content-Length that is not
a number. aiohttp answers those in text/plain; OpenAIRequestHandler.handle_error answers them as every other
error of the front end: {"error": {"message", "type", "param", "code"}}, 414 for the request line, 431 for
the headers, 400 otherwise, and the connection closes.

Past max_connections open connections, a new connection is not served: its first request is answered 503
(code "too_many_connections", Retry-After) without reaching the application, and the connection closes; one
that sends no request is closed after refusal_timeout_s. This is the answer of uvicorn's --limit-concurrency
and nginx's limit_conn: a client learns at once that the server is full, and its connection does not wait
unseen in the listen backlog.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from cluster.api.internal_errors import report_internal_error
from cluster.api.openai_fields import OpenAIError, error_response

logger = logging.getLogger("tandem.cluster.http")
MAX_REQUEST_LINE_BYTES = 16 * 1024  # method, URL and version; past it 414
MAX_HEADER_FIELD_BYTES = 8190       # one header, name and value (aiohttp's default); past it 431
MAX_HEADERS = 128                   # header lines of a request (aiohttp's default); past it 431
_TOO_MANY_HEADERS = "Too many headers received"  # aiohttp's message (no exception class of its own)


@dataclass(frozen=True)
class ConnectionLimits:
    """max_connections: connections served at once (more are refused, see the module docstring);
    keepalive_timeout_s: a connection with no request in progress (idle between requests, or a request head
    still arriving) is closed after this long; refusal_timeout_s: the longest a refused connection stays open.
    HttpServerConfig checks them."""

    max_connections: int
    keepalive_timeout_s: float
    refusal_timeout_s: float


class ConnectionCap:
    """How many connections are open and served, against the limit. Used from the event loop only."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.open = 0

    def admit(self) -> bool:
        """Counts a new connection in and returns True while fewer than max_connections are open; False
        (nothing counted) when the server is full."""
        if self.open >= self.max_connections:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        """Counts an admitted connection out."""
        self.open -= 1


class OpenAIRequestHandler(web.RequestHandler):
    """One connection: aiohttp's protocol, admitted under `cap` or refused, with its refusals as OpenAI JSON."""

    def __init__(self, manager: web.Server, cap: ConnectionCap, refusal_timeout_s: float, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._cap, self._refusal_timeout_s = cap, refusal_timeout_s
        self._admitted = False
        self._refusal_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admits the connection, or makes it one that answers 503 to its request and closes."""
        self._admitted = self._cap.admit()
        if not self._admitted:  # every request of the connection is answered by _refuse, not the application
            self._request_handler = self._refuse
            self._refusal_timer = asyncio.get_running_loop().call_later(self._refusal_timeout_s, self.force_close)
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._admitted:
            self._admitted = False
            self._cap.release()
        if self._refusal_timer is not None:
            self._refusal_timer.cancel()
        super().connection_lost(exc)

    async def _refuse(self, request: web.BaseRequest) -> web.StreamResponse:
        error = OpenAIError(503, f"the server has {self._cap.max_connections} connections open, its limit: "
                                 "retry later", type="service_unavailable", code="too_many_connections")
        response = error_response(error, close_connection=True)
        response.headers["Retry-After"] = "1"
        return response

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request its parser refused (status 400) or whose handler raised past the
        middlewares (500, 504), as OpenAI's error JSON; the connection closes after it. ConnectionError
        when a response has begun already (as aiohttp's own)."""
        if request.writer.output_size > 0:
            raise ConnectionError("a response was sent already: the error cannot be answered")
        if status >= 500:
            error = OpenAIError(status, report_internal_error(logger, exc or RuntimeError(message), None),
                                type="internal_error", code="internal_error")
        else:
            logger.debug("refused a malformed request from %s: %s", request.remote, exc or message)
            error = _parser_refusal(exc, message or "")
        return error_response(error, close_connection=True)


def _parser_refusal(exc: BaseException | None, message: str) -> OpenAIError:
    """The answer to what aiohttp's HTTP parser raised."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "?"
        if str(limit) == str(MAX_REQUEST_LINE_BYTES):
            return OpenAIError(414, f"the request line (method, URL, version) is longer than {limit} bytes",
                               code="uri_too_long")
        return OpenAIError(431, f"a request header is longer than {limit} bytes", code="header_too_large")
    if isinstance(exc, BadHttpMessage) and exc.message == _TOO_MANY_HEADERS:
        return OpenAIError(431, f"the request has more than {MAX_HEADERS} headers", code="too_many_headers")
    first_line = message.strip().splitlines()[0].rstrip(":") if message.strip() else "malformed HTTP request"
    return OpenAIError(400, f"invalid HTTP request: {first_line}", code="invalid_http_request")


class _CappedServer(web.Server):
    """aiohttp's connection factory, making an OpenAIRequestHandler per connection."""

    def __init__(self, handler, cap: ConnectionCap, handler_args: dict, **kwargs) -> None:
        super().__init__(handler, **kwargs)
        self._cap, self._handler_args = cap, handler_args

    def __call__(self) -> web.RequestHandler:
        return OpenAIRequestHandler(self, self._cap, loop=self._loop, **self._handler_args)


class OpenAIAppRunner(web.AppRunner):
    """web.AppRunner whose connections are OpenAIRequestHandlers under `limits`. `cap` counts them."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits
        self.cap = ConnectionCap(limits.max_connections)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # runs the application's start-up and freezes it
        limits = self._limits
        handler_args = {"refusal_timeout_s": limits.refusal_timeout_s, "keepalive_timeout": limits.keepalive_timeout_s,
                        "max_line_size": MAX_REQUEST_LINE_BYTES, "max_field_size": MAX_HEADER_FIELD_BYTES,
                        "max_headers": MAX_HEADERS, "access_log": None}
        return _CappedServer(plain.request_handler, self.cap, handler_args, request_factory=plain.request_factory,
                             handler_cancellation=plain.handler_cancellation, loop=asyncio.get_running_loop())
