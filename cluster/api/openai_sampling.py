"""The OpenAI request fields of n, the logits processors, logprobs and the text options, parsed into
build_sampling_params' keyword arguments (request_validation.py checks their values).

Both endpoints: n (samples per prompt, 1..128), presence_penalty, frequency_penalty (OpenAI's, in [-2, 2]),
repetition_penalty, min_p, min_tokens (vLLM's extensions), logit_bias ({"token id": bias in [-100, 100]},
JSON keys are strings of ASCII digits).
Logprobs: completions take `logprobs` (0..20: the sampled token plus that many alternatives); chat takes
`logprobs: true` and `top_logprobs` (0..20; only with logprobs true, 0 or null otherwise). Anything
malformed is an InvalidField naming the field (HTTP 400 with it as `param`). vLLM's text options:
include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens (booleans).
"""
from __future__ import annotations

import json

from cluster.api.request_validation import TEXT_ARGS, InvalidField
from engine.sampling_params import MAX_LOGPROBS

MAX_TOKEN_ID_DIGITS = 10  # token ids are int32; longer keys are refused before int() reads them
NUMBER_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
EXTRA_FIELDS = (*NUMBER_FIELDS, "min_tokens", "logit_bias", "n", *TEXT_ARGS)


def sampling_extras(body: dict, chat: bool, echo: bool = False) -> dict:
    """build_sampling_params keyword arguments of the processors and logprobs fields of `body`; a completion
    that echoes its prompt with logprobs asks for as many prompt logprobs."""
    extras = {name: _number(body, name) for name in NUMBER_FIELDS}
    extras["min_tokens"] = _integer(body, "min_tokens")
    extras["n"] = _integer(body, "n")
    extras["logit_bias"] = _logit_bias(body.get("logit_bias"))
    extras["logprobs"] = _chat_logprobs(body) if chat else _integer(body, "logprobs")
    if echo:
        extras["prompt_logprobs"] = extras["logprobs"]
    extras.update({name: _boolean(body, name) for name in TEXT_ARGS})
    return extras


def _chat_logprobs(body: dict) -> int | None:
    """`logprobs: true` -> top_logprobs (0 when absent); false or null -> None (top_logprobs 0 or null)."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidField("logprobs", f"logprobs must be a boolean, got {json.dumps(wanted)}")
    top = _integer(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidField("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}")
    if not wanted:
        if top:
            raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return 0 if top is None else top


def _logit_bias(value) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidField("logit_bias", "logit_bias must be an object mapping token ids to biases")
    bias = {}
    for key, amount in value.items():
        # int() would also take "+5", " 5", "5_0" and other scripts' digits ("１２"): only ASCII digits are ids
        if not (key.isascii() and key.isdigit()) or len(key) > MAX_TOKEN_ID_DIGITS:
            raise InvalidField("logit_bias", f"logit_bias keys must be token ids (ASCII digits), got "
                                             f"{json.dumps(key[:32])}")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise InvalidField("logit_bias", f"logit_bias[{key}] must be a number, got {json.dumps(amount)}")
        bias[int(key)] = amount
    return bias


def _number(body: dict, name: str) -> float | int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise InvalidField(name, f"{name} must be a number, got {json.dumps(value)}")
    return value


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidField(name, f"{name} must be an integer, got {json.dumps(value)}")
    return value


def _boolean(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidField(name, f"{name} must be a boolean, got {json.dumps(value)}")
    return value
