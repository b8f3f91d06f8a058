"""Checkpoint loading errors and the embedded default model."""
from __future__ import annotations

import json
import shutil

import pytest

from engine import SamplingParams
from engine.model.default_model import UNTRAINED_NOTICE
from tests.support.engine_checks import assert_all_blocks_free
from tests.support.engines import make_llm


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_is_named(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "gpt")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        make_llm(str(path))


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(missing, tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    (path / missing).unlink()
    with pytest.raises(ValueError, match=missing.split(".")[0]):
        make_llm(str(path))


def test_missing_weight_is_named(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    path = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj"):
        make_llm(str(path))


def test_default_model_is_deterministic_and_says_untrained(caplog):
    llm = make_llm()
    assert UNTRAINED_NOTICE in caplog.text
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    first = llm.generate(["hello tandem"], params)[0].outputs[0]
    again = make_llm().generate(["hello tandem"], params)[0].outputs[0]
    assert first.token_ids == again.token_ids and len(first.token_ids) == 16
    assert_all_blocks_free(llm)
