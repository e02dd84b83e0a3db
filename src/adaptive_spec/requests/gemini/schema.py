"""Gemini's two schema dialects read as the JSON Schema llama-server turns into a grammar: `parametersJsonSchema` and
`responseJsonSchema` are JSON Schema already; `parameters` and `responseSchema` are Google's OpenAPI subset, with
upper-case types (`"OBJECT"`, `"STRING"`), `nullable`, and keys no grammar needs (`propertyOrdering`, `example`).

Google reads the upper-case type names in the JSON Schema dialect too (Gemini CLI 0.61's router classifier sends its
`responseJsonSchema` so), which llama-server's grammar refuses ("unrecognized type OBJECT"): they are lower-cased there.

Pure."""

from __future__ import annotations

from typing import Any

# OpenAPI keys with no meaning for a grammar: dropped.
_DROPPED = frozenset({"nullable", "propertyOrdering", "property_ordering", "example"})
# snake_case spellings the proto JSON reader accepts, as JSON Schema spells them.
_RENAMED = {
    "any_of": "anyOf",
    "max_items": "maxItems",
    "min_items": "minItems",
    "max_length": "maxLength",
    "min_length": "minLength",
    "max_properties": "maxProperties",
    "min_properties": "minProperties",
}
_MAX_DEPTH = 64
# Google's type names (its `Type` enum): upper case, as nothing in JSON Schema spells a type.
_GOOGLE_TYPES = frozenset({"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"})


def lower_type_names(schema: Any, depth: int = 0) -> Any:
    """A JSON Schema with Google's upper-case type names (`"OBJECT"`, or one in a list of types) in lower case, at any
    depth; everything else as it came. A schema that has none comes back as the same object."""
    if depth > _MAX_DEPTH:
        return schema
    if isinstance(schema, list):
        items = [lower_type_names(item, depth + 1) for item in schema]
        return schema if all(a is b for a, b in zip(items, schema, strict=True)) else items
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    changed = False
    for key, value in schema.items():
        if key == "type" and isinstance(value, str | list):
            new = _lower_type(value)
        else:
            new = lower_type_names(value, depth + 1) if isinstance(value, dict | list) else value
        changed = changed or new is not value
        out[key] = new
    return out if changed else schema


def _lower_type(value: str | list[Any]) -> Any:
    if isinstance(value, str):
        return value.lower() if value in _GOOGLE_TYPES else value
    lowered = [_lower_type(v) if isinstance(v, str) else v for v in value]
    return lowered if lowered != value else value


def openapi_to_json_schema(schema: Any, depth: int = 0) -> Any:
    """A Gemini OpenAPI-dialect schema as JSON Schema: its types in lower case (`TYPE_UNSPECIFIED` dropped),
    `nullable: true` as a `"null"` type (or a null branch of `anyOf`, or `null` among its `enum`), nested schemas
    converted alike. A value that is not a schema object comes back as it is (llama-server judges it)."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROPPED:
            continue
        name = str(_RENAMED.get(key, key))
        if name == "type":
            if isinstance(value, str) and value.upper() != "TYPE_UNSPECIFIED":
                out["type"] = value.lower()
        elif name == "properties" and isinstance(value, dict):
            out[name] = {prop: openapi_to_json_schema(sub, depth + 1) for prop, sub in value.items()}
        elif name == "items":
            out[name] = openapi_to_json_schema(value, depth + 1)
        elif name == "anyOf" and isinstance(value, list):
            out[name] = [openapi_to_json_schema(sub, depth + 1) for sub in value]
        else:
            out[name] = value
    if schema.get("nullable") is True:
        _allow_null(out)
    return out


def _allow_null(out: dict[str, Any]) -> None:
    kind = out.get("type")
    if isinstance(kind, str) and kind != "null":
        out["type"] = [kind, "null"]
    elif "anyOf" in out and isinstance(out["anyOf"], list):
        out["anyOf"] = [*out["anyOf"], {"type": "null"}]
    if isinstance(out.get("enum"), list) and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
