"""The APIs the proxy tells apart, and what each one does, in one table: a question about a request's API ("does it
generate?", "are its errors Anthropic's?") is a column here, not a set of names kept in the module that asks.

The names are the proxy's own words; a request's path decides its API once (`requests/body/parse.py`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Api(StrEnum):
    CHAT = "chat"  # /v1/chat/completions
    COMPLETIONS = "completions"  # /v1/completions
    COMPLETION = "completion"  # llama-server's own /completion
    RESPONSES = "responses"  # /v1/responses
    MESSAGES = "messages"  # Anthropic's /v1/messages
    COUNT_TOKENS = "count_tokens"  # Anthropic's /v1/messages/count_tokens
    MODELS = "models"
    GEMINI = "gemini"  # Gemini's /v1beta/models/{model}:generateContent and :streamGenerateContent
    GEMINI_COUNT_TOKENS = "gemini_count_tokens"  # Gemini's :countTokens, answered by the proxy
    GEMINI_MODELS = "gemini_models"  # Gemini's GET /v1beta/models and /v1beta/models/{model}, answered by the proxy
    OTHER = "other"  # any other llama-server path, passed through


@dataclass(frozen=True, slots=True)
class Traits:
    generates: bool = False  # a model answers: parsed, grouped into a session, routed, recorded, traced
    anthropic: bool = False  # its errors take Anthropic's shape
    # A patched llama-server reads `speculative.*` from its body: a profile's per-request settings go there (its
    # Anthropic and Responses conversions carry them on).
    speculation: bool = False
    # llama-server passes `id_slot` on from its body (its Anthropic and Responses conversions rebuild the body).
    takes_slot: bool = False
    # llama-server can annotate its stream with per-token timings (the live draft progress). Its Anthropic stream
    # carries no timings at all, asked or not (b11434): only usage at the end.
    progress: bool = False
    # llama-server takes `tool_choice` none (tools still rendered, so the prompt's cached prefix stays, but no call
    # is parsed). On /v1/messages ({"type": "none"}) only a patched server honours it (patch 0005): a stock one's
    # conversion drops it, and the repeat guard's note then comes alone.
    text_choice: bool = False
    checked_errors: bool = False  # an error body from llama-server is read and put in the API's shape
    google: bool = False  # its errors take Google's shape
    # Its body is translated into this API's for llama-server (Gemini's into a chat completion): the proxy's rules
    # for that API's bodies (repairs, the repeat guard) apply to what is sent, and the answer is translated back.
    translated_to: Api | None = None


_GENERATING = Traits(generates=True, speculation=True, checked_errors=True)
_CHAT = Traits(generates=True, speculation=True, takes_slot=True, progress=True, text_choice=True, checked_errors=True)

TRAITS: dict[Api, Traits] = {
    Api.CHAT: _CHAT,
    Api.COMPLETIONS: Traits(generates=True, speculation=True, takes_slot=True, progress=True, checked_errors=True),
    Api.COMPLETION: _GENERATING,
    Api.RESPONSES: Traits(generates=True, speculation=True, progress=True, text_choice=True, checked_errors=True),
    Api.MESSAGES: Traits(generates=True, speculation=True, anthropic=True, text_choice=True, checked_errors=True),
    Api.COUNT_TOKENS: Traits(anthropic=True, checked_errors=True),
    Api.MODELS: Traits(),
    # Sent to llama-server as a chat request: chat's traits, with Google's errors.
    Api.GEMINI: replace(_CHAT, google=True, translated_to=Api.CHAT),
    Api.GEMINI_COUNT_TOKENS: Traits(google=True),
    Api.GEMINI_MODELS: Traits(google=True),
    Api.OTHER: Traits(),
}


_NOTHING = Traits()


def traits(api: Api) -> Traits:
    """What `api` does; a name the proxy does not know does what `other` does (nothing of its own)."""
    return TRAITS.get(api, _NOTHING)


def sent_as(api: Api) -> Api:
    """The API whose body llama-server is sent for a request of `api`: its own, or the one it is translated to."""
    return TRAITS.get(api, _NOTHING).translated_to or api
