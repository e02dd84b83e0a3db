"""Both of Gemini's schema dialects reach llama-server as JSON Schema: the OpenAPI one converted, nested schemas too."""

from __future__ import annotations

from typing import Any

import pytest

from adaptive_spec.requests.gemini.schema import lower_type_names, openapi_to_json_schema


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


@pytest.mark.parametrize(
    ("sent", "read"),
    [
        # Gemini CLI 0.61's classifier: a responseJsonSchema in Google's type names.
        (
            {"type": "OBJECT", "properties": {"score": {"type": "INTEGER"}, "why": {"type": "STRING"}}},
            {"type": "object", "properties": {"score": {"type": "integer"}, "why": {"type": "string"}}},
        ),
        ({"type": ["STRING", "NULL"]}, {"type": ["string", "null"]}),
        (
            {"anyOf": [{"type": "ARRAY", "items": {"type": "BOOLEAN"}}]},
            {"anyOf": [{"type": "array", "items": {"type": "boolean"}}]},
        ),
        # A property named "type", an enum of upper-case words, a type llama-server judges: as they came.
        (
            {"type": "object", "properties": {"type": {"type": "string", "enum": ["OBJECT", "STRING"]}}},
            {"type": "object", "properties": {"type": {"type": "string", "enum": ["OBJECT", "STRING"]}}},
        ),
        ({"type": "Object"}, {"type": "Object"}),
        (None, None),
    ],
)
def test_google_type_names_in_json_schema_are_lower_cased(sent: Any, read: Any) -> None:
    assert lower_type_names(sent) == read


def test_a_json_schema_without_google_type_names_is_the_same_object() -> None:
    schema = {"type": "object", "properties": {"a": {"type": ["string", "null"]}}, "required": ["a"]}
    assert lower_type_names(schema) is schema
