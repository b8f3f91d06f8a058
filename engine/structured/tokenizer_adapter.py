"""The engine's tokenizer as an llguidance LLTokenizer, sized to the model's logits.

An HFTokenizer (Hugging Face and GGUF checkpoints) hands llguidance its tokenizer.json; the embedded model's
ByteTokenizer is described token by token (ids 0..255 are bytes, then its special tokens). `vocab_size` is the
model's logits width, which may exceed the tokenizer's: ids without a token are never allowed.
"""
from __future__ import annotations

import llguidance

from engine.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


class _ByteVocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer, for ByteTokenizer."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.EOS_ID
        self.bos_token_id = tokenizer.BOS_ID
        specials = dict(tokenizer.SPECIAL_TOKENS)
        self.tokens = [bytes([i]) for i in range(256)] + [specials[i].encode() for i in sorted(specials)]
        self.special_token_ids = sorted(specials)

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return list(data)


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """An LLTokenizer for `tokenizer` whose masks are `vocab_size` tokens wide, EOS = the tokenizer's EOS ids.
    Costs up to a second for a 50k vocabulary: build it once per engine. ValueError for a tokenizer kind it
    cannot describe."""
    eos = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.native.to_str(), n_vocab=vocab_size, eos_token=eos or None)
    if isinstance(tokenizer, ByteTokenizer):
        wrapper = llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos or None)
    raise ValueError(f"structured outputs do not support the tokenizer {type(tokenizer).__name__}")
