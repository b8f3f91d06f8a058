"""The host socket path's shortcuts (issue 28's fixed cost) against the general code they stand in for: a host pool's
planes as numpy views against block_planes, a receiver's host targets against plane_targets (and no staging for a
run read in place), the inline batches cut at row boundaries, the checksum's cached weights, and a zero-byte
staging buffer that never enters the cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_transfer.checksum import RunChecksum, checksum_blocks, checksum_of_row_sums
from kv_transfer.dist.inline_batches import batch, byte_batches
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import Manifest, ModelFingerprint, RunInfo
from kv_transfer.runs import block_planes, group_runs
from kv_transfer.staging import StagingPool
from kv_transfer.testing import FreeListPool, fill_blocks

FP = ModelFingerprint(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4)
ROW_NBYTES = FP.block_nbytes // (2 * FP.num_layers)


def _same_memory(a: np.ndarray, b: torch.Tensor) -> bool:
    return a.ctypes.data == b.data_ptr() and a.size == b.numel() * b.element_size()


def _same_pieces(pieces, reference: list[torch.Tensor]) -> bool:
    """Both views of HostPieces are the reference planes' memory, in order."""
    planes, buffers = pieces
    return len(planes) == len(buffers) == len(reference) and all(
        _same_memory(p, r) and _same_memory(np.frombuffer(b, dtype=np.uint8), r)
        for p, b, r in zip(planes, buffers, reference))


@pytest.mark.parametrize("start,count", [(0, 1), (3, 4), (9, 7), (0, 16)])
def test_host_planes_are_the_pools_planes_without_a_torch_op_each(start, count):
    pool = FreeListPool(FP, 16)
    fill_blocks(pool.kv, list(range(16)), seed=3)
    pieces = pool.view().host_planes(start, count)
    reference = block_planes(pool.kv[:, :, start : start + count])
    assert len(reference) == 2 * FP.num_layers and _same_pieces(pieces, reference)


def _manifest(block_ids: tuple[int, ...]) -> Manifest:
    runs = tuple(RunInfo(r.start, r.num_blocks, r.num_blocks * FP.block_nbytes, None) for r in group_runs(block_ids))
    return Manifest("r", FP, len(block_ids) * FP.block_size, block_ids, 7, runs)


def test_a_host_reader_stages_only_the_runs_it_cannot_read_in_place():
    free_order = [4, 5, 6, 11, 2, 3] + [b for b in range(16) if b not in (4, 5, 6, 11, 2, 3)]
    pool = FreeListPool(FP, 16, free_order=free_order)
    staging = StagingPool("cpu")
    manifest = _manifest((0, 1, 2, 8, 9, 10))  # two sender runs of 3 -> receiver ids 4,5,6 and 11,2,3
    incoming = IncomingTransfer.accept(manifest, pool.view(), staging, trailing_checksums=True, host_reads=True)
    try:
        assert incoming.block_ids == (4, 5, 6, 11, 2, 3)
        assert incoming.payloads[0] is None and incoming.payloads[1].numel() == 3 * FP.block_nbytes
        for index in range(2):
            targets, in_place = incoming.host_targets(index)
            reference, reference_in_place = incoming.plane_targets(index, torch.device("cpu"))
            assert in_place == reference_in_place == (index == 0)
            assert _same_pieces(targets, reference)
    finally:
        incoming.fail(0, "test")
    assert pool.num_free == 16


def test_every_reader_but_a_host_one_stages_every_run():
    pool = FreeListPool(FP, 16)
    incoming = IncomingTransfer.accept(_manifest((0, 1, 2)), pool.view(), StagingPool("cpu"), trailing_checksums=True)
    assert incoming.payloads[0].numel() == 3 * FP.block_nbytes
    incoming.fail(0, "test")


@pytest.mark.parametrize("count,rows,batch_rows", [(5, 1, 4), (2, 3, 4), (16, 2, 4), (1, 7, 3), (3, 9, 4), (2, 2, 1)])
def test_batches_keep_the_bytes_in_order_and_cut_only_between_rows(count, rows, batch_rows, monkeypatch):
    monkeypatch.setattr("kv_transfer.dist.inline_batches.BATCH_BYTES", batch_rows * ROW_NBYTES - 1)
    data = np.random.default_rng(0).integers(0, 256, (count, 2 * rows * ROW_NBYTES), dtype=np.uint8)
    planes = data[:, : rows * ROW_NBYTES]  # strided, as a run's planes in a pool
    batches = [batch((planes, [memoryview(plane) for plane in planes]), cut)
               for cut in byte_batches(*planes.shape, ROW_NBYTES)]
    assert np.array_equal(np.concatenate([part for rows_, _ in batches for part in rows_]), planes.reshape(-1))
    assert all(np.array_equal(np.concatenate(list(rows_)), np.frombuffer(b"".join(views), dtype=np.uint8))
               for rows_, views in batches)  # both views of a batch are the same bytes
    assert all(rows_.ndim == 2 and rows_.shape[1] % ROW_NBYTES == 0 and rows_.size for rows_, _ in batches)
    assert all(rows_.nbytes < max(batch_rows, 2) * ROW_NBYTES for rows_, _ in batches)  # a row alone when larger


def test_the_run_checksum_summed_piece_by_piece_equals_the_whole_runs():
    pool = FreeListPool(FP, 16)
    fill_blocks(pool.kv, list(range(16)), seed=11)
    for start, count in ((0, 1), (2, 5), (0, 16), (2, 5)):  # the second (2, 5) reuses the cached weights
        summed = RunChecksum.of_run(FP, count)
        pieces = pool.view().host_planes(start, count)
        for cut in byte_batches(*pieces[0].shape, ROW_NBYTES):
            summed.add(batch(pieces, cut)[0])
        assert summed.value() == checksum_blocks(pool.kv[:, :, start : start + count])


def test_checksum_of_row_sums_wraps_like_its_definition():
    rows = np.random.default_rng(1).integers(-(1 << 63), (1 << 63) - 1, 1000, dtype=np.int64)
    weights = np.arange(1, rows.size + 1, dtype=np.int64)
    with np.errstate(over="ignore"):
        plain, weighted = int(rows.sum(dtype=np.int64)), int((rows * weights).sum(dtype=np.int64))
    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15
    expected = ((plain & mask) ^ (((weighted & mask) * golden) & mask) ^ 99) & mask
    assert checksum_of_row_sums(rows, 99) == expected


def test_a_zero_byte_staging_buffer_is_shared_and_never_cached():
    staging = StagingPool("cpu")
    empty = staging.acquire(0)
    assert empty.numel() == 0 and staging.acquire(0) is empty
    staging.release(empty)
    assert staging.acquire(16).numel() == 16 and staging._free == []
