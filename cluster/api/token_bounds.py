"""How many characters of a prompt one token can stand for, where the tokenizer guarantees a bound.

With such a bound M, every text has at least ceil(len(text) / M) tokens, so a prompt longer than M x the
context in characters is provably too long and is refused without tokenizing it (prompt_encoder.py). The bound
holds when every character of the text ends up in some token and no token stands for more than M characters.

ByteTokenizer: one token per UTF-8 byte, so M = 1. A Hugging Face tokenizer (its tokenizer.json) qualifies
only when every stage of its pipeline is one known to keep that true:
- no truncation (it would cap the count);
- a normalizer that never shortens the text: none, Prepend, Lowercase, NFD, NFKD, Replace of a string by one
  at least as long, or a Sequence of these (NFC and NFKC compose characters, Strip drops them);
- a pre-tokenizer that drops nothing: ByteLevel (one symbol per UTF-8 byte, so at least one per character),
  Metaspace, Digits, Split or Punctuation not set to remove what they match, or a Sequence of these
  (Whitespace, WhitespaceSplit and BertPreTokenizer drop the spaces);
- a BPE model in which no character can vanish and no run of them share a token: byte-level with all 256
  byte symbols in its vocabulary, byte fallback with all 256 <0xNN> tokens, or an unknown token that is not
  fused (a fused one stands for any run of unknown characters, as WordPiece's, WordLevel's and Unigram's can:
  those models never qualify);
- added tokens that do not swallow the whitespace beside them (lstrip, rstrip);
- a post-processor that only adds tokens (ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing).
M is then the longest vocabulary entry or added token in characters (byte-level entries in byte symbols: at
least the characters they cover). Any other tokenizer has no bound; its prompts are tokenized, off the event
loop when large.
"""
from __future__ import annotations

import json

from tokenizers import Tokenizer as NativeTokenizer
from tokenizers import pre_tokenizers

from engine.text.tokenizer import ByteTokenizer, HFTokenizer

_LENGTH_KEEPING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD"})
_DROPLESS_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"})
_ADDING_PROCESSORS = frozenset({"ByteLevel", "TemplateProcessing", "RobertaProcessing", "BertProcessing"})
_BYTE_FALLBACK_TOKENS = tuple(f"<0x{value:02X}>" for value in range(256))


def native_tokenizer(tokenizer) -> NativeTokenizer | None:
    """The `tokenizers` library's Tokenizer behind an engine HFTokenizer, whose batch calls release the GIL;
    None for any other tokenizer."""
    native = tokenizer.native if isinstance(tokenizer, HFTokenizer) else None
    return native if isinstance(native, NativeTokenizer) else None


def chars_per_token_bound(tokenizer) -> int | None:
    """M: no token of `tokenizer` stands for more than M characters of a text, and every character is in
    some token (see the module docstring); None when the tokenizer does not guarantee it. Reads the whole
    tokenizer.json once (tens of milliseconds for a 128k vocabulary): call it at startup."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    native = native_tokenizer(tokenizer)
    if native is None:
        return None
    spec = json.loads(native.to_str())
    pre_tokenizer = spec.get("pre_tokenizer")
    if spec.get("truncation") is not None or not _keeps_length(spec.get("normalizer")) \
            or not _drops_nothing(pre_tokenizer) or not _only_adds(spec.get("post_processor")):
        return None
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    return _longest_token(spec.get("model") or {}, _has_byte_level(pre_tokenizer), added)


def _keeps_length(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_length(step) for step in normalizer.get("normalizers", ()))
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        return "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"])
    return kind in _LENGTH_KEEPING_NORMALIZERS


def _drops_nothing(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_drops_nothing(step) for step in pre_tokenizer.get("pretokenizers", ()))
    return kind in _DROPLESS_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _only_adds(processor: dict | None) -> bool:
    if processor is None:
        return True
    if processor.get("type") == "Sequence":
        return all(_only_adds(step) for step in processor.get("processors", ()))
    return processor.get("type") in _ADDING_PROCESSORS


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(step) for step in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") == "ByteLevel"


def _longest_token(model: dict, byte_level: bool, added: list[dict]) -> int | None:
    """M of a BPE model whose every character lands in a token of at most M characters, else None."""
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not vocab:
        return None
    every_byte = byte_level and all(symbol in vocab for symbol in pre_tokenizers.ByteLevel.alphabet())
    fallback = bool(model.get("byte_fallback")) and all(token in vocab for token in _BYTE_FALLBACK_TOKENS)
    unknown = model.get("unk_token")
    one_unknown_per_character = unknown in vocab and not model.get("fuse_unk")
    if not (every_byte or fallback or one_unknown_per_character):
        return None
    return max(max(map(len, vocab)), max((len(token.get("content", "")) for token in added), default=1))
