"""kv_transfer/bench.py's results: a row per size, printed as it is measured; the transfer's fixed cost and
per-byte rate fitted over the sizes; the --json file, {"rows": [...], "cost": the fit or null}, written and read
back (by the selftest and the planner)."""
from __future__ import annotations

import json
from pathlib import Path


def _line(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line seconds = a + b * size."""
    mean_x, mean_y = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    var = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds)) / var
    return mean_y - slope * mean_x, slope


def fixed_and_per_byte(rows: list[dict]) -> dict | None:
    """A transfer's fixed cost and its per-byte rate, fitted over rows of at least two sizes (the smallest
    size, e.g. 64 KiB, pins the fixed cost), for the transport and for the raw socket beside it."""
    if len({row["size_bytes"] for row in rows}) < 2:
        return None
    sizes = [float(row["size_bytes"]) for row in rows]
    fixed, per_byte = _line(sizes, [row["seconds"] for row in rows])
    raw_fixed, raw_per_byte = _line(sizes, [row["size_bytes"] / row["baseline_gbps"] / 1e9 for row in rows])
    return {"fixed_ms": fixed * 1e3, "per_byte_gbps": 1 / per_byte / 1e9 if per_byte > 0 else float("inf"),
            "raw_fixed_ms": raw_fixed * 1e3,
            "raw_per_byte_gbps": 1 / raw_per_byte / 1e9 if raw_per_byte > 0 else float("inf")}


def print_cost(transport: str, num_layers: int, cost: dict) -> None:
    print(f"{transport:5s} {num_layers:2d}L  fixed cost {cost['fixed_ms']:.3f} ms per transfer, "
          f"then {cost['per_byte_gbps']:.2f} GB/s (raw socket: {cost['raw_fixed_ms']:.3f} ms, "
          f"{cost['raw_per_byte_gbps']:.2f} GB/s); least squares over the sizes' medians", flush=True)


def write_results(path: Path, rows: list[dict], cost: dict | None) -> None:
    path.write_text(json.dumps({"rows": rows, "cost": cost}, indent=1))  # cost: None below two sizes


def read_rows(path: Path) -> list[dict]:
    """The rows a run with --json wrote to path ([] when there is no such file)."""
    return json.loads(path.read_text())["rows"] if path.is_file() else []


def print_row(row: dict) -> None:
    """One size's line: the transfer, the raw socket (and the gRPC floor, the gathered variant) beside it."""
    ratio = row["gbps"] / row["baseline_gbps"]
    extra = ""
    if "floor_gbps" in row:
        extra += (f"  grpc floor {row['floor_gbps']:6.2f} GB/s (ratio {row['floor_gbps'] / row['baseline_gbps']:4.2f}; "
                  f"transfer / floor {row['gbps'] / row['floor_gbps']:4.2f})")
    if "gathered_gbps" in row:
        extra += (f"  gathered: ratio {row['gathered_gbps'] / row['baseline_gbps']:5.2f} "
                  f"cpu {row['gathered_cpu_seconds'] * 1e3:6.1f} ms")
    print(f"{row['transport']:5s} {row['num_layers']:2d}L {row['size_bytes'] / 2**20:7.4g} MiB  "
          f"{row['seconds'] * 1e3:9.2f} ms  {row['gbps']:6.2f} GB/s  raw socket {row['baseline_gbps']:6.2f} GB/s  "
          f"ratio {ratio:5.2f}  cpu {row['cpu_seconds'] * 1e3:6.1f} ms{extra}  bit_exact={row['bit_exact']}",
          flush=True)
