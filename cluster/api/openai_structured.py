"""Structured outputs on the OpenAI routes: `response_format`, vLLM's `structured_outputs` and its older
`guided_*` extras, parsed into an engine StructuredOutputsParams and checked (the spec compiles) before any
backend sees the request.

`response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object), {"type":
"json_schema", "json_schema": {"name", "schema", "strict", "description"}} (the output follows the schema;
with `strict` true the schema must also be one OpenAI's strict mode honours, openai_strict.py, else a 400 naming
"response_format.json_schema.schema"). `structured_outputs`: {"json" | "regex" | "choice" | "grammar" |
"json_object": ...}, exactly one. `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: one each.
Two of these at once, or anything malformed, is a 400 whose `param` names the field (for a spec that does not
compile, the field inside it: "response_format.json_schema.schema", "structured_outputs.regex", "guided_regex").
"""
from __future__ import annotations

import json

from cluster.api.openai_fields import OpenAIError, bad_request
from cluster.api.openai_strict import check_strict_schema
from engine.structured import check_spec
from engine.structured_params import KINDS, StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED_FIELDS})
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The request's structured outputs spec (None when it asks for none); OpenAIError (400) naming the field
    when it is malformed, does not compile, or comes with another structured-output field."""
    given = [read for read in (_read(name, body[name]) for name in _ordered(body)) if read is not None]
    if len(given) > 1:
        raise bad_request(f"{given[1][0][0]} cannot be combined with {given[0][0][0]}: give one structured-output "
                          "field", param=given[1][0][0])
    if not given:
        return None
    (_, param), spec = given[0]
    try:
        check_spec(spec)
    except ValueError as error:
        raise bad_request(str(error), param=param) from error
    return spec


def _ordered(body: dict) -> list[str]:
    return [name for name in body if name in STRUCTURED_FIELDS and body[name] is not None]


def _read(name: str, value) -> tuple[tuple[str, str], StructuredOutputsParams] | None:
    """((field, param of its spec), spec) of one field, None when it asks for nothing."""
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured(value)
    kind = GUIDED_FIELDS[name]
    return (name, name), _spec(name, **{kind: value})


def _response_format(value) -> tuple[tuple[str, str], StructuredOutputsParams] | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMAT_TYPES)}"
                          f", got {json.dumps(value)[:200]}", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("response_format", "response_format"), _spec("response_format", json_object=True)
    described = value.get("json_schema")
    if not isinstance(described, dict):
        raise bad_request("response_format.json_schema must be an object with the schema",
                          param="response_format.json_schema")
    for name, kinds in (("name", str), ("description", str), ("strict", bool)):
        if described.get(name) is not None and not isinstance(described[name], kinds):
            raise bad_request(f"response_format.json_schema.{name} must be a {kinds.__name__}",
                              code="invalid_type", param=f"response_format.json_schema.{name}")
    schema = described.get("schema", described.get("json_schema"))
    param = "response_format.json_schema.schema"
    if described.get("strict"):
        _check_strict(schema, described.get("name"), param)
    if schema is None:
        return ("response_format", param), _spec(param, json_object=True)
    return ("response_format", param), _spec(param, json=schema)


def _check_strict(schema, name, param: str) -> None:
    """400 naming `param` when strict mode cannot honour `schema` (openai_strict.py)."""
    try:
        if schema is None:
            raise ValueError("strict mode needs a schema")
        check_strict_schema(StructuredOutputsParams(json=schema).json)
    except ValueError as error:
        raise bad_request(f"Invalid schema for response_format {json.dumps(name or '')}: {error}",
                          param=param) from error


def _structured(value) -> tuple[tuple[str, str], StructuredOutputsParams] | None:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", code="invalid_type", param="structured_outputs")
    unknown = set(value) - set(KINDS)
    if unknown:
        name = sorted(unknown)[0]
        raise bad_request(f"structured_outputs.{name} is not supported (give one of {', '.join(KINDS)})",
                          code="unsupported_parameter", param=f"structured_outputs.{name}")
    fields = {name: item for name, item in value.items() if item is not None and item is not False}
    if not fields:
        return None
    param = f"structured_outputs.{next(iter(fields))}" if len(fields) == 1 else "structured_outputs"
    return ("structured_outputs", param), _spec(param, **fields)


def _spec(param: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as error:
        raise bad_request(str(error), param=param) from error


__all__ = ["OpenAIError", "STRUCTURED_FIELDS", "structured_outputs"]
