"""Checks shared by the gRPC and HTTP front ends: prompts to token ids, and sampling settings.

Everything here raises ValueError with a message meant for the client; the front ends turn it into
INVALID_ARGUMENT or an HTTP 400. Nothing invalid reaches a backend.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from engine.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
OFF_LOOP_INPUT_CHARS = 8192          # inputs longer than this are tokenized on a worker thread
SEED_RANGE = (-(2 ** 63), 2 ** 63)  # what a torch.Generator takes and gRPC's int64 carries
MAX_TOP_K = 2 ** 31 - 1              # the sampler builds an int64 tensor of top_k values


def encode_prompt(text: str, tokenizer, max_model_len: int, add_special_tokens: bool = True) -> tuple[int, ...]:
    """The token ids of a text prompt (with the tokenizer's BOS unless told otherwise), checked
    like any token-id prompt."""
    if not isinstance(text, str):
        raise ValueError(f"prompt must be a string, got {type(text).__name__}")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return check_prompt_token_ids(ids, tokenizer, max_model_len)


def check_prompt_token_ids(ids: Sequence, tokenizer, max_model_len: int) -> tuple[int, ...]:
    """`ids` as a tuple if it is a non-empty list of token ids of the tokenizer's vocabulary that
    fits the model's context."""
    if len(ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if len(ids) > max_model_len:  # before any per-token work
        raise ValueError(f"the prompt has {len(ids)} tokens, more than the model's context of "
                         f"{max_model_len} tokens")
    vocab = tokenizer.vocab_size
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab:
            raise ValueError(f"prompt token id {token_id!r} is outside the vocabulary [0, {vocab})")
    return tuple(ids)


def build_sampling_params(*, max_tokens: int | None = None, temperature: float | None = None,
                          top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                          stop: Sequence[str] | str | None = None,
                          stop_token_ids: Sequence[int] | None = None,
                          ignore_eos: bool = False) -> SamplingParams:
    """SamplingParams from wire values; None takes SamplingParams' default. Rejects NaN and
    infinities, seeds outside int64, more than MAX_STOP_STRINGS or overlong stop strings, and more than
    MAX_STOP_TOKEN_IDS stop token ids, on top of SamplingParams' own checks."""
    values = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "seed": seed, "stop": stop, "stop_token_ids": stop_token_ids}
    for name in ("temperature", "top_p"):
        value = values[name]
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if isinstance(seed, int) and not isinstance(seed, bool) and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"seed must fit in a signed 64-bit integer, got {seed}")
    if isinstance(top_k, int) and top_k > MAX_TOP_K:
        raise ValueError(f"top_k must be at most {MAX_TOP_K}, got {top_k}")
    _check_stop(stop)
    if isinstance(stop_token_ids, (list, tuple)) and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported, got {len(stop_token_ids)}")
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be a boolean, got {ignore_eos!r}")
    given = {name: value for name, value in values.items() if value is not None}
    return SamplingParams(ignore_eos=ignore_eos, **given)


def _check_stop(stop) -> None:
    if stop is None or isinstance(stop, str):
        stop = [] if stop is None else [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
    for text in stop:
        if isinstance(text, str) and len(text) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters")
