"""The per-transfer fixed path's shortcuts against the general code they stand in for: the manifest's checks
(which name a failing block only once one fails), the decoder's reuse of the receiver's fingerprint, run grouping,
and the ipc receiver's pool-to-pool copies."""
from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest
import torch

from kv_transfer.incoming import IncomingTransfer
from kv_transfer.ipc.landing import NO_STAGING, MappedIncoming, copy_block_lists, runs_start
from kv_transfer.manifest import (Manifest, ManifestError, ManifestLimits, ModelFingerprint, RunInfo, _validate,
                                  encode_manifest)
from kv_transfer.manifest_decode import decode_manifest
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.results import SendRequest
from kv_transfer.runs import BlockRun, consecutive_start, group_runs
from kv_transfer.staging import StagingPool
from kv_transfer.testing import FreeListPool, fill_blocks

FP = ModelFingerprint(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4)


class _Int(int):
    pass


def _unchecked(**changes) -> Manifest:
    """A manifest with `changes` applied and no validation run (to hand to the checks themselves)."""
    fields = dict(request_id="r", fingerprint=FP, num_tokens=14, block_ids=(3, 4, 5, 9), first_token=42,
                  runs=(RunInfo(3, 3, 3 * FP.block_nbytes, 7), RunInfo(9, 1, FP.block_nbytes, 8)),
                  checksum_algo="rowsum64", first_logprobs=None, streamed=False, prefix_blocks=0)
    fields.update(changes)
    manifest = object.__new__(Manifest)
    for name, value in fields.items():
        object.__setattr__(manifest, name, value)
    return manifest


_VARIANTS = [
    {}, {"block_ids": (3, 4, 5, True)}, {"block_ids": (3, 4, 5, _Int(9))}, {"block_ids": (3, 4, 5, -9)},
    {"block_ids": (3, 4, 5, 1 << 64)}, {"block_ids": (3, 4, 5, 3)}, {"block_ids": [3, 4, 5, 9]},
    {"block_ids": (3, 4, 5)}, {"num_tokens": 14.0}, {"num_tokens": True}, {"num_tokens": 0}, {"num_tokens": 17},
    {"request_id": ""}, {"request_id": "x" * 513}, {"request_id": b"r"}, {"first_token": None},
    {"first_token": -1}, {"first_token": "1"}, {"streamed": 1}, {"streamed": True}, {"checksum_algo": "crc"},
    {"prefix_blocks": 1}, {"prefix_blocks": -1}, {"prefix_blocks": True}, {"runs": ()},
    {"runs": (RunInfo(3, 4, 4 * FP.block_nbytes, 7),)}, {"runs": (RunInfo(3, 3, 3 * FP.block_nbytes, 7),)},
    {"runs": (RunInfo(3, 3, 3 * FP.block_nbytes, 7), RunInfo(9, 1, 1, 8))},
    {"runs": (RunInfo(3, 3, 3 * FP.block_nbytes, -7), RunInfo(9, 1, FP.block_nbytes, 8))},
    {"runs": (RunInfo(3, 3, 3 * FP.block_nbytes, 7), RunInfo(9, True, FP.block_nbytes, 8))},
    {"runs": (RunInfo(3, 3, 3 * FP.block_nbytes, None), RunInfo(9, 1, FP.block_nbytes, None))},
    {"runs": (RunInfo(4, 3, 3 * FP.block_nbytes, 7), RunInfo(9, 1, FP.block_nbytes, 8))},
    {"runs": (RunInfo(3, 2, 2 * FP.block_nbytes, 7), RunInfo(5, 2, 2 * FP.block_nbytes, 8))},
    {"first_token": None, "streamed": True,
     "runs": (RunInfo(3, 3, 3 * FP.block_nbytes, None), RunInfo(9, 1, FP.block_nbytes, None))},
    {"num_tokens": 12, "prefix_blocks": 1, "block_ids": (4, 5),
     "runs": (RunInfo(4, 2, 2 * FP.block_nbytes, None),)},
]


_VALID = (0, 2, 30, 33, 34)  # the variants the checks accept (2: an int subclass is an int); the others fail
_BLOCK_ERRORS = {1: "block_ids[3] must be an int, got bool", 3: "block_ids[3]=-9 outside",
                 4: "block_ids[3]=18446744073709551616 outside", 5: "block_ids contain duplicates"}


@pytest.mark.parametrize("index", range(len(_VARIANTS)))
def test_the_checks_accept_exactly_the_valid_manifests_and_name_a_bad_block(index):
    manifest = _unchecked(**_VARIANTS[index])
    if index in _VALID:
        _validate(manifest)
        return
    with pytest.raises(ManifestError) as failure:
        _validate(manifest)
    if index in _BLOCK_ERRORS:
        assert _BLOCK_ERRORS[index] in str(failure.value)


def test_the_receivers_own_fingerprint_is_reused_only_for_an_exact_match():
    limits = ManifestLimits(FP, 64)
    manifest = _unchecked()
    assert decode_manifest(encode_manifest(manifest), limits).fingerprint is FP
    raw = msgpack.unpackb(encode_manifest(manifest))
    for wrong in (True, 2.0):
        raw["fingerprint"]["num_layers"] = wrong
        with pytest.raises(ManifestError, match="fingerprint.num_layers must be an int"):
            decode_manifest(msgpack.packb(raw), limits)
    raw["fingerprint"]["num_layers"] = 3
    with pytest.raises(ManifestError, match="KV layout differs: num_layers: 2 != 3"):
        decode_manifest(msgpack.packb(raw), limits)


