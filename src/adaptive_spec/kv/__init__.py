"""Moving KV caches between llama-servers: slot files, the movers (shared directory, kv-relay), remote prefill and its
cost model.
"""
