"""When a sample ends: on a stop token or stop string once min_tokens are out, or at its length limits."""
from __future__ import annotations

from collections.abc import Collection

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def is_stop_token(params: SamplingParams, token: int, eos_token_ids: Collection[int]) -> bool:
    """A token of stop_token_ids, or an EOS id unless the request ignores EOS."""
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)


def finish_reason(seq: Sequence, stopped: bool, may_stop: bool, max_model_len: int) -> str | None:
    """"stop" when a stop was seen and may end it (min_tokens are out), "length" at max_tokens or the model's
    context, else None (the sample goes on)."""
    if may_stop and stopped:
        return "stop"
    if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
