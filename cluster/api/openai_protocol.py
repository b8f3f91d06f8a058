"""Parsing and validation of OpenAI-compatible requests (/v1/completions, /v1/chat/completions).

Everything a client gets wrong becomes an OpenAIError (HTTP status + OpenAI's error body) before any
backend sees the request. Fields are checked strictly: wrong types are rejected, fields that would
change the result but are not implemented (best_of, echo, suffix, ...) are accepted only at their
no-op value, and unknown fields are rejected, as OpenAI does. The logits processors and logprobs fields
are parsed in openai_sampling.py, the chat messages and template options in openai_chat.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cluster.api.json_body import load_json_object
from cluster.api.openai_chat import TEMPLATE_FIELDS, render_chat_prompt
from cluster.api.openai_fields import (OpenAIError, bad_request, bool_field, check_fields, int_field, is_list_of,
                                       number_field)
from cluster.api.openai_prompts import completion_prompts
from cluster.api.openai_sampling import EXTRA_FIELDS, sampling_extras
from cluster.api.openai_structured import STRUCTURED_FIELDS, structured_outputs
from cluster.api.openai_tools import ToolForcing, forced_tools
from cluster.api.prompt_encoder import PromptEncoder
from cluster.api.request_validation import InvalidField, build_sampling_params
from engine.sampling_params import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                            "stop_token_ids", "stream", "stream_options", "ignore_eos", "return_token_ids",
                            "user", "metadata", *EXTRA_FIELDS, *STRUCTURED_FIELDS})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _COMMON_FIELDS | TEMPLATE_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Fields that would change the result; only their no-op value (or null) is accepted.
NO_OP_VALUES = {"best_of": (1,), "echo": (False,), "suffix": ("",)}
COMPLETION_NO_OPS = {name: values for name, values in NO_OP_VALUES.items() if name != "echo"}


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the model's name, tokenizer and context length. `name` is
    reported; `other_names` are accepted as `model` too (--served-model-name A B: name A, other_names (B,)).
    `encoder`: the PromptEncoder of the tokenizer and context, built here once."""

    name: str
    tokenizer: object
    max_model_len: int
    other_names: tuple[str, ...] = ()
    encoder: PromptEncoder = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder", PromptEncoder(self.tokenizer, self.max_model_len))

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.other_names)


@dataclass(frozen=True)
class ParsedRequest:
    """A valid completion or chat request, ready for the backend: one or more prompts (a completion's
    batch; a chat has one), each sampled params.n times."""

    model: str
    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    echo: tuple[tuple[str, tuple[int, ...]], ...] | None = None  # completions: each prompt's (text, ids)
    tool_forcing: ToolForcing | None = None  # chat: tool_choice forces a call (openai_tools.py)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)


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
    """POST /v1/completions: `prompt` is a string, a list of token ids, or a batch: a list of strings or a
    list of token-id lists (openai_prompts.py). `echo`: each choice starts with its prompt (with `logprobs`,
    the prompt tokens' logprobs too: SamplingParams.prompt_logprobs)."""
    check_fields(body, COMPLETION_FIELDS, COMPLETION_NO_OPS)
    model = requested_model(body, served)
    prompts, texts = completion_prompts(body.get("prompt"), served)
    max_tokens = _max_tokens(body, ("max_tokens",), prompts, served)
    echo = bool_field(body, "echo")
    call = _parsed(body, model, prompts, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                   echo=echo)
    if not echo:
        return call
    skip = call.params.skip_special_tokens
    echoed = tuple((served.tokenizer.decode(ids, skip_special_tokens=skip) if text is None else text, ids)
                   for text, ids in zip(texts, prompts))
    return dataclasses.replace(call, echo=echoed)


