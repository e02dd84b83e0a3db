"""Sessions: which session and project a request belongs to (grouping by ids and the reply echo, the project key),
and what each session's context is worth to an n-gram drafter (the counterfactual drafter, per-session statistics).
Pure and synchronous; the proxy's sessions service (`proxy/session_service.py`) is its shell."""
