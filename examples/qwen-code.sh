#!/bin/sh
# Qwen Code through adaptive-spec (OpenAI chat/completions). It sends no session header: adaptive-spec groups its
# requests by the reply echo. Usage: examples/qwen-code.sh [qwen arguments], e.g. examples/qwen-code.sh --yolo "..."
export OPENAI_BASE_URL="${OPENAI_BASE_URL:-http://127.0.0.1:8088/p/myproject/v1}"
export OPENAI_API_KEY="${OPENAI_API_KEY:-local}"
export OPENAI_MODEL="${OPENAI_MODEL:-local}"
# Its stream guard gives up on a stream with no chunk for this long (240 s in 0.24.4; the setting
# generationConfig.streamIdleTimeoutMs wins over this variable); on a CPU its ~15k-token first turn prefills for
# minutes. adaptive-spec sends keep-alive chunks meanwhile (serve --prefill-keepalive, 10 s), which reset that guard;
# raise it anyway if you turn them off.
export QWEN_STREAM_IDLE_TIMEOUT_MS="${QWEN_STREAM_IDLE_TIMEOUT_MS:-600000}"
# It also caps a stream's whole wait at 900 s, chunks or not, and gave up on its first request after 600 s and 860 s
# here, keep-alives flowing: a slow CPU's first turn (15-17k tokens) can take longer. Both raised:
export QWEN_STREAM_MAX_LIFETIME_MS="${QWEN_STREAM_MAX_LIFETIME_MS:-3600000}"
export QWEN_CODE_API_TIMEOUT_MS="${QWEN_CODE_API_TIMEOUT_MS:-3600000}"
exec qwen "$@"