def parse_chat_request(body: dict, served: ServedModel) -> ParsedRequest:
    """POST /v1/chat/completions: messages rendered with the chat template (openai_chat.py), then encoded
    without special tokens (the template writes them). max_tokens defaults to the rest of the context."""
    _check_fields(body, CHAT_FIELDS)
    model = requested_model(body, served)
    text = render_chat_prompt(body, served.tokenizer)
    try:
        ids = served.encoder.encode_prompt(text, add_special_tokens=False, field="messages")
    except ValueError as error:
        raise bad_request(str(error), param=getattr(error, "field", "messages")) from error
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), (ids,), served)
    if max_tokens is None:
        max_tokens = max(1, served.max_model_len - len(ids))
    call = _parsed(body, model, (ids,), max_tokens, chat=True)
    forced = forced_tools(body)
    if forced is None:
        return call
    if call.params.structured_outputs is not None:
        raise bad_request("tool_choice forcing a call cannot be combined with response_format / structured_outputs",
                          param="tool_choice")
    forcing, spec = forced
    return dataclasses.replace(call, params=constrained(call.params, spec), tool_forcing=forcing)


def _max_tokens(body: dict, names: tuple[str, ...], prompts, served: ServedModel) -> int | None:
    """The first of the fields `names` given; 400 naming it when a prompt and that many tokens do not fit
    the model's context (vLLM's check; when none is given, generation stops at the context instead)."""
    for name in names:
        value = int_field(body, name)
        if value is None:
            continue
        longest = max(len(prompt) for prompt in prompts)
        if value > 0 and longest + value > served.max_model_len:
            raise bad_request(f"This model's maximum context length is {served.max_model_len} tokens. However, "
                              f"you requested {longest + value} tokens ({longest} in the prompt, {value} in the "
                              f"completion: {name}). Please reduce the length of the prompt or {name}.", param=name)
        return value
    return None


def _parsed(body: dict, model: str, prompts: tuple[tuple[int, ...], ...], max_tokens: int,
            chat: bool = False, echo: bool = False) -> ParsedRequest:
    stream = bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad_request("stream_options must be an object with at most 'include_usage'",
                          param="stream_options")
    include_usage = bool_field(options or {}, "include_usage")
    return ParsedRequest(model, prompts, _sampling_params(body, max_tokens, chat, echo), stream, include_usage,
                         bool_field(body, "return_token_ids"))


def _sampling_params(body: dict, max_tokens: int, chat: bool, echo: bool) -> SamplingParams:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not is_list_of(stop, str):
        raise bad_request("stop must be a string or a list of strings", code="invalid_type", param="stop")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not is_list_of(stop_token_ids, int):
        raise bad_request("stop_token_ids must be a list of integers", code="invalid_type",
                          param="stop_token_ids")
    try:
        params = build_sampling_params(
            max_tokens=max_tokens, temperature=number_field(body, "temperature"),
            top_p=number_field(body, "top_p"), top_k=int_field(body, "top_k"), seed=int_field(body, "seed"),
            stop=stop, stop_token_ids=stop_token_ids, ignore_eos=bool_field(body, "ignore_eos"),
            **sampling_extras(body, chat, echo))
    except ValueError as error:  # InvalidField names its field
        raise bad_request(str(error), param=getattr(error, "field", None)) from error
    return constrained(params, structured_outputs(body))  # response_format, structured_outputs, guided_*


def constrained(params: SamplingParams, spec) -> SamplingParams:
    """params with `spec` as its structured_outputs (params itself for None); 400 naming min_tokens, which
    cannot be combined with it."""
    if spec is None:
        return params
    try:
        return dataclasses.replace(params, structured_outputs=spec)
    except ValueError as error:
        raise bad_request(str(error), param="min_tokens") from error


def _check_fields(body: dict, known: frozenset) -> None:
    check_fields(body, known, NO_OP_VALUES)


def requested_model(body: dict, served: ServedModel) -> str:
    """The `model` asked for (the first served name when absent); 404 for a name not served."""
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


__all__ = ["OpenAIError", "ParsedRequest", "ServedModel", "parse_chat_request", "parse_completion_request",
           "parse_json_body", "requested_model"]
