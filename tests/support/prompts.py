"""Prompts the tests on the real Qwen model share: a Python file the model is asked to hand back changed, whose
answer copies most of its prompt (what n-gram drafting is for)."""

from __future__ import annotations

# A file the model is asked to hand back with one change: the answer copies most of the prompt.
SOURCE = "\n".join(
    [
        "import json",
        "from dataclasses import dataclass",
        "",
        "",
        "@dataclass",
        "class Item:",
        "    name: str",
        "    quantity: int",
        "    price_cents: int",
        "",
        "    def total_cents(self) -> int:",
        "        return self.quantity * self.price_cents",
        "",
        "",
        "def load_items(path: str) -> list[Item]:",
        "    with open(path) as handle:",
        "        rows = json.load(handle)",
        "    return [Item(row['name'], row['quantity'], row['price_cents']) for row in rows]",
        "",
        "",
        "def order_total(items: list[Item]) -> int:",
        "    return sum(item.total_cents() for item in items)",
        "",
        "",
        "def cheapest(items: list[Item]) -> Item:",
        "    return min(items, key=lambda item: item.price_cents)",
        "",
        "",
        "def report(items: list[Item]) -> str:",
        "    lines = [f'{item.name}: {item.quantity} x {item.price_cents}' for item in items]",
        "    lines.append(f'total: {order_total(items)}')",
        "    return '\\n'.join(lines)",
    ]
)
EDIT = (
    f"```python\n{SOURCE}\n```\n\nRename the function `cheapest` to `cheapest_item`. Return the complete updated file."
)
