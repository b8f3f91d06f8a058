"""GGUF checkpoints: tiny random models written here with the `gguf` package's writer in F32, F16, Q8_0 and Q4_1
load into the engine, whose greedy tokens equal transformers' own GGUF loading (which dequantizes with the same
numerics); the tokenizer built from the metadata encodes as transformers' GGUF tokenizer does; bad files are
refused naming the file and what is wrong."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.model.gguf_checkpoint import GGUFCheckpoint, unpermute_rotary_rows
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm
from tests.support.factories import hf_greedy_generate, load_hf_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers loads GGUF files only with it
from tests.support.gguf_files import _permute, write_gguf  # noqa: E402


def _gguf_tokenizer_oracle_missing() -> bool:
    """Whether this transformers lacks the GGUF tokenizer conversion the tests compare with (the one in
    transformers.integrations.gguf). Before it (transformers 5.17, seen on the H200 host, where both exist and
    integrations/ggml.py's GGUFTokenizerSkeleton converts) EOS is read from the BOS id and BOS and EOS are swapped."""
    if importlib.util.find_spec("transformers.integrations.gguf") is None:
        return True
    return hasattr(importlib.import_module("transformers.integrations.ggml"), "GGUFTokenizerSkeleton")


needs_gguf_tokenizer_oracle = pytest.mark.skipif(
    _gguf_tokenizer_oracle_missing(), reason="this transformers predates the GGUF tokenizer conversion the tests "
                                             "compare with")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TEXTS = ["Hello world! The quick brown fox.", "  two leading spaces,\ttabs\tand\n\nnew lines\n",
         "café, naïve, 日本語 and an emoji 😀", "def f(x):\n    return x ** 2  # code, 42 and 2024",
         "numbers 1234567 and 3.14159", "x" * 40, "", " "]


@pytest.fixture(scope="module")
def gguf_file(tiny_checkpoint, tmp_path_factory):
    """`get(arch, quant) -> Path`: the tiny `arch` checkpoint as a GGUF file of that type, written once."""
    written: dict[tuple[str, str], Path] = {}

    def get(arch: str, quant: str) -> Path:
        if (arch, quant) not in written:
            out = tmp_path_factory.mktemp(f"gguf-{arch}-{quant}") / f"{arch}-{quant}.gguf"
            written[arch, quant] = write_gguf(tiny_checkpoint(arch), out, quant)
        return written[arch, quant]

    return get


def _hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch, quant", [("llama", "F32"), ("llama", "F16"), ("llama", "Q8_0"), ("llama", "Q4_1"),
                                         ("qwen2", "F32"), ("qwen2", "Q4_1")])
def test_greedy_equals_transformers_gguf_loading(arch, quant, gguf_file):
    path = gguf_file(arch, quant)
    with make_llm(str(path), device="cpu") as llm:
        prompts = random_prompts([1, 7, 30], llm.get_tokenizer().vocab_size, seed=11)
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
        assert got == hf_greedy_generate(_hf_from_gguf(path), prompts, 8)
        assert_all_blocks_free(llm)


def test_qwen3_head_dim_and_qk_norm_come_from_the_metadata(gguf_file, tiny_checkpoint):
    """The tiny qwen3's head_dim (32) is not hidden / heads (16): it is read from attention.key_length
    (transformers' GGUF loading does not read it, so the oracle is the original checkpoint; F32 is lossless)."""
    with make_llm(str(gguf_file("qwen3", "F32")), device="cpu") as llm:
        prompts = random_prompts([5, 21], llm.get_tokenizer().vocab_size, seed=12)
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert got == hf_greedy_generate(load_hf_model(tiny_checkpoint("qwen3")), prompts, 8)


@needs_gguf_tokenizer_oracle
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_from_metadata_encodes_as_transformers_does(arch, gguf_file):
    from transformers import AutoTokenizer
    path = gguf_file(arch, "Q8_0")
    with make_llm(str(path), device="cpu") as llm:
        ours = llm.get_tokenizer()
        theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        specials = [t for t in (theirs.bos_token, theirs.eos_token) if t]
        for text in [*TEXTS, f"{specials[-1]} between {specials[0]} specials"]:
            ids = ours.encode(text)
            assert ids == theirs.encode(text), text
            assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        messages = [{"role": "user", "content": "What is a KV cache?"}]
        assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                                add_generation_prompt=True)
        assert ours.eos_token_ids == (theirs.eos_token_id,)


def test_unpermute_undoes_llama_cpp_permute():
    weight = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)  # 6 heads of dim 8
    assert torch.equal(unpermute_rotary_rows(torch.from_numpy(_permute(weight.numpy(), 6)), 6), weight)


def test_the_config_comes_from_the_metadata(gguf_file):
    config = GGUFCheckpoint(gguf_file("qwen2", "Q8_0")).hf_config()
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 64, 384)
    assert config["rope_theta"] == 1e6 and config["torch_dtype"] == "bfloat16"


def test_files_that_are_not_gguf_or_not_whole_are_refused(tmp_path, gguf_file):
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="model.gguf.*is a file but not a GGUF file"):
        make_llm(str(text))
    whole = gguf_file("llama", "Q8_0").read_bytes()
    for cut in (12, 400, len(whole) // 2):
        truncated = tmp_path / f"cut-{cut}.gguf"
        truncated.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"cut-{cut}.gguf"):
            make_llm(str(truncated))


