"""The serving modes `tandem bench compare` runs, each as the `tandem serve` flags that make it.

    colocated-<N>        N colocated replicas on a local Ray (`--replicas N`): N engines doing both phases
                         with chunked prefill (--chunk-size token steps), behind the coordinator (routing by
                         load with prefix affinity)
    colocated-<N>-tp<T>  the same, each replica a tensor-parallel group of T ranks (`--tp T`): N x T GPUs
    disagg-<P>p<D>d      P prefill + D decode workers on a local Ray, KV shipped between them; their
                         engines cap one prompt's tokens per step (--long-prefill-threshold), so short
                         prompts queued behind a long one on a prefill worker join the next step
    disagg-<P>p<D>d-ptp<A>-dtp<B>   the same with prefill workers of A ranks and decode workers of B
                         (`--prefill-tp A --decode-tp B`; either suffix left out: 1): P x A + D x B GPUs
    disagg-<P>p<D>d-local<N>   the same with conditional disaggregation: prompts shorter than N tokens
                         are prefilled on their decode worker (no prefill queue, no transfer)
    disagg-...-noreuse   any disagg mode without decoder-side prefix reuse (`--no-decode-prefix-reuse`):
                         every prompt's whole KV travels, decode workers are routed by load only
    colocated            one engine in the serve process, no chunking: a long prompt's prefill is one
                         step, and every running decode waits for it (the classic interference)
    colocated-chunked    one engine in the serve process, chunked prefill (Sarathi) in --chunk-size steps

Equal hardware: the default compares the modes of one device count G (`--gpus`, `--workers`): colocated-(G/T)
against the disagg splits that use all G devices (TP=1: 2: disagg-1p1d; 4: disagg-1p3d, 2p2d, 3p1d; with
`--prefill-tp A --decode-tp B --tp T`, P x A + D x B = G: cluster/bench/compare_splits.py). Every Ray rank (a worker
of TP size T has T) gets cores / ranks CPU threads on CPU, or one GPU (TP=1 only: a 1/W share when the machine
has a single GPU); the in-process engine gets every core, or one GPU. Each mode's `hardware` says which and
`devices` how many GPUs (CPU: rank shares) it used.
"""
from __future__ import annotations

import dataclasses
import os
import re

from cluster.bench.compare_splits import check_tp_sizes, deployment_name, splits

_DISAGG = re.compile(r"^disagg-(\d+)p(\d+)d(?:-ptp(\d+))?(?:-dtp(\d+))?(?:-local(\d+))?(-noreuse)?$")
_REPLICAS = re.compile(r"^colocated-(\d+)(?:-tp(\d+))?$")
IN_PROCESS_MODES = ("colocated", "colocated-chunked")


@dataclasses.dataclass(frozen=True)
class ServingMode:
    """A named way to serve, the `tandem serve` flags that start it, and the hardware it gets."""

    name: str
    serve_flags: tuple[str, ...]
    hardware: str = ""
    devices: int = 0  # GPUs (one per rank) or CPU rank shares its workers take; 0: the in-process engine

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


