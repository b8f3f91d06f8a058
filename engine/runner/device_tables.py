"""Block tables kept on the device and updated incrementally.

Each sequence a runner steps holds a row of one device table [rows, max_blocks] int32 for as long as it keeps
being scheduled. A step sends only what changed since the row was last written: the blocks appended to the
sequence's table (its Python list only grows, `extend`, until it is replaced by a new list: preemption, prefix
reuse, a fork), or the whole list when the row is new or the list was replaced. Those (row, column, block) triples
travel in the step's one upload (engine/step_io.py) and land with one scatter; the step's [N, width] tables
are then one gather of the rows it uses. A decode step of 256 sequences thus sends a few hundred bytes of tables,
not 256 whole tables.

A row whose sequence is gone (or is not in the step being planned, when rows run out) is taken for another; the
table grows (rows or columns, doubled, copied on the device) when a step needs more.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from engine.sequence import Sequence


@dataclass
class _Row:
    """What row `index` of the device table holds: the first `length` entries of the list `source`."""

    index: int
    source: list[int] | None = None
    length: int = 0


@dataclass
class TableUpdates:
    """The (row, column, block) triples one step writes into the device table, host side."""

    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)


class DeviceBlockTables:
    """See the module docstring. plan() is host work (per sequence, plus per new block); apply() and gather() run
    on the device with the step's uploaded tensors."""

    def __init__(self, max_blocks: int, device: torch.device, num_rows: int = 64) -> None:
        self.table = torch.zeros(max(1, num_rows), max(1, max_blocks), dtype=torch.int32, device=device)
        self._rows: weakref.WeakKeyDictionary[Sequence, _Row] = weakref.WeakKeyDictionary()
        self._owners: list[weakref.ref | None] = [None] * self.table.shape[0]

    def plan(self, seqs: list[Sequence]) -> tuple[list[int], TableUpdates]:
        """Each sequence's row (assigned if it has none) and the triples that bring the rows up to date with the
        sequences' block tables. Grows the device table when the rows or columns do not suffice."""
        longest = max((len(seq.block_table) for seq in seqs), default=0)
        if longest > self.table.shape[1]:
            self._resize(self.table.shape[0], max(longest, 2 * self.table.shape[1]))
        present = set(map(id, seqs))
        rows, updates = [], TableUpdates()
        for seq in seqs:
            row = self._rows.get(seq) or self._assign(seq, present)
            table = seq.block_table
            if row.source is not table or len(table) < row.length:
                row.source, row.length = table, 0
            if len(table) > row.length:
                new = len(table) - row.length
                updates.rows += [row.index] * new
                updates.cols += range(row.length, len(table))
                updates.blocks += table[row.length:]
                row.length = len(table)
            rows.append(row.index)
        return rows, updates

    def apply(self, rows: torch.Tensor, cols: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write the step's triples ([U] int64, int64, int32 on the device) into the table: one scatter."""
        if rows.numel():
            self.table.index_put_((rows, cols), blocks)

    def gather(self, rows: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The step's tables [N, width] int32: rows [N] int64 of the table, in batch order (into `out` when
        given: a graph's static tables [N, cols], width = cols then). Each row's first len(block_table) entries
        are its sequence's blocks; past them, whatever the row held before (block ids no kernel reads)."""
        width = width if out is None else out.shape[1]
        if width > self.table.shape[1]:
            self._resize(self.table.shape[0], width)
        if out is None:
            return self.table[:, :width].index_select(0, rows)
        return torch.index_select(self.table[:, :out.shape[1]], 0, rows, out=out)

    def _assign(self, seq: Sequence, present: set[int]) -> _Row:
        """A row for seq: a free one, else one whose sequence is gone or not in this step, else a new one."""
        index = next((i for i, owner in enumerate(self._owners) if owner is None or owner() is None), None)
        if index is None:
            index = next((i for i, owner in enumerate(self._owners) if id(owner()) not in present), None)
            if index is not None:
                self._rows.pop(self._owners[index](), None)
        if index is None:
            index = self.table.shape[0]
            self._resize(2 * index, self.table.shape[1])
        self._owners[index] = weakref.ref(seq)
        row = self._rows[seq] = _Row(index)
        return row

    def _resize(self, num_rows: int, num_cols: int) -> None:
        old = self.table
        self.table = torch.zeros(num_rows, num_cols, dtype=old.dtype, device=old.device)
        self.table[:old.shape[0], :old.shape[1]] = old
        self._owners += [None] * (num_rows - len(self._owners))
