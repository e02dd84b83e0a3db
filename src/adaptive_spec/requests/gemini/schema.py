"""Gemini's two schema dialects read as the JSON Schema llama-server turns into a grammar: `parametersJsonSchema` and
`responseJsonSchema` are JSON Schema already; `parameters` and `responseSchema` are Google's OpenAPI subset, with
upper-case types (`"OBJECT"`, `"STRING"`), `nullable`, and keys no grammar needs (`propertyOrdering`, `example`).

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
