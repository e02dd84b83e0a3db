"""What the proxy tells about itself: event types, request records and history, the event bus, Prometheus metrics, the
JSONL trace.
"""
