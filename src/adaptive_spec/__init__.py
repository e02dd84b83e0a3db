"""adaptive-spec: route each request to the llama-server speculation profile that decodes it fastest."""

__version__ = "0.1.0"
