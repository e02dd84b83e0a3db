#!/usr/bin/env sh
# aider through adaptive-spec: the openai/ prefix selects the OpenAI-compatible provider.
export OPENAI_API_BASE=http://127.0.0.1:8088/p/myproject/v1
export OPENAI_API_KEY=local
exec aider --model openai/local "$@"
