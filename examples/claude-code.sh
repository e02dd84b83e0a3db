#!/bin/sh
# Claude Code through adaptive-spec (its Anthropic /v1/messages path, which llama-server serves).
# Usage: examples/claude-code.sh [claude arguments], e.g. examples/claude-code.sh -p "Create hello.py that prints hello."
export ANTHROPIC_BASE_URL="${ANTHROPIC_BASE_URL:-http://127.0.0.1:8088/p/myproject}"
export ANTHROPIC_AUTH_TOKEN="${ANTHROPIC_AUTH_TOKEN:-local}"     # any value; adaptive-spec's --api-key if you set one
export ANTHROPIC_MODEL="${ANTHROPIC_MODEL:-local}"               # each profile serves one model: the name is a label
export ANTHROPIC_SMALL_FAST_MODEL="${ANTHROPIC_SMALL_FAST_MODEL:-$ANTHROPIC_MODEL}"
# It does not know a local model's window and assumes 1M tokens, so it never compacts before llama-server's limit:
# name the context of one slot (serve --ctx-size / --parallel; 32768 by default).
export CLAUDE_CODE_MAX_CONTEXT_TOKENS="${CLAUDE_CODE_MAX_CONTEXT_TOKENS:-32768}"
# It keeps room in that window for its largest answer (32,000 tokens by default): with a 32k window and its ~12k-token
# first turn that room is gone, and it stops with "Prompt is too long" before compacting (measured with 2.1.328 on
# the 1.5B). A local model's answers are short: keep 8k for them.
export CLAUDE_CODE_MAX_OUTPUT_TOKENS="${CLAUDE_CODE_MAX_OUTPUT_TOKENS:-8192}"
# A first turn on a CPU prefills 12-18k tokens before its first event: minutes. Its stream watchdog gives up after
# 300 s (never less) without an event from its SDK, which drops the proxy's keep-alive `ping` events: nothing the
# proxy can send resets it, so it is raised (to 30 min: 2.1.332 clamps its byte watchdog, which takes the same
# value, there). Its request timeout (API_TIMEOUT_MS, 600 s, to the headers) and byte watchdog the keep-alives do
# reset (examples/README.md, the timers).
export CLAUDE_STREAM_IDLE_TIMEOUT_MS="${CLAUDE_STREAM_IDLE_TIMEOUT_MS:-1800000}"
# Its system prompt's first block is a billing line whose cch= value can change per request. llama-server and
# adaptive-spec both read it with that value normalised, so the cache holds either way; off, the line is not sent.
export CLAUDE_CODE_ATTRIBUTION_HEADER="${CLAUDE_CODE_ATTRIBUTION_HEADER:-0}"
# No telemetry, update checks or other traffic that has nowhere to go on a local setup.
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
export DISABLE_AUTOUPDATER=1
exec claude "$@"