def default_mode_names(devices: int, prefill_tp: int = 1, decode_tp: int = 1, tp: int = 1) -> list[str]:
    """colocated-(G/T) and the disaggregated splits that use all G devices: the fewest prefill workers, the
    middle split, the most (TP=1: 1pXd, the even split, Xp1d). ValueError names the flag: G < 2, a TP size that
    is not >= 1 or does not divide G, or no split that uses every device."""
    if devices < 2:
        raise ValueError(f"--gpus/--workers must be >= 2 (one prefill and one decode worker at least), got {devices}")
    check_tp_sizes(devices, prefill_tp, decode_tp, tp)
    full = [(p, d) for p, d in splits(devices, prefill_tp, decode_tp) if p * prefill_tp + d * decode_tp == devices]
    if not full:
        raise ValueError(f"no split of {devices} devices into prefill workers of --prefill-tp {prefill_tp} and decode "
                         f"workers of --decode-tp {decode_tp} uses every device: not an equal-hardware comparison")
    picked = sorted({0, (len(full) - 1) // 2, len(full) - 1})
    return [deployment_name(0, devices // tp, 1, tp)] + [deployment_name(*full[i], prefill_tp, decode_tp)
                                                         for i in picked]


def parse_modes(text: str) -> list[str]:
    """'colocated-2,disagg-1p1d' -> names; ValueError names an unknown mode."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("--modes needs at least one mode")
    for name in names:
        if name not in IN_PROCESS_MODES and not _DISAGG.match(name) and not _REPLICAS.match(name):
            raise ValueError(f"unknown mode {name!r}: use colocated-<N>[-tp<T>] (N replicas on Ray), "
                             "disagg-<P>p<D>d[-ptp<A>][-dtp<B>], disagg-<P>p<D>d-local<N>, colocated or "
                             "colocated-chunked (one engine in process) (e.g. colocated-2, colocated-2-tp2, "
                             "disagg-1p1d, disagg-1p2d-ptp2, disagg-1p1d-local256, disagg-1p1d-noreuse)")
        match, replicas = _DISAGG.match(name), _REPLICAS.match(name)
        if match and (int(match.group(1)) < 1 or int(match.group(2)) < 1):
            raise ValueError(f"mode {name!r} needs at least one prefill and one decode worker")
        if replicas and int(replicas.group(1)) < 1:
            raise ValueError(f"mode {name!r} needs at least one replica")
        sizes = match.group(3, 4) if match else replicas.group(2, 2) if replicas else ()
        if any(size is not None and int(size) < 1 for size in sizes):
            raise ValueError(f"mode {name!r}: a TP size (-tp, -ptp, -dtp) must be >= 1")
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
        tp = int(replicas.group(2) or 1)
        shape = (0, int(replicas.group(1)), 1, tp)
        flags = ["--mode", "colocated", "--replicas", replicas.group(1), "--enable-chunked-prefill",
                 "--max-num-batched-tokens", str(settings.chunk_size)] + (["--tp", str(tp)] if tp > 1 else [])
    else:
        prefill, decode, prefill_tp, decode_tp, local, noreuse = _DISAGG.match(name).groups()
        shape = (int(prefill), int(decode), int(prefill_tp or 1), int(decode_tp or 1))
        flags = ["--mode", "disaggregated", "--prefill-workers", prefill, "--decode-workers", decode,
                 "--transport", settings.transport, "--local-prefill-tokens", local or "0",
                 "--long-prefill-token-threshold", str(settings.long_prefill_threshold)]
        flags += ["--prefill-tp", prefill_tp] if shape[2] > 1 else []
        flags += ["--decode-tp", decode_tp] if shape[3] > 1 else []
        flags += ["--no-decode-prefix-reuse"] if noreuse else []
    share_flags, hardware = _worker_shares(name, shape, settings)
    ranks = shape[0] * shape[2] + shape[1] * shape[3]
    return ServingMode(name, tuple(common + flags + share_flags), hardware, ranks)


def _worker_shares(name: str, shape: tuple[int, int, int, int], settings: ModeSettings) -> tuple[list[str], str]:
    """The flags that give each rank of the mode's workers (`shape`: prefill workers, decode workers (replicas),
    their TP sizes) an equal share, and the words for it (TP=1: as before TP existed)."""
    prefill, decode, prefill_tp, decode_tp = shape
    workers, ranks = prefill + decode, prefill * prefill_tp + decode * decode_tp
    threads = max(1, settings.cpu_cores // ranks)
    flags, s = ["--cpu-threads", str(threads)], "s" if threads > 1 else ""
    tp = max(prefill_tp, decode_tp) > 1
    groups = (f": {prefill} prefill x TP{prefill_tp} + {decode} decode x TP{decode_tp}" if prefill
              else f": {decode} replicas x TP{decode_tp}")
    if not settings.num_gpus:
        return flags, (f"{ranks} ranks x {threads} thread{s}{groups}" if tp
                       else f"{workers} workers x {threads} thread{s}")
    if settings.num_gpus >= ranks:
        return flags, (f"{ranks} GPUs, 1 per rank{groups}" if tp else f"{workers} GPUs, 1 per worker")
    if settings.num_gpus == 1 and not tp:
        return flags + ["--gpus-per-worker", f"{1 / workers:.6f}"], f"1 GPU shared by {workers} workers"
    raise ValueError(f"mode {name!r} needs {ranks} GPUs (one per {'rank' if tp else 'worker'})"
                     f"{'' if tp else ' or a single shared GPU'}; this machine has {settings.num_gpus}: choose "
                     "--gpus/--workers, the TP sizes or --modes to match")
