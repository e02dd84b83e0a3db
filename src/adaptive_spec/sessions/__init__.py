"""Which agent session and project a request belongs to, and what its context is worth to an n-gram drafter."""
