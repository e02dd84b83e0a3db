"""Moving slot files between hosts: `adaptive-spec kv-relay`, the service run beside a remote llama-server, and the
client the proxy uses to reach it (remote prefill, `serve --pp-server`)."""
