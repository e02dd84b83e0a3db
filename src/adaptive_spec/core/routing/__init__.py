"""Routing: which profile serves a request. `decide()` and its cost model, the learned speeds, the policy schema,
the copy-hint analysis of a prompt, and placements (where a session's KV cache lives, which slot it holds) with the
one `observe()` step that learns from a finished request: the proxy's router shell and the simulator both call it.
Pure and synchronous; the I/O (slot save/restore, policy files) lives in `proxy/`."""
