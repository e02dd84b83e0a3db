"""A Gemini request's `contents` (and `systemInstruction`) as chat messages: the user's parts as a user message
(text, images, audio), the model's as an assistant message (its text and function calls; thoughts and thought signatures
dropped, as they are not the prompt's), each `functionResponse` as a tool message.

Tool-call ids are stable across turns, so a history renders to the same prompt each turn (its cached prefix is reused):
a call's own `id` when the client sent one (Gemini CLI sends back the ids of the calls it was answered with), else one
derived from the call's place in the history and its name; a `functionResponse` without an id answers the oldest open
call of its name. Pure."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from adaptive_spec.requests.gemini.fields import Untranslatable, camel, field

_AUDIO = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/mp3": "mp3", "audio/mpeg": "mp3"}


def messages(obj: dict[str, Any], notes: list[str]) -> list[dict[str, Any]]:
    contents = field(obj, "contents")
    if contents is None or contents == []:
        raise Untranslatable(
            "'contents' is required: the conversation to answer.", "contents", "missing_required_parameter"
        )
    if not isinstance(contents, list):
        raise Untranslatable.wrong("contents", "an array of Content objects")
    messages: list[dict[str, Any]] = []
    system = _system_text(field(obj, "systemInstruction"))
    if system is not None:
        messages.append({"role": "system", "content": system})
    ids = _CallIds()
    for turn, content in enumerate(contents):
        where = f"contents[{turn}]"
        if not isinstance(content, dict):
            raise Untranslatable.wrong(where, "a Content object")
        parts = field(content, "parts") or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise Untranslatable.wrong(f"{where}.parts", "an array of Part objects")
        if content.get("role") == "model":
            message = _model_message(parts, turn, ids, notes)
            messages.extend([message] if message is not None else [])
        else:  # "user", "function" (older clients' function results), or none: the user's side
            messages.extend(_user_messages(parts, turn, ids, notes))
    return messages


def _system_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    parts = field(value, "parts") if isinstance(value, dict) else None
    if not isinstance(parts, list):
        raise Untranslatable.wrong("systemInstruction", "a Content object with 'parts'")
    return "\n".join(_text(p, f"systemInstruction.parts[{i}]") or "" for i, p in enumerate(parts))


def _text(part: Any, where: str) -> str | None:
    text = part.get("text") if isinstance(part, dict) else None
    if text is not None and not isinstance(text, str):
        raise Untranslatable.wrong(f"{where}.text", "a string")
    return text


def _model_message(parts: list[dict[str, Any]], turn: int, ids: _CallIds, notes: list[str]) -> dict[str, Any] | None:
    """The model's turn as an assistant message: its text (thoughts dropped: they are not the prompt's) and its
    function calls; None when it said nothing else."""
    ids.new_turn()
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        where = f"contents[{turn}].parts[{index}]"
        text = _text(part, where)
        call = field(part, "functionCall")
        if call is not None:
            calls.append(_tool_call(call, ids, turn, index, where))
        elif text is not None and part.get("thought") is not True:
            texts.append(text)
        elif text is None and part.get("thought") is not True and not _signature_only(part):
            notes.append(f"{where}: a {_kind(part)} part of the model's")
    if not texts and not calls:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _signature_only(part: dict[str, Any]) -> bool:
    return all(camel(key) in ("thoughtSignature", "thought") for key in part)


def _kind(part: dict[str, Any]) -> str:
    keys = [camel(k) for k in part if camel(k) not in ("thoughtSignature", "thought")]
    return keys[0] if keys else "empty"


def _tool_call(call: Any, ids: _CallIds, turn: int, index: int, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise Untranslatable.wrong(f"{where}.functionCall", "an object with a string 'name'")
    args = call.get("args")
    if args is not None and not isinstance(args, dict):
        raise Untranslatable.wrong(f"{where}.functionCall.args", "an object")
    call_id = ids.call(call, turn, index)
    arguments = orjson.dumps(args or {}).decode()
    return {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": arguments}}


def _user_messages(parts: list[dict[str, Any]], turn: int, ids: _CallIds, notes: list[str]) -> list[dict[str, Any]]:
    """The user's turn: a tool message per function response (first, as they answer the model's calls), then one
    user message with the rest."""
    tools: list[dict[str, Any]] = []
    pieces: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        where = f"contents[{turn}].parts[{index}]"
        result = field(part, "functionResponse")
        if result is not None:
            tools.append(_tool_message(result, ids, turn, index, where, notes))
            continue
        piece = _user_piece(part, where, notes)
        if piece is not None:
            pieces.append(piece)
    if not pieces:
        return tools
    if all(p["type"] == "text" for p in pieces):
        return [*tools, {"role": "user", "content": "\n".join(p["text"] for p in pieces)}]
    return [*tools, {"role": "user", "content": pieces}]


def _tool_message(result: Any, ids: _CallIds, turn: int, index: int, where: str, notes: list[str]) -> dict[str, Any]:
    if not isinstance(result, dict) or not isinstance(result.get("name"), str):
        raise Untranslatable.wrong(f"{where}.functionResponse", "an object with a string 'name'")
    if field(result, "parts"):
        notes.append(f"{where}.functionResponse.parts")
    return {"role": "tool", "tool_call_id": ids.response(result, turn, index), "content": _result_text(result)}


def _result_text(result: dict[str, Any]) -> str:
    """A function's result as the tool message's text: a lone `output` (Gemini CLI's), `result` or `content`
    string as it is; anything else as compact JSON."""
    response = result.get("response")
    if isinstance(response, str):
        return response
    if isinstance(response, dict) and len(response) == 1:
        key, value = next(iter(response.items()))
        if key in ("output", "result", "content") and isinstance(value, str):
            return value
    return orjson.dumps(response if response is not None else {}).decode()


def _user_piece(part: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any] | None:
    """One part of the user's turn as a chat content part (text, an image, audio); what a local model cannot read
    (a file by URI, a document) becomes a line of text saying so."""
    text = _text(part, where)
    if text is not None:
        return None if part.get("thought") is True else {"type": "text", "text": text}
    inline = field(part, "inlineData")
    if isinstance(inline, dict) and isinstance(inline.get("data"), str):
        mime = str(field(inline, "mimeType") or "")
        if mime.startswith("image/"):
            return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{inline['data']}"}}
        if mime in _AUDIO:
            return {"type": "input_audio", "input_audio": {"data": inline["data"], "format": _AUDIO[mime]}}
        notes.append(f"{where}.inlineData ({mime or 'no mimeType'})")
        return {"type": "text", "text": f"[an attachment of type {mime or 'unknown'} was left out]"}
    code = field(part, "executableCode")
    if isinstance(code, dict):
        language = str(code.get("language", "")).lower()
        return {"type": "text", "text": f"```{language}\n{code.get('code', '')}\n```"}
    outcome = field(part, "codeExecutionResult")
    if isinstance(outcome, dict):
        return {"type": "text", "text": str(outcome.get("output", ""))}
    if not _signature_only(part):
        notes.append(f"{where}: a {_kind(part)} part")
    return None


class _CallIds:
    """The ids of a history's function calls, handed out in its order, so the same history gets the same ids."""

    def __init__(self) -> None:
        self._open: list[tuple[str, str]] = []  # (id, name) of the last model turn's calls not answered yet

    def new_turn(self) -> None:
        self._open = []

    def call(self, call: dict[str, Any], turn: int, index: int) -> str:
        sent = call.get("id")
        call_id = sent if isinstance(sent, str) and sent else derived_call_id(turn, index, call["name"])
        self._open.append((call_id, call["name"]))
        return call_id

    def response(self, result: dict[str, Any], turn: int, index: int) -> str:
        sent = result.get("id")
        if isinstance(sent, str) and sent:
            self._open = [(i, n) for i, n in self._open if i != sent]
            return sent
        for k, (call_id, name) in enumerate(self._open):
            if name == result["name"]:
                del self._open[k]
                return call_id
        return derived_call_id(turn, index, result["name"])  # answers no call in view: an id of its own


def derived_call_id(turn: int, index: int, name: str) -> str:
    """A call's id from its place in the history and its name: nine letters and digits (the strictest chat
    templates, Mistral's, take no other shape)."""
    return hashlib.sha256(f"{turn}:{index}:{name}".encode()).hexdigest()[:9]
