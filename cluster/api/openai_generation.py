"""One parsed OpenAI request through the backend, answered whole (JSON) or streamed (SSE).

Each prompt of the request is a GenerationRequest of its own (`<request id>-<prompt index>` when there are
several), all sent to the backend at once; each asks for the request's n samples. ChoiceStreams merges their
chunks into choices. An error before every prompt has its first chunk is the answer's status (400, 429, 503,
...); a later one ends a stream with a `data: {"error": ...}` event, or a whole answer with its status.
"""
from __future__ import annotations

import dataclasses
import json
import logging

from aiohttp import web

from cluster.api.choice_streams import ChoiceStreams
from cluster.api.internal_errors import report_internal_error
from cluster.api.openai_fields import OpenAIError
from cluster.api.openai_protocol import ParsedRequest
from cluster.api.openai_responses import ChoiceResult, ResponseShape
from cluster.api.request_validation import field_named_by
from cluster.backend import Backend, BackendOverloaded, BackendUnavailable, GenerationRequest
from engine.sampling_params import SamplingParams

logger = logging.getLogger("tandem.cluster.http")
SAMPLING_FIELDS = tuple(field.name for field in dataclasses.fields(SamplingParams))


def backend_error(error: Exception) -> OpenAIError:
    """The HTTP answer to an exception raised by a backend."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, BackendOverloaded):
        return OpenAIError(429, str(error), type="rate_limit_error", code="overloaded")
    if isinstance(error, BackendUnavailable):
        return OpenAIError(503, str(error), type="service_unavailable", code="backend_unavailable")
    if isinstance(error, ValueError):  # InvalidField names its field; the engine's messages start with it
        param = getattr(error, "field", None) or field_named_by(str(error), SAMPLING_FIELDS)
        return OpenAIError(400, str(error), code="invalid_value", param=param)
    return OpenAIError(500, report_internal_error(logger, error, None), type="internal_error",
                       code="internal_error")


def generation_requests(call: ParsedRequest, request_id: str, arrival: float) -> list[GenerationRequest]:
    if len(call.prompts) == 1:
        return [GenerationRequest(request_id, call.prompts[0], call.params, arrival)]
    return [GenerationRequest(f"{request_id}-{i}", ids, call.params, arrival) for i, ids in enumerate(call.prompts)]


async def respond(request: web.Request, backend: Backend, call: ParsedRequest, shape: ResponseShape,
                  requests: list[GenerationRequest]) -> web.StreamResponse:
    """Run `requests` (the prompts of `call`) and answer: SSE when call.stream, else one JSON body."""
    try:
        streams = ChoiceStreams(backend, requests, call.params.n)
        await streams.open()
    except Exception as error:
        raise backend_error(error) from error
    try:
        if call.stream:
            return await _stream(request, call, shape, streams)
        return web.json_response(await _whole(call, shape, streams))
    finally:
        await streams.aclose()


async def _whole(call: ParsedRequest, shape: ResponseShape, streams: ChoiceStreams) -> dict:
    choices = {index: ChoiceResult(index, index // call.params.n) for index in range(call.num_choices)}
    timing = None
    try:
        async for item in streams:
            choices[item.choice].add(item.chunk)
            timing = item.chunk.timing or timing  # the sample that finished last: the whole request's
    except Exception as error:
        raise backend_error(error) from error
    return shape.full(list(choices.values()), call.num_prompt_tokens, timing)


async def _stream(request: web.Request, call: ParsedRequest, shape: ResponseShape,
                  streams: ChoiceStreams) -> web.StreamResponse:
    """SSE: `data: {json}` per object, `data: [DONE]` last."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    try:
        await _stream_events(response, call, shape, streams)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left; closing the streams aborts the requests
        pass
    return response


async def _stream_events(response: web.StreamResponse, call: ParsedRequest, shape: ResponseShape,
                         streams: ChoiceStreams) -> None:
    """The events of the whole request. An error after the headers went out is sent as a
    `data: {"error": ...}` event."""
    try:
        for opening in shape.stream_opening(call.num_choices):
            await _send_event(response, opening)
        completion_tokens = 0
        async for item in streams:
            completion_tokens += len(item.chunk.token_ids)
            for payload in shape.stream_objects(item.choice, item.chunk, call.include_usage, item.prompt):
                await _send_event(response, payload)
        if call.include_usage:
            await _send_event(response, shape.stream_usage(call.num_prompt_tokens, completion_tokens))
    except ConnectionResetError:
        raise
    except Exception as error:
        await _send_event(response, backend_error(error).body())


async def _send_event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n")
