"""In-process checks of the KV transfer plane's pieces: manifest, runs, checksum, staging, wire codec, proto."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from kv_transfer import (KVTransferError, Manifest, ManifestError, ModelFingerprint, SendRequest, TransferConfig,
                         TransferStatus, decode_manifest, encode_manifest, resolve_transport)
from kv_transfer.checksum import checksum_blocks
from kv_transfer.grpc.auth import SECRET_METADATA_KEY, is_authorized
from kv_transfer.grpc.codec import decode_chunk, encode_checksum_chunk, encode_data_chunk
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import FingerprintMismatch, ManifestLimits
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.runs import BlockRun, group_runs
from kv_transfer.staging import StagingPool
from kv_transfer.testing import FreeListPool, blocks_bytes, fill_blocks
from proto import tandem_pb2

FP = ModelFingerprint(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4)


def _manifest() -> Manifest:
    pool = FreeListPool(FP, 16)
    pool.take([3, 4, 5, 9])
    fill_blocks(pool.kv, [3, 4, 5, 9], seed=1)
    return prepare_outgoing(pool.view(), SendRequest("req-1", (3, 4, 5, 9), 14, 42), StagingPool("cpu")).manifest


def _raw(m: Manifest) -> dict:
    return msgpack.unpackb(encode_manifest(m))


def test_manifest_round_trip():
    m = _manifest()
    assert decode_manifest(encode_manifest(m)) == m
    assert [(r.start_block, r.num_blocks) for r in m.runs] == [(3, 3), (9, 1)]
    assert m.total_nbytes == 4 * FP.block_nbytes


@pytest.mark.parametrize("mutate, reason", [
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.pop("first_token"), "missing ['first_token']"),
    (lambda d: d.update(extra=1), "unexpected ['extra']"),
    (lambda d: d.update(num_tokens="14"), "num_tokens must be an int"),
    (lambda d: d.update(num_tokens=20), "need 5 blocks"),
    (lambda d: d["fingerprint"].update(dtype="int8"), "fingerprint.dtype"),
    (lambda d: d["runs"][0].__setitem__(2, 7), "runs[0].nbytes"),
    (lambda d: d["runs"][1].__setitem__(0, 10), "do not cover block_ids"),
    (lambda d: d.update(runs=[[3, 3, 1, 2, 5]]), "runs[0] must be"),
    (lambda d: d.update(block_ids=[3, 3, 5, 9]), "duplicates"),
    (lambda d: d.update(request_id=""), "request_id"),
])
def test_malformed_manifest_is_rejected_with_a_reason(mutate, reason):
    raw = _raw(_manifest())
    mutate(raw)
    with pytest.raises(ManifestError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        decode_manifest(msgpack.packb(raw))


LIMITS = ManifestLimits(FP, max_blocks=16)


@pytest.mark.parametrize("mutate, reason", [
    (lambda d: d.update(num_tokens=16 * 4 + 1), "could ever hold"),
    (lambda d: d.update(block_ids=list(range(21))), "at most 20 entries"),  # 20: a first token's top logprobs
    (lambda d: d.update(runs=[[3, 1, FP.block_nbytes, None]] * 5), "5 runs for 4 blocks"),
    (lambda d: d.update(runs=[[3, 10**12, 10**12 * FP.block_nbytes, None]]), "already cover"),
    (lambda d: d.update(request_id="r" * 5000), "exceeds"),
])
def test_manifest_beyond_the_receivers_pool_is_refused_before_it_is_built(mutate, reason):
    raw = _raw(_manifest())
    mutate(raw)
    with pytest.raises(ManifestError, match=reason) as err:
        decode_manifest(msgpack.packb(raw), LIMITS)
    assert err.value.status == TransferStatus.MALFORMED


def test_manifest_limits_check_size_and_fingerprint_first():
    m = _manifest()
    assert decode_manifest(encode_manifest(m), LIMITS) == m
    assert LIMITS.max_manifest_bytes < 16 << 10
    with pytest.raises(ManifestError, match="exceeds"):
        decode_manifest(b"\x00" * (LIMITS.max_manifest_bytes + 1), LIMITS)
    raw = _raw(m)
    raw["fingerprint"]["num_layers"] = 2**40
    with pytest.raises(FingerprintMismatch, match="num_layers") as err:
        decode_manifest(msgpack.packb(raw), LIMITS)
    assert err.value.status == TransferStatus.REJECTED_FINGERPRINT


def test_runs_are_summed_before_they_are_expanded_even_without_limits():
    raw = _raw(_manifest())
    raw["runs"] = [[3, 2**50, 2**50 * FP.block_nbytes, None]]  # expanding it would never end
    with pytest.raises(ManifestError, match="already cover"):
        decode_manifest(msgpack.packb(raw))


def test_cluster_secret_stays_out_of_reprs_and_errors():
    secret = "s3cret-" * 4
    config = TransferConfig(cluster_secret=secret)
    assert secret not in repr(config) and config.cluster_secret == secret
    for bad in ("short", "has a space in it ....", "\u00e9" * 20):
        with pytest.raises(ValueError) as err:
            TransferConfig(cluster_secret=bad)
        assert bad not in str(err.value)
    metadata = ((SECRET_METADATA_KEY, secret),)
    assert is_authorized(None, None) and is_authorized(None, metadata) and is_authorized(secret, metadata)
    assert not is_authorized(secret, None) and not is_authorized(secret, ((SECRET_METADATA_KEY, secret[:-1]),))
    assert not is_authorized(secret, metadata * 2)  # exactly one value
    assert not is_authorized(secret, ((SECRET_METADATA_KEY, "\u00e9" * 28),))


def test_garbage_is_not_a_manifest():
    with pytest.raises(ManifestError, match="msgpack"):
        decode_manifest(b"\xc1\xff\x00")
    with pytest.raises(ManifestError, match="must be a map"):
        decode_manifest(msgpack.packb([1, 2, 3]))


def test_receiver_rejects_a_foreign_fingerprint_and_holds_nothing():
    m = _manifest()
    other = FreeListPool(dataclasses.replace(FP, dtype="float16"), 16)
    with pytest.raises(KVTransferError) as err:
        IncomingTransfer.accept(m, other.view(), StagingPool("cpu"))
    assert err.value.status == TransferStatus.REJECTED_FINGERPRINT and "dtype" in err.value.message
    assert other.num_free == 16


def test_local_round_trip_into_shuffled_blocks_is_bit_exact():
    src = FreeListPool(FP, 16)
    src.take([3, 4, 5, 9])
    fill_blocks(src.kv, [3, 4, 5, 9], seed=5)
    out = prepare_outgoing(src.view(), SendRequest("r", (3, 4, 5, 9), 16, 0), StagingPool("cpu"), max_run_bytes=1)
    assert [(r.start_block, r.num_blocks) for r in out.manifest.runs] == [(3, 1), (4, 1), (5, 1), (9, 1)]
    out.gather_all()
    dst = FreeListPool(FP, 16, free_order=[15, 2, 8, 7] + [i for i in range(16) if i not in (15, 2, 8, 7)])
    incoming = IncomingTransfer.accept(out.manifest, dst.view(), StagingPool("cpu"))
    for payload in out.run_payloads:
        data = payload.numpy().tobytes()
        incoming.write(data[:100])
        incoming.write(data[100:])
    got = incoming.commit()
    assert got.block_ids == (15, 2, 8, 7)
    assert blocks_bytes(dst.kv, got.block_ids) == blocks_bytes(src.kv, [3, 4, 5, 9])
    assert incoming.fail(TransferStatus.TIMEOUT, "late").status == TransferStatus.TIMEOUT  # no double free
    dst.free(got.block_ids)
    assert dst.num_free == 16


def test_trailing_checksums_round_trip_and_land_in_order():
    """A manifest may leave the checksums out (they follow each run, as GrpcSender sends them): it round-trips,
    a receiver that cannot carry them refuses it holding nothing, and one that can lands each run once its
    checksum is in, equal to the sender's blocks."""
    src = FreeListPool(FP, 16)
    src.take([3, 4, 5, 9])
    fill_blocks(src.kv, [3, 4, 5, 9], seed=6)
    out = prepare_outgoing(src.view(), SendRequest("r", (3, 4, 5, 9), 16, 0), StagingPool("cpu"), trailing_checksums=True)
    assert [r.checksum for r in out.manifest.runs] == [None, None] and out.manifest.trailing_checksums
    assert decode_manifest(encode_manifest(out.manifest)) == out.manifest
    dst = FreeListPool(FP, 16)
    with pytest.raises(KVTransferError) as err:
        IncomingTransfer.accept(out.manifest, dst.view(), StagingPool("cpu"))  # gloo / nccl
    assert err.value.status == TransferStatus.MALFORMED and dst.num_free == 16
    incoming = IncomingTransfer.accept(out.manifest, dst.view(), StagingPool("cpu"), trailing_checksums=True)
    out.gather_all()
    for index, payload in enumerate(out.run_payloads):
        incoming.write(payload.numpy().tobytes())
        assert not incoming.complete
        incoming.run_checksum(out.checksum(index))
    got = incoming.commit()
    assert blocks_bytes(dst.kv, got.block_ids) == blocks_bytes(src.kv, [3, 4, 5, 9])
    dst.free(got.block_ids)
    assert dst.num_free == 16


