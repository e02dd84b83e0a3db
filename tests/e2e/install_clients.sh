#!/usr/bin/env bash
# Install the coding agents the end-to-end tests drive, into a folder of their own (never the project's venv):
#   opencode, Codex CLI, Claude Code, Qwen Code, Gemini CLI, pi, Continue CLI and Cline CLI from npm into $DIR/npm
#   (with Continue's config schema, @continuedev/config-yaml, and a YAML reader for it), aider and llm into the venv
#   $DIR/venv. All but opencode and Codex are pinned to the versions measured (examples/README.md); Claude Code, Qwen
#   Code and Cline ask for Node 22 (npm warns on older ones; they ran on Node 20 here).
# Usage: tests/e2e/install_clients.sh [DIR]   (default: .e2e-clients in the repository root; git ignores it)
# Then: ADAPTIVE_SPEC_E2E=1 ADAPTIVE_SPEC_E2E_CLIENTS=DIR pytest tests/e2e
set -euo pipefail
DIR="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.e2e-clients}"
mkdir -p "$DIR/npm"
CLAUDE_CODE=@anthropic-ai/claude-code@2.1.328
QWEN_CODE=@qwen-code/qwen-code@0.24.4
GEMINI_CLI=@google/gemini-cli@0.61.0
PI=@mariozechner/pi-coding-agent@0.73.1
CONTINUE_CLI=@continuedev/cli@1.5.47
CLINE=cline@3.0.65
echo "npm: opencode-ai, @openai/codex, $CLAUDE_CODE, $QWEN_CODE, $GEMINI_CLI, $PI, $CONTINUE_CLI, $CLINE," \
  "@continuedev/config-yaml, yaml -> $DIR/npm"
npm install --prefix "$DIR/npm" --no-audit --no-fund opencode-ai @openai/codex "$CLAUDE_CODE" "$QWEN_CODE" \
  "$GEMINI_CLI" "$PI" "$CONTINUE_CLI" "$CLINE" @continuedev/config-yaml yaml || echo "npm install failed" >&2
echo "pip: aider-chat, llm -> $DIR/venv"
python3 -m venv "$DIR/venv"
"$DIR/venv/bin/pip" install --quiet --upgrade pip || true
"$DIR/venv/bin/pip" install --quiet aider-chat || echo "pip install aider-chat failed" >&2
"$DIR/venv/bin/pip" install --quiet llm || echo "pip install llm failed" >&2
echo "installed:"
ls "$DIR/npm/node_modules/.bin" 2>/dev/null | grep -E '^(opencode|codex|claude|qwen|gemini|pi|cn|cline)$' || true
ls "$DIR/venv/bin" | grep -E '^(aider|llm)$' || true
