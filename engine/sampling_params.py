"""SamplingParams: how one request picks its tokens and when it stops (mirrors vLLM's)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from engine.structured_params import StructuredOutputsParams

MAX_TOP_K = 2 ** 31 - 1  # larger values mean "no cut" anyway; this keeps them inside int tensors
GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM: below this, dividing logits by it overflows to inf / NaN
MAX_LOGPROBS = 20        # top alternatives a request may ask for per token (vLLM's and OpenAI's 20)
MAX_LOGIT_BIAS = 100.0   # |bias| bound, as OpenAI's logit_bias
MAX_N = 128              # samples of one prompt per request


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; validated on construction (ValueError naming the field).

    n: independent samples of the prompt (vLLM's n; sample j of a seeded request uses seed + j).
    temperature below 1e-5 (0 included) means greedy; top_k -1 means no top-k cut; top_p 1.0 means no
    nucleus cut; min_p 0 means no min-p cut (else tokens below min_p x the top token's probability are
    cut). A seeded request draws the token at position p from (seed, p) alone, so it gets the
    same tokens wherever it runs (colocated, prefilled on one worker and decoded on another, migrated).
    `stop` strings end generation and are cut from the returned text; `stop_token_ids` end it and
    stay in `token_ids`. The model's EOS ends it too unless `ignore_eos`.

    Logits processors (vLLM's semantics, applied to greedy rows too, in this order): `min_tokens`
    masks EOS and `stop_token_ids` until that many tokens were generated (stop strings cannot end it
    before either); `logit_bias` ({token id: bias in [-100, 100]}, stored as sorted (id, bias) pairs)
    is added to the logits; `repetition_penalty` (> 0, 1 = off) divides the positive and multiplies
    the negative logits of every token seen in the prompt or the output; `frequency_penalty` and
    `presence_penalty` (in [-2, 2]) subtract penalty x count and penalty x (count > 0) of each token
    in the output so far. `logprobs` (None = off, 0..20): report the sampled token's logprob and the
    `logprobs` most likely alternatives' for every generated token (engine/sampling/sampler.py says of which
    logits). `prompt_logprobs` (None = off, 0..20): the same for every prompt token but the first, from the
    model's raw logits (engine/sampling/prompt_logprobs.py); such a request does not use the prefix cache.

    `structured_outputs` (None = off): a StructuredOutputsParams (JSON schema, regex, choice, grammar or any
    JSON object) the output is constrained to, token by token (engine/structured/); its mask applies before
    the logits processors, so logprobs are those of the masked distribution.

    Text (vLLM's options and defaults): `include_stop_str_in_output` keeps a stop string in the text (and,
    for a stop token or EOS that ends the request, that token's text; otherwise it is not detokenized);
    `skip_special_tokens` leaves special tokens out of the text; `spaces_between_special_tokens` (see
    Tokenizer.decode) joins kept special tokens to the text around them with the tokenizer's own decode
    (True) or with no separator (False).
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | str | list[str] | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
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
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2 ** 63:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalize_ids(self.stop_token_ids))
        self._check_processors()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides where the "
                             "output may end")

    def _check_processors(self) -> None:
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        object.__setattr__(self, "logit_bias", _normalize_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (or None), got {value}")

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of sample `index` of n: n = 1, and seed + index (mod 2**63) for a seeded request, as vLLM
        derives its children's seeds; unseeded samples draw from the engine's generator, each its own draw."""
        seed = None if self.seed is None else (self.seed + index) % 2 ** 63
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether any penalty needs the sequence's token counts."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_range(name: str, value, low: float, high: float) -> None:
    _check_number(name, value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value}")


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


def _normalize_bias(bias) -> tuple[tuple[int, float], ...]:
    """{id: bias} or (id, bias) pairs -> (id, float bias) pairs sorted by id; ids the vocabulary
    holds are checked at admission (LLMEngine), which knows it."""
    if bias is None:
        return ()
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
    normalized = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {pair!r}")
        token_id, value = pair
        _check_int("logit_bias token id", token_id)
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
        _check_range(f"logit_bias[{token_id}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        normalized[token_id] = float(value)
    return tuple(sorted(normalized.items()))
