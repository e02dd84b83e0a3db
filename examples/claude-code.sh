#!/bin/sh
# Claude Code through adaptive-spec (its Anthropic /v1/messages path, which llama-server serves).
# Usage: examples/claude-code.sh [claude arguments], e.g. examples/claude-code.sh -p "Create hello.py that prints hello."
export ANTHROPIC_BASE_URL="${ANTHROPIC_BASE_URL:-http://127.0.0.1:8088/p/myproject}"
export ANTHROPIC_AUTH_TOKEN="${ANTHROPIC_AUTH_TOKEN:-local}"     # any value; adaptive-spec's --api-key if you set one
export ANTHROPIC_MODEL="${ANTHROPIC_MODEL:-local}"               # each profile serves one model: the name is a label
export ANTHROPIC_SMALL_FAST_MODEL="${ANTHROPIC_SMALL_FAST_MODEL:-$ANTHROPIC_MODEL}"
# Its system prompt's first block is a billing line whose cch= value can change per request: off, so the head of
# every request is the same and llama-server's cache (and adaptive-spec's head store) can reuse it.
export CLAUDE_CODE_ATTRIBUTION_HEADER=0
# No telemetry, update checks or other traffic that has nowhere to go on a local setup.
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
export DISABLE_AUTOUPDATER=1
exec claude "$@"
