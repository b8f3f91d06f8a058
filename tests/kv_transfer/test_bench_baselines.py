"""The transfer benchmark's baselines: the raw socket and the bare gRPC stream deliver every byte, and a gRPC
run of `kv_transfer.bench` times the floor beside each transfer."""
import argparse
import json

import numpy as np

from kv_transfer import bench
from kv_transfer.bench_baselines import GrpcFloorClient, GrpcFloorSink, TcpSink, tcp_send


def _payload(nbytes: int, seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes())


def test_the_grpc_floor_lands_every_byte_in_order_over_one_stream():
    sink = GrpcFloorSink(max_bytes=3 << 20, max_message_bytes=64 << 20)
    client = GrpcFloorClient(sink.port, max_message_bytes=64 << 20)
    try:
        for seed, nbytes in enumerate([3 << 20, 1000, (1 << 20) + 7]):  # whole, short and ragged last chunks
            payload = _payload(nbytes, seed)
            assert client.send(payload, chunk_bytes=1 << 20) > 0
            assert sink.buffer[:nbytes] == payload
    finally:
        client.close()
        sink.close()


def test_the_raw_socket_lands_every_byte():
    sink = TcpSink(max_bytes=1 << 20)
    payload = _payload(1 << 20, 7)
    try:
        thread = sink.receive(payload.nbytes)
        assert tcp_send(sink.port, payload) > 0
        thread.join(10)
        assert sink.buffer == payload
    finally:
        sink.close()


def test_a_grpc_run_reports_the_floor_beside_each_transfer(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "rows.json"
    args = parser.parse_args(["--transport", "grpc", "--num-layers", "1", "--sizes-mib", "0.0625,1",
                              "--repeats", "1", "--json", str(out)])
    assert bench.run(args) == 0  # every transfer bit-exact
    rows = json.loads(out.read_text())["rows"]
    assert [row["size_bytes"] for row in rows] == [1 << 16, 1 << 20]
    assert all(row["floor_gbps"] > 0 and row["baseline_gbps"] > 0 for row in rows)
