"""TransferModel: how long the KV of a prompt takes from its prefill worker to its decode worker.

    seconds(prompt_len) = latency + blocks(prompt_len) x bytes_per_block / bytes_per_second

Whole blocks travel (kv_transfer moves pool blocks), so a 17-token prompt with 16-token blocks ships two.
The latency and the bandwidth are either given (`--transfer-gbps`, `--transfer-latency-ms`) or measured
by `tandem bench transfer` (kv_transfer/bench.py: two processes, every transfer checked) at two sizes:
the line through the two medians gives both.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path

MEASURE_SIZES_MIB = (1, 16)


@dataclass(frozen=True)
class TransferModel:
    """`source` says where the numbers came from (shown in the report)."""

    bytes_per_block: int
    block_size: int
    bytes_per_second: float
    latency_s: float
    source: str

    def __post_init__(self) -> None:
        if self.bytes_per_block < 1 or self.block_size < 1 or not self.bytes_per_second > 0 \
                or self.latency_s < 0:
            raise ValueError(f"a transfer model needs positive sizes and bandwidth and a latency >= 0, got {self}")

    def kv_bytes(self, prompt_len: int) -> int:
        return -(-prompt_len // self.block_size) * self.bytes_per_block

    def seconds(self, prompt_len: int) -> float:
        return self.latency_s + self.kv_bytes(prompt_len) / self.bytes_per_second


def given_transfer(bytes_per_block: int, block_size: int, gbps: float, latency_ms: float) -> TransferModel:
    """The model from flags. ValueError names the flag that is out of range."""
    if not gbps > 0:
        raise ValueError(f"--transfer-gbps must be > 0, got {gbps}")
    if latency_ms < 0:
        raise ValueError(f"--transfer-latency-ms must be >= 0, got {latency_ms}")
    return TransferModel(bytes_per_block, block_size, gbps * 1e9, latency_ms / 1e3,
                         f"given: {gbps:g} GB/s, {latency_ms:g} ms per transfer")


def measured_transfer(bytes_per_block: int, block_size: int, transport: str) -> TransferModel:
    """Runs `tandem bench transfer --transport <transport>` at MEASURE_SIZES_MIB (3 transfers each) and
    fits latency + bytes / bandwidth through the two medians. RuntimeError when the bench cannot run here
    (say which flags give the numbers instead)."""
    from kv_transfer import bench
    from kv_transfer.bench_results import read_rows

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with tempfile.TemporaryDirectory(prefix="tandem-plan-") as tmp:
        out = Path(tmp) / "transfer.json"
        args = parser.parse_args(["--transport", transport, "--sizes-mib", ",".join(map(str, MEASURE_SIZES_MIB)),
                                  "--repeats", "3", "--json", str(out), "--timeout-s", "60"])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = bench.run(args)
        rows = read_rows(out)
    if code != 0 or len(rows) != len(MEASURE_SIZES_MIB):
        raise RuntimeError(f"measuring the {transport} KV transfer failed ({printed.getvalue().strip()[-300:]}); "
                           "give --transfer-gbps and --transfer-latency-ms instead")
    (small_bytes, small_s), (large_bytes, large_s) = [(row["size_bytes"], row["seconds"]) for row in rows]
    bandwidth = (large_bytes - small_bytes) / max(large_s - small_s, 1e-9)
    latency = max(0.0, small_s - small_bytes / bandwidth)
    return TransferModel(bytes_per_block, block_size, bandwidth, latency,
                         f"measured: {transport} {bandwidth / 1e9:.2f} GB/s + {latency * 1e3:.2f} ms per transfer "
                         f"(tandem bench transfer at {' and '.join(f'{s} MiB' for s in MEASURE_SIZES_MIB)})")
