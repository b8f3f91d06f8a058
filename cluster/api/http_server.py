"""The OpenAI-compatible HTTP front end (aiohttp): completions, chat completions, health, metrics, /ping;
the models, /tokenize, /detokenize and /version are in utility_routes.py, /admin/workers in admin_routes.py.

Every error is answered with OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 bad
input (`param` names the field), 401 missing or wrong API key (every route but the probes, PROBE_PATHS,
which stay open for probes and scrapers), 404 unknown model or route, 408 body not arrived within the read
deadline, 413 body over the limit (refused on its Content-Length, before it is read), 414 / 431 request line
or headers too long, 429 overload, 503 no backend or too many connections. A client that disconnects
cancels its handler, which closes the backend stream: the request is aborted and its blocks freed. The
bounds on what comes in (body size and deadline, `Expect: 100-continue`): http_body.py; on connections
and what aiohttp's parser refuses: http_connections.py. A large body is parsed, rendered and tokenized on the
InputPool's threads, never on the event loop that answers the probes (input_pool.py, prompt_encoder.py); 429
when too many wait for them.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from cluster.api.admin_routes import AdminRoutes
from cluster.api.api_key import ApiKeyCheck
from cluster.api.http_body import BodyLimits, RequestBodyGate
from cluster.api.http_connections import ConnectionLimits, OpenAIAppRunner
from cluster.api.input_pool import InputLimits, InputPool
from cluster.api.metered_backend import MeteredBackend
from cluster.api.metrics import CONTENT_TYPE, ServingMetrics
from cluster.api.openai_fields import OpenAIError, error_response
from cluster.api.openai_generation import backend_error, generation_requests, respond
from cluster.api.openai_protocol import (ParsedRequest, ServedModel, parse_chat_request, parse_completion_request,
                                         parse_json_body)
from cluster.api.openai_responses import ChatShape, CompletionShape, ResponseShape
from cluster.api.openai_tool_stream import ToolCallShape
from cluster.api.request_validation import MAX_REQUEST_BYTES
from cluster.api.utility_routes import UtilityRoutes
from cluster.backend import Backend, WorkerScaling

logger = logging.getLogger("tandem.cluster.http")
_HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
PROBE_PATHS = frozenset({"/health", "/metrics", "/ping", "/version"})  # answered without the API key


@dataclass(frozen=True)
class HttpServerConfig:
    """Where the HTTP front end listens and what it accepts. port 0 picks a free port; api_key None
    serves without authentication; a body over max_body_bytes gets 413, one not arrived within
    request_read_timeout_s 408. served_model_names: the names requests may give as `model` (the first is
    the one reported); empty: the backend's model_name. max_connections: connections served at once (one
    more gets 503 and is closed); keepalive_timeout_s: a connection without a request in progress (idle, or
    its request head still arriving) closes after this long. input_limits: how large bodies are prepared off the
    event loop (input_pool.py)."""

    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    max_body_bytes: int = MAX_REQUEST_BYTES
    shutdown_timeout_s: float = 2.0
    served_model_names: tuple[str, ...] = ()
    request_read_timeout_s: float = 30.0
    max_connections: int = 1024
    keepalive_timeout_s: float = 75.0
    input_limits: InputLimits = InputLimits()

    @property
    def body_limits(self) -> BodyLimits:
        return BodyLimits(self.max_body_bytes, self.request_read_timeout_s)

    @property
    def connection_limits(self) -> ConnectionLimits:
        """Refused connections live at most as long as a request body may take to arrive."""
        return ConnectionLimits(self.max_connections, self.keepalive_timeout_s, self.request_read_timeout_s)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None or a non-empty string")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        names = self.served_model_names
        if not isinstance(names, tuple) or not all(isinstance(n, str) and n.strip() for n in names) \
                or len(set(names)) != len(names):
            raise ValueError(f"served_model_names must be a tuple of distinct non-empty names, got {names!r}")
        if not 0 < self.request_read_timeout_s <= 3600 or not 0 < self.keepalive_timeout_s <= 3600:
            raise ValueError(f"request_read_timeout_s and keepalive_timeout_s must be in (0, 3600] seconds, got "
                             f"{self.request_read_timeout_s} and {self.keepalive_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


class OpenAIFrontEnd:
    """Route handlers over one backend; `metrics` is what GET /metrics shows; `scaling`: the backend's
    worker set for /admin/workers (None: it has none); `inputs`: where large bodies are prepared."""

    def __init__(self, backend: Backend, metrics: ServingMetrics, config: HttpServerConfig,
                 scaling: WorkerScaling | None, inputs: InputPool) -> None:
        self._backend, self._metrics, self._scaling, self._inputs = backend, metrics, scaling, inputs
        self._api_key = ApiKeyCheck(config.api_key)
        names = config.served_model_names or (backend.model_name,)
        self._served = ServedModel(names[0], backend.tokenizer, backend.max_model_len, names[1:])
        self._body_limits = config.body_limits

    def build_app(self) -> web.Application:
        """The application: its routes, and the middlewares every request passes in this order: errors as
        OpenAI JSON, the API key, the body read under its limits (RequestBodyGate)."""
        gate = RequestBodyGate(self._body_limits)
        app = web.Application(client_max_size=self._body_limits.max_bytes,
                              middlewares=[self._errors, self._auth, gate.read_body_first])
        expect = gate.expect_handler
        app.router.add_post("/v1/completions", self.completions, expect_handler=expect)
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=expect)
        UtilityRoutes(self._served, self._inputs).add_to(app, expect)
        app.router.add_get("/health", self.health, expect_handler=expect)
        app.router.add_get("/ping", self.ping, expect_handler=expect)
        app.router.add_post("/ping", self.ping, expect_handler=expect)
        app.router.add_get("/metrics", self.metrics, expect_handler=expect)
        AdminRoutes(self._scaling, self._inputs).add_to(app, expect)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except OpenAIError as error:
            return error_response(error)
        except web.HTTPException as error:
            code = _HTTP_ERROR_CODES.get(error.status, "http_error")
            return error_response(OpenAIError(error.status, error.text or error.reason, code=code))
        except Exception as error:  # a bug or a failed engine: answer 500, keep serving
            return error_response(backend_error(error))

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path not in PROBE_PATHS and not self._api_key.accepts(
                request.headers.get("Authorization"), request.headers.get("X-Api-Key")):
            raise OpenAIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
        return await handler(request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion_request, CompletionShape, "cmpl")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat_request, ChatShape, "chatcmpl")

    async def _generate(self, request: web.Request, parse, shape_type: type[ResponseShape],
                        id_prefix: str) -> web.StreamResponse:
        arrival = time.perf_counter()
        body = await request.read()
        call: ParsedRequest = await self._inputs.prepare(len(body), lambda: parse(parse_json_body(body), self._served))
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        options = {} if call.tool_forcing is None else {"forcing": call.tool_forcing}
        if call.tool_forcing is not None:  # tool_choice forces a call: answered as tool_calls
            shape_type = ToolCallShape
        shape = shape_type(request_id, call.model, int(time.time()), call.return_token_ids,
                           call.params.logprobs, self._served.tokenizer, call.echo, **options)
        return await respond(request, self._backend, call, shape, generation_requests(call, request_id, arrival))

    async def health(self, request: web.Request) -> web.Response:
        health = await self._backend.health()
        failures = health.details.get("worker_failures") or {}
        status = "unavailable" if not health.serving else "degraded" if failures else "ok"
        body = {"status": status, "model": self._served.name,
                "prefill_workers": health.prefill_workers, "decode_workers": health.decode_workers}
        if failures:  # which workers were lost, and why (the survivors serve)
            body["lost_workers"] = failures
        workers = health.details.get("workers")
        if workers:  # each serving worker's role, process and Ray node (disaggregated)
            body["workers"] = {name: {key: load.get(key) for key in ("role", "pid", "node_id", "node_ip")}
                               for name, load in workers.items()}
        return web.json_response(body, status=200 if health.serving else 503)

    async def ping(self, request: web.Request) -> web.Response:
        """vLLM's liveness probe (GET or POST): 200 while the backend serves, else 503; no body."""
        health = await self._backend.health()
        return web.Response(status=200 if health.serving else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = self._metrics.render(await self._backend.health())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def start_http_server(backend: Backend, config: HttpServerConfig = HttpServerConfig(),
                            metrics: ServingMetrics | None = None, scaling: WorkerScaling | None = None,
                            input_pool: InputPool | None = None) -> tuple[web.AppRunner, int]:
    """Start serving `backend` (from inside a running asyncio loop); returns the runner and the bound
    port. Requests are recorded in `metrics` (a new ServingMetrics if None) under frontend="http";
    pass the one given to start_grpc_server to see both in /metrics. `scaling`: the worker set
    /admin/workers reads and changes (the coordinator's; None: the route answers 400). `input_pool`: the
    InputPool large bodies are prepared on, the caller's to close (pass the gRPC front end's too, to bound
    both together); None: one of config.input_limits, closed with the runner. Stop with
    `await runner.cleanup()`; the backend is the caller's to shut down."""
    metrics = metrics if metrics is not None else ServingMetrics()
    inputs = input_pool if input_pool is not None else InputPool(config.input_limits)
    front_end = OpenAIFrontEnd(MeteredBackend(backend, metrics, "http"), metrics, config, scaling, inputs)
    app = front_end.build_app()
    if input_pool is None:
        app.on_cleanup.append(lambda _: _close(inputs))
    runner = OpenAIAppRunner(app, config.connection_limits, handler_cancellation=True,
                             shutdown_timeout=config.shutdown_timeout_s, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    logger.info("HTTP front end on %s:%d serving %s", config.host, port, backend.model_name)
    return runner, port


async def _close(inputs: InputPool) -> None:
    inputs.close()
