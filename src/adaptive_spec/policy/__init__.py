"""Routing policy: the model of a policy (its tables and keys, pure) and the files it is read from."""
