"""`bench --simulate`: routing, a replica pool and remote prefill replayed at speeds measured elsewhere, with the
same decision code the proxy runs."""
