"""A step's batch on the host, and its one upload for an eager forward.

`host_batch` lays the scheduled chunks out token-major (single-token chunks first) as plain lists: the ids, each
sequence's counts, the rows to sample and the positions their picks will have. A sequence whose last token was
sampled by the step still running (async scheduling) has no id on the host yet: its row gets a placeholder and a
feed entry (its row, its pick's index in that step's picks), and the device copies the pick in (`feed_tokens`).
`stage_eager` writes the lists into the runner's staging buffer and uploads them in one copy
(engine/step_io.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.runner.device_tables import DeviceBlockTables, TableUpdates
from engine.host_lists import Uploads
from engine.step_io import StepIO, layout, stage_uploads, uploads_layout
from engine.sampling.prompt_logprobs import PromptRows, prompt_rows
from engine.sequence import ScheduledChunk, Sequence


@dataclass
class HostBatch:
    """One step's batch as host lists (sequences in batch order: single-token chunks first)."""

    seqs: list[Sequence] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)       # [T], 0 where a row is fed from the device
    num_computed: list[int] = field(default_factory=list)    # [N]
    num_new: list[int] = field(default_factory=list)         # [N]
    sample_rows: list[int] = field(default_factory=list)     # [S] batch rows sampled (a fork's repeat its parent's)
    sampled: list[Sequence] = field(default_factory=list)    # [S] the sequence (sample) each pick goes to
    pick_positions: list[int] = field(default_factory=list)  # [S] the index each pick will have in its sequence
    prompt: PromptRows = field(default_factory=lambda: PromptRows([], [], []))
    feed_rows: list[int] = field(default_factory=list)       # [F] rows whose id is the last step's pick ...
    feed_from: list[int] = field(default_factory=list)       # [F] ... at this index of its picks

    @property
    def seq_lens(self) -> list[int]:
        return [c + n for c, n in zip(self.num_computed, self.num_new)]


def host_batch(chunks: list[ScheduledChunk], fed_index: dict[int, int]) -> HostBatch:
    """The chunks' batch; fed_index: id(sequence) -> index of its pick in the running step's picks, for the
    sequences whose last token is pending."""
    batch, row = HostBatch(), 0
    for chunk in sorted(chunks, key=lambda c: c.num_new_tokens > 1):  # stable: single tokens first
        seq, start, n = chunk.seq, chunk.seq.num_computed_tokens, chunk.num_new_tokens
        if seq.num_pending_tokens:
            if n != 1 or start != seq.num_tokens:
                raise RuntimeError(f"{seq!r} has a pending token but is scheduled for {n} from {start}")
            batch.feed_rows.append(row)
            batch.feed_from.append(fed_index[id(seq)])
            batch.input_ids.append(0)
        else:
            batch.input_ids += seq.token_ids[start:start + n]
        prompt_rows(seq, start, n, row, batch.prompt)
        row += n
        batch.seqs.append(seq)
        batch.num_computed.append(start)
        batch.num_new.append(n)
        if chunk.samples:  # the sequence's next token; a prefill of n samples gives each its first
            for sample in (seq, *seq.forks):
                batch.sample_rows.append(row - 1)
                batch.sampled.append(sample)
                batch.pick_positions.append(start + n)
    return batch


def feed_tokens(input_ids: torch.Tensor, rows: torch.Tensor, picks: torch.Tensor | None,
                index: torch.Tensor) -> None:
    """input_ids[rows] = picks[index], on the device (no-op without rows). input_ids [T] int64, rows and index
    [F] int64, picks [S'] int64: the running step's picks."""
    if rows.numel():
        input_ids.index_copy_(0, rows, picks.index_select(0, index))


def stage_eager(io: StepIO, tables: DeviceBlockTables, batch: HostBatch, table_rows: list[int],
                updates: TableUpdates, uploads: Uploads | None = None) -> dict[str, torch.Tensor]:
    """The eager step's inputs, and behind them its sampling inputs (uploads: bound to their device views), through
    the staging buffer in one upload; applies the table updates on the device. Returns the device views by field
    name."""
    num_seqs, num_updates, num_feeds = len(batch.num_computed), len(updates), len(batch.feed_rows)
    fields, end = layout([("input_ids", np.int64, len(batch.input_ids)), ("num_computed", np.int64, num_seqs),
                          ("num_new", np.int64, num_seqs), ("query_start", np.int32, num_seqs + 1),
                          ("seq_lens", np.int32, num_seqs), ("table_rows", np.int64, num_seqs),
                          ("sample_rows", np.int64, len(batch.sample_rows)), ("feed_rows", np.int64, num_feeds),
                          ("feed_from", np.int64, num_feeds), ("update_rows", np.int64, num_updates),
                          ("update_cols", np.int64, num_updates), ("update_blocks", np.int32, num_updates)])
    appended, end = uploads_layout(uploads, end) if uploads is not None else ([], end)
    staging = io.staging_for(end)
    staging.wait_writable()
    host = {name: staging.host(f) for name, f in fields.items()}
    host["input_ids"][:], host["num_computed"][:], host["num_new"][:] = \
        batch.input_ids, batch.num_computed, batch.num_new
    host["query_start"][0] = 0
    np.cumsum(host["num_new"], out=host["query_start"][1:], dtype=np.int32)
    np.add(host["num_computed"], host["num_new"], out=host["seq_lens"], casting="unsafe")
    host["table_rows"][:], host["sample_rows"][:] = table_rows, batch.sample_rows
    host["feed_rows"][:], host["feed_from"][:] = batch.feed_rows, batch.feed_from
    host["update_rows"][:], host["update_cols"][:], host["update_blocks"][:] = \
        updates.rows, updates.cols, updates.blocks
    if appended:
        stage_uploads(staging, appended, uploads)
    staging.upload(end)
    view = {name: staging.device_view(f) for name, f in fields.items()}
    tables.apply(view["update_rows"], view["update_cols"], view["update_blocks"])
    return view
