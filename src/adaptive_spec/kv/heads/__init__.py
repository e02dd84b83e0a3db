"""Warm starts: agents' heads (system prompt + tools + first message) kept as slot files in the state directory, found
again by a chain of piece digests and restored into a new session's slot when that beats a prefill.

`matching` is the pure part (keys, the index, matching, eviction, pricing); `store` the files and slot actions."""
