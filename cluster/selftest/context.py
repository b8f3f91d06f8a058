"""What the checks share: the device, the sizes for this device and mode, the checkpoints (built once), and
the engine the performance checks measure (built once, released before the transfer checks)."""
from __future__ import annotations

import gc
import importlib.util
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Sizes:
    """How big each check runs. perf_shape: the cluster.bench checkpoint the perf checks measure;
    greedy_step_tokens: the greedy checks' step budget (below the longest prompt, so its prefill is chunked)."""

    greedy_prompt_lengths: tuple[int, ...]
    greedy_max_tokens: int
    perf_shape: str
    perf_batched_tokens: int
    prefill_prompts: int
    prefill_len: int
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    transfer_mib: int
    transfer_repeats: int
    greedy_step_tokens: int = 64


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    lengths = (1, 17, 40, 100, 300)
    batches = (1, 8, 64)
    if device.type == "cuda":
        if quick:
            return Sizes(lengths, 8, "llama-25m", 2048, 8, 256, batches, 128, 16, 16, 2)
        return Sizes(lengths, 16, "qwen2.5-0.5b", 4096, 8, 512, batches, 512, 32, 64, 3)
    if quick:  # Triton runs interpreted here: every prompt token costs, so fewer of them in a 32-token budget
        return Sizes(lengths[:3], 6, "tiny-llama", 2048, 4, 64, batches, 32, 16, 4, 2, greedy_step_tokens=32)
    return Sizes(lengths, 12, "llama-25m", 2048, 8, 256, batches, 128, 16, 16, 3)


class SelftestContext:
    """Shared state of one selftest run. Failures while building something shared are remembered and
    raised again to every check that needs it, so each of them reports the same error."""

    def __init__(self, device: torch.device, quick: bool, workdir: Path) -> None:
        self.device, self.quick, self.workdir = device, quick, workdir
        self.sizes = sizes_for(device, quick)
        self.perf_dtype = "bfloat16" if device.type == "cuda" else "float32"
        self.notes: list[str] = []
        self._built: dict[str, object] = {}

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def shared(self, key: str, build):
        """build() once per key; an exception is kept and raised again on every later call."""
        if key not in self._built:
            try:
                self._built[key] = build()
            except Exception as exc:
                traceback.clear_frames(exc.__traceback__)  # keep the trace, free what its frames held (GPU memory)
                self._built[key] = exc
        value = self._built[key]
        if isinstance(value, Exception):
            raise RuntimeError(f"{key} could not be built: {type(value).__name__}: {value}") from value
        return value

    def checkpoint(self, shape: str) -> Path:
        def build() -> Path:
            from cluster.bench.checkpoint import build_bench_checkpoint
            quiet_transformers()
            return build_bench_checkpoint(self.workdir / shape, shape)
        return self.shared(f"checkpoint {shape}", build)

    def perf_llm(self):
        """The engine the memory-plan, prefill and decode checks measure: the perf shape on this device,
        sized as a user would run it (on CUDA the pool is planned from measured memory)."""
        def build():
            from engine import LLM
            return LLM(str(self.checkpoint(self.sizes.perf_shape)), dtype=self.perf_dtype, device=str(self.device),
                       max_num_batched_tokens=self.sizes.perf_batched_tokens)
        return self.shared("perf engine", build)

    def release_perf(self) -> None:
        self._built.pop("perf engine", None)
        self._built.pop("decode floor", None)
        free_device_memory()


def transformers_missing() -> str:
    """Why checks that need transformers (the oracle, and the builder of every checkpoint) skip; '' if present."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (it builds the test checkpoints)"
    return ""


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers between the report's rows."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    except ImportError:
        pass
