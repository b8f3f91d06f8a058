"""HFTokenizer against transformers' AutoTokenizer, ByteTokenizer, and IncrementalDetokenizer streams."""

from __future__ import annotations

import random
import shutil
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = [
    "Hello world!",
    " leading space and  double  spaces",
    "   three leading spaces\ttab\nnewline\n\n",
    "héllo wörld, naïve café, decomposed e\u0301 and Å",
    "日本語のテキストと中文",
    "emoji 🎉👍🏽 and a family 👨‍👩‍👧 ok",
    "The quick brown fox jumps over the lazy dog.",
    "<s> a literal bos and </s> eos inside text",
    "",
    "numbers 1234567890 and symbols @#$%^&*()",
]
CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " What is 2+2? "},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Ünïcode 🎉"}],
]
TOKENIZER_ARCHS = ["llama", "qwen2"]  # BOS + string template / no BOS + named templates


@pytest.fixture(scope="module")
def hf_pair(tiny_checkpoint):
    """(checkpoint dir, our HFTokenizer, transformers' AutoTokenizer) per tokenizer flavour."""
    from transformers import AutoTokenizer

    pairs = {}
    for arch in TOKENIZER_ARCHS:
        path = tiny_checkpoint(arch)
        pairs[arch] = (path, HFTokenizer.from_dir(path), AutoTokenizer.from_pretrained(path))
    return pairs


@pytest.mark.parametrize("arch", TOKENIZER_ARCHS)
def test_encode_matches_transformers(hf_pair, arch):
    _, ours, theirs = hf_pair[arch]
    for text in TEXTS:
        for add_special in (True, False):
            expected = theirs(text, add_special_tokens=add_special)["input_ids"]
            assert ours.encode(text, add_special_tokens=add_special) == expected, (text, add_special)
    with_bos = ours.encode("Hello")
    assert (with_bos[0] == ours.bos_token_id) == (arch == "llama")
    assert ours.encode("<s>Hello").count(0) == (2 if arch == "llama" else 0)  # BOS is added once, not twice


