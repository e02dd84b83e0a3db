"""State that several `serve` processes share (`serve --shared-state redis://…`): sessions' reply echoes, placements
and slot bookings, read before routing and written after it."""
