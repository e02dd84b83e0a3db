"""The HTTP shell: an aiohttp server that forwards OpenAI/Anthropic requests to llama-server profiles."""
