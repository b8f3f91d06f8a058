"""KV transfer GB/s of each available transport against a plain copy of the same bytes on the pools' device.

Each transport runs `tandem bench transfer` (kv_transfer/bench.py: this process receives, a spawned process
sends, every transfer checked byte for byte) at one small size; the baseline is one copy of as many bytes
where the bench's pools live: a host memcpy for gloo and gRPC (CPU pools), a device-to-device copy for nccl
and ipc (GPU pools). The bench's raw loopback socket figure is reported beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import statistics
import time

import numpy
import torch

from cluster.selftest.results import Outcome, skipped, verdict

TRANSPORTS = ("gloo", "grpc", "nccl", "ipc")
GPU_POOLS = ("nccl", "ipc")


def check_transfer(ctx, transport: str) -> Outcome:
    ctx.release_perf()  # the measured engine may hold most of the device
    reason = unavailable(ctx, transport)
    if reason:
        return skipped(reason)
    rc, rows, printed = run_bench(ctx, transport)
    if rc == 2 or (not rows and "unavailable" in printed):
        return skipped(printed.strip().splitlines()[-1] if printed.strip() else f"{transport} is unavailable")
    if not rows:
        return verdict(False, f"the bench returned {rc} and no rows: {printed.strip()[-300:]}")
    row = rows[-1]
    on_gpu = transport in GPU_POOLS
    baseline = copy_gbps(row["size_bytes"], "cuda" if on_gpu else "cpu")
    exact = all(r.get("bit_exact") for r in rows)
    detail = (f"{transport} {row['gbps']:.2f} GB/s vs {'d2d copy' if on_gpu else 'memcpy'} {baseline:.2f} GB/s "
              f"({row['gbps'] / baseline:.1%}); raw socket {row['baseline_gbps']:.2f} GB/s; "
              f"{row['size_bytes'] / 2**20:.0f} MiB x {ctx.sizes.transfer_repeats}, "
              f"{'bit-exact' if exact else 'NOT bit-exact'}")
    return verdict(rc == 0 and exact, detail, gbps=row["gbps"], copy_gbps=baseline,
                   socket_gbps=row["baseline_gbps"], size_bytes=row["size_bytes"], bit_exact=exact)


def unavailable(ctx, transport: str) -> str:
    """Why this transport cannot run here ('' when it can)."""
    from kv_transfer.config import IMPLEMENTED_TRANSPORTS

    if transport not in IMPLEMENTED_TRANSPORTS:
        return f"{transport} is not implemented in this build"
    if transport == "grpc" and importlib.util.find_spec("grpc") is None:
        return "grpcio is not installed"
    if transport == "nccl" and (not ctx.cuda or torch.cuda.device_count() < 2):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return f"nccl runs between two GPUs; {found} here" + ("" if ctx.cuda else " (CPU run)")
    if transport == "ipc" and not ctx.cuda:
        return "CUDA IPC runs between processes on one GPU; this is a CPU run"
    return ""


def run_bench(ctx, transport: str) -> tuple[int, list[dict], str]:
    """(exit code, result rows, what it printed) of kv_transfer.bench at the selftest's size."""
    from kv_transfer import bench
    from kv_transfer.bench_results import read_rows

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out_path = ctx.workdir / f"transfer-{transport}.json"
    args = parser.parse_args(["--transport", transport, "--sizes-mib", str(ctx.sizes.transfer_mib),
                              "--repeats", str(ctx.sizes.transfer_repeats), "--json", str(out_path),
                              "--timeout-s", "60"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = bench.run(args)
    return rc, read_rows(out_path), printed.getvalue()


def copy_gbps(nbytes: int, device: str, repeats: int = 5) -> float:
    """GB/s of one copy of nbytes on device (bytes copied / seconds, the median of repeats): on CUDA
    dst.copy_(src), on CPU a plain single-threaded memcpy (numpy), which no busy core can stall."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(device)
    dst = torch.empty_like(src)
    if device == "cpu":
        src_array, dst_array = src.numpy(), dst.numpy()

        def copy():
            numpy.copyto(dst_array, src_array)
    else:
        def copy():
            dst.copy_(src)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        started = time.perf_counter()
        copy()
        _sync(device)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times[1:]) / 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
