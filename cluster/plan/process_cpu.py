"""CPU time of a process tree, read from /proc (Linux): what `tandem plan --calibrate` charges to the serving
path of a real server.

A snapshot maps every process of the tree (the root and its descendants, found by their parent ids) to the
user + system CPU seconds its own threads have used (/proc/PID/stat utime and stime; children's times are
not in them). The CPU used between two snapshots is the sum of the differences, over the processes in both.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessCpu:
    pid: int
    name: str        # the command line's first word (Ray workers: "ray::DecodeActor..." and so on)
    cpu_s: float


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3 on), None if the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _name(pid: int) -> str:
    try:
        words = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return words[0].decode(errors="replace") if words else ""


def process_tree(root: int) -> list[int]:
    """`root` and every process whose chain of parents leads to it."""
    parents = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[1])  # field 4, ppid
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def snapshot(root: int) -> dict[int, ProcessCpu]:
    """CPU seconds so far of every process in the tree of `root`. RuntimeError off Linux (no /proc)."""
    if not (PROC / "self" / "stat").is_file():
        raise RuntimeError("reading process CPU times needs Linux's /proc")
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in process_tree(root):
        fields = _stat_fields(pid)
        if fields is not None:
            found[pid] = ProcessCpu(pid, _name(pid), (int(fields[11]) + int(fields[12])) / ticks)  # utime, stime
    return found


def cpu_between(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu]) -> list[ProcessCpu]:
    """Per process of `after`, the CPU seconds it used since `before` (all of them if it started since)."""
    return [ProcessCpu(pid, now.name, now.cpu_s - (before[pid].cpu_s if pid in before else 0.0))
            for pid, now in after.items()]
