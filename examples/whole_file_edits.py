"""An iterative edit session through adaptive-spec: one file, several turns, each answer the whole edited file.

This is the traffic n-gram drafting is for (each answer copies most of the previous one), and what the embedded
0.5B coder does well when the user turn asks for the whole file. Watch it with `adaptive-spec tui` while it runs:
the session starts on the plain profile, moves to the n-gram one with its KV cache, and most of each later answer
comes from accepted drafts.

    OPENAI_BASE_URL=http://127.0.0.1:8088/p/demo/v1 python examples/whole_file_edits.py [--turns 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

from openai import OpenAI

INVENTORY = '''\
"""A small inventory of items with prices and stock counts."""

from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    stock: int


def total_value(items):
    total = 0.0
    for item in items:
        total += item.price * item.stock
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best


def in_stock(items):
    result = []
    for item in items:
        if item.stock > 0:
            result.append(item)
    return result


def restock(items, name, amount):
    for item in items:
        if item.name == name:
            item.stock += amount
            return item
    raise KeyError(name)


def price_list(items):
    lines = []
    for item in sorted(items, key=lambda i: i.name):
        lines.append(f"{item.name}: {item.price:.2f}")
    return "\\n".join(lines)
'''

ASKS = [
    "Add type hints to every function.",
    "Add a one-line docstring to every function that lacks one.",
    "Rename `restock` to `add_stock` and update its docstring.",
    "Make `price_list` take an optional `currency` argument (default '$') and put it before each price.",
    "Add a function `most_valuable(items)` that returns the item with the largest price * stock.",
    "Sort the functions alphabetically by name, keeping the dataclass at the top.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=4, help="edit turns after the first (at most 6)")
    parser.add_argument("--max-tokens", type=int, default=700)
    args = parser.parse_args()
    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8088/v1")
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "sk-local"), timeout=900)
    session = {"x-session-id": f"edit-{uuid.uuid4().hex[:8]}"}
    messages = [
        {"role": "system", "content": "You are a careful Python programmer."},
        {"role": "user", "content": f"Here is inventory.py:\n```python\n{INVENTORY}```\nExplain briefly what it does."},
    ]
    for turn, ask in enumerate([None, *ASKS[: args.turns]]):
        if ask is not None:
            messages.append({"role": "user", "content": f"{ask} Output the whole file."})
        started = time.monotonic()
        reply = client.chat.completions.create(
            model="local",
            messages=messages,
            temperature=0,
            max_tokens=args.max_tokens,
            stream=True,
            extra_headers=session,
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
        messages.append({"role": "assistant", "content": text})
        print(f"turn {turn}: {len(text)} chars in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
