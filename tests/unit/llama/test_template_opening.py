"""What a chat template writes ahead of a prompt without a system message, from llama-server's two renderings (the
server's side is tests/integration/estimates/test_first_turn_estimate.py)."""

from __future__ import annotations

from adaptive_spec.llama.template_opening import opening_tokens
from adaptive_spec.routing.prompt.pieces import lacks_system


def test_a_default_system_block_is_its_text_and_its_markers() -> None:
    # Qwen2.5's template on llama-server: 38 tokens bare, 22 after an empty system message (5 of them its block).
    assert opening_tokens(38, 22, 5.0) == 21.0


def test_a_template_that_writes_no_default_block_opens_with_nothing() -> None:
    # Gemma's folds a system message into the first user turn: the bare prompt is no longer than the other.
    assert opening_tokens(20, 21, 5.0) == 0.0
    assert opening_tokens(20, 20, 5.0) == 0.0


def test_only_a_chat_prompt_without_a_system_message_lacks_one() -> None:
    user = {"role": "user", "content": "hi"}
    assert lacks_system({"messages": [user]})
    assert not lacks_system({"messages": [{"role": "system", "content": "s"}, user]})
    assert not lacks_system({"messages": [{"role": "developer", "content": "s"}, user]})
    assert not lacks_system({"system": "s", "messages": [user]})  # Anthropic's
    assert not lacks_system({"instructions": "s", "input": [user]})  # Responses'
    assert lacks_system({"input": [user]})
    assert not lacks_system({"prompt": "plain text"})  # no template
    assert not lacks_system({"messages": []})
