"""Logprobs of sampled tokens: what they are, computed on the device beside the draw.

Which logits: the row's logits after the logits processors (min_tokens, logit_bias, penalties) and
temperature (a greedy row: temperature 1), before the min-p / top-k / top-p cuts; log_softmax over the
whole vocabulary (vLLM's "processed" logprobs, less the cuts, so an alternative outside the kept set
still has a finite value). For the sampled token and the `logprobs` most likely tokens of the same
distribution; rank is 1 + how many tokens have a strictly larger logprob.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_lists import Key, Uploads
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's logprobs: the sampled token's (its logprob and rank) and the top
    alternatives', most likely first (as many as the request's `logprobs`; the sampled token is among
    them when its rank is within that number)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    @classmethod
    def of(cls, token_id: int, given, num_top: int) -> "TokenLogprobs":
        """From anything with logprob, rank, top_ids and top_logprobs (e.g. what a KV transfer carried for
        a token sampled elsewhere); ValueError unless it holds exactly num_top alternatives."""
        top_ids, top_logprobs = tuple(given.top_ids), tuple(given.top_logprobs)
        if len(top_ids) != num_top or len(top_logprobs) != num_top:
            raise ValueError(f"token {token_id}: {len(top_ids)} top ids and {len(top_logprobs)} top logprobs "
                             f"for logprobs={num_top}")
        return cls(token_id, float(given.logprob), int(given.rank), tuple(int(t) for t in top_ids),
                   tuple(float(v) for v in top_logprobs))


@dataclass(frozen=True)
class LogprobPlan:
    """The rows of a step that asked for logprobs, planned on the host."""

    asked: tuple[int, ...]            # the rows
    rows: Key | None                  # [L] the same in the step's uploads; None: every row
    temperature: float | Key | None   # each row's (a greedy row's: 1), shared or [L]; None: all 1
    k: int                            # the largest `logprobs` among the rows

    @property
    def width(self) -> int:
        """Values per row in logprob_tensors."""
        return 2 + 2 * self.k


def plan_logprobs(params: Sequence[SamplingParams], uploads: Uploads) -> LogprobPlan | None:
    """The rows asking for logprobs and their temperatures, added to uploads where they differ; None when no row
    asks."""
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not asked:
        return None
    temperatures = [1.0 if params[i].greedy else params[i].temperature for i in asked]
    temperature = None if all(t == 1.0 for t in temperatures) else uploads.shared_or_add(temperatures, np.float32)
    return LogprobPlan(tuple(asked), None if len(asked) == len(params) else uploads.add(asked, np.int64),
                       temperature, max(params[i].logprobs for i in asked))


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, plan: LogprobPlan, uploads: Uploads) -> torch.Tensor:
    """For plan's rows of processed logits [S, vocab] and the sampled tokens [S]: one float64 tensor
    [L, 2 + 2k]: per row the sampled logprob, rank, the top-k logprobs, the top-k ids (k = the largest
    `logprobs` among rows; each row keeps its own first `logprobs` on the host). Ids and ranks are
    exact in float64, so the whole thing comes back in the sampler's one copy. log_softmax is never
    materialised: logprob = scaled logit - logsumexp of the row, for the few entries reported."""
    index = None if plan.rows is None else uploads.get(plan.rows)  # [L]
    picked = logits if index is None else logits.index_select(0, index)  # [L, vocab]
    if plan.temperature is not None:
        picked = picked / uploads.per_row(plan.temperature)  # [L, vocab]
    normalizer = picked.logsumexp(dim=-1, keepdim=True)  # [L, 1]: logprob = logit - normalizer
    sampled = picked.gather(1, (tokens if index is None else tokens.index_select(0, index)).unsqueeze(1))  # [L, 1]
    rank = (picked > sampled).sum(dim=-1, keepdim=True, dtype=torch.int32) + 1  # [L, 1] (int32: faster on CPU)
    top_values, top_ids = picked.topk(plan.k, dim=-1)  # [L, k] each, most likely first
    return torch.cat([(sampled - normalizer).double(), rank.double(), (top_values - normalizer).double(),
                      top_ids.double()], dim=1)


def unpack(values: list[float], tokens: list[int], params: Sequence[SamplingParams],
           rows: list[int]) -> list[TokenLogprobs | None]:
    """The host copy of logprob_tensors (flattened) -> one TokenLogprobs per row (None where a row did
    not ask)."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    width = len(values) // len(rows) if rows else 0
    k = (width - 2) // 2
    for n, i in enumerate(rows):
        row = values[n * width:(n + 1) * width]
        mine = params[i].logprobs
        out[i] = TokenLogprobs(tokens[i], row[0], int(row[1]), tuple(int(t) for t in row[2 + k:2 + k + mine]),
                               tuple(row[2:2 + mine]))
    return out
