"""Token masks of constrained rows (structured outputs), applied to the logits before anything else.

The sampler holds a TokenMaskFiller (engine/structured/ implements it) and is handed, per row, the row's
grammar state or None. Only when some row has one does it ask the filler for one packed bitmask of those rows
([R, words] int32 on the host: bit t % 32 of word t // 32 allows token t), copy it to the logits' device
(non-blocking; pinned on CUDA) and set every disallowed logit of those rows to -inf there. Tokens past the
mask's width (a model's padded vocabulary) are disallowed. Unconstrained rows are untouched.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.host_lists import to_device


class TokenMaskFiller(Protocol):
    def fill(self, grammars: Sequence[object]) -> torch.Tensor:
        """[len(grammars), words] int32 on the host: the tokens each grammar allows next."""


def constrained_rows(constraints: Sequence[object | None] | None) -> list[int]:
    """The rows that carry a grammar state ([] when none does, or no constraints were given)."""
    if constraints is None:
        return []
    return [i for i, c in enumerate(constraints) if c is not None]


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [R, words] int32 (any device) -> allowed [R, vocab] bool on the same device; False past
    words x 32."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # [32]
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [R, words * 32]
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)


def apply_token_masks(logits: torch.Tensor, constraints: Sequence[object | None] | None,
                      filler: TokenMaskFiller | None) -> torch.Tensor:
    """logits [S, vocab] -> [S, vocab] with each constrained row's disallowed tokens at -inf: the input itself
    (never written to) when no row is constrained, else a new tensor."""
    rows = constrained_rows(constraints)
    if not rows:
        return logits
    if filler is None:
        raise RuntimeError("constrained rows reached a sampler without a token mask filler")
    host = filler.fill([constraints[i] for i in rows])  # [R, words] int32
    bitmask = host.to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [R, vocab]
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, float("-inf"))
    index = to_device(rows, torch.long, logits.device)  # [R]
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, index, masked)
