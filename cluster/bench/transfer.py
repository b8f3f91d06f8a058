"""`tandem bench transfer`: the KV transfer plane alone (kv_transfer/bench.py: GB/s against a raw socket), or
with `--streaming` on real workers, how much of the transfer layer-wise streaming hides
(cluster/bench/transfer_streaming.py)."""
from __future__ import annotations

import argparse

from cluster.bench.transfer_streaming import add_streaming_arguments, run_streaming
from kv_transfer import bench as plane_bench


def add_arguments(parser: argparse.ArgumentParser) -> None:
    plane_bench.add_arguments(parser)
    add_streaming_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return run_streaming(args) if args.streaming else plane_bench.run(args)
