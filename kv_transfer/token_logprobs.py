"""The first token's logprobs on the wire: sampled on the prefill worker, carried in the KV manifest so
the decode worker reports them with the token (kv_transfer does not import engine/; this mirrors
engine.sampling.logprobs.TokenLogprobs without the token id, which the manifest's first_token gives)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_TOP_LOGPROBS = 20  # engine.sampling_params.MAX_LOGPROBS


class LogprobsError(ValueError):
    """A malformed first_logprobs entry (the manifest's decoder turns it into a ManifestError)."""


@dataclass(frozen=True)
class FirstTokenLogprobs:
    """logprob and rank of the sampled first token, and its top alternatives (most likely first)."""

    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.logprob, float) or self.logprob > 0:  # NaN passes: a model's NaN is no crafted input
            raise LogprobsError(f"first_logprobs.logprob must be a float <= 0, got {self.logprob!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LogprobsError(f"first_logprobs.rank must be an int >= 1, got {self.rank!r}")
        if len(self.top_ids) != len(self.top_logprobs) or len(self.top_ids) > MAX_TOP_LOGPROBS:
            raise LogprobsError(f"first_logprobs needs as many top ids as top logprobs, at most {MAX_TOP_LOGPROBS}")
        for token_id, value in zip(self.top_ids, self.top_logprobs):
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise LogprobsError(f"first_logprobs.top_ids entries must be ints >= 0, got {token_id!r}")
            if not isinstance(value, float) or value > 0:
                raise LogprobsError(f"first_logprobs.top_logprobs entries must be floats <= 0, got {value!r}")

    @classmethod
    def of(cls, given: Any) -> "FirstTokenLogprobs":
        """From anything with logprob, rank, top_ids, top_logprobs (an engine.sampling.logprobs.TokenLogprobs)."""
        return cls(float(given.logprob), int(given.rank), tuple(int(t) for t in given.top_ids),
                   tuple(float(v) for v in given.top_logprobs))

    def encode(self) -> list:
        return [self.logprob, self.rank, list(self.top_ids), list(self.top_logprobs)]

    @classmethod
    def decode(cls, raw: Any) -> "FirstTokenLogprobs":
        if not isinstance(raw, list) or len(raw) != 4 or not isinstance(raw[2], list) or not isinstance(raw[3], list):
            raise LogprobsError("first_logprobs must be [logprob, rank, [top ids], [top logprobs]]")
        return cls(raw[0], raw[1], tuple(raw[2]), tuple(raw[3]))
