"""Logits processors: what changes a row's logits before the sampler picks, greedy rows included.

vLLM's semantics and order: `min_tokens` masks (-inf) EOS and the stop token ids while fewer than
min_tokens tokens were generated; `logit_bias` adds each biased token's bias; then the penalties:
repetition (every token of prompt + output: positive logits divided by it, negative ones multiplied),
frequency (minus penalty x the token's count in the output) and presence (minus penalty once the token
is in the output). "Output" is every token after the prompt, a resumed request's earlier tokens
included, so a migrated request is penalized as it would have been where it started.

Planned on the host (`plan_processing`, before the step's forward): the rows that ask for something, the flat
indexes (row x vocab + token) of the masks and biases, and for the penalties the penalized rows' histories
flattened into one list per kind (the prompt too for repetition); all of it goes into the step's uploads
(engine/host_lists.py Uploads) and crosses in the step's one upload. Applied on the logits' device
(`apply_processing`), vectorised over those rows: one index_fill_ for the masks, one index_add_ for the biases,
and for the penalties gathers and scatters at the histories' flat indexes, so their cost grows with the histories,
not with rows x vocab. No row asking: nothing is planned, nothing runs and the logits come back as they were.
`cut_min_p` is the min-p cut, applied by the sampler after temperature.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_lists import Key, Uploads
from engine.sampling.penalties import History, Penalties, apply_penalties, plan_penalties
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Processing:
    """A step's logits processors, planned on the host; the arrays are Keys of the step's uploads."""

    rows: Key | None           # [P] the rows processed; None: every row
    count: int                 # P
    banned: Key | None         # [F] flat indexes (j x vocab + token) min_tokens masks
    bias_at: Key | None        # [M] flat indexes of the biased logits ...
    bias: Key | None           # [M] float32 ... and their biases
    penalties: Penalties | None


def plan_processing(params: Sequence[SamplingParams], histories: Sequence[History] | None,
                    eos_token_ids: Sequence[int], vocab: int, uploads: Uploads) -> Processing | None:
    """What min_tokens, logit_bias and the penalties do to a step's rows (histories[i]: row i's tokens; None: empty
    histories, so only logit_bias and a first token's min_tokens apply), its arrays added to uploads; None (nothing
    added) when no row asks for any."""
    histories = histories if histories is not None else [((), 0)] * len(params)
    banned = [_banned_now(p, h, eos_token_ids, vocab) for p, h in zip(params, histories)]
    rows = [i for i, p in enumerate(params) if banned[i] or p.logit_bias or p.penalized]
    if not rows:
        return None
    sub = [params[i] for i in rows]
    flat_banned = [j * vocab + t for j, i in enumerate(rows) for t in banned[i]]
    bias_at = [j * vocab + t for j, p in enumerate(sub) for t, _ in p.logit_bias]
    penalized = [j for j, p in enumerate(sub) if p.penalized]
    return Processing(
        None if len(rows) == len(params) else uploads.add(rows, np.int64), len(rows),
        uploads.add(flat_banned, np.int64) if flat_banned else None,
        uploads.add(bias_at, np.int64) if bias_at else None,
        uploads.add([b for p in sub for _, b in p.logit_bias], np.float32) if bias_at else None,
        plan_penalties(penalized, [sub[j] for j in penalized], [histories[rows[j]] for j in penalized], uploads)
        if penalized else None)


def apply_processing(logits: torch.Tensor, plan: Processing | None, uploads: Uploads) -> torch.Tensor:
    """logits [S, vocab] float32 -> [S, vocab] after each row's min_tokens, logit_bias and penalties: the input
    itself (never written to) without a plan, else a new tensor. uploads: bound (on the logits' device)."""
    if plan is None:
        return logits
    index = None if plan.rows is None else uploads.get(plan.rows)  # [P]
    picked = logits.clone() if index is None else logits.index_select(0, index)  # [P, vocab]: written in place
    flat = picked.view(-1)  # [P * vocab]
    if plan.banned is not None:
        flat.index_fill_(0, uploads.get(plan.banned), float("-inf"))  # flat: no sync
    if plan.bias_at is not None:
        flat.index_add_(0, uploads.get(plan.bias_at), uploads.get(plan.bias).to(picked.dtype))
    if plan.penalties is not None:
        apply_penalties(picked, plan.penalties, uploads)
    return picked if index is None else logits.index_copy(0, index, picked)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   histories: Sequence[History] | None, eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """plan_processing then apply_processing, outside a step (each array copied on its own): the input itself
    when no row asks for anything."""
    uploads = Uploads()
    plan = plan_processing(params, histories, eos_token_ids, logits.shape[1], uploads)
    uploads.bind_each(logits.device)
    return apply_processing(logits, plan, uploads)


def _banned_now(p: SamplingParams, history: History, eos_token_ids: Sequence[int], vocab: int) -> tuple[int, ...]:
    """The ids min_tokens masks for this row's next token: none once min_tokens were generated."""
    if p.min_tokens == 0 or len(history[0]) - history[1] >= p.min_tokens:
        return ()
    ids = p.stop_token_ids if p.ignore_eos else (*p.stop_token_ids, *eos_token_ids)
    return tuple(t for t in dict.fromkeys(ids) if t < vocab)


def min_p_floor(params: Sequence[SamplingParams], uploads: Uploads) -> float | Key | None:
    """log(min_p) per row (-inf without one), shared or in uploads ([R] float32); None when no row has min_p."""
    if all(p.min_p == 0.0 for p in params):
        return None
    return uploads.shared_or_add([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], np.float32)


def apply_min_p(logits: torch.Tensor, floor: float | torch.Tensor) -> torch.Tensor:
    """min_p on temperature-scaled logits [R, vocab] -> [R, vocab]: a token whose probability is below
    min_p x the top token's is set to -inf. p_i >= min_p x p_max  <=>  l_i >= l_max + log(min_p), so
    no softmax is needed. floor: log(min_p), shared or [R, 1]."""
    top = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    return logits.masked_fill(logits < top + floor, float("-inf"))  # [R, vocab]


def cut_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """apply_min_p with the rows' own min_p, outside a step: the input itself when no row has min_p."""
    uploads = Uploads()
    floor = min_p_floor(params, uploads)
    if floor is None:
        return logits
    uploads.bind_each(logits.device)
    return apply_min_p(logits, uploads.per_row(floor))
