#!/bin/sh
# Qwen Code through adaptive-spec (OpenAI chat/completions). It sends no session header: adaptive-spec groups its
# requests by the reply echo. Usage: examples/qwen-code.sh [qwen arguments], e.g. examples/qwen-code.sh --yolo "..."
export OPENAI_BASE_URL="${OPENAI_BASE_URL:-http://127.0.0.1:8088/p/myproject/v1}"
export OPENAI_API_KEY="${OPENAI_API_KEY:-local}"
export OPENAI_MODEL="${OPENAI_MODEL:-local}"
# On a CPU its 15-17k-token first turn prefills for minutes. Its stream guard gives up on a stream with no chunk for
# 240 s, and its request timeout on headers that take 120 s: adaptive-spec's keep-alives (serve --prefill-keepalive,
# 10 s: the headers, then a chunk with no choices every 10 s) reset both. Its cap on a stream's whole wait (900 s,
# chunks or not) nothing resets: raised here for a slow machine's first turn (examples/README.md, the timers).
export QWEN_STREAM_MAX_LIFETIME_MS="${QWEN_STREAM_MAX_LIFETIME_MS:-3600000}"
exec qwen "$@"
