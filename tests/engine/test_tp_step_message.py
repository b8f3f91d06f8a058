"""Rank 0's step message: packed and unpacked exactly, one broadcast when it fits, the overflow in a second,
STOP ends the receiver, KV moves between the steps; over a real 2-rank gloo group."""
from __future__ import annotations

import dataclasses

import numpy as np

from engine.parallel.step_message import (HEADER_WORDS, KV_GATHER, KV_SCATTER, KVMove, StepChannel, StepInputs, pack,
                                          unpack)
from tests.support.tp_ranks import run_ranks


def _step(num_seqs: int, width: int, copies=((), ()), streamed=()) -> StepInputs:
    rng = np.random.default_rng(num_seqs)
    new = [1] * (num_seqs - 1) + [5]
    return StepInputs(rng.integers(0, 50000, sum(new)).tolist(), rng.integers(0, 900, num_seqs).tolist(), new,
                      rng.integers(0, 4000, (num_seqs, width)).astype(np.int32), list(range(num_seqs)), [3, 4],
                      (list(copies[0]), list(copies[1])), list(streamed))


def _same(a: StepInputs, b: StepInputs) -> bool:
    return (a.input_ids, a.num_computed, a.num_new, a.sample_rows, a.prompt_rows) == \
        (b.input_ids, b.num_computed, b.num_new, b.sample_rows, b.prompt_rows) and \
        np.array_equal(a.block_tables, b.block_tables) and [list(c) for c in a.copies] == [list(c) for c in b.copies] \
        and list(a.stream_blocks) == list(b.stream_blocks) and a.lane_stream == b.lane_stream


def test_pack_unpack_round_trip():
    lanes = dataclasses.replace(_step(5, 2), lane_stream=True)  # its followers report each layer (KV lanes)
    for step in (_step(1, 1), _step(7, 3, ([1, 2], [9, 10])), _step(40, 0), _step(3, 2, ([4], [5]), [7, 8, 9]), lanes):
        words = pack(step)
        assert words.dtype == np.int32 and words[HEADER_WORDS - 1] == words.size
        assert _same(unpack(words), step)


def _exchange(group, steps, inline_words):
    channel = StepChannel(group, inline_words)
    if group.rank == 0:
        for step in steps:
            channel.send_kv_move(step) if isinstance(step, KVMove) else channel.send(step)
        channel.send_stop()
        return None
    received = []
    while (step := channel.receive()) is not None:
        received.append(step)
    return received


def test_channel_delivers_every_step_in_order_then_stop():
    # 64 inline words: the small steps fit one broadcast, the 30 x 20 block table overflows into a second
    steps = [_step(2, 2), _step(30, 20, ([5], [6])), _step(1, 1), _step(3, 4, streamed=[2, 3])]
    moves = [KVMove(KV_GATHER, [4, 5, 6]), KVMove(KV_SCATTER, list(range(80)), ([1], [2]))]  # the 2nd overflows
    assert pack(steps[0]).size <= 64 < pack(steps[1]).size
    _, received = run_ranks(_exchange, 2, steps[:2] + moves + steps[2:], 64)
    assert len(received) == len(steps) + 2 and all(_same(a, b) for a, b in zip(received[:2] + received[4:], steps))
    assert [(m.kind, list(m.block_ids), [list(c) for c in m.copies]) for m in received[2:4]] == \
        [(KV_GATHER, [4, 5, 6], [[], []]), (KV_SCATTER, list(range(80)), [[1], [2]])]
