"""Incremental detokenization for streaming: text deltas that never need to be taken back."""

from __future__ import annotations

from typing import Sequence

from engine.text.tokenizer import Tokenizer, validate_token_ids

REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, a stable piece at a time.

    Technique (vLLM/TGI prefix-offset/read-offset): `step` decodes only a small window,
    `ids[prefix_offset:]`, and compares it with the decode of `ids[prefix_offset:read_offset]`, whose text
    was already emitted. The difference is emitted only if it is non-empty and does not end in U+FFFD,
    i.e. while the tail is an incomplete UTF-8 sequence (a character split across tokens) it is held back.
    Decoding from `prefix_offset` (one emitted chunk back) rather than from `read_offset` keeps the
    context that BPE/SentencePiece decoders need for leading spaces. Per step the work is O(window), where
    the window spans the tokens since the previous emission; it only grows while no text can be emitted.

    Guarantee: after `flush()`, the concatenation of everything `step` and `flush` returned (== `.text`)
    equals `tokenizer.decode(token_ids, skip_special_tokens, spaces_between_special_tokens)` for byte-level
    BPE tokenizers and `ByteTokenizer`. (SentencePiece byte-fallback decoders turn a whole run of byte tokens
    into U+FFFDs when any of it is invalid, so for them equality holds when the byte tokens form valid UTF-8.)
    Before `flush`, `.text` lags the full decode by at most the held-back tail.

    `prompt_token_ids` is accepted for vLLM-shaped call sites but does not influence the text: the text is
    the decode of the output ids alone (vLLM uses the prompt tail as left context instead, which differs
    only for SentencePiece tokenizers, where it keeps the first output token's leading space).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prompt_token_ids = tuple(validate_token_ids(prompt_token_ids))
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.flushed = False
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""

    @property
    def window_token_count(self) -> int:
        """How many tokens the next `step` re-decodes besides its new ones (small in steady state)."""
        return len(self.token_ids) - self._prefix_offset

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append `new_token_ids` to the output and return the newly stable text ("" if none yet).

        Changes `token_ids`, `text` and the window offsets. ValueError on a negative or non-int id, or when
        called after `flush`.
        """
        if self.flushed:
            raise ValueError("IncrementalDetokenizer.step called after flush(); make a new detokenizer")
        new_ids = validate_token_ids(new_token_ids)
        if not new_ids:
            return ""
        self.token_ids.extend(new_ids)
        window_text = self._decode(self.token_ids[self._prefix_offset:])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """Return whatever text is still held back (a trailing incomplete or invalid UTF-8 sequence, as
        U+FFFD) and mark the stream finished. Idempotent; after it `text == decode(token_ids)`."""
        if self.flushed:
            return ""
        window_text = self._decode(self.token_ids[self._prefix_offset:])
        delta = self._emit(window_text) if len(window_text) > len(self._prefix_text) else ""
        self.flushed = True
        return delta

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)
