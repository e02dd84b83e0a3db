"""The workloads of `ngram_params.py`, written for this benchmark: a ~120-line Python module edited over several
turns (every turn asks for the whole file back), and unrelated one-shot coding prompts."""

from __future__ import annotations

SOURCE_FILE = '''\
"""Tiny warehouse stock keeper with a command-line front end."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CURRENCY = "USD"
STORE_PATH = Path("stock.json")


@dataclass
class Item:
    sku: str
    name: str
    quantity: int = 0
    unit_price: float = 0.0
    tags: list[str] = field(default_factory=list)

    def value(self) -> float:
        return self.quantity * self.unit_price

    def to_dict(self) -> dict[str, object]:
        return {
            "sku": self.sku,
            "name": self.name,
            "quantity": self.quantity,
            "unit_price": self.unit_price,
            "tags": list(self.tags),
        }


class Stock:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add_item(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def find_item(self, sku: str) -> Item | None:
        return self.items.get(sku)

    def remove_item(self, sku: str) -> Item:
        return self.items.pop(sku)

    def restock(self, sku: str, amount: int) -> int:
        item = self.find_item(sku)
        if item is None:
            raise KeyError(sku)
        if amount <= 0:
            raise ValueError("amount must be positive")
        item.quantity += amount
        return item.quantity

    def sell(self, sku: str, amount: int) -> float:
        item = self.find_item(sku)
        if item is None:
            raise KeyError(sku)
        if amount > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} left")
        item.quantity -= amount
        return amount * item.unit_price

    def list_items(self, tag: str | None = None) -> list[Item]:
        rows = sorted(self.items.values(), key=lambda it: it.sku)
        if tag is not None:
            rows = [it for it in rows if tag in it.tags]
        return rows

    def total_value(self) -> float:
        return sum(it.value() for it in self.items.values())

    def save(self, path: Path = STORE_PATH) -> None:
        data = [it.to_dict() for it in self.list_items()]
        path.write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, path: Path = STORE_PATH) -> "Stock":
        stock = cls()
        if not path.exists():
            return stock
        for row in json.loads(path.read_text()):
            stock.add_item(Item(**row))
        return stock


def format_money(amount: float, currency: str = DEFAULT_CURRENCY) -> str:
    return f"{amount:,.2f} {currency}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stock")
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add a new item")
    add.add_argument("sku")
    add.add_argument("name")
    add.add_argument("--quantity", type=int, default=0)
    add.add_argument("--price", type=float, default=0.0)
    add.add_argument("--tag", action="append", default=[])
    sell = sub.add_parser("sell", help="sell some units")
    sell.add_argument("sku")
    sell.add_argument("amount", type=int)
    show = sub.add_parser("list", help="list items")
    show.add_argument("--tag")
    sub.add_parser("value", help="print the total stock value")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stock = Stock.load()
    if args.command == "add":
        stock.add_item(Item(args.sku, args.name, args.quantity, args.price, args.tag))
    elif args.command == "sell":
        earned = stock.sell(args.sku, args.amount)
        print(f"sold for {format_money(earned)}")
    elif args.command == "list":
        for item in stock.list_items(args.tag):
            print(f"{item.sku:10} {item.name:24} {item.quantity:5d}")
    elif args.command == "value":
        print(format_money(stock.total_value()))
    stock.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

SYSTEM_PROMPT = "You are a careful Python assistant. When asked to change code, reply with the whole file."

FENCE = "`" * 3
# Edits are aimed at the top half of the file so that each turn hits a real edit (a drafting miss) even
# when --iter-max-tokens truncates the answer; later uses are renamed too when answers run long enough.
ASK_WHOLE = " Return the complete updated file in a single " + FENCE + "python block."
ITERATIVE_TURNS: tuple[str, ...] = (
    "Here is my module:\n\n" + FENCE + "python\n" + SOURCE_FILE + FENCE + "\n\n"
    "Rename the field `unit_price` of `Item` to `price` everywhere it is used." + ASK_WHOLE,
    "Add a one-line docstring to `Item.value` that says what it returns." + ASK_WHOLE,
    "Add a parameter `replace: bool = False` to `Stock.add_item`; when it is true, overwrite an existing "
    "item instead of raising." + ASK_WHOLE,
    'Change DEFAULT_CURRENCY from "USD" to "EUR".' + ASK_WHOLE,
    "Rename the method `find_item` to `lookup_item` everywhere it is used." + ASK_WHOLE,
)

ONESHOT_PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns True when a string reads the same backwards, ignoring case and spaces.",
    "In two sentences, when should I pick a tuple over a list in Python?",
    "Write a SQL query that returns the five customers with the highest total order amount "
    "from tables customers(id, name) and orders(customer_id, amount).",
    "Give a bash one-liner that counts the lines in every .py file below the current directory.",
    "Write a JavaScript debounce(fn, ms) helper.",
    "Write a Python generator that yields the Fibonacci numbers below a limit.",
)

ITERATIVE_MAX_TOKENS = 1400
ONESHOT_MAX_TOKENS = 200

WARMUP: list[dict[str, str]] = [{"role": "user", "content": "Say hello."}]


def iterative_messages(turn: int, reference: list[str]) -> list[dict[str, str]]:
    """Append-only history for `turn`: earlier user turns and the recorded (plain) assistant answers."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i in range(turn):
        messages.append({"role": "user", "content": ITERATIVE_TURNS[i]})
        messages.append({"role": "assistant", "content": reference[i]})
    messages.append({"role": "user", "content": ITERATIVE_TURNS[turn]})
    return messages
