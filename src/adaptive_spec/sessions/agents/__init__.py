"""Which agent a request comes from, and the waits that agent gives up after."""
