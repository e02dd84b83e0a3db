"""Who may use the proxy and the relay: the access policy (API key, Host and Origin allow-lists, CORS), its
options, and reading a key from a flag, the environment or a file."""
