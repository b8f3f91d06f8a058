"""One constrained sequence's matcher, and the bitmask of a step's constrained rows.

Bit t of a row (word t // 32, bit t % 32) is set when token t may come next. llguidance allows EOS only where
the grammar may end, and only EOS once it has ended. A matcher that fell into its error state (a token it did
not allow was forced on it, which the engine does not do) allows only EOS, so the sequence ends.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import llguidance
import torch


class SequenceGrammar:
    """The grammar state of one sequence: a copy of the compiled template, advanced by each of its tokens.
    Owned by the engine's step thread."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self.matcher = template.deep_copy()

    def advance(self, tokens: Iterable[int]) -> None:
        """Consume tokens the sequence already has (a resumed request's, a prefilled request's); ValueError,
        naming the first token the grammar refuses, when they do not follow it."""
        for position, token in enumerate(tokens):
            if not self.matcher.consume_token(token):
                raise ValueError(f"token {token} at output position {position} does not follow the request's "
                                 f"structured outputs grammar: {self.matcher.get_error().strip()}")

    def accept(self, token: int) -> None:
        """Consume the token just sampled (allowed by this matcher's last mask). An EOS after the grammar
        ended is consumed too; a refused token leaves the matcher in its error state (only EOS allowed)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a complete match."""
        return self.matcher.is_accepting()


class TokenMaskFiller:
    """Fills the step's bitmask for its constrained rows on the host, in parallel over rows (llguidance's
    executor, GIL released). Implements engine.sampling.token_mask.TokenMaskFiller."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], threads: int | None = None) -> None:
        """vocab_size: the llguidance tokenizer's (a mask's width; the sampler disallows wider logits' rest)."""
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_token_ids = tuple(t for t in eos_token_ids if t < vocab_size)
        self._executor = llguidance.LLExecutor(threads)
        self._buffers = [torch.empty(0, self.words, dtype=torch.int32)] * 2
        self._calls = 0

    def fill(self, grammars: Sequence[SequenceGrammar]) -> torch.Tensor:
        """[len(grammars), words] int32 on the host (pinned where CUDA is), row i the tokens grammars[i] allows
        next. Two buffers alternate: the tensor stays valid until the call after next, so a non-blocking copy
        of it to the device may still be in flight during the next step's fill."""
        rows, slot = len(grammars), self._calls % 2
        self._calls += 1
        if self._buffers[slot].shape[0] < rows:
            self._buffers[slot] = torch.empty(max(rows, 2 * self._buffers[slot].shape[0]), self.words,
                                              dtype=torch.int32, pin_memory=torch.cuda.is_available())
        bitmask = self._buffers[slot][:rows]
        row_bytes = self.words * 4
        if rows == 1:
            grammars[0].matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            self._executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                                   bitmask.data_ptr(), row_bytes, rows)
        for i, grammar in enumerate(grammars):
            if grammar.failed:
                self._only_eos(bitmask[i])
        return bitmask

    def _only_eos(self, row: torch.Tensor) -> None:
        row.zero_()
        for token in self.eos_token_ids:
            row[token // 32] |= 1 << (token % 32)
