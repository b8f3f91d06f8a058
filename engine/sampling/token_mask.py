"""Token masks of constrained rows (structured outputs), applied to the logits before anything else.

The sampler holds a TokenMaskFiller (engine/structured/ implements it) and is handed, per row, the row's
grammar state or None. Only when some row has one does it ask the filler, when the step is staged on the host,
for one packed bitmask of those rows ([R, words] int32: bit t % 32 of word t // 32 allows token t), written straight
into the step's staging buffer; the bitmask (and the rows' indexes) cross in the step's one upload
(engine/host_lists.py Uploads), and every disallowed logit of those rows is set to -inf on the device. Tokens past the mask's width (a model's padded vocabulary) are disallowed.
Unconstrained rows are untouched.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.host_lists import Key, Uploads


class TokenMaskFiller(Protocol):
    words: int  # int32 words of one row's bitmask

    def fill_into(self, grammars: Sequence[object], out: np.ndarray) -> None:
        """Writes out ([len(grammars), words] int32, host, C-contiguous): row i the tokens grammars[i] allows next."""


@dataclass(frozen=True)
class MaskPlan:
    """A step's token masks, planned on the host: which rows, and their bitmask, in the step's uploads."""

    rows: Key | None  # [C] the constrained rows; None: every row
    bits: Key         # [C * words] int32, row-major
    count: int        # C
    words: int


def constrained_rows(constraints: Sequence[object | None] | None) -> list[int]:
    """The rows that carry a grammar state ([] when none does, or no constraints were given)."""
    if constraints is None:
        return []
    return [i for i, c in enumerate(constraints) if c is not None]


def plan_token_masks(constraints: Sequence[object | None] | None, filler: TokenMaskFiller | None,
                     uploads: Uploads) -> MaskPlan | None:
    """Adds the constrained rows' bitmask to uploads, filled (the grammar states read, never advanced) straight
    into its staged place when the step is staged; None (nothing added) when no row is constrained."""
    rows = constrained_rows(constraints)
    if not rows:
        return None
    if filler is None:
        raise RuntimeError("constrained rows reached a sampler without a token mask filler")
    grammars, words = [constraints[i] for i in rows], filler.words
    every_row = len(rows) == len(constraints)
    row_keys = None if every_row else uploads.add(rows, np.int64)
    bits = uploads.add_filled(len(rows) * words, np.int32,  # [C * words], filled in place when the step is staged
                              lambda view: filler.fill_into(grammars, view.reshape(len(rows), words)))
    return MaskPlan(row_keys, bits, len(rows), words)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [R, words] int32 (any device) -> allowed [R, vocab] bool on the same device; False past
    words x 32."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # [32]
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [R, words * 32]
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)


def apply_planned_masks(logits: torch.Tensor, plan: MaskPlan | None, uploads: Uploads) -> torch.Tensor:
    """logits [S, vocab] -> [S, vocab] with each constrained row's disallowed tokens at -inf: the input itself
    (never written to) without a plan, else a new tensor. uploads: bound (on the logits' device)."""
    if plan is None:
        return logits
    bitmask = uploads.get(plan.bits).view(plan.count, plan.words)  # [C, words] int32
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [C, vocab]
    if plan.rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    index = uploads.get(plan.rows)  # [C]
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))  # [C, vocab]
    return logits.index_copy(0, index, masked)


def apply_token_masks(logits: torch.Tensor, constraints: Sequence[object | None] | None,
                      filler: TokenMaskFiller | None) -> torch.Tensor:
    """plan_token_masks then apply_planned_masks, outside a step (the bitmask copied on its own): the input itself
    when no row is constrained."""
    uploads = Uploads()
    plan = plan_token_masks(constraints, filler, uploads)
    uploads.bind_each(logits.device)
    return apply_planned_masks(logits, plan, uploads)
