"""Structured outputs: grammar-constrained decoding with llguidance.

A request's StructuredOutputsParams (JSON schema, regex, choice list, Lark/GBNF grammar, any JSON object) becomes
an llguidance grammar (`grammars.py`, checked at admission: ValueError naming what is wrong), compiled once per
distinct spec against the model's tokenizer (`tokenizer_adapter.py`) on a compile thread, off the step loop
(`compiler.py`, a bounded cache of compiled templates). Each constrained sequence keeps its own matcher
(`matcher.py`, a copy of the template advanced by every token the sequence gets); each step the sampler asks
`TokenMaskFiller.fill` for one bitmask of all its constrained rows (filled in parallel by llguidance's executor,
GIL released) and applies it to the logits before anything else (engine/sampling/token_mask.py). Rows without a
grammar cost nothing; a step without one does no mask work at all.
"""
from engine.structured.compiler import GrammarCompiler
from engine.structured.grammars import check_spec, grammar_text
from engine.structured.matcher import SequenceGrammar, TokenMaskFiller

__all__ = ["GrammarCompiler", "SequenceGrammar", "TokenMaskFiller", "check_spec", "grammar_text"]
