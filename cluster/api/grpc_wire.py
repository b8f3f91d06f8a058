"""How `tandem.v1.Tandem` is registered on a grpc.aio server: as the generated code does, except that a
GenerateRequest that does not parse reaches the handler as an UndecodableRequest, and one over
OFF_LOOP_MESSAGE_BYTES as a LargeRequest, its bytes not yet parsed.

protobuf refuses a string field whose bytes are not UTF-8 (the wire form of a lone surrogate, say) while
deserializing, before any handler runs, and grpc then answers UNKNOWN with the parser's text. Decoding
leniently lets Generate answer INVALID_ARGUMENT naming the field, like any other bad input. grpc.aio
deserializes on the event loop's thread, and parsing 3.5 MB of prompt_token_ids (1.3 million ids) holds the GIL
for 27 ms: a large message is parsed by the handler on the InputPool instead (LargeRequest.decoded).
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from proto import tandem_pb2

SERVICE = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name
OFF_LOOP_MESSAGE_BYTES = 256 * 1024  # parsed on the loop in 2 ms at most
_STRING_FIELDS = {f.number: f.name for f in tandem_pb2.GenerateRequest.DESCRIPTOR.fields
                  if f.type == f.TYPE_STRING}


@dataclass(frozen=True)
class UndecodableRequest:
    """What arrived instead of a GenerateRequest; `message` says why, naming the field when it can."""

    message: str


@dataclass(frozen=True)
class LargeRequest:
    """A GenerateRequest too large to parse on the event loop: its bytes, parsed by `decoded()` off the loop."""

    raw: bytes

    def decoded(self) -> tandem_pb2.GenerateRequest:
        """The request; ValueError saying what is wrong (naming the field when it can) when it does not parse."""
        request = _decoded(self.raw)
        if isinstance(request, UndecodableRequest):
            raise ValueError(request.message)
        return request


def decode_generate_request(raw: bytes) -> tandem_pb2.GenerateRequest | UndecodableRequest | LargeRequest:
    """grpc's request deserializer for Generate (see the module docstring)."""
    return LargeRequest(raw) if len(raw) > OFF_LOOP_MESSAGE_BYTES else _decoded(raw)


def _decoded(raw: bytes) -> tandem_pb2.GenerateRequest | UndecodableRequest:
    try:
        return tandem_pb2.GenerateRequest.FromString(raw)
    except DecodeError:
        field = _non_utf8_string_field(raw)
        if field is not None:
            return UndecodableRequest(f"{field} is not valid UTF-8 text")
        return UndecodableRequest("the request is not a valid tandem.v1.GenerateRequest")


def _non_utf8_string_field(raw: bytes) -> str | None:
    """The name of the first top-level string field of `raw` (a serialized GenerateRequest) whose bytes are
    not UTF-8; None if there is none or the wire format itself is broken."""
    position = 0
    try:
        while position < len(raw):
            key, position = _varint(raw, position)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, position = _varint(raw, position)
            elif wire_type in (1, 5):
                position += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                length, position = _varint(raw, position)
                value, position = raw[position:position + length], position + length
                if number in _STRING_FIELDS and not _is_utf8(value):
                    return _STRING_FIELDS[number]
            else:
                return None
    except IndexError:
        return None
    return None


def _varint(raw: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = raw[position]
        value |= (byte & 0x7F) << shift
        position, shift = position + 1, shift + 7
        if not byte & 0x80 or shift > 63:
            return value, position


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def add_tandem_service(servicer, server: grpc.aio.Server) -> None:
    """tandem_pb2_grpc.add_TandemServicer_to_server with Generate's requests decoded leniently."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=decode_generate_request,
            response_serializer=tandem_pb2.GenerateResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=tandem_pb2.HealthRequest.FromString,
            response_serializer=tandem_pb2.HealthResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
