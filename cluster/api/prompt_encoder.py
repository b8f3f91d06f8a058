"""Prompt text to token ids (and token ids to text) for the front ends, with no more work than the answer needs.

A prompt for generation (encode_prompt) is checked against the context as early as its length allows: when the
tokenizer bounds the characters one token stands for (token_bounds.py), a prompt whose character count alone
proves it too long is refused without being tokenized. A text of a Hugging Face tokenizer longer than
`large_chars` goes through the `tokenizers` library's batch call without offsets, which releases the GIL for the
whole of the work (and is faster): HFTokenizer.encode holds it, and a 3.9 MB prompt held it for 4 s, during which
no other thread, the event loop answering the probes included, ran a line of Python. A count past the context is
then read off the encoding without building the list of its ids. Shorter texts (a third of a millisecond at most)
take tokenizer.encode, as does any other tokenizer.

Large inputs are prepared on the front ends' InputPool threads (input_pool.py), never on the event loop.
"""
from __future__ import annotations

from collections.abc import Sequence

from cluster.api.request_validation import InvalidField, check_prompt_token_ids, check_text, context_error
from cluster.api.token_bounds import chars_per_token_bound, native_tokenizer

NATIVE_FROM_CHARS = 1024  # texts (and id lists) longer than this are encoded (decoded) with the GIL released


class PromptEncoder:
    """Encodes for one served model: `tokenizer` and its context of `max_model_len` tokens. Immutable; safe to
    use from several threads at once."""

    def __init__(self, tokenizer, max_model_len: int, large_chars: int = NATIVE_FROM_CHARS) -> None:
        """Reads the tokenizer's pipeline once (token_bounds.chars_per_token_bound): build one at startup."""
        self.tokenizer, self.max_model_len, self.large_chars = tokenizer, max_model_len, large_chars
        self._native = native_tokenizer(tokenizer)
        self._encode_batch = _batch_encoder(self._native)
        self.chars_per_token = chars_per_token_bound(tokenizer)

    @property
    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt that fits the context can have (None: no bound short of tokenizing)."""
        return None if self.chars_per_token is None else self.chars_per_token * self.max_model_len

    def encode_prompt(self, text, add_special_tokens: bool = True, field: str = "prompt") -> tuple[int, ...]:
        """The token ids of a text prompt (with the tokenizer's BOS unless told otherwise), checked as
        check_prompt_token_ids checks ids: ValueError when empty or past the context (decided from the character
        count when that proves it); InvalidField(`field`) for what is not a string, a lone surrogate, or text the
        tokenizer raises on."""
        _check_string(text, field)
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            least = -(-len(text) // self.chars_per_token)
            raise context_error(f"at least {least} tokens ({len(text)} characters, a token of this tokenizer "
                                f"standing for at most {self.chars_per_token})", self.max_model_len)
        check_text(text, field)
        if self._native is None or len(text) <= self.large_chars:
            ids = self._small(text, add_special_tokens, field)
        else:
            encoding = self._large(text, add_special_tokens, field)
            if len(encoding) > self.max_model_len:  # known without building its list of ids
                raise context_error(f"{len(encoding)} tokens", self.max_model_len)
            ids = encoding.ids
        return check_prompt_token_ids(ids, self.tokenizer, self.max_model_len)

    def tokenize(self, text, add_special_tokens: bool, field: str = "prompt") -> list[int]:
        """tokenizer.encode(text), any length (empty too; /tokenize counts past the context); InvalidField(`field`)
        as encode_prompt raises it."""
        _check_string(text, field)
        check_text(text, field)
        if self._native is None or len(text) <= self.large_chars:
            return self._small(text, add_special_tokens, field)
        return self._large(text, add_special_tokens, field).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """tokenizer.decode(ids, skip_special_tokens) of token ids already checked against the vocabulary; the GIL
        released while a long list is decoded."""
        if self._native is None or len(ids) <= self.large_chars:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._native.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def _small(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as error:  # the tokenizers library raises TypeError and bare Exceptions on odd text
            raise _untakeable(field, error) from error

    def _large(self, text: str, add_special_tokens: bool, field: str):
        """The tokenizers Encoding of `text`: what HFTokenizer.encode computes, without the GIL held."""
        try:
            return self._encode_batch([text], add_special_tokens=add_special_tokens)[0]
        except Exception as error:
            raise _untakeable(field, error) from error


def _batch_encoder(native):
    """The batch call of `native` without character offsets (tokenizers >= 0.21) where it has one: 3x faster on long
    texts, and its encodings free in milliseconds where one with offsets held the GIL for 0.1 s to free 2.6
    million tokens."""
    return None if native is None else getattr(native, "encode_batch_fast", native.encode_batch)


def _check_string(text, field: str) -> None:
    if not isinstance(text, str):
        raise InvalidField(field, f"{field} must be a string, got {type(text).__name__}")


def _untakeable(field: str, error: Exception) -> InvalidField:
    return InvalidField(field, f"the tokenizer cannot take {field} ({type(error).__name__})")
