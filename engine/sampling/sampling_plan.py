"""The non-greedy rows of a step, planned on the host before its forward (`plan_draw`): which rows, their
temperatures, min-p floors, top-k / top-p cuts (grouped by the work they need) and the uniforms of seeded rows.
Whatever differs between rows goes into the step's uploads (engine/host_lists.py Uploads) and crosses in the
step's one upload; a value every row shares stays a scalar and crosses nothing. `candidate_probs` and `draw_rows`
then run on the device with the bound uploads.

A seeded row's uniform is drawn on the host from a CPU generator seeded from (seed, position): the same number
whatever the device, the batch, or the engine that samples the token.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_lists import Key, Uploads
from engine.sampling.draw import draw
from engine.sampling.logits_processors import min_p_floor
from engine.sampling.nucleus import ladder_need, nucleus_candidates
from engine.sampling_params import SamplingParams


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw for the token at `position` (its index in the
    sequence, prompt included): a function of (seed, position) alone, the same in every process."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class Cut:
    """One group of drawn rows' top-k / top-p cut."""

    index: Key | None          # [G] the group's rows among the drawn rows; None: all of them
    max_k: int                 # the largest top-k (the vocabulary when no row has one)
    k: int | Key               # each row's top-k (vocab: none), shared or [G]
    min_top_p: float
    top_p: float | Key         # shared or [G]
    need: Key | None           # [G] nucleus.ladder_need(top_p), for top-p without top-k


@dataclass(frozen=True)
class Draw:
    """The drawn (non-greedy) rows of a step."""

    rows: Key | None                  # [R] their rows; None: every row
    count: int                        # R
    temperature: float | Key | None   # shared or [R]; None: every temperature is 1
    min_p: float | Key | None         # log(min_p), shared or [R]; None: no row has min_p
    cuts: tuple[Cut, ...]
    seeded: Key | None                # [R] float32 uniforms of the seeded rows (0 elsewhere); None: no seeded row
    unseeded: Key | None              # [U] rows drawing from the shared generator, when some rows are seeded
    num_unseeded: int                 # U


def plan_draw(params: Sequence[SamplingParams], positions: Sequence[int], vocab: int,
              uploads: Uploads) -> Draw | None:
    """The non-greedy rows' draw (positions[i]: the index row i's token will have), what differs added to
    uploads; None when every row is greedy."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return None
    sub = [params[i] for i in rows]
    temperatures = [p.temperature for p in sub]
    temperature = None if all(t == 1.0 for t in temperatures) else uploads.shared_or_add(temperatures, np.float32)
    groups = row_groups(sub, vocab)
    cuts = tuple(plan_cut([sub[i] for i in g], vocab, None if len(groups) == 1 else uploads.add(g, np.int64), uploads)
                 for g in groups)
    unseeded = [j for j, p in enumerate(sub) if p.seed is None]
    seeded = None
    if len(unseeded) < len(sub):
        seeded = uploads.add([0.0 if p.seed is None else seeded_uniform(p.seed, positions[i])
                              for i, p in zip(rows, sub)], np.float32)
    return Draw(None if len(rows) == len(params) else uploads.add(rows, np.int64), len(rows), temperature,
                min_p_floor(sub, uploads), cuts, seeded,
                uploads.add(unseeded, np.int64) if seeded is not None and unseeded else None, len(unseeded))


def seeded_uniform(seed: int, position: int) -> float:
    """A seeded row's uniform in [0, 1) (float32) for the token at position."""
    generator = torch.Generator().manual_seed(position_seed(seed, position))
    return torch.rand(1, generator=generator).item()


def row_groups(params: Sequence[SamplingParams], vocab: int) -> list[list[int]]:
    """Rows by the work their cuts need: top-k (partial sort), top-p alone (engine/sampling/nucleus.py), no cut."""
    top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    top_p = [i for i, p in enumerate(params) if not 0 < p.top_k < vocab and p.top_p < 1.0]
    plain = [i for i, p in enumerate(params) if not 0 < p.top_k < vocab and p.top_p >= 1.0]
    return [group for group in (top_k, top_p, plain) if group]


def plan_cut(params: Sequence[SamplingParams], vocab: int, index: Key | None, uploads: Uploads) -> Cut:
    """The cut of one group of rows (index: where they are among the drawn rows)."""
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    max_k, min_top_p = max(ks), min(top_p)
    nucleus = max_k >= vocab and min_top_p < 1.0
    return Cut(index, max_k, uploads.shared_or_add(ks, np.int64) if max_k < vocab else vocab, min_top_p,
               uploads.shared_or_add(top_p, np.float32) if min_top_p < 1.0 else 1.0,
               uploads.add(ladder_need(top_p), np.float32) if nucleus else None)


def candidate_probs(logits: torch.Tensor, cut: Cut, uploads: Uploads):
    """Top-k, then top-p, on transformed logits [G, vocab]. Returns (probs [G, n], ids [G, n]), probs normalised
    over each row's kept tokens and zero elsewhere, ids the vocabulary id of each column; ids is None when no row
    asks for a cut (then n == vocab, columns are token ids, and nothing was sorted)."""
    vocab, device = logits.shape[-1], logits.device
    if cut.max_k < vocab:
        values, ids = logits.topk(cut.max_k, dim=-1)  # [G, k] high to low: a partial sort
        rank = torch.arange(values.shape[-1], device=device).unsqueeze(0)  # [1, k]
        probs = values.masked_fill(rank >= uploads.per_row(cut.k), float("-inf")).softmax(dim=-1)  # [G, k]
    elif cut.min_top_p < 1.0:
        need = uploads.get(cut.need) if cut.need is not None else None  # [G]
        probs, ids = nucleus_candidates(logits, None, need)  # [G, n] high to low, enough to hold each nucleus
        rank = torch.arange(probs.shape[-1], device=device).unsqueeze(0)  # [1, n]
    else:
        return logits.softmax(dim=-1), None  # [G, vocab]
    if cut.min_top_p < 1.0:
        p = uploads.per_row(cut.top_p)  # shared, or [G, 1]
        mass_before = probs.cumsum(dim=-1) - probs  # [G, n]: mass of the higher-ranked tokens
        probs = probs.masked_fill((mass_before >= p) & (p < 1.0) & (rank > 0), 0.0)  # the top one stays
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, ids


def draw_rows(logits: torch.Tensor, cuts: Sequence[Cut], uniforms: torch.Tensor, uploads: Uploads) -> torch.Tensor:
    """One token id per row of transformed logits [R, vocab], drawn with uniforms [R] after each group's cut; -1
    for a row whose kept probabilities do not sum to a positive finite mass (all -inf, NaN)."""
    if len(cuts) == 1:
        return draw(*candidate_probs(logits, cuts[0], uploads), uniforms)
    drawn = torch.empty_like(uniforms, dtype=torch.long)  # [R]
    for cut in cuts:
        index = uploads.get(cut.index)  # [G]
        probs, ids = candidate_probs(logits.index_select(0, index), cut, uploads)
        drawn.index_copy_(0, index, draw(probs, ids, uniforms.index_select(0, index)))
    return drawn
