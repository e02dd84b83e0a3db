"""A request's body: read and checked once (its API, project and shape), repaired where llama-server would refuse what
an agent sends, rewritten where an agent loops, and counted before it is routed.

Pure: no I/O."""
