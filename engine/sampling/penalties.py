"""Repetition, frequency and presence penalties (engine/sampling/logits_processors.py applies them after
min_tokens and logit_bias): planned on the host as flat lists of the penalized rows' histories in the step's
uploads, applied on the device at those (row, token) entries only."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_lists import Key, Uploads
from engine.sampling_params import SamplingParams

History = tuple[Sequence[int], int]  # (prompt + generated token ids so far, number of prompt tokens)


@dataclass(frozen=True)
class Entries:
    """Token lists of Q rows flattened: tokens [N] and each row's count [Q], Keys of the step's uploads."""

    tokens: Key
    lengths: Key
    total: int  # N


@dataclass(frozen=True)
class Penalties:
    """The penalized rows of a processed batch, planned on the host."""

    rows: Key                  # [Q] their index among the processed rows
    count: int                 # Q
    prompt: Entries | None     # their prompts (the rows with a repetition penalty only); None: empty
    output: Entries | None     # their generated tokens; None: empty
    repetition: Key | None     # [Q] float32; None: no row has one
    frequency: Key | None      # [Q] float32
    presence: Key | None       # [Q] float32


def plan_penalties(rows: list[int], params: list[SamplingParams], histories: list[History],
                   uploads: Uploads) -> Penalties:
    """rows: the penalized rows' index among the processed ones, params and histories: theirs. Adds the flat
    histories and the per-row penalties to uploads."""
    prompt = _entries([h[0][:h[1]] if p.repetition_penalty != 1.0 else () for p, h in zip(params, histories)],
                      uploads)
    output = _entries([h[0][h[1]:] for h in histories], uploads)

    def per_row(name: str, neutral: float) -> Key | None:
        values = [getattr(p, name) for p in params]
        return uploads.add(values, np.float32) if any(v != neutral for v in values) else None

    return Penalties(uploads.add(rows, np.int64), len(rows), prompt, output, per_row("repetition_penalty", 1.0),
                     per_row("frequency_penalty", 0.0), per_row("presence_penalty", 0.0))


def _entries(slices: list[Sequence[int]], uploads: Uploads) -> Entries | None:
    """The slices flattened into uploads (one list of tokens, one of counts); None when they are all empty."""
    lengths = [len(s) for s in slices]
    total = sum(lengths)
    if total == 0:
        return None
    tokens = list(itertools.chain.from_iterable(slices))
    return Entries(uploads.add(tokens, np.int64), uploads.add(lengths, np.int64), total)


def apply_penalties(logits: torch.Tensor, plan: Penalties, uploads: Uploads) -> None:
    """The penalties of plan's rows of logits [P, vocab] (contiguous), in place, touching only the (row, token)
    entries the histories list: O(history), no [rows, vocab] temporary. Repetition and presence gather the entries'
    values, then scatter one new value per entry: a token listed several times gets the same value from each
    listing, so duplicates need no unique() (a sync on CUDA). Frequency adds -penalty once per listing in the
    output: -penalty x count."""
    vocab, flat = logits.shape[1], logits.view(-1)
    rows = uploads.get(plan.rows)  # [Q]
    prompt, output = (_flat_keys(e, rows, vocab, uploads) for e in (plan.prompt, plan.output))
    listed = [e for e in (prompt, output) if e is not None]
    if listed and plan.repetition is not None:
        keys, which = (torch.cat(parts) for parts in zip(*listed))  # [N], [N]
        repetition = uploads.get(plan.repetition).to(logits.dtype)[which]  # [N]
        values = flat.index_select(0, keys)  # [N]
        flat.scatter_(0, keys, torch.where(values > 0, values / repetition, values * repetition))
    if output is None:
        return
    keys, which = output  # [M], [M]: the generated tokens
    if plan.frequency is not None:
        flat.index_add_(0, keys, -uploads.get(plan.frequency).to(logits.dtype)[which])
    if plan.presence is not None:
        presence = uploads.get(plan.presence).to(logits.dtype)[which]  # [M]
        flat.scatter_(0, keys, flat.index_select(0, keys) - presence)


def _flat_keys(entries: Entries | None, rows: torch.Tensor, vocab: int,
               uploads: Uploads) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The flat logits index (row x vocab + token) of every listed token ([N]) and the penalized row of each
    ([N]); the rows are rebuilt on the device from the counts."""
    if entries is None:
        return None
    which = torch.repeat_interleave(torch.arange(rows.shape[0], device=rows.device), uploads.get(entries.lengths),
                                    output_size=entries.total)  # [N]
    return rows[which] * vocab + uploads.get(entries.tokens), which
