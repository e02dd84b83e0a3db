"""Which profile, replica and slot serve a request: the cost model, the router's state and its policy files."""
