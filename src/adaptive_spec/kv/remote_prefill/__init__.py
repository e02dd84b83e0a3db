"""Remote prefill (`serve --pp-server`): a long prompt prefilled by a bigger machine through its kv-relay and its KV
brought back for local decoding: the pricing (`pricing.py`, pure), the shell that carries it out (`shell.py`) and
`serve`'s options (`options.py`)."""
