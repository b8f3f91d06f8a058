"""Checks shared by the gRPC and HTTP front ends: text, token-id prompts, chat roles and sampling settings (text
prompts are encoded by prompt_encoder.py, with these checks).

Everything here raises ValueError with a message meant for the client; the front ends turn it into
INVALID_ARGUMENT or an HTTP 400. Nothing invalid reaches a backend.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from cluster.backend import InvalidField
from engine.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
OFF_LOOP_INPUT_CHARS = 8192          # inputs longer than this are prepared off the event loop (input_pool.py)
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # an HTTP request body, a received gRPC message: the same default bound
SEED_RANGE = (-(2 ** 63), 2 ** 63)  # what a torch.Generator takes and gRPC's int64 carries
MAX_TOP_K = 2 ** 31 - 1              # the sampler builds an int64 tensor of top_k values
MAX_LOGIT_BIAS_ENTRIES = 1024        # each biased token costs the sampler a little every step
PROCESSOR_ARGS = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                  "logit_bias", "logprobs", "prompt_logprobs", "n")
TEXT_ARGS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")
STANDARD_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
__all__ = ["InvalidField"]  # defined with the Backend contract, which raises it too


def check_text(text: str, field: str) -> None:
    """InvalidField unless `text` is Unicode text that UTF-8 can carry (a lone surrogate such as the
    JSON escape "\\ud800" cannot be; no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidField(field, f"{field} is not valid Unicode text: it has a lone surrogate "
                                  f"U+{ord(text[error.start]):04X} at character {error.start}") from None


def check_chat_roles(messages: Sequence[dict], tokenizer) -> None:
    """InvalidField("messages[i].role") for a role that is neither one of STANDARD_CHAT_ROLES nor named
    in the chat template as a string literal (a template that handles, say, "ipython" accepts it)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    for index, message in enumerate(messages):
        role = message.get("role")
        if not _accepted_role(role, template):
            raise InvalidField(f"messages[{index}].role", f"messages[{index}].role {role!r} is not a chat role: "
                                                          f"use one of {', '.join(STANDARD_CHAT_ROLES)}")


def _accepted_role(role, template: str) -> bool:
    if role in STANDARD_CHAT_ROLES:
        return True
    plain = isinstance(role, str) and role.strip() and not set(role) & set("'\"\\{}%")
    return bool(plain) and (f"'{role}'" in template or f'"{role}"' in template)


def check_prompt_token_ids(ids: Sequence, tokenizer, max_model_len: int) -> tuple[int, ...]:
    """`ids` as a tuple if it is a non-empty list of token ids of the tokenizer's vocabulary that
    fits the model's context."""
    if len(ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if len(ids) > max_model_len:  # before any per-token work
        raise context_error(f"{len(ids)} tokens", max_model_len)
    vocab = tokenizer.vocab_size
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab:
            raise ValueError(f"prompt token id {token_id!r} is outside the vocabulary [0, {vocab})")
    return tuple(ids)


def context_error(prompt_length: str, max_model_len: int) -> ValueError:
    """The error of a prompt past the context; `prompt_length` says how long it is ("1500 tokens")."""
    return ValueError(f"the prompt has {prompt_length}, more than the model's context of {max_model_len} tokens")


def build_sampling_params(*, max_tokens: int | None = None, temperature: float | None = None,
                          top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                          stop: Sequence[str] | str | None = None,
                          stop_token_ids: Sequence[int] | None = None,
                          ignore_eos: bool = False, **processors) -> SamplingParams:
    """SamplingParams from wire values; None takes SamplingParams' default. `processors`: the
    PROCESSOR_ARGS (logits processors, logprobs, n) and TEXT_ARGS, SamplingParams' names. Rejects NaN and
    infinities, seeds outside int64, more than MAX_STOP_STRINGS or overlong stop strings, more than
    MAX_STOP_TOKEN_IDS stop token ids and more than MAX_LOGIT_BIAS_ENTRIES logit_bias entries, on top
    of SamplingParams' own checks; a bad value is an InvalidField naming its field."""
    unknown = set(processors) - set(PROCESSOR_ARGS) - set(TEXT_ARGS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(unknown))}")
    values = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "seed": seed, "stop": stop, "stop_token_ids": stop_token_ids}
    _check_wire_bounds(values, ignore_eos, processors.get("logit_bias"))
    given = {name: value for name, value in {**values, **processors}.items() if value is not None}
    try:
        return SamplingParams(ignore_eos=ignore_eos, **given)
    except ValueError as error:  # SamplingParams' messages start with the field's name
        field = field_named_by(str(error), given)
        if field is None:
            raise
        raise InvalidField(field, str(error)) from None


def field_named_by(message: str, names) -> str | None:
    """The longest of `names` that `message` starts with as a word ("top_k must be ..." -> "top_k", but not
    "n" for "num_tokens ..."): SamplingParams' and the engine's messages about a request start with the
    field at fault. None when none does."""
    for name in sorted(names, key=len, reverse=True):
        rest = message[len(name):len(name) + 1]
        if message.startswith(name) and not (rest.isalnum() or rest == "_"):
            return name
    return None


def _check_wire_bounds(values: dict, ignore_eos, logit_bias) -> None:
    """InvalidField for what SamplingParams would take but the server does not: infinities, seeds past int64,
    too large a top_k, too many or too long stop strings, too many stop ids or logit_bias entries."""
    for name in ("temperature", "top_p"):
        value = values[name]
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidField(name, f"{name} must be a finite number, got {value!r}")
    seed, top_k, stop_token_ids = values["seed"], values["top_k"], values["stop_token_ids"]
    if isinstance(seed, int) and not isinstance(seed, bool) and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise InvalidField("seed", f"seed must fit in a signed 64-bit integer, got {seed}")
    if isinstance(top_k, int) and top_k > MAX_TOP_K:
        raise InvalidField("top_k", f"top_k must be at most {MAX_TOP_K}, got {top_k}")
    _check_stop(values["stop"])
    if isinstance(stop_token_ids, (list, tuple)) and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidField("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported, "
                                             f"got {len(stop_token_ids)}")
    if not isinstance(ignore_eos, bool):
        raise InvalidField("ignore_eos", f"ignore_eos must be a boolean, got {ignore_eos!r}")
    if isinstance(logit_bias, dict) and len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidField("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries are supported, "
                                         f"got {len(logit_bias)}")


def _check_stop(stop) -> None:
    """InvalidField("stop") for too many stop strings or not a list, ("stop[i]") for too long a string."""
    if stop is None or isinstance(stop, str):
        if isinstance(stop, str) and len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidField("stop", f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters")
        return
    if not isinstance(stop, (list, tuple)):
        raise InvalidField("stop", f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidField("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
    for index, text in enumerate(stop):
        if isinstance(text, str) and len(text) > MAX_STOP_STRING_CHARS:
            raise InvalidField(f"stop[{index}]", f"stop[{index}] has {len(text)} characters; stop strings may "
                                                 f"have at most {MAX_STOP_STRING_CHARS}")