@pytest.mark.parametrize("arch", TOKENIZER_ARCHS)
def test_decode_matches_transformers(hf_pair, arch):
    _, ours, theirs = hf_pair[arch]
    rng = random.Random(7)
    streams = [ours.encode(text) for text in TEXTS]
    streams += [[rng.randrange(ours.vocab_size + 24) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    for ids in streams:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for text in TEXTS:  # the Qwen-style tokenizer normalizes to NFC
        expected = unicodedata.normalize("NFC", text) if arch == "qwen2" else text
        assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == expected


@pytest.mark.parametrize("arch", TOKENIZER_ARCHS)
def test_special_ids_match_transformers(hf_pair, arch):
    _, ours, theirs = hf_pair[arch]
    assert ours.bos_token_id == theirs.bos_token_id
    assert theirs.eos_token_id in ours.eos_token_ids
    # the tokenizer's eos_token united with config.json's and generation_config.json's ids
    assert set(ours.eos_token_ids) == {"llama": {1, 2}, "qwen2": {0, 2}}[arch]
    assert ours.vocab_size == len(theirs)


@pytest.mark.parametrize("arch", TOKENIZER_ARCHS)
def test_chat_template_matches_transformers(hf_pair, arch):
    _, ours, theirs = hf_pair[arch]
    for messages in CHATS:
        for add_prompt in (True, False):
            expected = theirs.apply_chat_template(messages, add_generation_prompt=add_prompt, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=add_prompt) == expected


TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("arch", TOKENIZER_ARCHS)
def test_chat_template_options_match_transformers(hf_pair, arch):
    """tools (qwen2's checkpoint then uses its "tool_use" template, as transformers picks it),
    continue_final_message, and template variables that override the special tokens."""
    _, ours, theirs = hf_pair[arch]
    cases = [(CHATS[1], dict(tools=TOOLS, add_generation_prompt=True)),
             (CHATS[1][:3], dict(continue_final_message=True, add_generation_prompt=False)),
             (CHATS[0], dict(add_generation_prompt=True, chat_template_kwargs={"eos_token": "<END>"}))]
    for messages, options in cases:
        variables = options.pop("chat_template_kwargs", {})
        expected = theirs.apply_chat_template(messages, tokenize=False, **options, **variables)
        assert ours.apply_chat_template(messages, **options, chat_template_kwargs=variables) == expected
    tool_use = ours.apply_chat_template(CHATS[1], tools=TOOLS)
    assert (tool_use.startswith("[system] Be brief.")) == (arch == "qwen2")
    with pytest.raises(ValueError, match="cannot both be true"):
        ours.apply_chat_template(CHATS[1], continue_final_message=True)
    with pytest.raises(ValueError, match="'messages'"):
        ours.apply_chat_template(CHATS[1], chat_template_kwargs={"messages": []})


def test_byte_tokenizer_continues_the_final_message():
    rendered = ByteTokenizer().apply_chat_template(CHATS[1][:3], add_generation_prompt=False,
                                                   continue_final_message=True)
    assert rendered.endswith("<|assistant|>\n4")


def test_chat_template_errors_are_value_errors(hf_pair):
    _, ours, _ = hf_pair["llama"]
    with pytest.raises(ValueError, match="Unknown role: tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="non-empty list"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match="string 'role'"):
        ours.apply_chat_template([{"content": "no role"}])


def _copy_checkpoint(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def test_chat_template_file_overrides_config(hf_pair, tmp_path):
    from transformers import AutoTokenizer

    path = _copy_checkpoint(hf_pair["llama"][0], tmp_path / "ckpt")
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    expected = AutoTokenizer.from_pretrained(path).apply_chat_template(CHATS[1], tokenize=False)
    assert HFTokenizer.from_dir(path).apply_chat_template(CHATS[1]) == expected == (
        "system: Be brief.\nuser:  What is 2+2? \nassistant: 4\nuser: Ünïcode 🎉\n")


def test_without_post_processor_bos_follows_transformers(hf_pair, tmp_path):
    """tokenizer.json without a post-processor and add_bos_token=true: transformers 5 adds no BOS; nor do we."""
    from transformers import AutoTokenizer

    path = _copy_checkpoint(hf_pair["llama"][0], tmp_path / "ckpt")
    backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    backend.post_processor = None
    backend.save(str(path / "tokenizer.json"))
    expected = AutoTokenizer.from_pretrained(path)("Hello world")["input_ids"]
    assert HFTokenizer.from_dir(path).encode("Hello world") == expected


def test_missing_tokenizer_file_is_named(tmp_path, hf_pair):
    with pytest.raises(ValueError, match="tokenizer.json"):
        HFTokenizer.from_dir(tmp_path / "does-not-exist")
    path = _copy_checkpoint(hf_pair["llama"][0], tmp_path / "ckpt")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        HFTokenizer.from_dir(path)
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        HFTokenizer.from_dir(path)


def test_bad_ids_and_text_raise(hf_pair):
    for tokenizer in (hf_pair["llama"][1], ByteTokenizer()):
        with pytest.raises(ValueError, match="position 1"):
            tokenizer.decode([5, -1])
        with pytest.raises(ValueError, match="must be a str"):
            tokenizer.encode(b"bytes")


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_ids) == (259, 256, (257,))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
        assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
        assert tokenizer.decode(ids) == text
    ids = [256, *b"hi", 257, 258, 300]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>hi</s><pad>"
    assert tokenizer.decode([0xE2, 0x82]) == "\ufffd"


def test_byte_tokenizer_chat_template():
    rendered = ByteTokenizer().apply_chat_template(CHATS[1][:2])
    assert rendered == "<|system|>\nBe brief.\n<|user|>\n What is 2+2? \n<|assistant|>\n"
    assert not ByteTokenizer().apply_chat_template(CHATS[0], add_generation_prompt=False).endswith("<|assistant|>\n")


def _stream(tokenizer, ids, rng, skip_special_tokens=True):
    """Feed `ids` in random-sized chunks; return (per-step deltas, flush delta, detokenizer)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens=skip_special_tokens)
    deltas, position = [], 0
    while position < len(ids):
        size = rng.choice([1, 1, 1, 2, 3])
        deltas.append(detokenizer.step(ids[position:position + size]))
        position += size
    return deltas, detokenizer.flush(), detokenizer


@pytest.mark.parametrize("flavour", ["llama", "qwen2", "bytes"])
def test_incremental_detokenizer_equals_full_decode(hf_pair, flavour):
    tokenizer = ByteTokenizer() if flavour == "bytes" else hf_pair[flavour][1]
    rng = random.Random(11)
    streams = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    streams += [[rng.randrange(tokenizer.vocab_size + 20) for _ in range(rng.randrange(1, 60))]
                for _ in range(60)]
    for ids in streams:
        for skip in (True, False):
            deltas, tail, detokenizer = _stream(tokenizer, ids, rng, skip)
            expected = tokenizer.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) + tail == detokenizer.text == expected
            assert all(not delta.endswith("\ufffd") for delta in deltas)


def test_incremental_detokenizer_holds_back_split_characters():
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), [])
    euro, party = list("€".encode()), list("🎉".encode())
    assert [detokenizer.step([byte]) for byte in euro] == ["", "", "€"]
    assert [detokenizer.step([byte]) for byte in [*party, ord("!")]] == ["", "", "", "🎉", "!"]
    assert detokenizer.step([0xF0]) == "" and detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "€🎉!\ufffd"
    with pytest.raises(ValueError, match="after flush"):
        detokenizer.step([65])


def test_incremental_detokenizer_splits_hf_bytes(hf_pair):
    """Byte-level BPE tokens that each carry one byte of a multi-byte character."""
    path, tokenizer, _ = hf_pair["llama"]
    backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    byte_tokens = [backend.token_to_id(char) for char in ("Ã", "©")]  # byte-level spellings of é's two bytes
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert [detokenizer.step([token]) for token in byte_tokens] == ["", "é"]


def test_incremental_detokenizer_keeps_leading_space_context(tmp_path):
    """A SentencePiece-style (Metaspace) decoder drops the leading space of the first token it decodes, so
    windows need left context to match the full decode."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(TEXTS, trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer.from_dir(tmp_path)
    rng = random.Random(5)
    for ids in [tokenizer.encode(text) for text in TEXTS] + [
            [rng.randrange(tokenizer.vocab_size) for _ in range(30)] for _ in range(20)]:
        deltas, tail, _ = _stream(tokenizer, ids, rng)
        assert "".join(deltas) + tail == tokenizer.decode(ids)


def test_incremental_detokenizer_window_stays_small(hf_pair):
    tokenizer = hf_pair["llama"][1]
    ids = tokenizer.encode(" ".join(TEXTS[:7]) * 20, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    largest_window = 0
    for token in ids:
        detokenizer.step([token])
        largest_window = max(largest_window, detokenizer.window_token_count)
    assert len(ids) > 500 and largest_window <= 8
    assert detokenizer.text + detokenizer.flush() == tokenizer.decode(ids)
