"""The candidates of a top-p (nucleus) cut without a top-k: the highest-ranked tokens of each row, enough of
them to hold its nucleus, high to low, with their probabilities over the whole vocabulary.

The nucleus is defined on the sorted order (keep a token while the mass ranked above it is below p), and no
fixed count of top tokens is sure to hold it. On a CPU a full sort of a 152k vocabulary is the slow case
(~0.5 s for 64 rows on 2 cores), while a partial sort (`torch.topk`) of the largest k is cheap; and a real
model's distribution puts most of its mass on few tokens. So each row climbs a ladder: the top
NUCLEUS_LADDER[0] tokens when they hold p of its mass (with a margin for float sums), else the next rung,
else a full sort. The rows that the rungs hold are found by their own logits alone, so a row's candidates,
and the token a seeded row draws from them, do not depend on what else shares the batch. Whenever the top k
hold p, the cut keeps exactly what the full sort's cut keeps: every later token has at least p ranked above
it. On a GPU a segmented sort is cheap and each rung would cost a host sync: it sorts at once.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.host_lists import to_device

NUCLEUS_LADDER = (1024, 16384)  # candidate counts tried on a CPU before a full sort
COVER_MARGIN = 1e-3             # the rung's mass must pass p by this much (float32 sums of up to 16k terms)


def ladder_need(top_p: Sequence[float]) -> list[float]:
    """The mass a rung must hold per row: top_p + COVER_MARGIN."""
    return [p + COVER_MARGIN for p in top_p]


def nucleus_candidates(logits: torch.Tensor, top_p: Sequence[float] | None,
                       need: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, vocab] (transformed), top_p per row -> (probs [R, n], ids [R, n]): each row's best tokens
    high to low and their probabilities softmax(logits) (not renormalised over the candidates); columns
    past a row's own candidates have probability 0 (and a valid id). need: ladder_need(top_p) already on the
    device ([R]; then top_p is not read); copied here from top_p if None."""
    vocab, device = logits.shape[-1], logits.device
    log_total = logits.logsumexp(dim=-1, keepdim=True)  # [R, 1]
    rungs = [k for k in NUCLEUS_LADDER if k < vocab] if device.type == "cpu" else []
    if rungs and need is None:
        need = to_device(ladder_need(top_p), logits.dtype, device)  # [R]
    left = torch.arange(logits.shape[0], device=device)  # [L]: rows not placed yet
    placed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, probs, ids) per rung
    for k in rungs:
        values, ids = logits.index_select(0, left).topk(k, dim=-1)  # [L, k], high to low
        probs = (values - log_total.index_select(0, left)).exp()  # [L, k]
        held = probs.sum(dim=-1) >= need.index_select(0, left)  # [L]
        placed.append((left[held], probs[held], ids[held]))
        left = left[~held]
        if left.numel() == 0:
            break
    if left.numel():
        values, ids = logits.index_select(0, left).sort(dim=-1, descending=True)  # [L, vocab]
        placed.append((left, (values - log_total.index_select(0, left)).exp(), ids))
    if len(placed) == 1 and placed[0][0].numel() == logits.shape[0]:
        return placed[0][1], placed[0][2]  # one rung held every row, in order
    width = max(probs.shape[-1] for _, probs, _ in placed)
    all_probs = logits.new_zeros(logits.shape[0], width)  # [R, n]
    all_ids = torch.zeros(logits.shape[0], width, dtype=torch.long, device=device)  # [R, n]
    for rows, probs, ids in placed:
        all_probs[rows, :probs.shape[-1]] = probs
        all_ids[rows, :ids.shape[-1]] = ids
    return all_probs, all_ids
