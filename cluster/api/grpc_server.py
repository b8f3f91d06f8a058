"""The public gRPC front end: `service Tandem` of proto/tandem.proto (package tandem.v1) on grpc.aio.

Generate streams one GenerateResponse per backend chunk; the last has finish_reason and timing.
Status codes: bad input INVALID_ARGUMENT, overload RESOURCE_EXHAUSTED, no workers UNAVAILABLE,
missing or wrong API key UNAUTHENTICATED. A client cancel closes the backend stream, which aborts the
request and frees its blocks. Health needs no API key (for probes). A large prompt is checked and tokenized on
the InputPool's threads, never on the event loop that answers Health (input_pool.py, prompt_encoder.py). Beside
it, the standard grpc.health.v1.Health (following the backend) and server reflection: grpc_operators.py.
"""
from __future__ import annotations

import logging
import time
import dataclasses
import uuid
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from cluster.api.api_key import ApiKeyCheck
from cluster.api.grpc_operators import add_operator_services
from cluster.api.grpc_wire import LargeRequest, UndecodableRequest, add_tandem_service
from cluster.api.input_pool import InputLimits, InputPool
from cluster.api.internal_errors import report_internal_error
from cluster.api.metered_backend import MeteredBackend
from cluster.api.metrics import ServingMetrics
from cluster.api.prompt_encoder import PromptEncoder
from cluster.api.request_validation import MAX_REQUEST_BYTES, TEXT_ARGS, build_sampling_params, check_prompt_token_ids
from cluster.backend import Backend, BackendOverloaded, BackendUnavailable, GenerationChunk, GenerationRequest
from engine.structured import check_spec
from engine.structured_params import StructuredOutputsParams
from proto import tandem_pb2, tandem_pb2_grpc

logger = logging.getLogger("tandem.cluster.grpc")
MAX_REQUEST_ID_CHARS = 256
GENERATE_METHOD = "/tandem.v1.Tandem/Generate"


@dataclass(frozen=True)
class GrpcServerConfig:
    """Where the gRPC front end listens and what it accepts. port 0 picks a free port. api_key None
    serves without authentication. max_message_bytes bounds each received and sent message (by default
    the HTTP front end's body limit). health_poll_s: how often grpc.health.v1.Health reads the backend's
    health. The connection bounds (HTTP/2, per connection): the server pings a connection silent for
    keepalive_time_s and drops it when no answer comes within keepalive_timeout_s (a vanished client's
    streams end, their requests are aborted); a connection with no call for max_connection_idle_s, or open
    for max_connection_age_s, is told to go away (GOAWAY; clients reconnect), calls in flight then get
    max_connection_age_grace_s to finish. input_limits: how large prompts are prepared off the event loop
    (input_pool.py)."""

    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    max_message_bytes: int = MAX_REQUEST_BYTES
    health_poll_s: float = 1.0
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    max_connection_idle_s: float = 300.0
    max_connection_age_s: float = 3600.0
    max_connection_age_grace_s: float = 600.0
    input_limits: InputLimits = InputLimits()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None or a non-empty string")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not 0 < self.health_poll_s <= 60:
            raise ValueError(f"health_poll_s must be in (0, 60], got {self.health_poll_s}")
        for name in ("keepalive_time_s", "keepalive_timeout_s", "max_connection_idle_s", "max_connection_age_s",
                     "max_connection_age_grace_s"):
            if not 0 < getattr(self, name) <= 7 * 24 * 3600:
                raise ValueError(f"{name} must be in (0, 1 week] seconds, got {getattr(self, name)}")

    def server_options(self) -> list[tuple[str, int]]:
        """The grpc.server options of these bounds."""
        def ms(seconds: float) -> int:
            return max(1, round(seconds * 1000))

        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
                ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
                ("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)),
                ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
                ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
                ("grpc.so_reuseport", 0)]


