#!/usr/bin/env sh
# gptme (pip install gptme) through adaptive-spec: its "local" provider, an OpenAI-compatible server named by
# OPENAI_BASE_URL; the model name after "local/" is any (each profile serves one model).
# Keeps the OPENAI_BASE_URL and OPENAI_API_KEY you already set; else the proxy's default address. Its OpenAI SDK
# waits 600 s between bytes (LLM_API_TIMEOUT): the proxy's keep-alive chunks reset that wait during a long prefill.
export OPENAI_BASE_URL="${OPENAI_BASE_URL:-http://127.0.0.1:8088/p/myproject/v1}"
export OPENAI_API_KEY="${OPENAI_API_KEY:-local}"
exec gptme -m local/local "$@"
