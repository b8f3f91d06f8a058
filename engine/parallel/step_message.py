"""The one message rank 0 sends the other ranks of its group for each step: the step's host inputs, packed into an
int32 buffer of a fixed size (one broadcast on the group's host control group, engine/parallel/group.py), from
which a follower stages the same batch tensors in one upload (engine/runner/follower_inputs.py) and runs the same
forward.

Layout (int32 words): header [kind, T, N, width, S, R, C, B, lane_stream, total] then input_ids [T], num_computed
[N], num_new [N], block_tables [N * width], sample_rows [S], prompt_rows [R], copy sources [C], copy targets [C],
streamed blocks [B] (every layer of theirs gathered to rank 0 as the forward writes it: engine/runner/group_kv.py);
lane_stream 1: every rank tells its rank service each layer the forward wrote (KV lanes stream from every rank).
kind STOP ends a follower. Kinds KV_GATHER / KV_SCATTER (a KVMove: header [kind, n, C, 0, ..., total], block ids
[n], copies [C] [C]) move KV blocks between the ranks' pools and one full-head tensor on rank 0
(engine/runner/group_kv.py). Every step of at most INLINE_WORDS words (decode steps of 256 sequences with up to
60 blocks each, prefill steps of ~15k tokens) is one broadcast; a larger one sends the words past INLINE_WORDS
in a second broadcast, announced by `total` in the first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.parallel.group import TPGroup

STEP, STOP, KV_GATHER, KV_SCATTER = 1, 2, 3, 4
HEADER_WORDS = 10
INLINE_WORDS = 16384  # 64 KiB: one broadcast of this size costs ~0.1 ms over loopback gloo


@dataclass(frozen=True)
class StepInputs:
    """Everything a rank needs to run one step's forward and its logits calls, on the host."""

    input_ids: list[int]          # [T] the batch's tokens, sequence by sequence
    num_computed: list[int]       # [N] tokens already in each sequence's KV
    num_new: list[int]            # [N] tokens of each sequence in this step (single-token chunks first)
    block_tables: np.ndarray      # [N, width] int32
    sample_rows: list[int]        # [S] batch rows that go through the LM head to be sampled
    prompt_rows: list[int]        # [R] batch rows that give prompt logprobs (in ROWS_PER_SLICE slices)
    copies: tuple[list[int], list[int]] = field(default=((), ()))  # [C] KV blocks copied (source, target)
    stream_blocks: list[int] = field(default=())  # [B] blocks whose every layer goes to rank 0 once written
    lane_stream: bool = False  # every rank reports each layer written to its rank service (kv_transfer/lanes/)


@dataclass(frozen=True)
class KVMove:
    """Rank 0 moves KV blocks across its group (engine/runner/group_kv.py): KV_GATHER, every rank sends its heads
    of block_ids to rank 0; KV_SCATTER, rank 0 sends every rank a full-head tensor of block_ids' KV, each rank
    writes its own heads into block_ids."""

    kind: int
    block_ids: list[int]  # [n] ids in every rank's pool (the ranks' pools share block ids)
    copies: tuple[list[int], list[int]] = field(default=((), ()))  # [C] block copies queued before it, applied first


def pack_kv_move(move: KVMove) -> np.ndarray:
    sources, targets = move.copies
    total = HEADER_WORDS + len(move.block_ids) + 2 * len(sources)
    header = [move.kind, len(move.block_ids), len(sources)] + [0] * (HEADER_WORDS - 4) + [total]
    return np.asarray(header + list(move.block_ids) + list(sources) + list(targets), dtype=np.int32)


def unpack_kv_move(words: np.ndarray) -> KVMove:
    num_blocks, num_copies = int(words[1]), int(words[2])
    ids, sources, targets = np.split(words[HEADER_WORDS:], np.cumsum([num_blocks, num_copies]))
    return KVMove(int(words[0]), ids.tolist(), (sources.tolist(), targets[:num_copies].tolist()))


def pack(step: StepInputs) -> np.ndarray:
    """The step as its int32 words (header included)."""
    tables = np.ascontiguousarray(step.block_tables, dtype=np.int32)
    sources, targets = step.copies
    parts = [step.input_ids, step.num_computed, step.num_new, tables.reshape(-1), step.sample_rows,
             step.prompt_rows, sources, targets, step.stream_blocks]
    body = np.concatenate([np.asarray(p, dtype=np.int32).reshape(-1) for p in parts])
    header = np.array([STEP, len(step.input_ids), len(step.num_new), tables.shape[1] if tables.ndim == 2 else 0,
                       len(step.sample_rows), len(step.prompt_rows), len(sources), len(step.stream_blocks),
                       int(step.lane_stream), HEADER_WORDS + body.size], dtype=np.int32)
    return np.concatenate([header, body])


def unpack(words: np.ndarray) -> StepInputs:
    """pack's inverse."""
    _, num_tokens, num_seqs, width, num_samples, num_prompt, num_copies, num_streamed, lane_stream, _ = (
        int(w) for w in words[:HEADER_WORDS])
    sizes = [num_tokens, num_seqs, num_seqs, num_seqs * width, num_samples, num_prompt, num_copies, num_copies,
             num_streamed]
    bounds = np.cumsum([HEADER_WORDS] + sizes)
    ids, computed, new, tables, samples, prompt, sources, targets, streamed = (
        words[start:stop] for start, stop in zip(bounds[:-1], bounds[1:]))
    return StepInputs(ids.tolist(), computed.tolist(), new.tolist(), tables.reshape(num_seqs, width).copy(),
                      samples.tolist(), prompt.tolist(), (sources.tolist(), targets.tolist()), streamed.tolist(),
                      bool(lane_stream))


class StepChannel:
    """Rank 0 sends (send, send_stop), the others receive, one message per step, in the same order."""

    def __init__(self, group: TPGroup, inline_words: int = INLINE_WORDS) -> None:
        self.group = group
        self.buffer = torch.zeros(inline_words, dtype=torch.int32)  # host; reused for every message

    def send(self, step: StepInputs) -> None:
        self._send_words(pack(step))

    def send_kv_move(self, move: KVMove) -> None:
        self._send_words(pack_kv_move(move))

    def send_stop(self) -> None:
        self._send_words(np.array([STOP] + [0] * (HEADER_WORDS - 2) + [HEADER_WORDS], dtype=np.int32))

    def receive(self) -> StepInputs | KVMove | None:
        """The next message rank 0 sent (a step or a KV move), or None for STOP. Waits as long as rank 0 is idle."""
        inline = self.buffer.numel()
        words = self.group.broadcast_control_(self.buffer, idle=True).numpy()
        if words[0] == STOP:
            return None
        total = int(words[HEADER_WORDS - 1])
        if total > inline:
            rest = self.group.broadcast_control_(torch.empty(total - inline, dtype=torch.int32))
            words = np.concatenate([words, rest.numpy()])
        if words[0] in (KV_GATHER, KV_SCATTER):
            return unpack_kv_move(words[:total])
        return unpack(words[:total])

    def _send_words(self, words: np.ndarray) -> None:
        inline = self.buffer.numel()
        self.buffer.numpy()[:min(inline, words.size)] = words[:inline]
        self.group.broadcast_control_(self.buffer)
        if words.size > inline:
            self.group.broadcast_control_(torch.from_numpy(np.ascontiguousarray(words[inline:])))
