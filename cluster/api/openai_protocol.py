"""Parsing and validation of OpenAI-compatible requests (/v1/completions, /v1/chat/completions).

Everything a client gets wrong becomes an OpenAIError (HTTP status + OpenAI's error body) before any
backend sees the request. Fields are checked strictly: wrong types are rejected, fields that would
change the result but are not implemented (n > 1, best_of, echo, tools, ...) are accepted only at their
no-op value, and unknown fields are rejected, as OpenAI does. The logits processors and logprobs fields
are parsed in openai_sampling.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from cluster.api.json_body import load_json_object
from cluster.api.openai_sampling import PROCESSOR_FIELDS, sampling_extras
from cluster.api.request_validation import (InvalidField, build_sampling_params, check_chat_roles,
                                            check_prompt_token_ids, encode_prompt)
from engine.sampling_params import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                            "stop_token_ids", "stream", "stream_options", "ignore_eos", "return_token_ids",
                            "user", "metadata", *PROCESSOR_FIELDS})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Fields that would change the result; only their no-op value (or null) is accepted.
NO_OP_VALUES = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "tools": ([],),
    "tool_choice": ("none",), "response_format": ({"type": "text"},), "parallel_tool_calls": (True, False),
}


class OpenAIError(Exception):
    """An error answered with `status` and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, code: str = "invalid_value", param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the model's name, tokenizer and context length. `name` is
    reported; `other_names` are accepted as `model` too (--served-model-name A B: name A, other_names (B,))."""

    name: str
    tokenizer: object
    max_model_len: int
    other_names: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.other_names)


@dataclass(frozen=True)
class ParsedRequest:
    """A valid completion or chat request, ready for the backend."""

    model: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object; 400 for anything else (NaN and Infinity, nesting past
    json_body.MAX_JSON_DEPTH, and strings with lone surrogates, which name their field, included)."""
    try:
        return load_json_object(raw)
    except InvalidField as error:
        raise bad_request(str(error), param=error.field) from error
    except ValueError as error:
        raise bad_request(str(error), code="invalid_json") from error


def parse_completion_request(body: dict, served: ServedModel) -> ParsedRequest:
    """POST /v1/completions: `prompt` is one string or one list of token ids."""
    _check_fields(body, COMPLETION_FIELDS)
    model = _model(body, served)
    prompt = body.get("prompt")
    try:
        if isinstance(prompt, str):
            ids = encode_prompt(prompt, served.tokenizer, served.max_model_len)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = check_prompt_token_ids(prompt, served.tokenizer, served.max_model_len)
        elif isinstance(prompt, list):
            raise bad_request("prompt must be one string or one list of token ids; batched prompts are "
                              "not supported, send one request per prompt", code="unsupported_value",
                              param="prompt")
        else:
            raise bad_request("prompt is required: a string or a list of token ids", param="prompt")
    except ValueError as error:
        raise bad_request(str(error), param="prompt") from error
    max_tokens = _int_field(body, "max_tokens")
    return _parsed(body, model, ids, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)


def parse_chat_request(body: dict, served: ServedModel) -> ParsedRequest:
    """POST /v1/chat/completions: messages rendered with the chat template (generation prompt added),
    then encoded without special tokens (the template writes them). max_tokens defaults to the rest of
    the context."""
    _check_fields(body, CHAT_FIELDS)
    model = _model(body, served)
    messages = _messages(body.get("messages"))
    try:
        check_chat_roles(messages, served.tokenizer)
        text = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = encode_prompt(text, served.tokenizer, served.max_model_len, add_special_tokens=False,
                            field="messages")
    except ValueError as error:
        raise bad_request(str(error), param=getattr(error, "field", "messages")) from error
    max_tokens = _int_field(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    if max_tokens is None:
        max_tokens = max(1, served.max_model_len - len(ids))
    return _parsed(body, model, ids, max_tokens, chat=True)


def _parsed(body: dict, model: str, ids: tuple[int, ...], max_tokens: int, chat: bool = False) -> ParsedRequest:
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad_request("stream_options must be an object with at most 'include_usage'",
                          param="stream_options")
    include_usage = _bool_field(options or {}, "include_usage")
    return ParsedRequest(model, ids, _sampling_params(body, max_tokens, chat), stream, include_usage,
                         _bool_field(body, "return_token_ids"))


def _sampling_params(body: dict, max_tokens: int, chat: bool) -> SamplingParams:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not _is_list_of(stop, str):
        raise bad_request("stop must be a string or a list of strings", code="invalid_type", param="stop")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not _is_list_of(stop_token_ids, int):
        raise bad_request("stop_token_ids must be a list of integers", code="invalid_type",
                          param="stop_token_ids")
    try:
        return build_sampling_params(
            max_tokens=max_tokens, temperature=_number_field(body, "temperature"),
            top_p=_number_field(body, "top_p"), top_k=_int_field(body, "top_k"), seed=_int_field(body, "seed"),
            stop=stop, stop_token_ids=stop_token_ids, ignore_eos=_bool_field(body, "ignore_eos"),
            **sampling_extras(body, chat))
    except ValueError as error:  # InvalidField names its field
        raise bad_request(str(error), param=getattr(error, "field", None)) from error


def _check_fields(body: dict, known: frozenset) -> None:
    for name, value in body.items():
        if name in NO_OP_VALUES:
            if not _is_no_op(value, NO_OP_VALUES[name]):
                raise bad_request(f"{name}={json.dumps(value)} is not supported by this server",
                                  code="unsupported_parameter", param=name)
        elif name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {name}", code="unknown_parameter",
                              param=name)


def _is_no_op(value, allowed: tuple) -> bool:
    return value is None or any(type(value) is type(a) and value == a for a in allowed)


def _model(body: dict, served: ServedModel) -> str:
    model = body.get("model")
    if model is None:
        return served.name
    if not isinstance(model, str):
        raise bad_request("model must be a string", code="invalid_type", param="model")
    if model not in served.names:
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                               f"{', '.join(f'`{name}`' for name in served.names)}",
                          code="model_not_found", param="model")
    return model


def _messages(messages) -> list[dict]:
    """Chat messages as {"role", "content"} dicts with text content (text parts are joined)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    cleaned = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{index}] must be an object with a string 'role'", param="messages")
        cleaned.append({"role": message["role"], "content": _content(message.get("content"), index)})
    return cleaned


def _content(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(part["text"] for part in content)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts",
                      code="unsupported_value", param="messages")


def _is_list_of(value, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)


def _int_field(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad_request(f"{name} must be an integer, got {json.dumps(value)}", code="invalid_type", param=name)
    return value


def _number_field(body: dict, name: str) -> float | int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise bad_request(f"{name} must be a number, got {json.dumps(value)}", code="invalid_type", param=name)
    return value


def _bool_field(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {json.dumps(value)}", code="invalid_type", param=name)
    return bool(value)


# Shared with the routes beside generation (/tokenize, /detokenize: cluster/api/utility_routes.py).
requested_model, chat_messages, bool_field = _model, _messages, _bool_field