class TandemService(tandem_pb2_grpc.TandemServicer):
    """Validates GenerateRequests (large ones on `inputs`), runs them on the backend and streams the chunks
    back."""

    def __init__(self, backend: Backend, inputs: InputPool) -> None:
        self._backend, self._inputs = backend, inputs
        self._encoder = PromptEncoder(backend.tokenizer, backend.max_model_len)

    async def Generate(self, request: tandem_pb2.GenerateRequest | UndecodableRequest | LargeRequest,
                       context: grpc.aio.ServicerContext) -> None:
        arrival = time.perf_counter()
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        large = isinstance(request, LargeRequest)  # parsed with the rest of the work, on the InputPool
        try:
            size = len(request.raw) if large else len(request.prompt) + len(request.prompt_token_ids)
            generation = await self._inputs.prepare(size, lambda: self._generation_request(request, arrival))
        except Exception as error:  # ValueError: INVALID_ARGUMENT; anything else: INTERNAL with an incident id
            label = "-" if large else request.request_id[:MAX_REQUEST_ID_CHARS] or "-"
            await context.abort(*_status_of(error, label))
        failure: Exception | None = None
        async with aclosing(self._backend.generate(generation)) as chunks:
            try:
                async for chunk in chunks:
                    await context.write(_response(generation.request_id, chunk))
            except Exception as error:  # mapped to a status below; the server stays up
                failure = error
        if failure is not None:
            await context.abort(*_status_of(failure, generation.request_id))

    async def Health(self, request: tandem_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> tandem_pb2.HealthResponse:
        health = await self._backend.health()
        return tandem_pb2.HealthResponse(status="SERVING" if health.serving else "NOT_SERVING",
                                         model=health.model, prefill_workers=health.prefill_workers,
                                         decode_workers=health.decode_workers)

    def _generation_request(self, request: tandem_pb2.GenerateRequest | LargeRequest,
                            arrival: float) -> GenerationRequest:
        """ValueError names the first thing wrong with `request` (a LargeRequest is parsed first)."""
        if isinstance(request, LargeRequest):
            request = request.decoded()
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id may have at most {MAX_REQUEST_ID_CHARS} characters")
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        return GenerationRequest(request_id, self._prompt_token_ids(request),
                                 _sampling_params(request), arrival)

    def _prompt_token_ids(self, request: tandem_pb2.GenerateRequest) -> tuple[int, ...]:
        has_text, has_ids = bool(request.prompt), len(request.prompt_token_ids) > 0
        if has_text == has_ids:
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if has_text:
            return self._encoder.encode_prompt(request.prompt)
        return check_prompt_token_ids(request.prompt_token_ids, self._backend.tokenizer, self._backend.max_model_len)


def _sampling_params(request: tandem_pb2.GenerateRequest):
    def optional(name: str):
        return getattr(request, name) if request.HasField(name) else None

    processors = {name: optional(name) for name in ("min_p", "presence_penalty", "frequency_penalty",
                                                    "repetition_penalty", "min_tokens", "logprobs", "n", *TEXT_ARGS)}
    params = build_sampling_params(max_tokens=optional("max_tokens"), temperature=optional("temperature"),
                                   top_p=optional("top_p"), top_k=optional("top_k"), seed=optional("seed"),
                                   stop=list(request.stop) or None, ignore_eos=request.ignore_eos,
                                   logit_bias=dict(request.logit_bias) or None, **processors)
    spec = _structured_outputs(request)
    return params if spec is None else dataclasses.replace(params, structured_outputs=spec)


def _structured_outputs(request: tandem_pb2.GenerateRequest) -> StructuredOutputsParams | None:
    """The request's structured outputs (None when unset); ValueError naming the field when the spec is
    malformed or does not compile (engine/structured/grammars.py check_spec)."""
    if not request.HasField("structured_outputs"):
        return None
    kind = request.structured_outputs.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs is set but gives no kind (json_schema, regex, choice, grammar, "
                         "json_object)")
    value = getattr(request.structured_outputs, kind)
    if kind == "choice":
        value = list(value.choices)
    fields = {"json" if kind == "json_schema" else kind: value}
    try:
        spec = StructuredOutputsParams(**fields)
        check_spec(spec)
    except ValueError as error:
        raise ValueError(f"structured_outputs.{kind}: {error}") from None
    return spec


def _status_of(error: Exception, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of an exception raised by a backend."""
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, BackendOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, BackendUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    return grpc.StatusCode.INTERNAL, report_internal_error(logger, error, request_id)


def _response(request_id: str, chunk: GenerationChunk) -> tandem_pb2.GenerateResponse:
    response = tandem_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text,
                                           finish_reason=chunk.finish_reason or "", request_id=request_id,
                                           index=chunk.index)
    for lp in chunk.logprobs or ():
        response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top_ids=lp.top_ids,
                              top_logprobs=lp.top_logprobs)
    if chunk.timing is not None:
        t = chunk.timing
        response.timing.CopyFrom(tandem_pb2.Timing(
            queue_ms=t.queue_ms, prefill_ms=t.prefill_ms, transfer_ms=t.transfer_ms, ttft_ms=t.ttft_ms,
            kv_bytes=t.kv_bytes, prefill_worker=t.prefill_worker, decode_worker=t.decode_worker,
            migrations=t.migrations, transfer_exposed_ms=t.transfer_exposed_ms, prefill_location=t.prefill_location,
            decode_cached_tokens=t.decode_cached_tokens))
    return response


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects Generate calls without `authorization: Bearer KEY` or `x-api-key: KEY` metadata
    (UNAUTHENTICATED); other methods (Health) pass."""

    def __init__(self, check: ApiKeyCheck) -> None:
        self._check = check

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != GENERATE_METHOD:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._check.accepts(metadata.get("authorization"), metadata.get("x-api-key")):
            return handler
        return grpc.unary_stream_rpc_method_handler(
            _deny_unauthenticated, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


async def _deny_unauthenticated(request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or invalid API key: send metadata 'authorization: Bearer <key>'")


async def start_grpc_server(backend: Backend, config: GrpcServerConfig = GrpcServerConfig(),
                            metrics: ServingMetrics | None = None,
                            input_pool: InputPool | None = None) -> tuple[grpc.aio.Server, int]:
    """Start serving `backend` (from inside a running asyncio loop) and return the server and the
    port it bound. With `metrics`, requests are recorded there under frontend="grpc". `input_pool`: the
    InputPool large prompts are prepared on, the caller's to close (pass the HTTP front end's too, to bound
    both together); None: one of config.input_limits, closed when the server stops. Stop it with
    `await server.stop(grace)`; the backend is the caller's to shut down."""
    if metrics is not None:
        backend = MeteredBackend(backend, metrics, "grpc")
    interceptors = [ApiKeyInterceptor(ApiKeyCheck(config.api_key))] if config.api_key else []
    server = grpc.aio.server(interceptors=interceptors, options=config.server_options())
    inputs = input_pool if input_pool is not None else InputPool(config.input_limits)
    add_tandem_service(TandemService(backend, inputs), server)
    health = await add_operator_services(server, backend, config.health_poll_s)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise ValueError(f"cannot bind the gRPC server to {config.host}:{config.port}")
    await server.start()
    health.follow(server, on_stop=inputs.close if input_pool is None else None)
    logger.info("gRPC front end on %s:%d serving %s", config.host, port, backend.model_name)
    return server, port
