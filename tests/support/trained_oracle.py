"""The trained default's transformers oracle, loaded from its GGUF file once per test run.

transformers' own GGUF loading dequantizes the file (~20-30 s on 2 cores). Each pytest-xdist worker is a session of
its own, so a session fixture alone paid that once per worker. The first worker that needs the oracle now loads it
from the GGUF file and saves it (float32 safetensors and the tokenizer, as transformers saves them) under the run's
shared temporary root; the others wait for that and load the copy: the same weights bit for bit (and so the same
logits), the same tokenizer.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import torch


def shared_run_root(basetemp: Path) -> Path | None:
    """A directory every pytest-xdist worker of this test run shares (and no other run): the workers' base temporary
    directories sit side by side in one per-run directory. None in one process: nobody to share the copy with."""
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else None


def remove_oracle_copies(run_root: Path) -> None:
    """Deletes the run's oracle copies (called once every worker is done: by the xdist controller at the end)."""
    for copy in run_root.glob("trained-oracle-*"):
        if copy.is_dir():
            shutil.rmtree(copy, ignore_errors=True)
        else:
            copy.unlink(missing_ok=True)


def load_trained_oracle(gguf: Path, root: Path | None):
    """(tokenizer, float32 model in eval mode) of the GGUF file `gguf`, as transformers loads it; with a shared
    `root`, loaded from the GGUF file by the first worker only (the copy takes ~540 MB there for the run)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if root is None:
        return (AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name),
                AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval())
    stat = gguf.stat()
    copy = root / f"trained-oracle-{stat.st_size}-{stat.st_mtime_ns}-{transformers.__version__}"
    with open(root / f"{copy.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker loads and saves; the others wait here, then read
        if not (copy / "complete").exists():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tokenizer.save_pretrained(copy)
            _forget_gguf_origin(model)
            model.save_pretrained(copy)
            (copy / "complete").touch()
            return tokenizer, model.eval()
    return (AutoTokenizer.from_pretrained(copy),
            AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval())


def _forget_gguf_origin(model) -> None:
    """transformers refuses to save a model it loaded from a GGUF file ("quantized with gguf"), although the weights
    it holds are the dequantized float32 ones: drop the marks of that origin so that save_pretrained writes them."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
