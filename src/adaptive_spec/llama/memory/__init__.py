"""What a launch will hold, said before it is spent: weights, KV cache and recurrent state per server, read
from the GGUF's header."""
