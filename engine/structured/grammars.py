"""StructuredOutputsParams -> the llguidance grammar text, and the check an engine runs at admission.

JSON schemas compile with llguidance's JSON compiler: compact JSON (no free whitespace between tokens, so an
untrained or wandering model cannot spend its tokens on blanks), `additionalProperties` as the schema says. A
choice list is a Lark alternative of JSON-quoted literals; a grammar is Lark, or GBNF/EBNF (`::=`), which
llguidance's converter turns into Lark; a regex must match the whole output; json_object is the schema
{"type": "object"}.
"""
from __future__ import annotations

import json
from functools import lru_cache

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from engine.structured_params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its serialized form) of `spec`; ValueError when a grammar cannot be converted.
    Not checked for validity: `check_spec` does that."""
    return _grammar_text(spec.key)


@lru_cache(maxsize=1024)
def _grammar_text(key: tuple[str, str]) -> str:
    kind, text = key
    if kind in ("json", "json_object"):
        schema = json.loads(text) if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(text))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    try:
        lark = any_to_lark(text)
    except Exception as error:  # the converter's own parse errors (GbnfToLarkError and others)
        raise ValueError(f"grammar does not parse: {error}") from error
    return llguidance.LLMatcher.grammar_from_lark(lark)


@lru_cache(maxsize=1024)
def _check(key: tuple[str, str]) -> str | None:
    """The error of the spec with this key, None when it is valid (cached: a spec is checked once)."""
    try:
        grammar = _grammar_text(key)
    except ValueError as error:
        return str(error)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0].strip() if failed else None


def check_spec(spec: StructuredOutputsParams) -> None:
    """ValueError naming what is wrong when `spec` does not compile: an invalid JSON schema or one using a
    feature llguidance does not implement, a regex or grammar that does not parse. Needs no tokenizer; about a
    millisecond for a typical spec, and each distinct spec is checked once per process."""
    error = _check(spec.key)
    if error is not None:
        what = {"json": "json schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                "grammar": "grammar"}[spec.kind]
        raise ValueError(f"invalid structured_outputs {what}: {error}")
