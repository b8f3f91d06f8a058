"""OpenAI-shaped errors and the typed readers of request fields the OpenAI routes share.

Every reader raises an OpenAIError (400, `param` naming the field) for a value of the wrong type; None
(absent or null) is returned as None so that callers apply their defaults.
"""
from __future__ import annotations

import json

from aiohttp import web


class OpenAIError(Exception):
    """An error answered with `status` and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(error: OpenAIError, close_connection: bool = False) -> web.Response:
    """`error` as an HTTP response (its status, OpenAI's error body); close_connection: the connection closes
    once it is sent (a request whose body is left unread, or a client that stalled)."""
    response = web.json_response(error.body(), status=error.status)
    if close_connection:
        response.force_close()
    return response


def bad_request(message: str, *, code: str = "invalid_value", param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def unsupported(message: str, param: str) -> OpenAIError:
    return bad_request(message, code="unsupported_parameter", param=param)


def check_fields(body: dict, known: frozenset, no_op_values: dict) -> None:
    """400 for a field that is neither known nor, at its no-op value (or null), in no_op_values (name ->
    the values that change nothing)."""
    for name, value in body.items():
        if name in no_op_values:
            if not is_no_op(value, no_op_values[name]):
                raise unsupported(f"{name}={json.dumps(value)} is not supported by this server", param=name)
        elif name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {name}", code="unknown_parameter",
                              param=name)


def is_no_op(value, allowed: tuple) -> bool:
    return value is None or any(type(value) is type(a) and value == a for a in allowed)


def is_list_of(value, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)


def int_field(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad_request(f"{name} must be an integer, got {json.dumps(value)}", code="invalid_type", param=name)
    return value


def number_field(body: dict, name: str) -> float | int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise bad_request(f"{name} must be a number, got {json.dumps(value)}", code="invalid_type", param=name)
    return value


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {json.dumps(value)}", code="invalid_type", param=name)
    return value
