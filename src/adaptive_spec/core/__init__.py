"""The pure core: parsing, records and decisions. No HTTP, no terminals, no processes."""