def test_group_runs():
    assert group_runs([]) == []
    assert group_runs([4]) == [BlockRun(4, 1)]
    assert group_runs([1, 2, 3, 7, 8, 2]) == [BlockRun(1, 3), BlockRun(7, 2), BlockRun(2, 1)]
    assert group_runs(range(5), max_blocks=2) == [BlockRun(0, 2), BlockRun(2, 2), BlockRun(4, 1)]


def test_checksum_is_layout_independent_and_catches_changes():
    pool = FreeListPool(FP, 16)
    fill_blocks(pool.kv, range(16), seed=3)
    strided = pool.kv[:, :, 5:9]  # [L, 2, 4, bs, H, D], a strided view of the pool
    base = checksum_blocks(strided)
    assert checksum_blocks(strided.contiguous()) == base
    flipped = strided.contiguous()
    flipped.view(torch.uint8).view(-1)[-1] ^= 1
    swapped = strided[:, :, [1, 0, 2, 3]]
    assert len({base, checksum_blocks(flipped), checksum_blocks(swapped), checksum_blocks(strided[:, :, :3])}) == 4
    odd = torch.randn(2, 2, 3, 4, 1, 3).to(torch.float16)  # innermost 6 bytes: int16 words
    assert checksum_blocks(odd) == checksum_blocks(odd.clone())


