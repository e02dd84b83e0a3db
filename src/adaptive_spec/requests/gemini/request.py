"""A Gemini `generateContent` request read as the chat completion llama-server is sent instead: which model and method
its path names, its `contents` as messages (`contents.py`), its tools, its generation settings, and what it asked for
that a local model cannot honour (said in the record, never refused).

Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.shapes import RequestProblem
from adaptive_spec.requests.gemini.contents import messages
from adaptive_spec.requests.gemini.fields import Untranslatable, camel, field
from adaptive_spec.requests.gemini.schema import lower_type_names, openapi_to_json_schema

# After any /p/<project> prefix: the version, then `models/<model>` and the method after a colon.
_METHOD_PATH = re.compile(r"^/v1beta/models/([^/:]+):(generateContent|streamGenerateContent|countTokens)$")
_MODELS_PATH = re.compile(r"^/v1beta/models(?:/([^/:]+))?/?$")
_METHOD_APIS = {
    "generateContent": Api.GEMINI,
    "streamGenerateContent": Api.GEMINI,
    "countTokens": Api.GEMINI_COUNT_TOKENS,
}
# generationConfig fields with a llama-server counterpart, as it names them.
_SAMPLING = {
    "temperature": ("temperature", (int, float)),
    "topP": ("top_p", (int, float)),
    "topK": ("top_k", (int,)),
    "maxOutputTokens": ("max_tokens", (int,)),
    "seed": ("seed", (int,)),
    "presencePenalty": ("presence_penalty", (int, float)),
    "frequencyPenalty": ("frequency_penalty", (int, float)),
}
_RESPONSE_FORMAT = ("responseMimeType", "responseSchema", "responseJsonSchema", "stopSequences", "candidateCount")
_TOP_LEVEL = frozenset({"contents", "systemInstruction", "tools", "toolConfig", "generationConfig", "model"})
_CHOICES = {"ANY": "required", "NONE": "none"}  # AUTO, VALIDATED, MODE_UNSPECIFIED: llama-server's own (auto)


@dataclass(frozen=True, slots=True)
class GeminiTarget:
    """What a Gemini path names: the model as the client spelled it, and the method after the colon."""

    model: str
    method: str

    @property
    def stream(self) -> bool:
        return self.method == "streamGenerateContent"


@dataclass(frozen=True, slots=True)
class GeminiCall:
    """A Gemini request as the proxy translated it: the model it asked for, whether it streams (`sse`: as
    Server-Sent Events, `alt=sse`; else as a JSON array), and the fields taken but not honoured."""

    model: str
    stream: bool = False
    sse: bool = False
    not_honoured: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Translated:
    """The chat completion body llama-server is sent for a Gemini request, and what the request was."""

    call: GeminiCall
    chat: dict[str, Any]


def gemini_api(path: str) -> Api | None:
    """The Gemini API a path (after any /p/<project> prefix) names, or None when it names none."""
    match = _METHOD_PATH.match(path)
    if match is not None:
        return _METHOD_APIS[match.group(2)]
    return Api.GEMINI_MODELS if _MODELS_PATH.match(path) else None


def gemini_target(path: str) -> GeminiTarget | None:
    """The model and method of a `models/<model>:<method>` path; the model alone (method "") of `models/<model>`."""
    match = _METHOD_PATH.match(path)
    if match is not None:
        return GeminiTarget(match.group(1), match.group(2))
    listed = _MODELS_PATH.match(path)
    return GeminiTarget(listed.group(1), "") if listed is not None and listed.group(1) else None


def to_chat(raw: bytes, target: GeminiTarget, *, sse: bool = False) -> Translated | RequestProblem:
    """A Gemini request body as a chat completion body (a `countTokens` body's `generateContentRequest` when it
    sends one); the problem that stops it otherwise, naming the Gemini field."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return RequestProblem(f"The request body is not valid JSON: {exc}", "invalid_json")
    if not isinstance(obj, dict):
        return RequestProblem("The request body must be a JSON object.", "invalid_type")
    inner = field(obj, "generateContentRequest")
    if target.method == "countTokens" and isinstance(inner, dict):
        obj = inner
    notes: list[str] = [key for key in obj if camel(key) not in _TOP_LEVEL]
    try:
        chat: dict[str, Any] = {"messages": messages(obj, notes)}
        _add_tools(chat, obj, notes)
        _add_generation(chat, field(obj, "generationConfig"), notes)
    except Untranslatable as bad:
        return bad.problem
    if target.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # the counts of usageMetadata, in the stream's last chunk
    return Translated(GeminiCall(target.model, target.stream, sse and target.stream, tuple(notes)), chat)


