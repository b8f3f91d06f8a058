"""The checks of a request the engine admits: its id, prompt, resumed tokens and sampling params against the
model (context length, vocabulary), and for a prefilled request its first token, logprobs and blocks. Each
failure is a ValueError saying what is wrong; nothing is admitted."""
from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams


def check_request(request_id: str, prompt: Sequence[int], params: SamplingParams, num_resumed_tokens: int,
                  max_model_len: int, vocab_size: int) -> None:
    """ValueError unless the request can be admitted by an engine with this context and vocabulary."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt token ids must be a list of ints, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError("prompt is empty: give at least one token")
    if len(prompt) > max_model_len:
        raise ValueError(f"prompt has {len(prompt)} tokens, more than the model's context of {max_model_len}")
    if isinstance(num_resumed_tokens, bool) or not isinstance(num_resumed_tokens, int) \
            or not 0 <= num_resumed_tokens < min(len(prompt), params.max_tokens):
        raise ValueError(f"num_resumed_tokens must be in [0, {min(len(prompt), params.max_tokens)}) "
                         f"(fewer than the known tokens and than max_tokens), got {num_resumed_tokens!r}")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    biased = [t for t, _ in params.logit_bias if t >= vocab_size]
    if biased:
        raise ValueError(f"logit_bias token id {biased[0]} is outside the vocabulary [0, {vocab_size})")


def check_prefilled(request_id: str, num_prompt_tokens: int, first_token: int, params: SamplingParams,
                    has_first_logprobs: bool, num_blocks: int, block_size: int, vocab_size: int) -> None:
    """ValueError unless a prefilled request (its KV already in num_blocks blocks) can be admitted: one sample,
    a first token in the vocabulary, that token's logprobs when the request asks for logprobs, and blocks
    enough for the prompt."""
    if params.n != 1:
        raise ValueError(f"n={params.n}: a prefilled request is one sample (its KV came for one)")
    if isinstance(first_token, bool) or not isinstance(first_token, int) or not 0 <= first_token < vocab_size:
        raise ValueError(f"first token {first_token!r} is outside the vocabulary [0, {vocab_size})")
    if params.logprobs is not None and not has_first_logprobs:
        raise ValueError(f"request {request_id!r} asks for logprobs; its first token came without them")
    if num_blocks < -(-num_prompt_tokens // block_size):
        raise ValueError(f"{num_blocks} blocks cannot hold {num_prompt_tokens} prompt tokens")


def check_step_budget(config: EngineConfig, max_model_len: int) -> None:
    """Without chunked prefill a whole prompt must fit one step: ValueError when it may not."""
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be "
                         f">= max_model_len ({max_model_len})")
