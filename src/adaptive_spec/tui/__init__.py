"""`adaptive-spec tui`: a Textual view of a running proxy, fed only by its HTTP endpoints (the event feed, the request
history and the control endpoints), so it attaches to a live proxy or replays a recorded file alike.

It imports the core's event-feed parsing and nothing of the proxy, the launcher or serve."""
