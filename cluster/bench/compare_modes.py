"""The serving modes `tandem bench compare` runs, each as the `tandem serve` flags that make it.

    colocated            one engine prefills and decodes, no chunking: a long prompt's prefill is one
                         step, and every running decode waits for it (the classic interference)
    colocated-chunked    one engine, chunked prefill (Sarathi): prompts split into --chunk-size token
                         steps that decodes ride along with
    disagg-<P>p<D>d      P prefill + D decode workers on a local Ray, KV shipped between them; their
                         engines cap one prompt's tokens per step (--long-prefill-threshold), so short
                         prompts queued behind a long one on a prefill worker join the next step
    disagg-<P>p<D>d-local<N>   the same with conditional disaggregation: prompts shorter than N tokens
                         are prefilled on their decode worker (no prefill queue, no transfer)

Resources are split fairly: on CPU the colocated engine gets every core and each disaggregated worker
cores / workers of them; on GPU each worker (and the colocated engine) gets one GPU.
"""
from __future__ import annotations

import dataclasses
import os
import re

_DISAGG = re.compile(r"^disagg-(\d+)p(\d+)d(?:-local(\d+))?$")
DEFAULT_MODES = ("colocated", "colocated-chunked", "disagg-1p1d", "disagg-1p1d-local256")


@dataclasses.dataclass(frozen=True)
class ServingMode:
    """A named way to serve, and the `tandem serve` flags that start it."""

    name: str
    serve_flags: tuple[str, ...]

    @property
    def is_disaggregated(self) -> bool:
        return self.name.startswith("disagg-")


@dataclasses.dataclass(frozen=True)
class ModeSettings:
    """What every mode shares: the model, and the engine limits the workload needs."""

    model: str | None
    dtype: str
    device: str
    transport: str
    max_model_len: int
    chunk_size: int
    kv_cache_memory_mib: int | None
    long_prefill_threshold: int = 0
    cpu_cores: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)


def default_mode_names(num_gpus: int, cpu_cores: int) -> list[str]:
    """The baselines and 1P1D with and without conditional disaggregation, plus 2 prefill + 2 decode
    workers where the machine has 4 GPUs (or, without GPUs, 8 cores: two each)."""
    names = list(DEFAULT_MODES)
    if num_gpus >= 4 or (num_gpus == 0 and cpu_cores >= 8):
        names.append("disagg-2p2d")
    return names


def parse_modes(text: str) -> list[str]:
    """'colocated,disagg-1p1d' -> names; ValueError names an unknown mode."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("--modes needs at least one mode")
    for name in names:
        if name not in ("colocated", "colocated-chunked") and not _DISAGG.match(name):
            raise ValueError(f"unknown mode {name!r}: use colocated, colocated-chunked, disagg-<P>p<D>d "
                             "or disagg-<P>p<D>d-local<N> (e.g. disagg-1p1d, disagg-1p1d-local256)")
        match = _DISAGG.match(name)
        if match and (int(match.group(1)) < 1 or int(match.group(2)) < 1):
            raise ValueError(f"mode {name!r} needs at least one prefill and one decode worker")
    if len(set(names)) != len(names):
        raise ValueError("--modes lists a mode twice")
    return names


def serving_mode(name: str, settings: ModeSettings) -> ServingMode:
    """The flags of mode `name` (a name parse_modes accepted)."""
    common = ["--dtype", settings.dtype, "--device", settings.device,
              "--max-model-len", str(settings.max_model_len)]
    if settings.model is not None:
        common += ["--model", settings.model]
    if settings.kv_cache_memory_mib is not None:
        common += ["--kv-cache-memory-mib", str(settings.kv_cache_memory_mib)]
    if name == "colocated":
        flags = ["--mode", "colocated", "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", str(settings.max_model_len)]
    elif name == "colocated-chunked":
        flags = ["--mode", "colocated", "--enable-chunked-prefill",
                 "--max-num-batched-tokens", str(settings.chunk_size)]
    else:
        prefill, decode, local = _DISAGG.match(name).groups()
        threads = max(1, settings.cpu_cores // (int(prefill) + int(decode)))
        flags = ["--mode", "disaggregated", "--prefill-workers", prefill, "--decode-workers", decode,
                 "--transport", settings.transport, "--cpu-threads", str(threads),
                 "--local-prefill-tokens", local or "0",
                 "--long-prefill-token-threshold", str(settings.long_prefill_threshold)]
    return ServingMode(name, tuple(common + flags))
