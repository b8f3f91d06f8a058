"""StructuredOutputsParams: the grammar a request's output must follow (vLLM's shape), checked on construction.

What can be checked without a tokenizer or a grammar library is checked here (exactly one kind given, types,
an empty choice list, a JSON schema that is not JSON); whether a schema uses a feature the backend lacks, or a
regex / grammar compiles, is checked when an engine admits the request (engine/structured/grammars.py), also
as a ValueError naming what is wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema: a dict, a bool, or its JSON text), `regex` (the whole output
    matches it), `choice` (the output is one of these strings), `grammar` (a Lark or GBNF/EBNF grammar, start
    rule `start` / `root`), `json_object=True` (any JSON object). The output is constrained token by token;
    EOS is allowed only where the grammar may end. Immutable; `key` identifies the spec (the compile cache's
    key: equal specs share one compiled grammar)."""

    json: dict | bool | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in KINDS if (getattr(self, name) is not None if name != "json_object"
                                            else self.json_object)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a boolean, got {self.json_object!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        """Which field is given: one of KINDS."""
        return next(name for name in KINDS if (getattr(self, name) is not None if name != "json_object"
                                               else self.json_object))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text of the spec): equal for equal specs, whatever their dict order."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def _schema(value) -> dict | bool:
    """A JSON schema as a dict (or a bool schema); its JSON text is parsed. ValueError when it is neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"json schema is not valid JSON: {error}") from error
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"json schema must be a JSON object (or a boolean), got {type(value).__name__}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"json schema must be JSON-serializable: {error}") from error
    return value


def _choices(value) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"choice must be a list of strings, got {type(value).__name__}")
    if not value:
        raise ValueError("choice must not be empty: give at least one string")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"choice entries must be non-empty strings, got {item!r}")
    return tuple(value)
