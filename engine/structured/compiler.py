"""GrammarCompiler: compiles each distinct structured-outputs spec once, on a thread of its own.

The step loop never compiles: `submit` checks the spec (ValueError at once when it is invalid) and returns a
Future of the compiled template, shared by every request with an equal spec; the engine keeps such a request
out of the schedule until its Future is done, so a slow schema delays only its own requests. llguidance
releases the GIL while it builds a grammar, so the compile thread runs beside the steps. The tokenizer's
LLTokenizer is built on that thread too (up to a second for a 50k vocabulary), at the first structured request.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from engine.structured.grammars import _grammar_text, check_spec
from engine.structured.matcher import TokenMaskFiller
from engine.structured.tokenizer_adapter import ll_tokenizer
from engine.structured_params import StructuredOutputsParams
from engine.text.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """Compiled templates (fresh llguidance matchers, never advanced) by spec key, at most `max_cached`
    (least recently used dropped first; a dropped spec compiles again when it comes back)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        """Starts the compile thread and, on it, the tokenizer's llguidance form; returns at once."""
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
        self._tokenizer = self._pool.submit(ll_tokenizer, tokenizer, vocab_size)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The Future of spec's compiled template (llguidance.LLMatcher): the cached one when an equal spec
        came before, else a new compile on the compile thread. ValueError, nothing queued, when the spec is
        invalid (engine/structured/grammars.py check_spec)."""
        check_spec(spec)
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled template of spec, waiting for it (a decode worker admitting a prefilled request)."""
        return self.submit(spec).result()

    def mask_filler(self) -> TokenMaskFiller:
        """A TokenMaskFiller for this tokenizer's masks (waits for the tokenizer's llguidance form)."""
        tokenizer = self._tokenizer.result()
        return TokenMaskFiller(tokenizer.vocab_size, tokenizer.eos_tokens)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _compile(self, key: tuple[str, str]) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer.result(), _grammar_text(key), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs {key[0]} does not compile: {matcher.get_error().strip()}")
        return matcher

    def close(self) -> None:
        """Stop the compile thread (queued compiles are cancelled). Idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
