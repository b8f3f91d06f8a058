"""The device block table follows every way the engine changes a sequence's table, sending only what changed."""
from __future__ import annotations

import gc

import torch

from engine.attention.metadata import padded_tables
from engine.runner.device_tables import DeviceBlockTables
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(name: str, blocks: list[int]) -> Sequence:
    s = Sequence(name, [1, 2, 3], SamplingParams())
    s.block_table = list(blocks)
    return s


def step(tables: DeviceBlockTables, seqs: list[Sequence], width: int) -> tuple[list[list[int]], int]:
    """Plan, apply and gather as a runner does; returns the step's tables and how many triples it sent."""
    rows, updates = tables.plan(seqs)
    tables.apply(torch.tensor(updates.rows, dtype=torch.long), torch.tensor(updates.cols, dtype=torch.long),
                 torch.tensor(updates.blocks, dtype=torch.int32))
    return tables.gather(torch.tensor(rows, dtype=torch.long), width).tolist(), len(updates)


def test_only_appended_blocks_travel():
    tables = DeviceBlockTables(4, torch.device("cpu"), num_rows=2)
    a, b = seq("a", [7, 3]), seq("b", [])
    assert step(tables, [a, b], 3) == ([[7, 3, 0], [0, 0, 0]], 2)
    assert step(tables, [a, b], 3)[1] == 0  # nothing changed: nothing sent
    a.block_table.extend(range(100, 140))  # past the table's first columns: it grows
    b.block_table.append(9)
    got, sent = step(tables, [b, a], 43)
    assert sent == 41 and got == [[9] + [0] * 42, [7, 3, *range(100, 140), 0]]
    a.block_table = [5]  # preempted and re-admitted: a new list, the row written afresh
    got, sent = step(tables, [a], 1)
    assert (got, sent) == ([[5]], 1)
    a.block_table += [6, 8]
    assert step(tables, [a], 3) == ([[5, 6, 8]], 2)


def test_rows_are_reused_and_grow():
    tables = DeviceBlockTables(2, torch.device("cpu"), num_rows=2)
    many = [seq(f"s{i}", [i, i + 1]) for i in range(5)]  # more than the rows: the table grows
    got, _ = step(tables, many, 2)
    assert got == padded_tables([s.block_table for s in many]).tolist()
    rows_before = tables.table.shape[0]
    del many[:4]
    gc.collect()
    fresh = [seq(f"t{i}", [50 + i]) for i in range(3)]  # the gone sequences' rows are taken
    got, _ = step(tables, [*fresh, many[0]], 2)
    # past a sequence's own blocks a row holds whatever it held (no kernel reads there)
    assert [row[:len(s.block_table)] for row, s in zip(got, [*fresh, many[0]])] == [[50], [51], [52], [4, 5]]
    assert tables.table.shape[0] == rows_before


def test_a_sequence_not_in_the_step_yields_its_row_only_when_rows_run_out():
    tables = DeviceBlockTables(2, torch.device("cpu"), num_rows=2)
    a, b, c = seq("a", [1]), seq("b", [2]), seq("c", [3])
    step(tables, [a, b], 1)
    got, sent = step(tables, [c], 1)  # a's and b's rows are taken by c although both are alive
    assert got == [[3]] and sent == 1
    got, sent = step(tables, [a, b], 1)  # the one evicted is written afresh; the other kept its row
    assert got == [[1], [2]] and sent == 1