def test_staging_pool_reuses_buffers():
    pool = StagingPool("cpu", max_cached_bytes=1 << 20)
    first = pool.acquire(1000)
    pool.release(first)
    again = pool.acquire(800)
    assert again.data_ptr() == first.data_ptr() and again.numel() == 800


def test_data_chunk_encoding_matches_protobuf():
    payload = bytes(range(256)) * 1000
    wire = encode_data_chunk(memoryview(payload))
    assert wire == tandem_pb2.KVChunk(data=payload).SerializeToString()
    assert bytes(decode_chunk(wire).data) == payload
    manifest_wire = tandem_pb2.KVChunk(manifest=b"m").SerializeToString()
    assert decode_chunk(manifest_wire).manifest == b"m"
    for checksum in (0, 1, (1 << 64) - 1):  # 0 is a checksum, not an empty chunk
        got = decode_chunk(encode_checksum_chunk(checksum))
        assert (got.run_checksum, got.data, got.manifest) == (checksum, None, None)
    with pytest.raises(ValueError):
        decode_chunk(b"\x12\x05ab")


def test_proto_status_mirrors_transfer_status():
    assert {s.name: int(s) for s in TransferStatus} == {
        name.removeprefix("KV_"): number for name, number in tandem_pb2.KVStatus.items()}


def test_public_api_messages_have_the_contract_fields():
    fields = {f.name for f in tandem_pb2.GenerateRequest.DESCRIPTOR.fields}
    assert {"request_id", "prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
            "stop", "ignore_eos"} <= fields
    assert {"token_ids", "text", "finish_reason", "timing"} <= {f.name for f in tandem_pb2.GenerateResponse.DESCRIPTOR.fields}
    assert {"queue_ms", "prefill_ms", "transfer_ms", "ttft_ms", "kv_bytes", "prefill_worker", "decode_worker",
            "migrations", "transfer_exposed_ms", "prefill_location", "decode_cached_tokens"} == {
        f.name for f in tandem_pb2.Timing.DESCRIPTOR.fields}
    methods = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].methods_by_name
    assert methods["Generate"].server_streaming and not methods["Health"].server_streaming


def test_resolve_transport():
    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert resolve_transport("auto", cpu, cpu) == "gloo"
    assert resolve_transport("auto", cpu, cpu, same_host=False) == "grpc"
    assert resolve_transport("auto", cuda0, cuda1) == "nccl"
    assert resolve_transport("auto", cuda0, cuda0) == "ipc"  # one GPU: the receiver copies out of the sender's pool
    assert resolve_transport("grpc", cuda0, cuda1) == "grpc"
    with pytest.raises(ValueError, match="nccl"):
        resolve_transport("nccl", cpu, cuda0)
    with pytest.raises(ValueError, match="ipc"):
        resolve_transport("ipc", cuda0, cuda1)


def test_the_first_tokens_logprobs_travel_in_the_manifest():
    from kv_transfer.token_logprobs import FirstTokenLogprobs

    plain = _manifest()
    assert plain.first_logprobs is None and "first_logprobs" not in _raw(plain)
    logprobs = FirstTokenLogprobs(-0.25, 2, tuple(range(20)), tuple(-0.1 * i for i in range(20)))
    m = dataclasses.replace(plain, first_logprobs=logprobs)
    assert decode_manifest(encode_manifest(m), LIMITS) == m  # 20 alternatives fit a 16-block receiver's bounds
    for bad, reason in [([0.5, 1, [], []], "logprob"), ([-1.0, 0, [], []], "rank"), ([-1.0, 1, [3], []], "as many"),
                        ([-1.0, 1, [-3], [-2.0]], "top_ids"), ("x", "first_logprobs must be")]:
        raw = _raw(plain)
        raw["first_logprobs"] = bad
        with pytest.raises(ManifestError, match=reason):
            decode_manifest(msgpack.packb(raw), LIMITS)
