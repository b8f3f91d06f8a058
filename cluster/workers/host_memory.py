"""The CPU KV pools of the engines a serve command starts on this host: sized from the host's available memory.

On a GPU an engine measures its device and takes its share (engine/runner/memory_plan.py). On CPU the engine alone
would take a fixed 1 GiB; serving sizes the pools here instead, as vLLM's CPU server sizes its own (a share of the
host's memory, `--gpu-memory-utilization` of it there): CPU_KV_MEMORY_FRACTION of the memory available when the
command starts, split evenly among the engines it starts on this host (the in-process engine, or the local Ray's
workers). The rest is left to the weights (twice over on CPU float32: the oneDNN-packed copy beside the plain one),
the activations and everything else on the host. The pools' pages are committed as they are written
(engine/kv/kv_cache.py zeroed_pool), so a large pool costs nothing at start. An explicit size per engine
(`--kv-cache-memory-mib`) wins, and is refused when the engines on the host would need more than is available.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CPU_KV_MEMORY_FRACTION = 0.4
MIN_CPU_KV_BYTES = 64 << 20  # below this an engine would hold a handful of 512-token requests: not worth serving


@dataclass(frozen=True)
class CpuKvShare:
    """Each engine's pool and how it was decided, for the start-up log line."""

    bytes_per_engine: int
    engines: int
    available_bytes: int
    explicit: bool

    def describe(self) -> str:
        how = "as given" if self.explicit else f"{CPU_KV_MEMORY_FRACTION:.0%} of the available memory, shared"
        return (f"CPU KV cache: {_gib(self.bytes_per_engine)} GiB per engine x {self.engines} engine(s) on this host "
                f"({how}; {_gib(self.available_bytes)} GiB available)")


def available_host_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The host's available memory in bytes (Linux MemAvailable: free plus what the kernel can reclaim)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemAvailable line: give --kv-cache-memory-mib")


def cpu_kv_share(explicit_bytes: int | None, engines: int,
                 read_available: Callable[[], int] | None = None) -> CpuKvShare:
    """The pool of each of `engines` CPU engines on this host, the available memory read by read_available
    (default: available_host_memory). ValueError when an explicit size times the engines exceeds the available
    memory, or when the share left to each engine is below MIN_CPU_KV_BYTES."""
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    available = (read_available or available_host_memory)()
    if explicit_bytes is not None:
        if explicit_bytes * engines > available:
            raise ValueError(f"--kv-cache-memory-mib {explicit_bytes >> 20} x {engines} engine(s) on this host is "
                             f"{_gib(explicit_bytes * engines)} GiB, more than the {_gib(available)} GiB available: "
                             f"give at most {available // engines >> 20}")
        return CpuKvShare(explicit_bytes, engines, available, explicit=True)
    share = int(CPU_KV_MEMORY_FRACTION * available) // engines
    if share < MIN_CPU_KV_BYTES:
        raise ValueError(f"{_gib(available)} GiB available leaves {share >> 20} MiB of KV cache to each of {engines} "
                         f"engine(s): free memory, start fewer workers, or give --kv-cache-memory-mib")
    return CpuKvShare(share, engines, available, explicit=False)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f}"
