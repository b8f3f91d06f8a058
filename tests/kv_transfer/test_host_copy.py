"""The transfer plane's host copies and checksum sums (kv_transfer/host_copy.py, kv_transfer/checksum.py) run through
numpy on the calling thread: each gives exactly the bytes of the torch op it replaces, for every pool dtype and on
strided pool views."""
from __future__ import annotations

import pytest
import torch

from kv_transfer.checksum import _GOLDEN, _MASK, RunChecksum, _word_dtype, checksum_blocks
from kv_transfer.host_copy import SPLIT_BYTES, copy_tensor, put_blocks, take_blocks
from kv_transfer.pool import fingerprint_of
from kv_transfer.runs import block_planes

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_pool(dtype: torch.dtype, seed: int, num_blocks: int = 12) -> torch.Tensor:
    kv = torch.empty(3, 2, num_blocks, 4, 2, 16, dtype=dtype)  # [L, 2, N, bs, H, D]
    words = kv.view(torch.int16 if kv.element_size() == 2 else torch.int32)
    words.random_(generator=torch.Generator().manual_seed(seed))
    return kv


def torch_checksum(blocks: torch.Tensor) -> int:
    """rowsum64 as torch computes it (the CUDA path), the reference for the host path."""
    num_layers, two, n = blocks.shape[:3]
    words = blocks.contiguous().view(_word_dtype(blocks.shape[-1] * blocks.element_size()))
    rows = words.reshape(num_layers, two, n, -1).sum(-1, dtype=torch.int64).flatten()
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64)
    plain, weighted = torch.stack([rows.sum(), (rows * weights).sum()]).tolist()
    mixed = (plain & _MASK) ^ (((weighted & _MASK) * _GOLDEN) & _MASK)
    return (mixed ^ (blocks.numel() * blocks.element_size())) & _MASK


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_host_checksum_is_the_torch_checksum_on_strided_views(dtype):
    kv = random_pool(dtype, seed=1)
    for blocks in (kv[:, :, 3:8], kv[:, :, 5:6], kv[1:2, :, 0:12]):  # strided runs of the pool
        assert checksum_blocks(blocks) == torch_checksum(blocks)
    changed = kv[:, :, 3:8].clone()
    changed.view(torch.uint8).view(-1)[77] ^= 1
    assert checksum_blocks(changed) != checksum_blocks(kv[:, :, 3:8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_copies_move_exactly_the_bytes_torch_moves(dtype):
    kv, ids = random_pool(dtype, seed=2), [7, 2, 9]
    out = torch.empty(3, 2, 5, 4, 2, 16, dtype=dtype)
    copy_tensor(out, kv[:, :, 4:9])  # a strided run into contiguous staging
    assert torch.equal(out.view(torch.uint8), kv[:, :, 4:9].contiguous().view(torch.uint8))

    layer = torch.empty(2, 3, 4, 2, 16, dtype=dtype)
    take_blocks(layer, kv[1], ids, dim=1)  # one layer of scattered blocks
    assert torch.equal(layer.view(torch.uint8), kv[1].index_select(1, torch.tensor(ids)).view(torch.uint8))

    target, expected = random_pool(dtype, seed=3), random_pool(dtype, seed=3)
    put_blocks(target[2], layer, ids, dim=1)
    expected[2].index_copy_(1, torch.tensor(ids), layer)
    assert torch.equal(target.view(torch.uint8), expected.view(torch.uint8))


def test_operations_past_the_split_size_run_in_halves_with_the_same_result():
    """SPLIT_BYTES and more: the checksum's row sums and a copy run as two halves on two threads, bit for bit what
    one pass gives (a strided run of the pool, cut along its layers)."""
    kv = torch.empty(4, 2, 40, 16, 8, 64, dtype=torch.bfloat16)  # [L, 2, N, bs, H, D], 10 MiB
    kv.view(torch.int16).random_(generator=torch.Generator().manual_seed(4))
    run = kv[:, :, 3:37]  # 8.5 MiB, strided
    assert run.numel() * run.element_size() >= SPLIT_BYTES
    assert checksum_blocks(run) == torch_checksum(run)
    out = torch.empty(run.shape, dtype=run.dtype)
    copy_tensor(out, run)
    assert torch.equal(out.view(torch.int16), run.contiguous().view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 3])  # 3: rows of 6 or 12 bytes, summed as int16 / int32 words
def test_a_run_summed_piece_by_piece_has_the_checksum_of_its_blocks(dtype, head_dim):
    """RunChecksum (the inline path's sums, taken as each plane passes) equals checksum_blocks and torch's sum of the
    run, whether it passes as its planes or as one gathered piece; it refuses a piece that splits a row."""
    kv = torch.empty(3, 2, 12, 4, 2, head_dim, dtype=dtype)  # [L, 2, N, bs, H, D]
    kv.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(5))
    run = kv[:, :, 4:9]  # [L, 2, 5, bs, H, D], strided
    fingerprint = fingerprint_of(kv)
    by_planes = RunChecksum.of_run(fingerprint, 5)
    for plane in block_planes(run.contiguous()):
        by_planes.add(plane.numpy())
    whole = RunChecksum.of_run(fingerprint, 5)
    whole.add(run.contiguous().view(torch.uint8).view(-1).numpy())
    assert by_planes.value() == whole.value() == checksum_blocks(run) == torch_checksum(run)
    half_row = RunChecksum.of_run(fingerprint, 5)
    with pytest.raises(ValueError, match="does not fit"):
        half_row.add(run.contiguous().view(torch.uint8).view(-1)[: half_row.row_nbytes // 2].numpy())
    with pytest.raises(ValueError, match="rows were summed"):
        half_row.value()
