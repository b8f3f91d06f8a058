"""A closed gRPC KV plane: the receiver (in this process, real gRPC on 127.0.0.1) holds a cluster secret and
refuses, before it reads or allocates anything, senders (in a spawned peer) without it; and crafted
manifests pushed by hand over the real port are refused from the manifest alone, quickly, before any
allocation. Every test ends with every pool whole."""
from __future__ import annotations

import dataclasses
import time

import grpc
import msgpack
import pytest

from kv_transfer import TransferConfig, create_receiver
from kv_transfer.grpc.auth import SECRET_METADATA_KEY
from kv_transfer.grpc.codec import PUSH_PATH, encode_manifest_chunk
from proto import tandem_pb2
from tests.support import kv_scenarios as sc
from tests.support.kv_peer import FP32, PeerProcess, PeerSpec, Wait

TIMEOUT_S = 60.0
SECRET = "5ec2e7" * 8
QUICK_S = TIMEOUT_S / 2  # a refusal takes ms (6 s seen with 8 suites on one host); catches one that waits it out


def _side(secret: str | None) -> sc.Side:
    pool = sc.receiver_pool(FP32)
    gate = sc.Gate(pool)  # gate.entered is set by any allocate call
    config = TransferConfig(transport="grpc", kv_transfer_timeout_s=TIMEOUT_S, connect_timeout_s=30,
                            cluster_secret=secret)
    return sc.Side("float32", pool, gate, create_receiver(config, gate.view(), "grpc", host="127.0.0.1", port=0))


@pytest.fixture(scope="module")
def rig():
    peer = PeerProcess(PeerSpec("grpc", timeout_s=TIMEOUT_S))
    sides = {"closed": _side(SECRET), "open": _side(None)}
    yield sc.Rig(peer, peer, sides)
    peer.stop()
    for side in sides.values():
        side.receiver.close()


def _send(rig: sc.Rig, side: str, key: str, secret: str | None, blocks=(1, 2, 3, 9)):
    start = dataclasses.replace(rig.start(key, side, blocks, seed=len(key)), secret=secret)
    began = time.monotonic()
    assert rig.peer.call(start).ok
    return start, rig.peer.call(Wait(key)), time.monotonic() - began


def test_senders_without_the_clusters_secret_are_refused(rig):
    """A wrong secret and no secret: UNAUTHENTICATED at once, nothing allocated, nothing in the inbox;
    the sender right after them (this cluster's secret) is delivered bit for bit."""
    closed = rig.sides["closed"]
    closed.gate.entered.clear()
    for key, secret in (("stranger", "0" * 64), ("anonymous", None), ("prefix", SECRET[:-1])):
        _, sent, elapsed = _send(rig, "closed", key, secret)
        assert (sent.ok, sent.status) == (False, "UNAUTHENTICATED"), sent
        assert "own cluster" in sent.message and SECRET not in sent.message
        assert elapsed < QUICK_S, f"a refusal took {elapsed:.1f}s"
    assert not closed.gate.entered.is_set(), "the receiver allocated for an unauthenticated stream"
    assert closed.receiver.unauthenticated == 3 and closed.receiver.poll() == []
    start, sent, _ = _send(rig, "closed", "member", SECRET)
    assert sent.ok, sent
    sc.take_received(closed, start)
    rig.assert_all_free()


def test_a_receiver_without_a_secret_accepts_any_sender(rig):
    for key, secret in (("with-secret", SECRET), ("without", None)):
        start, sent, _ = _send(rig, "open", key, secret)
        assert sent.ok, sent
        sc.take_received(rig.sides["open"], start)
    rig.assert_all_free()


def _manifest(**changes) -> dict:
    """The msgpack map of a valid manifest for 3 blocks (sender ids 4, 5, 9) of FP32, with changes."""
    nbytes = FP32.block_nbytes
    raw = {"version": 1, "request_id": "crafted", "fingerprint": dataclasses.asdict(FP32),
           "num_tokens": 3 * FP32.block_size, "block_ids": [4, 5, 9], "first_token": 1, "checksum_algo": "rowsum64",
           "runs": [[4, 2, 2 * nbytes, None], [9, 1, nbytes, None]]}
    raw.update(changes)
    return raw


NB = FP32.block_nbytes
CRAFTED = {  # name: (manifest map, status, what the refusal says)
    "counts do not sum": (_manifest(runs=[[4, 2, 2 * NB, None], [9, 2, 2 * NB, None]]), "KV_MALFORMED",
                          "already cover 4 blocks"),
    "a run of 10**12 blocks": (_manifest(runs=[[4, 10**12, 10**12 * NB, None]]), "KV_MALFORMED", "already cover"),
    "millions of runs": (_manifest(runs=[[4, 1, NB, None]] * 2_000_000), "KV_MALFORMED", "exceeds"),
    "more runs than blocks": (_manifest(runs=[[4, 1, NB, None]] * 40), "KV_MALFORMED", "40 runs for 3 blocks"),
    "a block list beyond the pool": (_manifest(block_ids=list(range(5000)), num_tokens=5000 * FP32.block_size),
                                     "KV_MALFORMED", "exceeds"),
    "num_tokens beyond the pool": (_manifest(num_tokens=10**15), "KV_MALFORMED", "could ever hold"),
    "num_tokens inconsistent": (_manifest(num_tokens=3 * FP32.block_size + 1), "KV_MALFORMED", "need 4 blocks"),
    "wrong fingerprint": (_manifest(fingerprint={**dataclasses.asdict(FP32), "num_layers": 2**40}),
                          "KV_REJECTED_FINGERPRINT", "num_layers"),
}


def _push_manifest(target: str, manifest: bytes) -> tuple[tandem_pb2.KVAck, float]:
    """A hand-made Push carrying only `manifest` (with this cluster's secret); the receiver's final ack."""
    with grpc.insecure_channel(target) as channel:
        push = channel.stream_stream(PUSH_PATH, request_serializer=None,
                                     response_deserializer=tandem_pb2.KVAck.FromString)
        began = time.monotonic()
        acks = list(push(iter([encode_manifest_chunk(manifest)]), timeout=30,
                         metadata=((SECRET_METADATA_KEY, SECRET),)))
        return acks[-1], time.monotonic() - began


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_manifest_is_refused_before_anything_is_allocated(rig, case):
    raw, status, reason = CRAFTED[case]
    closed = rig.sides["closed"]
    closed.gate.entered.clear()
    ack, elapsed = _push_manifest(closed.receiver.address.target, msgpack.packb(raw))
    assert ack.final and tandem_pb2.KVStatus.Name(ack.status) == status and reason in ack.error, ack
    assert elapsed < QUICK_S, f"refusing {case!r} took {elapsed:.1f}s"
    assert not closed.gate.entered.is_set(), f"the receiver allocated for {case!r}"
    sc.take_failure(closed, status.removeprefix("KV_"))
    start, sent, _ = _send(rig, "closed", f"after-{case.replace(' ', '-')}", SECRET)
    assert sent.ok, sent
    sc.take_received(closed, start)
    rig.assert_all_free()
