"""How Google's JSON reader takes a request's fields (lowerCamelCase or snake_case alike), and the problem a field
that cannot be translated stops its request with.

Pure."""

from __future__ import annotations

import re
from typing import Any

from adaptive_spec.requests.body.shapes import RequestProblem


class Untranslatable(Exception):
    """A field that cannot be translated: the problem the request is answered with (a 400 naming the field)."""

    def __init__(self, message: str, param: str, code: str = "invalid_type") -> None:
        super().__init__(message)
        self.problem = RequestProblem(message, code, param)

    @classmethod
    def wrong(cls, where: str, wanted: str) -> Untranslatable:
        """`where` is not of the JSON type (or shape) it must have: `wanted` says which."""
        return cls(f"'{where}' must be {wanted}.", where)


def camel(key: str) -> str:
    """A field name in lowerCamelCase (`thought_signature` → `thoughtSignature`)."""
    head, *rest = key.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


def snake(key: str) -> str:
    """A field name in snake_case (`thoughtSignature` → `thought_signature`)."""
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


def field(obj: dict[str, Any], key: str) -> Any:
    """A field as Google's JSON reader takes it: in lowerCamelCase (`key`) or snake_case."""
    value = obj.get(key)
    return obj.get(snake(key)) if value is None else value
