"""Sampler: one next token per sampled row, greedy or temperature / top-k / top-p, seedable per request."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw for the token at `position` (its index in the
    sequence, prompt included): a function of (seed, position) alone, the same in every process."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    """Picks tokens from logits. A seeded row draws with a generator seeded from (seed, position), so a
    seeded request gets the same tokens whatever shares its batch and whichever engine samples which of
    its tokens; unseeded rows share the engine's generator."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 positions: Sequence[int]) -> list[int]:
        """One token per row of logits; positions[i] is the index the new token of row i will have."""
        # logits: [S, vocab] float32, one row per sampled sequence
        tokens = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return tokens
        probs, order = _filtered_probs(logits[random_rows].cpu(), [params[i] for i in random_rows])
        for j, row in enumerate(random_rows):
            seed = params[row].seed
            generator = self.generator if seed is None else \
                torch.Generator().manual_seed(position_seed(seed, positions[row]))
            choice = torch.multinomial(probs[j], 1, generator=generator).item()
            tokens[row] = int(order[j, choice])
        return tokens


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]):
    """Temperature, then top-k and top-p cuts on logits sorted high to low.

    Returns (probs [R, vocab] over the sorted order, order [R, vocab] token ids)."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    sorted_logits, order = (logits / temperature).sort(dim=-1, descending=True)
    rank = torch.arange(vocab).unsqueeze(0)  # [1, vocab]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of all higher-ranked tokens
    probs = probs.masked_fill((mass_before >= top_p) & (rank > 0), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order
