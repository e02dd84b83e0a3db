#!/bin/sh
# Gemini CLI through adaptive-spec (Google's Gemini API, which the proxy translates for llama-server). It sends no
# session id: adaptive-spec groups its requests by the reply echo, and its model router's classifier, sent before each
# turn, joins the conversation as a side request. Any model name it asks for is served by the profile's model.
# Settings: merge examples/gemini-settings.json into ~/.gemini/settings.json, or point GEMINI_CLI_HOME at a folder
# whose .gemini/settings.json it is. In it: an API key, not a Google login (security.auth.selectedType); a compression
# threshold for a local window (model.compressionThreshold is a fraction of the 1,048,576 tokens Gemini CLI assumes
# for every gemini-* model: 0.02 is ~21k, two thirds of serve's 32,768-token slot); no subagents (a small local model
# calls them for anything, and each runs a conversation of its own).
# Usage: examples/gemini-cli.sh [gemini arguments], e.g. examples/gemini-cli.sh -p "Create hello.py that prints hello." --yolo
export GOOGLE_GEMINI_BASE_URL="${GOOGLE_GEMINI_BASE_URL:-http://127.0.0.1:8088/p/myproject}"  # no /v1beta: it adds it
export GEMINI_API_KEY="${GEMINI_API_KEY:-local}"  # any value; sent as x-goog-api-key, checked if serve asks for a key
exec gemini "$@"
