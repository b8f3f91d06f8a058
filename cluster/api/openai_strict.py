"""OpenAI's strict mode for JSON schemas: `response_format.json_schema.strict` and a tool's `function.strict`.

What strict means (decided following OpenAI; vLLM accepts `strict` and ignores it): with strict true the output
follows the schema exactly, and the schema must be one strict mode can honour, checked before anything is
scheduled, as OpenAI checks it (a 400 naming the schema's field and where in it the rule is broken):
- the root is an object schema (not anyOf, not another type);
- every object schema (a `type` of "object", or one with `properties`) sets `additionalProperties: false`, and
  its `required` lists every key of its `properties` (an optional field is written as a union with "null");
- no keyword OpenAI's strict mode does not support (UNSUPPORTED_KEYWORDS: allOf, not, if/then/else,
  patternProperties, ...), and a `format` only among STRICT_FORMATS.
The rules apply in every subschema: properties, items, anyOf branches, $defs / definitions. Keywords OpenAI
lists as supported, and minLength / maxLength, which the grammar enforces exactly, are accepted.

Generation is the same with strict true, false or absent: Tandem always constrains the output to the schema
token by token (engine/structured), so with strict false the output follows the schema as far as it says (an
object without `additionalProperties: false` may carry extra keys, properties not required may be missing),
which is what strict false was before. A strict tool without `parameters` takes none: its arguments are `{}`.
"""
from __future__ import annotations

import json

UNSUPPORTED_KEYWORDS = ("allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                        "patternProperties", "unevaluatedProperties", "propertyNames", "minProperties",
                        "maxProperties", "unevaluatedItems", "contains", "minContains", "maxContains",
                        "uniqueItems")
STRICT_FORMATS = ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf",)


def empty_parameters() -> dict:
    """The parameters of a strict function that gives none: an object with no properties (a new dict each call)."""
    return {"type": "object", "properties": {}, "required": [], "additionalProperties": False}


def check_strict_schema(schema) -> None:
    """ValueError saying which rule of strict mode (module docstring) `schema` breaks and where, as OpenAI words
    it: "In context=('properties', 'a'), ...". Changes nothing; returns None for a schema strict mode honours."""
    if not isinstance(schema, dict):
        raise ValueError(f"strict mode needs a JSON schema object at the root, got {json.dumps(schema)[:80]}")
    if not _is_object(schema) or "anyOf" in schema:
        raise ValueError("In context=(), the root of a strict schema must be an object schema "
                         "(\"type\": \"object\"), not anyOf or another type")
    _check(schema, ())


def _check(node, context: tuple) -> None:
    """Checks `node` and every subschema under it; `context` is the path from the root."""
    if not isinstance(node, dict):
        if isinstance(node, bool):
            return
        raise ValueError(f"In context={context!r}, a schema must be an object, got {json.dumps(node)[:80]}")
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in node:
            raise ValueError(f"In context={context!r}, '{keyword}' is not permitted in strict mode")
    if "format" in node and node["format"] not in STRICT_FORMATS:
        raise ValueError(f"In context={context!r}, format {json.dumps(node['format'])[:80]} is not supported in "
                         f"strict mode (use one of {', '.join(STRICT_FORMATS)})")
    if _is_object(node):
        _check_object(node, context)
    for name in _SUBSCHEMA_MAPS:
        children = node.get(name)
        if isinstance(children, dict):
            for key, child in children.items():
                _check(child, (*context, name, key))
    for name in _SUBSCHEMA_LISTS:
        children = node.get(name)
        if isinstance(children, list):
            for index, child in enumerate(children):
                _check(child, (*context, name, index))
    if "items" in node:
        _check(node["items"], (*context, "items"))


def _check_object(node: dict, context: tuple) -> None:
    if node.get("additionalProperties") is not False:
        raise ValueError(f"In context={context!r}, 'additionalProperties' is required to be supplied and to be "
                         "false")
    properties = node.get("properties") or {}
    required = node.get("required")
    if not isinstance(properties, dict):
        raise ValueError(f"In context={context!r}, 'properties' must be an object")
    if not isinstance(required, list) and properties:
        raise ValueError(f"In context={context!r}, 'required' is required to be supplied and to be an array "
                         f"including every key in properties. Missing '{next(iter(properties))}'.")
    missing = [key for key in properties if key not in (required or [])]
    if missing:
        raise ValueError(f"In context={context!r}, 'required' is required to be supplied and to be an array "
                         f"including every key in properties. Missing '{missing[0]}'.")


def _is_object(node: dict) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node
