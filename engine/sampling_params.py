"""SamplingParams: how one request picks its tokens and when it stops (mirrors vLLM's)."""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TOP_K = 2 ** 31 - 1  # larger values mean "no cut" anyway; this keeps them inside int tensors
GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM: below this, dividing logits by it overflows to inf / NaN


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; validated on construction (ValueError on bad values).

    temperature below 1e-5 (0 included) means greedy; top_k -1 means no top-k cut; top_p 1.0 means no
    nucleus cut. A seeded request draws the token at position p from (seed, p) alone, so it gets the
    same tokens wherever it runs (colocated, prefilled on one worker and decoded on another, migrated).
    `stop` strings end generation and are cut from the returned text; `stop_token_ids` end it and
    stay in `token_ids`. The model's EOS ends it too unless `ignore_eos`.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] | str | list[str] | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1 or self.top_k > MAX_TOP_K:
            raise ValueError(f"top_k must be -1 (disabled) or in [1, {MAX_TOP_K}], got {self.top_k}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2 ** 63:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalize_ids(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _normalize_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    stop = tuple(stop)
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    return stop


def _normalize_ids(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    ids = tuple(ids)
    for token_id in ids:
        _check_int("stop_token_ids entry", token_id)
        if token_id < 0:
            raise ValueError(f"stop_token_ids must be >= 0, got {token_id}")
    return ids
