"""The house: how the code is laid out and how far a request walks through it (docs/module-map.md)."""
