"""A bounded, in-memory history of request records (the newest kept, the oldest dropped)."""

from __future__ import annotations

from collections import deque

from adaptive_spec.telemetry.records import RequestRecord


class RequestHistory:
    def __init__(self, max_records: int) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=max(1, max_records))
        self.total = 0
        self.own_total = 0  # of those, the proxy's own requests (a speed measurement, a probe)

    def add(self, record: RequestRecord) -> None:
        self._records.append(record)
        self.total += 1
        self.own_total += record.own is not None

    def replace(self, record: RequestRecord) -> None:
        """A record counted again (RequestCounted) takes the place of the one of the same request, if still kept."""
        for i in range(len(self._records) - 1, -1, -1):
            if self._records[i].request_id == record.request_id:
                self._records[i] = record
                return

    def latest(self, limit: int | None = None) -> list[RequestRecord]:
        """Oldest first, at most `limit` of the newest."""
        records = list(self._records)
        if limit is None or limit < 0:
            return records
        return records[-limit:] if limit else []
