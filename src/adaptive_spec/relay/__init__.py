"""The kv-relay (`adaptive-spec kv-relay`): a small HTTP service beside a llama-server, on another host than the proxy,
that streams its slot files to and from other hosts and prefills for others.

The proxy reaches it through `kv/relay_client.py`."""
