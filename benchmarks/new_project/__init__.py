"""A new project of a known agent: what it reuses of another project's head."""
