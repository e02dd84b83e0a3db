"""One request through the proxy: the gate, the parse of its body, the route it takes, the forward, its errors, and how
it ends.
"""
