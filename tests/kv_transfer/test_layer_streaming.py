"""Layer-streamed transfers over real gloo (on the pair's process group, and inline on its control connection) and
gRPC (sender and receiver in this process, on their own threads): bytes land bit-identical, the first token comes
from the tail, and a stream that breaks after k of n layers, is aborted or cancelled between layers frees everything
on both sides; a stream's listeners (KV lanes) hear its finish or abort."""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from kv_transfer import (DistRendezvous, ReceivedKV, ReceiveFailed, SendRequest, TransferConfig, create_receiver,
                         create_sender)
from kv_transfer.layer_stream import LayerClock, LayerStream, StreamTail
from kv_transfer.manifest import ManifestError, ModelFingerprint
from kv_transfer.status import KVTransferError, TransferStatus
from kv_transfer.stream_tail import decode_tail, encode_tail
from kv_transfer.testing import FreeListPool, blocks_bytes, fill_blocks
from kv_transfer.token_logprobs import FirstTokenLogprobs

FP = ModelFingerprint(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
NUM_BLOCKS = 32
SENDER_BLOCKS = (3, 4, 5, 9, 20)  # two runs; 5 blocks hold 17..20 tokens


class Rig:
    """A sender pool and sender, a receiver pool (shuffled free list: non-contiguous ids) and receiver."""

    def __init__(self, transport: str, inline_max_bytes: int = TransferConfig.inline_max_bytes):
        config = TransferConfig(transport=transport, kv_transfer_timeout_s=20, connect_timeout_s=30, dist_lanes=2,
                                inline_max_bytes=inline_max_bytes)
        self.src = FreeListPool(FP, NUM_BLOCKS)
        self.dst = FreeListPool(FP, NUM_BLOCKS, free_order=list(reversed(range(NUM_BLOCKS))))
        rdzv = lambda rank: DistRendezvous(rank, 2, f"ls-{uuid.uuid4().hex[:8]}")  # noqa: E731
        if transport == "grpc":
            self.receiver = create_receiver(config, self.dst.view(), "grpc")
            self.sender = create_sender(config, self.src.view(), "grpc")
        else:
            shared = rdzv(0)
            self.receiver = create_receiver(config, self.dst.view(), transport,
                                            rendezvous=DistRendezvous(1, 2, shared.namespace),
                                            peers=[0])
            self.sender = create_sender(config, self.src.view(), transport, rendezvous=shared)

    def start(self, request_id: str, seed: int) -> tuple[LayerClock, LayerStream, object]:
        """The engine's side: blocks allocated and being written, a stream started before the forward."""
        self.src.take(SENDER_BLOCKS)
        fill_blocks(self.src.kv, SENDER_BLOCKS, seed)
        clock = LayerClock(FP.num_layers, torch.device("cpu"))
        stream = LayerStream(clock)
        request = SendRequest(request_id, SENDER_BLOCKS, 18, None, stream=stream)
        handle = self.sender.send(self.receiver.address, request)
        return clock, stream, handle

    def outcome(self) -> ReceivedKV | ReceiveFailed:
        outcome = self.receiver.wait(20)
        assert outcome is not None, "no outcome within 20 s"
        return outcome

    def assert_whole(self) -> None:
        assert self.src.num_free == NUM_BLOCKS and self.dst.num_free == NUM_BLOCKS


@pytest.fixture(scope="module", params=["gloo-group", "gloo-inline", "grpc"])
def rig(request):
    transport, _, path = request.param.partition("-")
    rig = Rig(transport, 0 if path == "group" else TransferConfig.inline_max_bytes)
    yield rig
    rig.sender.close()
    rig.receiver.close()


def _compute_layers(clock: LayerClock, layers: range, pause_s: float = 0.01) -> None:
    for layer in layers:
        time.sleep(pause_s)  # the forward's work on this layer
        clock.layer_done(layer)


def test_streamed_layers_land_bit_identical_with_the_tail(rig):
    clock, stream, handle = rig.start("whole", seed=7)
    _compute_layers(clock, range(FP.num_layers))
    logprobs = FirstTokenLogprobs(-0.5, 1, (42, 7), (-0.5, -1.5))
    assert stream.finish(StreamTail(42, logprobs), SENDER_BLOCKS)
    handle.result(20)
    received = rig.outcome()
    assert isinstance(received, ReceivedKV), received
    assert received.manifest.first_token == 42 and received.manifest.first_logprobs == logprobs
    assert received.kv_bytes == len(SENDER_BLOCKS) * FP.block_nbytes
    assert blocks_bytes(rig.dst.kv, received.block_ids) == blocks_bytes(rig.src.kv, SENDER_BLOCKS)
    rig.dst.free(received.block_ids)
    rig.assert_whole()  # the transfer freed the sender's blocks once they were handed over


def test_layers_land_before_the_first_token_is_known(rig):
    """Every layer is written, the first token is not: the layers are already in the receiver's blocks,
    and the transfer waits only for the tail."""
    landing = rig.dst.next_free(len(SENDER_BLOCKS))
    clock, stream, handle = rig.start("early", seed=8)
    _compute_layers(clock, range(FP.num_layers), pause_s=0)
    expected = blocks_bytes(rig.src.kv, SENDER_BLOCKS)
    deadline = time.monotonic() + 20
    while blocks_bytes(rig.dst.kv, landing) != expected:
        assert time.monotonic() < deadline, "the layers did not land before the tail"
        time.sleep(0.01)
    assert not handle.done() and rig.receiver.wait(0) is None  # nothing is delivered without the tail
    assert stream.finish(StreamTail(3), SENDER_BLOCKS)
    handle.result(20)
    received = rig.outcome()
    assert isinstance(received, ReceivedKV) and received.manifest.first_token == 3
    assert list(received.block_ids) == landing
    rig.dst.free(received.block_ids)
    rig.assert_whole()


@pytest.mark.parametrize("layers_done", [0, 2])
def test_stream_broken_after_k_layers_frees_both_sides(rig, layers_done):
    clock, stream, handle = rig.start(f"broken-{layers_done}", seed=9)
    _compute_layers(clock, range(layers_done))
    clock.step_failed("RuntimeError: the forward failed")
    with pytest.raises(KVTransferError) as failure:
        handle.result(20)
    assert failure.value.status == TransferStatus.ABORTED_BY_SENDER
    outcome = rig.outcome()
    assert isinstance(outcome, ReceiveFailed)
    assert not stream.finish(StreamTail(1), SENDER_BLOCKS)  # the transfer is over: the engine keeps its blocks
    rig.src.free(SENDER_BLOCKS)  # as engine.abort does
    rig.assert_whole()


def test_first_token_ending_the_request_aborts_the_stream(rig):
    clock, stream, handle = rig.start("eos", seed=10)
    _compute_layers(clock, range(FP.num_layers))
    stream.abort("the first token ended the request")
    with pytest.raises(KVTransferError) as failure:
        handle.result(20)
    assert failure.value.status == TransferStatus.ABORTED_BY_SENDER
    assert isinstance(rig.outcome(), ReceiveFailed)
    rig.src.free(SENDER_BLOCKS)  # the engine freed them when it finished the request
    rig.assert_whole()


def test_receiver_cancel_between_layers(rig):
    clock, stream, handle = rig.start("cancelled", seed=11)
    _compute_layers(clock, range(2))
    rig.receiver.cancel("cancelled")
    _compute_layers(clock, range(2, FP.num_layers))
    handed_over = stream.finish(StreamTail(5), SENDER_BLOCKS)
    with pytest.raises(KVTransferError) as failure:
        handle.result(20)
    assert failure.value.status == TransferStatus.CANCELLED
    outcome = rig.outcome()
    assert isinstance(outcome, ReceiveFailed) and outcome.status == TransferStatus.CANCELLED
    if not handed_over:
        rig.src.free(SENDER_BLOCKS)
    rig.assert_whole()


def test_sender_cancel_between_layers(rig):
    clock, stream, handle = rig.start("sender-cancel", seed=12)
    _compute_layers(clock, range(1))
    threading.Timer(0.05, handle.cancel).start()
    time.sleep(0.2)
    _compute_layers(clock, range(1, FP.num_layers))
    handed_over = stream.finish(StreamTail(5), SENDER_BLOCKS)
    with pytest.raises(KVTransferError) as failure:
        handle.result(20)
    assert failure.value.status == TransferStatus.CANCELLED
    assert isinstance(rig.outcome(), ReceiveFailed)
    if not handed_over:
        rig.src.free(SENDER_BLOCKS)
    rig.assert_whole()


def test_tail_round_trip_and_bad_tails():
    logprobs = FirstTokenLogprobs(-0.25, 2, (1,), (-0.1,))
    assert decode_tail(encode_tail(9, logprobs)) == (9, logprobs)
    assert decode_tail(encode_tail(0, None)) == (0, None)
    for bad in (b"\xc1", encode_tail(-1, None), b"\x93\x01\xc0\xc0", b"\x00" * 5000):
        with pytest.raises(ManifestError):
            decode_tail(bad)


def test_streamed_manifests_are_validated():
    from kv_transfer.manifest import Manifest, RunInfo, encode_manifest
    from kv_transfer.manifest_decode import decode_manifest
    run = RunInfo(0, 2, 2 * FP.block_nbytes, None)
    streamed = Manifest("s", FP, 8, (0, 1), None, (run,), streamed=True)
    assert decode_manifest(encode_manifest(streamed)) == streamed
    assert streamed.piece_nbytes == [2 * FP.block_nbytes // FP.num_layers] * FP.num_layers
    with pytest.raises(ManifestError, match="first_token"):  # only a streamed manifest defers the first token
        Manifest("w", FP, 8, (0, 1), None, (run,))
    with pytest.raises(ManifestError, match="no run checksums"):
        Manifest("s", FP, 8, (0, 1), None, (RunInfo(0, 2, 2 * FP.block_nbytes, 5),), streamed=True)


def test_a_streams_listeners_hear_its_finish_or_its_abort_once_and_nothing_after_its_end():
    """LayerStream.add_listener (KV lanes pass the worker's stream on to every rank's): a finish that hands the blocks
    over and an abort are heard; an abort after the finish, and a finish after the transfer ended, are not."""
    heard = []
    finished = LayerStream(LayerClock(2, torch.device("cpu")))
    finished.add_listener(lambda tail, reason: heard.append(("finished", tail, reason)))
    assert finished.finish(StreamTail(7), (1, 2))
    finished.abort("too late")
    aborted = LayerStream(LayerClock(2, torch.device("cpu")))
    aborted.add_listener(lambda tail, reason: heard.append(("aborted", tail, reason)))
    aborted.abort("the first token ended the request")
    ended = LayerStream(LayerClock(2, torch.device("cpu")))
    ended.add_listener(lambda tail, reason: heard.append(("ended", tail, reason)))
    ended.ended(lambda blocks: None)
    assert not ended.finish(StreamTail(8), (3,))
    assert heard == [("finished", StreamTail(7), None), ("aborted", None, "the first token ended the request")]
