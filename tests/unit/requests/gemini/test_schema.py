"""Both of Gemini's schema dialects reach llama-server as JSON Schema: the OpenAPI one converted, nested schemas too."""

from __future__ import annotations

from typing import Any

import pytest

from adaptive_spec.requests.gemini.schema import openapi_to_json_schema


@pytest.mark.parametrize(
    ("openapi", "json_schema"),
    [
        ({"type": "STRING"}, {"type": "string"}),
        ({"type": "TYPE_UNSPECIFIED", "description": "x"}, {"description": "x"}),
        ({"type": "INTEGER", "nullable": True}, {"type": ["integer", "null"]}),
        (
            {"type": "STRING", "enum": ["a", "b"], "nullable": True},
            {"type": ["string", "null"], "enum": ["a", "b", None]},
        ),
        ({"anyOf": [{"type": "STRING"}], "nullable": True}, {"anyOf": [{"type": "string"}, {"type": "null"}]}),
        ({"type": "STRING", "nullable": False}, {"type": "string"}),
        (
            {"type": "ARRAY", "items": {"type": "NUMBER"}, "max_items": 3},
            {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        ),
        (
            {
                "type": "OBJECT",
                "properties": {"path": {"type": "STRING", "example": "a.py"}, "n": {"type": "INTEGER"}},
                "required": ["path"],
                "propertyOrdering": ["path", "n"],
            },
            {
                "type": "object",
                "properties": {"path": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["path"],
            },
        ),
        # Already JSON Schema (lower case): unchanged.
        (
            {"type": "object", "properties": {"a": {"type": "boolean"}}},
            {"type": "object", "properties": {"a": {"type": "boolean"}}},
        ),
        ("not a schema", "not a schema"),
    ],
)
def test_the_openapi_dialect_becomes_json_schema(openapi: Any, json_schema: Any) -> None:
    assert openapi_to_json_schema(openapi) == json_schema


def test_a_deeply_nested_schema_is_converted_down_to_its_leaves() -> None:
    leaf: dict[str, Any] = {"type": "BOOLEAN"}
    schema: dict[str, Any] = leaf
    for _ in range(10):
        schema = {"type": "OBJECT", "properties": {"x": schema}}
    out = openapi_to_json_schema(schema)
    for _ in range(10):
        assert out["type"] == "object"
        out = out["properties"]["x"]
    assert out == {"type": "boolean"}
