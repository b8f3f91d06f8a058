"""Workloads and arrival times for `tandem bench serve`, after `vllm bench serve`'s datasets.

Prompts are lists of token ids drawn uniformly in [0, vocab_size); every generator takes a seed so a
workload is reproducible. Arrival gaps are gamma distributed like vLLM's: shape = burstiness,
scale = 1 / (rate * burstiness), so the mean gap is 1 / rate and burstiness 1 is a Poisson process.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt's token ids and how many tokens to generate; structured_outputs: the
    request's `structured_outputs` field (vLLM's), None for an unconstrained request."""

    prompt_token_ids: tuple[int, ...]
    output_len: int
    structured_outputs: dict | None = None


@dataclasses.dataclass(frozen=True)
class RandomWorkload:
    """vLLM's `random` dataset: lengths uniform in [L(1-r), L(1+r)] (r = range_ratio; 0 = fixed)."""

    input_len: int
    output_len: int
    range_ratio: float = 0.0


@dataclasses.dataclass(frozen=True)
class PrefixRepetitionWorkload:
    """vLLM's `prefix-repetition` dataset: num_prefixes shared prefixes, each request one of them
    (round robin) followed by a unique random suffix."""

    prefix_len: int
    suffix_len: int
    num_prefixes: int
    output_len: int


@dataclasses.dataclass(frozen=True)
class MixedWorkload:
    """A share `long_fraction` of long prompts (long_len tokens) among short ones (short_len)."""

    long_fraction: float
    long_len: int
    short_len: int
    output_len: int


@dataclasses.dataclass(frozen=True)
class MultiturnWorkload:
    """Chats of min_turns..max_turns turns (uniform): the first user message first_len tokens, each later one
    user_len, every answer at most output_len. Turn k's prompt is the conversation so far (the earlier
    messages and the model's actual answers) plus message k, so the client builds it as the answers come
    (cluster/bench/serve_multiturn.py); turns of one conversation are sequential, conversations concurrent."""

    first_len: int
    user_len: int
    output_len: int
    min_turns: int = 4
    max_turns: int = 8


@dataclasses.dataclass(frozen=True)
class Conversation:
    """The user messages of one chat, one per turn, and the answers' output length."""

    messages: tuple[tuple[int, ...], ...]
    output_len: int

    @property
    def max_tokens(self) -> int:
        """The last turn's prompt plus its answer, at most."""
        return sum(len(message) for message in self.messages) + len(self.messages) * self.output_len


Workload = RandomWorkload | PrefixRepetitionWorkload | MixedWorkload | MultiturnWorkload


def add_shape_arguments(parser, output_help: str) -> None:
    """The flags that shape the random, prefix-repetition and mixed datasets (vLLM's names and defaults),
    shared by `bench serve` and `tandem plan` so one workload means the same to both."""
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128, help=output_help)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128)
    parser.add_argument("--mixed-long-fraction", type=float, default=0.1)
    parser.add_argument("--mixed-long-len", type=int, default=2048)
    parser.add_argument("--mixed-short-len", type=int, default=128)


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    low, high = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    return max(low, 1), max(high, 1)


def _token_ids(rng: np.random.Generator, count: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(token) for token in rng.integers(0, vocab_size, size=count))


def validate_workload(workload: Workload, vocab_size: int) -> None:
    """Raises ValueError on lengths, shares or a vocabulary that cannot make a workload."""
    if vocab_size < 1:
        raise ValueError("--vocab-size must be at least 1")
    if workload.output_len < 1:
        raise ValueError("output length must be at least 1")
    if isinstance(workload, RandomWorkload):
        if workload.input_len < 1 or not 0 <= workload.range_ratio < 1:
            raise ValueError("--random-input-len must be >= 1 and --random-range-ratio in [0, 1)")
    elif isinstance(workload, PrefixRepetitionWorkload):
        if workload.num_prefixes < 1 or workload.prefix_len < 0 or workload.suffix_len < 0 \
                or workload.prefix_len + workload.suffix_len < 1:
            raise ValueError("prefix repetition needs >= 1 prefix and a non-empty prompt")
    elif isinstance(workload, MultiturnWorkload):
        if min(workload.first_len, workload.user_len) < 1 or not 1 <= workload.min_turns <= workload.max_turns:
            raise ValueError("--multiturn-first-len and --multiturn-user-len must be >= 1, and "
                             "1 <= --multiturn-min-turns <= --multiturn-max-turns")
    elif not 0 <= workload.long_fraction <= 1 or min(workload.long_len, workload.short_len) < 1:
        raise ValueError("--mixed-long-fraction must be in [0, 1] and lengths >= 1")


