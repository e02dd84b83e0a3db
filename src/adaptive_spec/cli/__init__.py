"""The command line: `adaptive-spec` and its subcommands; each feature declares its own options beside it."""
