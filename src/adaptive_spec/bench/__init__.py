"""Offline tools, outside the request path: `adaptive-spec bench` (runner), `adaptive-spec report` (trace_report),
the per-profile table they print (table), the workload format and replay (workload, built-in `workloads/*.json`),
and the routing simulator at speeds measured elsewhere (simulator)."""
