"""The proxy process: `serve` starts the servers and the application, and wires the features together; the control and
feed routes.
"""
