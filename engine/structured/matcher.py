"""One constrained sequence's matcher, and the bitmask of a step's constrained rows.

Bit t of a row (word t // 32, bit t % 32) is set when token t may come next. llguidance allows EOS only where
the grammar may end, and only EOS once it has ended. A matcher that fell into its error state (a token it did
not allow was forced on it, which the engine does not do) allows only EOS, so the sequence ends.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import llguidance
import numpy as np


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

    def fill_into(self, grammars: Sequence[SequenceGrammar], out: np.ndarray) -> None:
        """Writes out ([len(grammars), words] int32, host, C-contiguous: the step's staged bitmask): row i the tokens
        grammars[i] allows next (only EOS for a failed one)."""
        rows, row_bytes = len(grammars), self.words * 4
        if out.shape != (rows, self.words) or out.dtype != np.int32 or not out.flags.c_contiguous:
            raise ValueError(f"a bitmask must be a C-contiguous int32 [{rows}, {self.words}], got {out.dtype} "
                             f"{out.shape}")
        if rows == 1:
            grammars[0].matcher.unsafe_compute_mask_ptr(out.ctypes.data, row_bytes)
        else:
            self._executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                                   out.ctypes.data, row_bytes, rows)
        for i, grammar in enumerate(grammars):
            if grammar.failed:
                self._only_eos(out[i].view(np.uint32))

    def _only_eos(self, row: np.ndarray) -> None:
        row[:] = 0
        for token in self.eos_token_ids:
            row[token // 32] |= np.uint32(1 << (token % 32))
