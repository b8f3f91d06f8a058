"""The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`), built
with the `tokenizers` library as an HFTokenizer: the vocabulary, the merges, the pre-tokenizer llama.cpp names in
`tokenizer.ggml.pre`, control tokens as special tokens and user-defined ones as added tokens, BOS when the file
says to add it, the special tokens' strings and the chat template.

Byte-level BPE (`tokenizer.ggml.model` "gpt2": GPT-2, Llama 3, Qwen2, SmolLM) is supported; a sentencepiece
vocabulary ("llama": Llama 2, Mistral v0.1) is not yet: pass the checkpoint's Hugging Face tokenizer directory
instead (`tokenizer=` / `--tokenizer`). The text splits follow llama.cpp (llama-vocab.cpp) per pre-tokenizer; for
"smollm" that is each digit alone, then GPT-2's split, as SmolLM's own tokenizer.json does.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine.text.tokenizer import HFTokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
          "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
GPT2_SPLIT = ("gpt2", "default", None)  # GPT-2's own split (ByteLevel's regex)
SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                     "pad_token": "padding_token_id", "sep_token": "seperator_token_id"}


def tokenizer_from_gguf(metadata: Mapping[str, Any], source: str) -> HFTokenizer:
    """The tokenizer of a GGUF file whose metadata is `metadata` (source: the file, for error messages).
    ValueError naming the file when it has no vocabulary or one of a kind this module cannot build."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ValueError(f"{source} has no tokenizer in its metadata: pass a Hugging Face tokenizer directory "
                         "(tokenizer=... / --tokenizer)")
    if kind != "gpt2":
        raise ValueError(f"{source}: tokenizer kind {kind!r} is not supported yet (byte-level BPE, 'gpt2', is): "
                         "pass the model's Hugging Face tokenizer directory (tokenizer=... / --tokenizer)")
    backend = _byte_level_bpe(tokens, metadata.get("tokenizer.ggml.merges") or [], source)
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"), source)
    types = metadata.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind_ in zip(tokens, types) if kind_ == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED])
    special_tokens = {name: tokens[int(metadata[f"tokenizer.ggml.{key}"])] for name, key in SPECIAL_TOKEN_IDS.items()
                      if metadata.get(f"tokenizer.ggml.{key}") is not None
                      and 0 <= int(metadata[f"tokenizer.ggml.{key}"]) < len(tokens)}
    backend.post_processor = _post_processor(metadata, special_tokens, backend)
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return HFTokenizer(backend, special_tokens=special_tokens, eos_token_ids=[] if eos is None else [int(eos)],
                       chat_template=metadata.get("tokenizer.chat_template"))


def _byte_level_bpe(tokens: list[str], merges: list[str], source: str) -> BackendTokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        if not right:
            raise ValueError(f"{source}: malformed merge {merge!r} (expected two tokens)")
        pairs.append((left, right))
    backend = BackendTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre: str | None, source: str):
    """How text is split before the merges, as llama.cpp splits it for this pre-tokenizer name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in GPT2_SPLIT:
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"{source}: pre-tokenizer {pre!r} is not supported yet (supported: gpt2, default, smollm, "
                     f"{', '.join(SPLITS)}); pass the model's Hugging Face tokenizer directory")


def _post_processor(metadata: Mapping[str, Any], special_tokens: dict[str, str], backend: BackendTokenizer):
    """BOS before the text when the file says to add it (llama.cpp's add_bos_token), else the bytes as they are."""
    bos = special_tokens.get("bos_token")
    if not metadata.get("tokenizer.ggml.add_bos_token", False) or bos is None:
        return processors.ByteLevel(trim_offsets=False)
    bos_id = backend.token_to_id(bos)
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])])
