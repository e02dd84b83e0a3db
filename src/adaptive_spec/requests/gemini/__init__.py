"""Gemini's API in front of llama-server: a `generateContent` request translated into a chat completion for
llama-server and its answer translated back (`request.py`, `reply.py`, `schema.py`: pure), and the routes the proxy
answers itself, the model list and `countTokens` (`views.py`)."""
