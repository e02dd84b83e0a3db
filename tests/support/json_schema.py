"""A small JSON Schema check for tool-call arguments: the keywords agents' tool schemas use, nothing more."""

from __future__ import annotations

from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def schema_errors(schema: Any, value: Any, where: str = "$") -> list[str]:
    """What in `value` breaks `schema` (type, enum, required, properties, additionalProperties, items, bounds)."""
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    if kinds is not None:
        names = kinds if isinstance(kinds, list) else [kinds]
        ok = any(
            isinstance(value, _TYPES[n]) and not (isinstance(value, bool) and n in ("integer", "number"))
            for n in names
            if n in _TYPES
        )
        if not ok:
            return [f"{where}: expected {kinds}, got {type(value).__name__}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: {value} > maximum {schema['maximum']}")
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        errors += [f"{where}: missing {key!r}" for key in schema.get("required") or () if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(properties[key], item, f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: unexpected {key!r}")
    if isinstance(value, list):
        for i, item in enumerate(value):
            errors += schema_errors(schema.get("items"), item, f"{where}[{i}]")
    return errors
