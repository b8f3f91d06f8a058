"""A tensor-parallel follower's step inputs in one upload: the follower's half of ModelRunner.prepare.

Rank 0 sends each step's host inputs (engine/parallel/step_message.py StepInputs: ids, counts, the step's whole
[N, width] block tables, sampled and prompt-logprob rows, streamed blocks). `FollowerInputs.stage` puts them on the
device the way rank 0's runner puts its own: an eager step through the follower's StepIO (engine/runner/step_batch.py
`stage_eager`), a decode-only step the decode graphs cover through their staged inputs (DecodeGraphs.run_staged),
the prompt-logprob rows and the streamed blocks behind either (an Uploads). One host-to-device copy a step, counted
by the follower's StepIO (its decode graphs share the counter); as on rank 0, a graphed step with more than
UPDATE_CAPACITY table updates sends them in a copy of their own.

Block tables: a follower has no Sequence to key a DeviceBlockTables row by, so `FollowerTables` finds a row by
the block its sequence last wrote (the block of its last position: that sequence's alone while it writes it; one
step later its last or second-to-last block), taken only if the row holds the sequence's other blocks, and sends
only the entries where the step's tables differ from what the device row holds (a host mirror of the device
table): a decode step, one entry per sequence that moved into a new block. A row matched badly would cost
updates, never correctness: whatever row a sequence gets, the entries it reads are made equal to the message's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.metadata import StepCounts, query_starts, step_tensors
from engine.host_lists import Key, Uploads
from engine.parallel.step_message import StepInputs
from engine.runner.decode_graphs import UPDATE_CAPACITY, DecodeBatch, DecodeGraphs
from engine.runner.device_tables import DeviceBlockTables, TableUpdates
from engine.runner.step_batch import HostBatch, stage_eager
from engine.step_io import StepIO


class FollowerTables:
    """The follower's device block table, brought up to date each step from the message's whole tables."""

    def __init__(self, device: torch.device, num_rows: int = 64, max_blocks: int = 64) -> None:
        self._device = device
        self.device_tables = DeviceBlockTables(max_blocks, device, num_rows)  # all zeros
        self._held = np.zeros(tuple(self.device_tables.table.shape), dtype=np.int32)  # [rows, cols]: its mirror
        self._key = [-1] * self._held.shape[0]  # the block each row is found by (-1: none)
        self._row_of: dict[int, int] = {}       # block -> the row it finds

    def plan(self, tables: np.ndarray, seq_lens: list[int], block_size: int) -> tuple[list[int], TableUpdates]:
        """Each sequence's row of `device_tables` and the (row, column, block) triples that make the first
        ceil(seq_lens[i] / block_size) entries of row i equal tables[i] ([N, width] int32); the host mirror
        assumes the caller applies them (stage_eager / DecodeGraphs.run_staged) before the next plan. A step
        with more rows or columns than the table has grows it first (doubled, its entries kept)."""
        num_seqs, width = tables.shape
        self._fit(num_seqs, width)
        seq = np.arange(num_seqs)
        used = -(-np.asarray(seq_lens, dtype=np.int64) // block_size)                   # [N] blocks each row reads
        last = tables[seq, used - 1].tolist()                                           # [N]
        before = np.where(used > 1, tables[seq, np.maximum(used - 2, 0)], -1).tolist()  # [N]
        rows = np.asarray(self._match(tables, used, last, before), dtype=np.int64)      # [N]
        stale = (self._held[rows, :width] != tables) & (np.arange(width) < used[:, None])  # [N, width]
        at, cols = np.nonzero(stale)                                                    # [U], [U]
        blocks = tables[at, cols]                                                       # [U]
        self._held[rows[at], cols] = blocks
        return rows.tolist(), TableUpdates(rows[at].tolist(), cols.tolist(), blocks.tolist())

    def _match(self, tables: np.ndarray, used: np.ndarray, last: list[int], before: list[int]) -> list[int]:
        """Rows for the step's sequences (tables [N, width], used [N] blocks each reads): the row found by a
        sequence's last block, else by its block before (it has moved into a new block since), if that row holds
        all of the sequence's blocks but the last; else a row no sequence of the step has. Re-keys the rows."""
        rows, claimed, width = [-1] * len(last), set(), tables.shape[1]
        for keys in (last, before):
            found = [(i, self._row_of.get(key)) for i, key in enumerate(keys) if rows[i] < 0]
            found = [(i, row) for i, row in found if row is not None and row not in claimed]
            if not found:
                continue
            seqs, cands = (np.asarray(column, dtype=np.int64) for column in zip(*found))  # [F], [F]
            same = (self._held[cands, :width] == tables[seqs]) | (np.arange(width) >= used[seqs, None] - 1)
            for (i, row), holds in zip(found, same.all(axis=1).tolist()):  # same: [F, width]
                if holds and row not in claimed:
                    rows[i] = row
                    claimed.add(row)
        free = (row for row in range(len(self._key)) if row not in claimed)
        rows = [row if row >= 0 else next(free) for row in rows]
        for row in rows:
            if self._row_of.get(self._key[row]) == row:
                del self._row_of[self._key[row]]
        for row, key in zip(rows, last):
            self._key[row], self._row_of[key] = key, row
        return rows

    def _fit(self, num_seqs: int, width: int) -> None:
        """A device table of at least num_seqs rows and width columns (doubled when it grows, its entries kept),
        the mirror and the keys sized to it (DeviceBlockTables.gather may have widened it: zeros)."""
        old = self.device_tables.table
        if num_seqs > old.shape[0] or width > old.shape[1]:
            self.device_tables = DeviceBlockTables(_grown(width, old.shape[1]), self._device,
                                                   _grown(num_seqs, old.shape[0]))
            self.device_tables.table[:old.shape[0], :old.shape[1]] = old  # on the device
        if self._held.shape != tuple(self.device_tables.table.shape):
            held, self._held = self._held, np.zeros(tuple(self.device_tables.table.shape), dtype=np.int32)
            self._held[:held.shape[0], :held.shape[1]] = held
            self._key += [-1] * (self._held.shape[0] - len(self._key))


