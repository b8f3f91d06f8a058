"""Block tables of a step as one int32 array, without re-reading every sequence's whole table each step.

A sequence's block table is a Python list that only grows (`extend`) until it is replaced by a new list
(preemption, release, admission). Each sequence keeps a numpy mirror here: the entries appended since the
last step are copied in, a replaced list is copied afresh. Building the step's [N, max_blocks] table is then
one row copy per sequence in C, so the Python work per step grows with the number of sequences and of new
blocks, not with context length (at 256 sequences x 16k tokens, reading the lists anew cost ~25 ms a step).
"""
from __future__ import annotations

import weakref

import numpy as np

from engine.sequence import Sequence


class _Mirror:
    """A numpy copy of one block-table list object; `array[:length]` equals the list's first entries."""

    def __init__(self, source: list[int]) -> None:
        self.source = source
        self.array = np.empty(max(16, 2 * len(source)), dtype=np.int32)
        self.length = 0

    def sync(self) -> np.ndarray:
        """The list's entries as int32 (appends since the last call are copied in)."""
        size = len(self.source)
        if size < self.length:  # shrunk in place: not how the engine changes tables, but stay exact
            self.length = 0
        if size > self.array.shape[0]:
            grown = np.empty(2 * size, dtype=np.int32)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        if size > self.length:
            self.array[self.length:size] = self.source[self.length:size]
            self.length = size
        return self.array[:size]


class BlockTableMirrors:
    """Numpy mirrors of the block tables of the sequences a runner has seen (dropped with the sequence)."""

    def __init__(self) -> None:
        self._mirrors: weakref.WeakKeyDictionary[Sequence, _Mirror] = weakref.WeakKeyDictionary()

    def tables(self, seqs: list[Sequence], width: int) -> np.ndarray:
        """[len(seqs), width] int32: each sequence's first `width` blocks, 0-padded."""
        out = np.zeros((len(seqs), width), dtype=np.int32)
        for row, seq in enumerate(seqs):
            mirror = self._mirrors.get(seq)
            if mirror is None or mirror.source is not seq.block_table:
                mirror = self._mirrors[seq] = _Mirror(seq.block_table)
            entries = mirror.sync()[:width]
            out[row, :entries.shape[0]] = entries
        return out