def test_unsupported_architecture_and_missing_tokenizer_are_named(tmp_path, tiny_checkpoint):
    odd = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(odd), "mamba")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    _close(writer)
    with pytest.raises(ValueError, match="odd.gguf.*architecture 'mamba' is not supported"):
        make_llm(str(odd))
    iq = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(iq), "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 66, dtype=torch.uint8).numpy(),
                      raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)  # 4 rows of 256 values, 66 bytes each
    _close(writer)
    with pytest.raises(ValueError, match="iq.gguf: tensor types IQ2_XXS are not supported"):
        make_llm(str(iq))
    bare = tmp_path / "bare.gguf"
    _strip_tokenizer(write_gguf(tiny_checkpoint("llama"), tmp_path / "full.gguf", "F32"), bare)
    with pytest.raises(ValueError, match="bare.gguf has no tokenizer.*--tokenizer"):
        make_llm(str(bare), device="cpu")
    with make_llm(str(bare), device="cpu", tokenizer=str(tiny_checkpoint("llama"))) as llm:  # a tokenizer dir
        assert llm.generate(["Hello"], GREEDY)[0].outputs[0].token_ids


def _close(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _strip_tokenizer(source: Path, out: Path) -> None:
    """`source` rewritten without its tokenizer.* metadata."""
    from engine.model.gguf_file import GGUFFile
    from gguf.quants import dequantize
    read = GGUFFile(source)
    writer = gguf.GGUFWriter(str(out), read.metadata["general.architecture"])
    for key, value in read.metadata.items():
        if key.startswith(f"{read.metadata['general.architecture']}."):
            _add_metadata(writer, key, value)
    for info in read.tensors:
        writer.add_tensor(info.name, dequantize(read.raw(info), gguf.GGMLQuantizationType(info.type_id)))
    _close(writer)


def _add_metadata(writer, key: str, value) -> None:
    if isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, int(value))


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1"])
def test_fast_dequantize_equals_the_gguf_reference(quant):
    from engine.model.gguf_dequant import dequantize, dequantize_reference
    values = torch.randn(48, 256, generator=torch.Generator().manual_seed(3)).numpy() * 3  # [rows, values]
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[quant])                   # [rows, bytes]
    fast, reference = dequantize(raw, quant), dequantize_reference(raw, quant)
    assert fast.shape == (48, 256) and torch.equal(fast, reference)
    step = float(abs(values).max()) / 8  # 4-bit types: 16 levels over [-max, max]; Q8_0: far finer
    assert (fast - torch.from_numpy(values)).abs().max() <= step  # and it is the matrix that was quantized


def test_convert_writes_a_checkpoint_transformers_loads(tmp_path, gguf_file, capsys):
    """`tandem convert`: transformers reads the directory back; its greedy tokens equal its own GGUF loading's,
    its tokenizer encodes as ours, and the engine serves the directory as it serves the file. The command runs
    through `tandem`'s entry point (cluster.cli.main) in this process: a second interpreter only added its start-up
    (~4 s on the 2-core CI machine); the cluster tests run `python -m cluster.cli` as a real process."""
    from transformers import AutoTokenizer

    from cluster.cli import main
    path, out = gguf_file("llama", "Q4_1"), tmp_path / "converted"
    assert main(["convert", str(path), str(out)]) == 0, capsys.readouterr().err[-2000:]
    prompts = random_prompts([4, 19], 300, seed=13)
    expected = hf_greedy_generate(_hf_from_gguf(path), prompts, 8)
    assert hf_greedy_generate(load_hf_model(out), prompts, 8) == expected
    theirs = AutoTokenizer.from_pretrained(out)
    with make_llm(str(path), device="cpu") as from_file, make_llm(str(out), device="cpu") as from_dir:
        for text in TEXTS:
            ids = theirs.encode(text)
            assert ids == from_file.get_tokenizer().encode(text) == from_dir.get_tokenizer().encode(text)
        for llm in (from_file, from_dir):
            outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
            assert [o.outputs[0].token_ids for o in outputs] == expected
    capsys.readouterr()
    assert main(["convert", str(out / "config.json"), str(tmp_path / "x")]) == 2
    assert "config.json is not a GGUF file" in capsys.readouterr().err


@needs_gguf_tokenizer_oracle
def test_sentencepiece_vocabulary_encodes_as_transformers_does(tmp_path):
    """A Llama 2 / Mistral style vocabulary (llama.cpp's "llama" kind: byte fallback, scores, no merges)."""
    from transformers import AutoTokenizer

    from engine.model.gguf_file import GGUFFile
    from engine.text.gguf_tokenizer import tokenizer_from_gguf
    from tests.support.gguf_files import write_sentencepiece_vocab_gguf
    path = write_sentencepiece_vocab_gguf(tmp_path / "spm.gguf")
    ours = tokenizer_from_gguf(GGUFFile(path).metadata, str(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [*TEXTS, "</s> between <s> specials"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == ours.bos_token_id == 1  # a sentencepiece vocabulary that does not say adds BOS
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
