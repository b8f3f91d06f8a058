"""The engine's structured-output requests: checked at admission, compiled off the step loop, and each sample
given its own matcher before it is scheduled.

A request whose grammar is not compiled yet waits here ("compiling"), outside the scheduler, so it holds no
block and delays nothing else; each step first hands the requests whose grammar is ready to the scheduler. A
request that resumes with tokens already generated, and a prefilled one (a decode worker's), gets its matcher at
admission instead (waiting for the compile: its KV is already placed), advanced over those tokens.
"""
from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

from engine.core.scheduler import Scheduler
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.structured import GrammarCompiler, SequenceGrammar, check_spec
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger("tandem.engine")
IDLE_WAIT_S = 0.05  # how long a step with nothing scheduled waits for a compile to finish


class StructuredRequests:
    """Owned by LLMEngine, used by its step thread. The compiler (its thread, the tokenizer's llguidance form)
    starts at the first structured request; an engine that never sees one pays nothing."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, sampler: Sampler) -> None:
        self._tokenizer, self._vocab_size, self._sampler = tokenizer, vocab_size, sampler
        self._compiler: GrammarCompiler | None = None
        self._compiling: list[tuple[Sequence, Future]] = []

    @property
    def has_pending(self) -> bool:
        return bool(self._compiling)

    @staticmethod
    def check(params: SamplingParams) -> None:
        """ValueError naming what is wrong when params' structured outputs spec does not compile."""
        if params.structured_outputs is not None:
            check_spec(params.structured_outputs)

    def hold(self, first: Sequence) -> bool:
        """Admit `first` (sample 0, its other samples in first.forks). True: it waits here for its grammar
        (a later `release` schedules it); False: schedule it now (no grammar, or its grammar is ready and
        every sample has its matcher). ValueError when a resumed request's tokens do not follow the grammar."""
        spec = first.params.structured_outputs
        if spec is None:
            return False
        future = self._compiler_now().submit(spec)
        if future.done() or first.num_output_tokens:
            self._attach(first, future.result())
            return False
        self._compiling.append((first, future))
        return True

    def attach_now(self, seq: Sequence) -> None:
        """Give a prefilled request its matcher now, advanced over its resumed tokens (not its first token:
        appending that advances it)."""
        if seq.params.structured_outputs is not None:
            self._attach(seq, self._compiler_now().compile(seq.params.structured_outputs))

    def release(self, scheduler: Scheduler) -> list[Sequence]:
        """Schedule the waiting requests whose grammar compiled (every sample with its matcher); waits up to
        IDLE_WAIT_S for one when the scheduler has nothing to run. Aborted ones are dropped. Returns the
        samples of requests whose compile failed, for the engine to end."""
        if not self._compiling:
            return []
        if not scheduler.has_work:
            wait_futures([f for _, f in self._compiling], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        failed, still = [], []
        for first, future in self._compiling:
            if not future.done():
                still.append((first, future))
            elif first.status != SequenceStatus.FINISHED:
                failed += self._schedule(first, future, scheduler)
        self._compiling = still
        return failed

    def _schedule(self, first: Sequence, future: Future, scheduler: Scheduler) -> list[Sequence]:
        try:
            self._attach(first, future.result())
        except Exception as error:  # noqa: BLE001 - a compile that failed after the spec was checked
            logger.error("request %s: its structured outputs grammar failed to compile: %s", first.request_id, error)
            return [first, *first.forks]
        scheduler.add_waiting(first)
        return []

    def _attach(self, first: Sequence, template) -> None:
        for seq in (first, *first.forks):
            grammar = SequenceGrammar(template)
            grammar.advance(seq.output_token_ids)
            seq.grammar = grammar
        if self._sampler.mask_filler is None:
            self._sampler.mask_filler = self._compiler.mask_filler()

    def _compiler_now(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size)
        return self._compiler

    def close(self) -> None:
        """Stop the compile thread; requests still compiling are the engine's to abort."""
        if self._compiler is not None:
            self._compiler.close()
        self._compiling = []