def generate_conversations(workload: MultiturnWorkload, num_conversations: int, vocab_size: int,
                           seed: int) -> list[Conversation]:
    """`num_conversations` chats of `workload`; the same seed gives the same user messages."""
    validate_workload(workload, vocab_size)
    rng = np.random.default_rng(seed)
    turns = rng.integers(workload.min_turns, workload.max_turns + 1, size=num_conversations)
    return [Conversation(tuple(_token_ids(rng, workload.first_len if turn == 0 else workload.user_len, vocab_size)
                               for turn in range(int(count))), workload.output_len) for count in turns]


def generate_requests(workload: Workload, num_prompts: int, vocab_size: int, seed: int) -> list[SampleRequest]:
    """`num_prompts` requests of `workload` (multiturn: the conversations' first turns); the same seed gives
    the same requests."""
    validate_workload(workload, vocab_size)
    if isinstance(workload, MultiturnWorkload):
        return [SampleRequest(conversation.messages[0], conversation.output_len)
                for conversation in generate_conversations(workload, num_prompts, vocab_size, seed)]
    rng = np.random.default_rng(seed)
    if isinstance(workload, RandomWorkload):
        return _random_requests(workload, num_prompts, vocab_size, rng)
    if isinstance(workload, PrefixRepetitionWorkload):
        return _prefix_requests(workload, num_prompts, vocab_size, rng)
    return _mixed_requests(workload, num_prompts, vocab_size, rng)


def fit_to_context(requests: list[SampleRequest], max_model_len: int) -> tuple[list[SampleRequest], int]:
    """The requests made to fit a served context of max_model_len tokens: a prompt whose tokens plus its
    output length would not fit loses tokens from its end, and an output length that alone leaves no room for
    one prompt token is cut to max_model_len - 1. Returns them, in order, and how many were cut."""
    if max_model_len < 2:
        raise ValueError(f"a served context of {max_model_len} tokens holds no prompt and output")
    fitted, cut = [], 0
    for request in requests:
        output_len = min(request.output_len, max_model_len - 1)
        room = max_model_len - output_len
        if output_len != request.output_len or len(request.prompt_token_ids) > room:
            request = dataclasses.replace(request, prompt_token_ids=request.prompt_token_ids[:room],
                                          output_len=output_len)
            cut += 1
        fitted.append(request)
    return fitted, cut


def _random_requests(workload: RandomWorkload, num_prompts: int, vocab_size: int,
                     rng: np.random.Generator) -> list[SampleRequest]:
    in_low, in_high = _length_range(workload.input_len, workload.range_ratio)
    out_low, out_high = _length_range(workload.output_len, workload.range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    return [SampleRequest(_token_ids(rng, int(input_len), vocab_size), int(output_len))
            for input_len, output_len in zip(input_lens, output_lens)]


def _prefix_requests(workload: PrefixRepetitionWorkload, num_prompts: int, vocab_size: int,
                     rng: np.random.Generator) -> list[SampleRequest]:
    prefixes = [_token_ids(rng, workload.prefix_len, vocab_size) for _ in range(workload.num_prefixes)]
    requests = [SampleRequest(prefixes[index % workload.num_prefixes]
                              + _token_ids(rng, workload.suffix_len, vocab_size), workload.output_len)
                for index in range(num_prompts)]
    order = rng.permutation(num_prompts)
    return [requests[int(index)] for index in order]


def _mixed_requests(workload: MixedWorkload, num_prompts: int, vocab_size: int,
                    rng: np.random.Generator) -> list[SampleRequest]:
    num_long = round(workload.long_fraction * num_prompts)
    is_long = np.zeros(num_prompts, dtype=bool)
    is_long[:num_long] = True
    rng.shuffle(is_long)
    return [SampleRequest(_token_ids(rng, workload.long_len if long else workload.short_len, vocab_size),
                          workload.output_len) for long in is_long]


def arrival_gaps(count: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each of `count` requests; all 0 when the rate is infinite."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(request_rate):
        return [0.0] * count
    rng = np.random.default_rng(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [float(gap) for gap in rng.gamma(shape=burstiness, scale=scale, size=count)]