def _grown(need: int, have: int) -> int:
    """A table dimension that holds `need`: `have`, or doubled (at least need) when it does not."""
    return max(need, 2 * have) if need > have else have


@dataclass(frozen=True)
class FollowerStep:
    """One step's inputs on the device, or, for a decode graph (`graph`), written behind the graphs' fields."""

    input_ids: torch.Tensor | None      # [T] int64 (None with graph)
    positions: torch.Tensor | None      # [T] int64
    meta: AttentionMetadata | None
    sample_rows: torch.Tensor | None    # [S] int64 (None with graph: DecodeGraphs.run_staged gives them)
    prompt_rows: torch.Tensor | None    # [R] int64 rows whose prompt logprobs rank 0 computes; None: none
    streamed: torch.Tensor | None       # [B] int64 blocks whose every layer goes to rank 0; None: none
    graph: DecodeBatch | None = None    # a decode-only step for DecodeGraphs.run_staged


class FollowerInputs:
    """Stages a follower's steps through its StepIO (`io`, whose `copies` count them) and its decode graphs."""

    def __init__(self, attention: AttentionBackend, block_size: int, device: torch.device, io: StepIO,
                 graphs: DecodeGraphs | None, num_rows: int = 64, max_blocks: int = 64) -> None:
        """graphs: built with this io (decode_graphs_for(..., io=io)), so their upload is counted with it.
        num_rows / max_blocks: the device block table's first size (it grows with the steps; a graph replay
        widens it to the graphs' width)."""
        self.attention, self.block_size, self.io, self.graphs = attention, block_size, io, graphs
        self.tables = FollowerTables(device, num_rows, max_blocks)

    def stage(self, step: StepInputs) -> FollowerStep:
        """The step's inputs on the device in one upload (the device block table updated with them), or, for a
        decode-only step the graphs cover (as rank 0 decides it), staged for DecodeGraphs.run_staged
        (`graph`), whose upload carries them. The device views stay valid until the next stage."""
        seq_lens = [c + n for c, n in zip(step.num_computed, step.num_new)]
        table_rows, updates = self.tables.plan(step.block_tables, seq_lens, self.block_size)
        uploads = Uploads()
        prompt = uploads.add(step.prompt_rows, np.int64) if step.prompt_rows else None
        streamed = uploads.add(step.stream_blocks, np.int64) if step.stream_blocks else None
        if self._graphed(step):
            graph = self._stage_graph(step, table_rows, updates, uploads)
            return FollowerStep(None, None, None, None, _get(uploads, prompt), _get(uploads, streamed), graph)
        batch = HostBatch(input_ids=step.input_ids, num_computed=step.num_computed, num_new=step.num_new,
                          sample_rows=step.sample_rows)
        view = stage_eager(self.io, self.tables.device_tables, batch, table_rows, updates, uploads)
        counts = StepCounts(view["num_computed"], view["num_new"], view["query_start"], view["seq_lens"])
        tables = self.tables.device_tables.gather(view["table_rows"], step.block_tables.shape[1])  # [N, width]
        tensors = step_tensors(self.attention, counts, tables, tuple(query_starts(step.num_new)), tuple(seq_lens),
                               self.block_size)
        return FollowerStep(view["input_ids"], tensors.positions, tensors.meta, view["sample_rows"],
                            _get(uploads, prompt), _get(uploads, streamed))

    def _graphed(self, step: StepInputs) -> bool:
        """Rank 0's rule for a graphed step (DecodeGraphs.takes), and no layer callback (a streaming step)."""
        return self.graphs is not None and not step.stream_blocks and not step.lane_stream \
            and self.graphs.takes(len(step.num_new), len(step.input_ids), len(step.sample_rows))

    def _stage_graph(self, step: StepInputs, table_rows: list[int], updates: TableUpdates,
                     uploads: Uploads) -> DecodeBatch:
        """The decode batch for run_staged, the uploads written behind its fields (both as rank 0 does)."""
        if len(updates) > UPDATE_CAPACITY:  # more than the graphs' upload has room for: a copy of their own
            stage_eager(self.io, self.tables.device_tables, HostBatch(), [], updates, uploads)
            updates = TableUpdates()
        elif len(uploads) and not self.graphs.stage_behind(len(table_rows), len(updates), uploads):
            stage_eager(self.io, self.tables.device_tables, HostBatch(), [], TableUpdates(), uploads)
        computed = np.asarray(step.num_computed, dtype=np.int64)                                  # [N]
        blocks = step.block_tables[np.arange(len(computed)), computed // self.block_size]         # [N]
        slots = blocks.astype(np.int64) * self.block_size + computed % self.block_size            # [N]
        return DecodeBatch(step.input_ids, step.num_computed, slots.tolist(), table_rows, step.sample_rows, updates,
                           [], [])


def _get(uploads: Uploads, key: Key | None) -> torch.Tensor | None:
    return None if key is None else uploads.get(key)
