"""The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`), built
with the `tokenizers` library as an HFTokenizer: the vocabulary, the merges, the pre-tokenizer llama.cpp names in
`tokenizer.ggml.pre`, control tokens as special tokens and user-defined ones as added tokens, BOS when the file
says to add it, the special tokens' strings and the chat template.

Two kinds of vocabulary (`tokenizer.ggml.model`): byte-level BPE, "gpt2" (GPT-2, Llama 3, Qwen2, SmolLM), its
text split as llama.cpp (llama-vocab.cpp) splits it for the pre-tokenizer the file names (for "smollm" each digit
alone, then GPT-2's split, as SmolLM's own tokenizer.json does); and sentencepiece BPE, "llama" (Llama 2, Mistral
v0.1, TinyLlama): spaces as "▁" with one before the text, bytes the vocabulary lacks as its <0xNN> tokens, the
merges rebuilt from the tokens' scores when the file has none (as transformers rebuilds them). Any other kind takes
the checkpoint's Hugging Face tokenizer directory instead (`tokenizer=` / `--tokenizer`).
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
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, _merges(metadata.get("tokenizer.ggml.merges") or [], source))
        backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"), source)
    elif kind == "llama":
        backend = _sentencepiece_bpe(tokens, metadata, source)
    else:
        raise ValueError(f"{source}: tokenizer kind {kind!r} is not supported yet ('gpt2' and 'llama' are): "
                         "pass the model's Hugging Face tokenizer directory (tokenizer=... / --tokenizer)")
    types = metadata.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind_ in zip(tokens, types) if kind_ == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED])
    special_tokens = {name: tokens[int(metadata[f"tokenizer.ggml.{key}"])] for name, key in SPECIAL_TOKEN_IDS.items()
                      if metadata.get(f"tokenizer.ggml.{key}") is not None
                      and 0 <= int(metadata[f"tokenizer.ggml.{key}"]) < len(tokens)}
    processor = _post_processor(metadata, special_tokens, backend)
    if processor is not None:
        backend.post_processor = processor
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return HFTokenizer(backend, special_tokens=special_tokens, eos_token_ids=[] if eos is None else [int(eos)],
                       chat_template=metadata.get("tokenizer.chat_template"))


def _merges(merges: list[str], source: str) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        if not right:
            raise ValueError(f"{source}: malformed merge {merge!r} (expected two tokens)")
        pairs.append((left, right))
    return pairs


def _byte_level_bpe(tokens: list[str], merges: list[tuple[str, str]]) -> BackendTokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], metadata: Mapping[str, Any], source: str) -> BackendTokenizer:
    """A sentencepiece BPE vocabulary as transformers' LlamaTokenizer builds one: byte fallback, "▁" for spaces
    (prepended to the text unless the file says add_space_prefix false), and the decoder that undoes both."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = _merges(metadata["tokenizer.ggml.merges"], source)
    elif metadata.get("tokenizer.ggml.scores"):
        merges = merges_from_scores(vocab, dict(zip(tokens, metadata["tokenizer.ggml.scores"])))
    else:
        raise ValueError(f"{source}: a sentencepiece vocabulary with neither merges nor scores")
    backend = BackendTokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                     prepend_scheme="first" if prefix else "never")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return backend


def merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: every split of a token into two tokens of the vocabulary,
    best score first (then the shorter left part, then the shorter right part), as transformers derives them."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:cut], token[cut:], score) for cut in range(1, len(token))
                 if token[:cut] in vocab and token[cut:] in vocab]
        merges += sorted(pairs, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
    merges.sort(key=lambda pair: (pair[2], len(pair[0]), len(pair[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


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
    """BOS before the text when the file says to add it (llama.cpp's add_bos_token; a sentencepiece vocabulary
    that does not say adds it, as llama.cpp does); byte-level vocabularies keep their bytes as they are."""
    byte_level = metadata.get("tokenizer.ggml.model") == "gpt2"
    steps = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    bos = special_tokens.get("bos_token")
    if metadata.get("tokenizer.ggml.add_bos_token", not byte_level) and bos is not None:
        steps.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                   special_tokens=[(bos, backend.token_to_id(bos))]))
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)