def _add_tools(chat: dict[str, Any], obj: dict[str, Any], notes: list[str]) -> None:
    tools = field(obj, "tools")
    if tools is None:
        return
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Untranslatable.wrong("tools", "an array of Tool objects")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        for key, value in tool.items():
            if camel(key) != "functionDeclarations":
                notes.append(f"tools[{i}].{key}")  # Google's own tools: search, code execution, URL context, ...
                continue
            if not isinstance(value, list):
                raise Untranslatable.wrong(f"tools[{i}].functionDeclarations", "an array")
            functions.extend(_function(d, f"tools[{i}].functionDeclarations[{j}]") for j, d in enumerate(value))
    choice, allowed = _tool_choice(field(obj, "toolConfig"))
    if allowed is not None:
        functions = [f for f in functions if f["function"]["name"] in allowed]
    if functions:
        chat["tools"] = functions
        if choice is not None:
            chat["tool_choice"] = choice


def _function(declaration: Any, where: str) -> dict[str, Any]:
    if not isinstance(declaration, dict) or not isinstance(declaration.get("name"), str):
        raise Untranslatable.wrong(where, "a FunctionDeclaration with a string 'name'")
    schema = lower_type_names(field(declaration, "parametersJsonSchema"))
    if schema is None:
        schema = openapi_to_json_schema(declaration.get("parameters"))
    function: dict[str, Any] = {"name": declaration["name"]}
    if isinstance(declaration.get("description"), str):
        function["description"] = declaration["description"]
    function["parameters"] = schema if isinstance(schema, dict) else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _tool_choice(config: Any) -> tuple[str | None, set[str] | None]:
    calling = field(config, "functionCallingConfig") if isinstance(config, dict) else None
    if not isinstance(calling, dict):
        return None, None
    mode = calling.get("mode")
    names = field(calling, "allowedFunctionNames")
    allowed = {n for n in names if isinstance(n, str)} if isinstance(names, list) else None
    return (_CHOICES.get(mode) if isinstance(mode, str) else None), allowed


def _add_generation(chat: dict[str, Any], config: Any, notes: list[str]) -> None:
    if config is None:
        return
    if not isinstance(config, dict):
        raise Untranslatable.wrong("generationConfig", "an object")
    for key, value in config.items():
        name = camel(key)
        if name in _SAMPLING and value is not None:
            sent_as, types = _SAMPLING[name]
            chat[sent_as] = _number(value, types, f"generationConfig.{name}")
        elif name not in _RESPONSE_FORMAT:
            notes.append(f"generationConfig.{key}")  # thinkingConfig, responseModalities, speechConfig, ...
    count = field(config, "candidateCount")
    if count is not None and count != 1:
        raise Untranslatable(
            f"generationConfig.candidateCount must be 1: llama-server answers with one candidate (asked for {count}).",
            "generationConfig.candidateCount",
            "invalid_value",
        )
    stops = field(config, "stopSequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise Untranslatable.wrong("generationConfig.stopSequences", "an array of strings")
        chat["stop"] = stops
    response_format = _response_format(config, notes)
    if response_format is not None:
        chat["response_format"] = response_format


def _number(value: Any, types: tuple[type, ...], where: str) -> int | float:
    if isinstance(value, float) and int in types and float not in types and value.is_integer():
        return int(value)  # an integer field sent as 40.0
    if isinstance(value, bool) or not isinstance(value, types):
        wanted = "an integer" if float not in types else "a number"
        raise Untranslatable.wrong(where, wanted)
    return value if isinstance(value, int | float) else 0


def _response_format(config: dict[str, Any], notes: list[str]) -> dict[str, Any] | None:
    """`responseMimeType: application/json` with its schema in either dialect, as llama-server's `response_format`."""
    mime = field(config, "responseMimeType")
    schema = lower_type_names(field(config, "responseJsonSchema"))
    if schema is None and field(config, "responseSchema") is not None:
        schema = openapi_to_json_schema(field(config, "responseSchema"))
    if mime not in (None, "text/plain", "application/json"):
        notes.append(f"generationConfig.responseMimeType ({mime})")
        return None
    if isinstance(schema, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    return {"type": "json_object"} if mime == "application/json" else None
