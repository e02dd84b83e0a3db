"""Sending a request to llama-server and relaying its answer: the forward, the retry on a fresh connection, the
keep-alives while it prefills, the stranded-request bookings, and how the exchange ended."""
