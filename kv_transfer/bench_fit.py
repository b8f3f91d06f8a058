"""A transfer's fixed cost and per-byte rate, fitted over a benchmark's sizes (kv_transfer/bench.py)."""
from __future__ import annotations


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
