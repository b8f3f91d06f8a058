"""The runner's numpy mirrors of block tables follow every way the engine changes a table."""
from __future__ import annotations

import gc

import numpy as np

from engine.attention.block_tables import BlockTableMirrors
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(name: str, blocks: list[int]) -> Sequence:
    s = Sequence(name, [1, 2, 3], SamplingParams())
    s.block_table = list(blocks)
    return s


def test_appends_replacements_and_width():
    mirrors = BlockTableMirrors()
    a, b = seq("a", [7, 3]), seq("b", [])
    assert mirrors.tables([a, b], 3).tolist() == [[7, 3, 0], [0, 0, 0]]
    a.block_table.extend(range(100, 140))  # grows past the mirror's first capacity
    b.block_table.extend([9])
    got = mirrors.tables([b, a], 43)
    assert got[0].tolist() == [9] + [0] * 42 and got[1].tolist() == [7, 3, *range(100, 140), 0]
    assert mirrors.tables([a], 2).tolist() == [[7, 3]]  # only the blocks the step needs
    a.block_table = [5]  # preempted and re-admitted: a new list
    assert mirrors.tables([a], 2).tolist() == [[5, 0]]
    a.block_table.extend([6, 8])
    assert mirrors.tables([a], 3).dtype == np.int32 and mirrors.tables([a], 3).tolist() == [[5, 6, 8]]


def test_a_finished_sequence_leaves_no_mirror():
    mirrors = BlockTableMirrors()
    mirrors.tables([seq("gone", [1, 2])], 2)
    gc.collect()
    assert len(mirrors._mirrors) == 0
