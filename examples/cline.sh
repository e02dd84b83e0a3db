#!/bin/sh
# Cline CLI through adaptive-spec (OpenAI chat/completions, its openai-compatible provider). It sends no session id:
# adaptive-spec groups its requests by the reply echo.
# Usage: examples/cline.sh "Create hello.py that prints hello."   (a task, run headless in the current folder)
# CLINE_DATA_DIR: the provider settings and task history (default ~/.cline/data, as Cline's own).
BASE="${OPENAI_BASE_URL:-http://127.0.0.1:8088/p/myproject/v1}"
DATA="${CLINE_DATA_DIR:-$HOME/.cline/data}"
cline auth openai -k "${OPENAI_API_KEY:-local}" -m "${OPENAI_MODEL:-local}" -b "$BASE" --data-dir "$DATA" >/dev/null || exit
# -t: the task's own limit in seconds (0: none); a CPU's first turn (~5k tokens) prefills for a minute or more.
exec cline "$@" --data-dir "$DATA" -c "$PWD" -t "${CLINE_TIMEOUT_S:-0}"
