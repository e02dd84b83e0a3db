#!/usr/bin/env sh
# aider through adaptive-spec: the openai/ prefix selects the OpenAI-compatible provider.
# Keeps the OPENAI_API_BASE / OPENAI_BASE_URL and OPENAI_API_KEY you already set; else the proxy's default address.
export OPENAI_API_BASE="${OPENAI_API_BASE:-${OPENAI_BASE_URL:-http://127.0.0.1:8088/p/myproject/v1}}"
export OPENAI_API_KEY="${OPENAI_API_KEY:-local}"
exec aider --model openai/local "$@"
