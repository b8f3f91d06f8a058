"""The serving modes `tandem bench compare` runs, each as the `tandem serve` flags that make it.

    colocated-<N>        N colocated replicas on a local Ray (`--replicas N`): N engines doing both phases
                         with chunked prefill (--chunk-size token steps), behind the coordinator (routing by
                         load with prefix affinity)
    disagg-<P>p<D>d      P prefill + D decode workers on a local Ray, KV shipped between them; their
                         engines cap one prompt's tokens per step (--long-prefill-threshold), so short
                         prompts queued behind a long one on a prefill worker join the next step
    disagg-<P>p<D>d-local<N>   the same with conditional disaggregation: prompts shorter than N tokens
                         are prefilled on their decode worker (no prefill queue, no transfer)
    disagg-...-noreuse   any disagg mode without decoder-side prefix reuse (`--no-decode-prefix-reuse`):
                         every prompt's whole KV travels, decode workers are routed by load only
    colocated            one engine in the serve process, no chunking: a long prompt's prefill is one
                         step, and every running decode waits for it (the classic interference)
    colocated-chunked    one engine in the serve process, chunked prefill (Sarathi) in --chunk-size steps

Equal hardware: the default compares the modes of one worker count W (`--workers`): colocated-W against
every disagg split of W workers (2: disagg-1p1d; 4: disagg-1p3d, 2p2d, 3p1d). Every Ray worker (replica,
prefill or decode worker) gets cores / workers CPU threads on CPU, or one GPU (a 1/W share when the machine
has a single GPU); the in-process engine gets every core, or one GPU. Each mode's `hardware` says which.
"""
from __future__ import annotations

import dataclasses
import os
import re

_DISAGG = re.compile(r"^disagg-(\d+)p(\d+)d(?:-local(\d+))?(-noreuse)?$")
_REPLICAS = re.compile(r"^colocated-(\d+)$")
IN_PROCESS_MODES = ("colocated", "colocated-chunked")


@dataclasses.dataclass(frozen=True)
class ServingMode:
    """A named way to serve, the `tandem serve` flags that start it, and the hardware it gets."""

    name: str
    serve_flags: tuple[str, ...]
    hardware: str = ""

    @property
    def is_disaggregated(self) -> bool:
        return self.name.startswith("disagg-")


@dataclasses.dataclass(frozen=True)
class ModeSettings:
    """What every mode shares: the model, the engine limits the workload needs, and the machine."""

    model: str | None
    dtype: str
    device: str
    transport: str
    max_model_len: int
    chunk_size: int
    kv_cache_memory_mib: int | None
    long_prefill_threshold: int = 0
    cpu_cores: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    num_gpus: int = 0  # GPUs the modes may use (0: CPU)


def default_workers(num_gpus: int, cpu_cores: int) -> int:
    """4 workers where the machine has 4 GPUs (or, without GPUs, 8 cores: two each), else 2."""
    return 4 if num_gpus >= 4 or (num_gpus == 0 and cpu_cores >= 8) else 2


def default_mode_names(workers: int) -> list[str]:
    """colocated-W and the disaggregated splits of W workers: 1pXd, the even split, Xp1d."""
    if workers < 2:
        raise ValueError(f"--workers must be >= 2 (one prefill and one decode worker at least), got {workers}")
    splits = sorted({1, workers // 2, workers - 1})
    return [f"colocated-{workers}"] + [f"disagg-{p}p{workers - p}d" for p in splits]


def parse_modes(text: str) -> list[str]:
    """'colocated-2,disagg-1p1d' -> names; ValueError names an unknown mode."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("--modes needs at least one mode")
    for name in names:
        if name not in IN_PROCESS_MODES and not _DISAGG.match(name) and not _REPLICAS.match(name):
            raise ValueError(f"unknown mode {name!r}: use colocated-<N> (N replicas on Ray), disagg-<P>p<D>d, "
                             "disagg-<P>p<D>d-local<N>, colocated or colocated-chunked (one engine in process)"
                             " (e.g. colocated-2, disagg-1p1d, disagg-1p1d-local256, disagg-1p1d-noreuse)")
        match, replicas = _DISAGG.match(name), _REPLICAS.match(name)
        if match and (int(match.group(1)) < 1 or int(match.group(2)) < 1):
            raise ValueError(f"mode {name!r} needs at least one prefill and one decode worker")
        if replicas and int(replicas.group(1)) < 1:
            raise ValueError(f"mode {name!r} needs at least one replica")
    if len(set(names)) != len(names):
        raise ValueError("--modes lists a mode twice")
    return names


def serving_mode(name: str, settings: ModeSettings) -> ServingMode:
    """The flags of mode `name` (a name parse_modes accepted). ValueError when the machine cannot give
    its workers equal shares (GPUs: one each, or a single GPU shared)."""
    common = ["--dtype", settings.dtype, "--device", settings.device,
              "--max-model-len", str(settings.max_model_len)]
    if settings.model is not None:
        common += ["--model", settings.model]
    if settings.kv_cache_memory_mib is not None:
        common += ["--kv-cache-memory-mib", str(settings.kv_cache_memory_mib)]
    if name in IN_PROCESS_MODES:
        chunked = name == "colocated-chunked"
        budget = settings.chunk_size if chunked else settings.max_model_len
        flags = ["--mode", "colocated", "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", str(budget)]
        hardware = "in-process engine, 1 GPU" if settings.num_gpus else \
            f"in-process engine, {settings.cpu_cores} threads"
        return ServingMode(name, tuple(common + flags), hardware)
    replicas = _REPLICAS.match(name)
    if replicas:
        workers = int(replicas.group(1))
        flags = ["--mode", "colocated", "--replicas", str(workers), "--enable-chunked-prefill",
                 "--max-num-batched-tokens", str(settings.chunk_size)]
    else:
        prefill, decode, local, noreuse = _DISAGG.match(name).groups()
        workers = int(prefill) + int(decode)
        flags = ["--mode", "disaggregated", "--prefill-workers", prefill, "--decode-workers", decode,
                 "--transport", settings.transport, "--local-prefill-tokens", local or "0",
                 "--long-prefill-token-threshold", str(settings.long_prefill_threshold)]
        flags += ["--no-decode-prefix-reuse"] if noreuse else []
    share_flags, hardware = _worker_shares(name, workers, settings)
    return ServingMode(name, tuple(common + flags + share_flags), hardware)


def _worker_shares(name: str, workers: int, settings: ModeSettings) -> tuple[list[str], str]:
    """The flags that give each of `workers` Ray workers an equal share, and the words for it."""
    threads = max(1, settings.cpu_cores // workers)
    flags = ["--cpu-threads", str(threads)]
    if not settings.num_gpus:
        return flags, f"{workers} workers x {threads} thread{'s' if threads > 1 else ''}"
    if settings.num_gpus >= workers:
        return flags, f"{workers} GPUs, 1 per worker"
    if settings.num_gpus == 1:
        return flags + ["--gpus-per-worker", f"{1 / workers:.6f}"], f"1 GPU shared by {workers} workers"
    raise ValueError(f"mode {name!r} needs {workers} GPUs (one per worker) or a single shared GPU; this "
                     f"machine has {settings.num_gpus}: choose --workers or --modes to match")
