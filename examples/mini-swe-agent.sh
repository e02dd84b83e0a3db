#!/usr/bin/env sh
# mini-swe-agent (pip install mini-swe-agent) through adaptive-spec: litellm's openai/ provider, the base URL given as
# the model's api_base. Cost tracking off (a local model has no price), and its first-run setup skipped.
# Keeps the OPENAI_BASE_URL and OPENAI_API_KEY you already set; else the proxy's default address.
export OPENAI_API_KEY="${OPENAI_API_KEY:-local}"
export MSWEA_COST_TRACKING=ignore_errors MSWEA_CONFIGURED=true
exec mini -m openai/local -c mini.yaml -c "model.model_kwargs.api_base=${OPENAI_BASE_URL:-http://127.0.0.1:8088/p/myproject/v1}" "$@"
