"""The table of APIs: what the proxy does with each, looked up by the name a request's path decided."""

from __future__ import annotations

import pytest

from adaptive_spec.requests.apis import TRAITS, Api, sent_as, traits
from adaptive_spec.requests.body.parse import split_path


@pytest.mark.parametrize(
    ("path", "api"),
    [
        ("/v1/chat/completions", Api.CHAT),
        ("/p/web/v1/messages", Api.MESSAGES),
        ("/v1/messages/count_tokens", Api.COUNT_TOKENS),
        ("/completion", Api.COMPLETION),
        ("/tokenize", Api.OTHER),
        ("/p/gem/v1beta/models/gemini-3.5-flash-lite:generateContent", Api.GEMINI),
        ("/v1beta/models/gemini-3.1-pro-preview:streamGenerateContent", Api.GEMINI),
        ("/v1beta/models/gemini-3.1-pro-preview:countTokens", Api.GEMINI_COUNT_TOKENS),
        ("/p/gem/v1beta/models", Api.GEMINI_MODELS),
    ],
)
def test_a_path_decides_its_api_once(path: str, api: Api) -> None:
    assert split_path(path).api is api


def test_every_api_has_a_row_and_a_passed_through_path_does_nothing() -> None:
    assert set(TRAITS) == set(Api)
    assert split_path("/v1/embeddings").api is Api.OTHER  # a path the proxy does not know is passed through
    assert traits(Api.OTHER) == traits(Api.MODELS)
    row = traits(Api.OTHER)
    assert not any(getattr(row, name) for name in row.__slots__)


def test_the_columns_say_what_llama_server_does_with_each_api() -> None:
    generating = {a for a in Api if traits(a).generates}
    assert generating == {Api.CHAT, Api.COMPLETIONS, Api.COMPLETION, Api.RESPONSES, Api.MESSAGES, Api.GEMINI}
    assert {a for a in Api if traits(a).anthropic} == {Api.MESSAGES, Api.COUNT_TOKENS}
    assert {a for a in Api if traits(a).google} == {Api.GEMINI, Api.GEMINI_COUNT_TOKENS, Api.GEMINI_MODELS}
    # id_slot survives only where llama-server does not rebuild the body (its Anthropic and Responses conversions do);
    # a Gemini body reaches llama-server as a chat completion, which keeps it
    assert {a for a in Api if traits(a).takes_slot} == {Api.CHAT, Api.COMPLETIONS, Api.GEMINI}
    # the Anthropic stream carries no timings at all: no live draft progress there
    assert {a for a in Api if traits(a).progress} == {Api.CHAT, Api.COMPLETIONS, Api.RESPONSES, Api.GEMINI}
    # tool_choice none: on /v1/messages a patched server maps {"type": "none"} (0005); a stock one ignores it
    assert {a for a in Api if traits(a).text_choice} == {Api.CHAT, Api.RESPONSES, Api.MESSAGES, Api.GEMINI}
    assert {a for a in Api if traits(a).speculation} == generating
    # What the proxy does to a Gemini body it does to a chat body: it is one by the time it is sent.
    assert {a: sent_as(a) for a in Api if sent_as(a) != a} == {Api.GEMINI: Api.CHAT}