def _reference_runs(block_ids, max_blocks=0):
    runs = []
    for block in block_ids:
        last = runs[-1] if runs else None
        if last and last.start + last.num_blocks == block and (not max_blocks or last.num_blocks < max_blocks):
            runs[-1] = BlockRun(last.start, last.num_blocks + 1)
        else:
            runs.append(BlockRun(block, 1))
    return runs


def test_group_runs_matches_the_block_by_block_definition():
    rng = random.Random(3)
    for _ in range(300):
        ids = rng.sample(range(40), rng.randint(0, 20))
        if rng.random() < 0.5:
            ids.sort()
        for max_blocks in (0, 1, 2, 5):
            assert group_runs(ids, max_blocks) == _reference_runs(ids, max_blocks)


def test_consecutive_and_runs_start():
    assert consecutive_start((7,)) == 7 and consecutive_start((2, 3, 4)) == 2
    assert consecutive_start((2, 4, 4)) is None and consecutive_start((2, 3, 3, 5)) is None
    assert consecutive_start((4, 3)) is None
    assert runs_start([RunInfo(2, 2, 0, None), RunInfo(4, 1, 0, None)]) == 2
    assert runs_start([RunInfo(2, 2, 0, None), RunInfo(5, 1, 0, None)]) is None


def _land(sender_blocks, free_order, fp=FP, num_blocks=40):
    """Lands sender_blocks of a filled pool through MappedIncoming.land_all; the receiver's blocks and pools."""
    src, dst = FreeListPool(fp, num_blocks), FreeListPool(fp, num_blocks, free_order=free_order)
    src.take(sender_blocks)
    fill_blocks(src.kv, sender_blocks, seed=5)
    request = SendRequest("r", tuple(sender_blocks), len(sender_blocks) * fp.block_size, 1)
    manifest = prepare_outgoing(src.view(), request, NO_STAGING, trailing_checksums=True).manifest
    incoming = MappedIncoming.accept_mapped(manifest, dst.view(), None)
    assert incoming.payloads == [None] * len(manifest.runs)  # nothing staged
    incoming.source = src.kv
    incoming.landed_all()
    received = incoming.commit()
    return received.block_ids, src, dst


@pytest.mark.parametrize("sender_blocks, free_order", [
    ([3, 4, 5], None),                            # consecutive both sides: one slice copy
    ([3, 4, 9], None),                            # sender runs with a gap
    ([3, 4, 5], [7, 2, 30] + [i for i in range(40) if i not in (7, 2, 30)]),  # receiver ids scattered
    ([8, 1, 2], [5, 9, 6] + [i for i in range(40) if i not in (5, 9, 6)]),
])
def test_land_all_is_bit_exact_whatever_the_ids(sender_blocks, free_order):
    got, src, dst = _land(sender_blocks, free_order)
    assert torch.equal(dst.kv[:, :, list(got)], src.kv[:, :, sender_blocks])
    untouched = [i for i in range(40) if i not in got]
    assert not dst.kv[:, :, untouched].any()


def test_land_all_of_many_blocks_is_bit_exact():
    fp = dataclasses.replace(FP, head_dim=128, num_kv_heads=8, block_size=16)  # 64 KiB blocks
    blocks = list(range(2, 2 + 9))
    got, src, dst = _land(blocks, None, fp=fp, num_blocks=len(blocks) + 4)
    assert torch.equal(dst.kv[:, :, list(got)], src.kv[:, :, blocks])


def test_copy_block_lists_matches_index_copy():
    src = torch.arange(2 * 2 * 6 * 3, dtype=torch.float32).reshape(2, 2, 6, 3)
    cases = (([RunInfo(1, 2, 0, None)], [4, 5]), ([RunInfo(1, 1, 0, None), RunInfo(4, 1, 0, None)], [5, 0]))
    for runs, dst_ids in cases:
        kv = torch.zeros_like(src)
        copy_block_lists(src, runs, kv, dst_ids)
        expected = torch.zeros_like(src)
        src_ids = [b for r in runs for b in range(r.start_block, r.start_block + r.num_blocks)]
        expected[:, :, dst_ids] = src[:, :, src_ids]
        assert torch.equal(kv, expected)


def test_staged_incoming_transfers_still_get_their_payload_views():
    pool = FreeListPool(FP, 16)
    manifest = _unchecked()
    incoming = IncomingTransfer.accept(manifest, pool.view(), StagingPool("cpu"))
    assert [p.numel() for p in incoming.payloads] == [run.nbytes for run in manifest.runs]
    incoming.fail(0, "test")


def test_a_pool_read_in_place_stages_nothing_and_keeps_the_manifest():
    pool = FreeListPool(FP, 16)
    request = SendRequest("r", (3, 4, 5, 9), 14, 42)
    staged = prepare_outgoing(pool.view(), request, NO_STAGING, trailing_checksums=True)
    in_place = prepare_outgoing(pool.view(), request, NO_STAGING, trailing_checksums=True, all_direct=True)
    assert in_place.manifest_bytes == staged.manifest_bytes and in_place.manifest == staged.manifest
    assert in_place.direct == [True, True] and in_place.run_payloads == [None, None]
    assert [p.shape[0] for p in staged.run_payloads] == [run.nbytes for run in staged.manifest.runs]
