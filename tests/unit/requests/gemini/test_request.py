"""A Gemini request as the chat completion llama-server is sent: paths, contents, tools in both schema dialects, tool
calls with ids stable across turns, generation settings, the fields taken but not honoured, and the problems that stop
a request (each naming its Gemini field). Synthetic bodies only."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.shapes import RequestProblem
from adaptive_spec.requests.gemini.contents import derived_call_id
from adaptive_spec.requests.gemini.request import GeminiTarget, Translated, gemini_api, gemini_target, to_chat

GENERATE = GeminiTarget("gemini-3.1-pro-preview", "generateContent")
STREAM = GeminiTarget("gemini-3.1-pro-preview", "streamGenerateContent")


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "parts": [{"text": text}]}


def _chat(body: dict[str, Any], target: GeminiTarget = GENERATE, *, sse: bool = False) -> Translated:
    out = to_chat(orjson.dumps(body), target, sse=sse)
    assert isinstance(out, Translated), out
    return out


def _problem(body: Any) -> RequestProblem:
    out = to_chat(body if isinstance(body, bytes) else orjson.dumps(body), GENERATE)
    assert isinstance(out, RequestProblem), out
    return out


@pytest.mark.parametrize(
    ("path", "api", "target"),
    [
        (
            "/v1beta/models/gemini-3.5-flash-lite:generateContent",
            Api.GEMINI,
            ("gemini-3.5-flash-lite", "generateContent"),
        ),
        (
            "/v1beta/models/gemini-3.1-pro-preview:streamGenerateContent",
            Api.GEMINI,
            ("gemini-3.1-pro-preview", "streamGenerateContent"),
        ),
        ("/v1beta/models/m:countTokens", Api.GEMINI_COUNT_TOKENS, ("m", "countTokens")),
        ("/v1beta/models", Api.GEMINI_MODELS, None),
        ("/v1beta/models/gemini-2.5-pro", Api.GEMINI_MODELS, ("gemini-2.5-pro", "")),
        ("/v1beta/models/m:embedContent", None, None),
        ("/v1/models", None, None),
        ("/v1beta/models/a/b:generateContent", None, None),
    ],
)
def test_a_gemini_path_names_its_api_model_and_method(
    path: str, api: Api | None, target: tuple[str, str] | None
) -> None:
    assert gemini_api(path) is api
    found = gemini_target(path)
    assert (None if found is None else (found.model, found.method)) == target


def test_a_plain_turn_becomes_a_user_message_with_the_system_instruction_first() -> None:
    out = _chat(
        {"systemInstruction": {"parts": [{"text": "Be brief."}, {"text": "Use tools."}]}, "contents": [_user("hi")]}
    )
    assert out.chat == {
        "messages": [{"role": "system", "content": "Be brief.\nUse tools."}, {"role": "user", "content": "hi"}]
    }
    assert out.call.model == "gemini-3.1-pro-preview" and not out.call.stream and out.call.not_honoured == ()


def test_a_system_instruction_may_be_a_plain_string_and_fields_may_be_snake_case() -> None:
    out = _chat({"system_instruction": "S", "contents": [_user("hi")], "generation_config": {"max_output_tokens": 7}})
    assert out.chat["messages"][0] == {"role": "system", "content": "S"}
    assert out.chat["max_tokens"] == 7


def test_the_models_turns_drop_thoughts_and_thought_signatures() -> None:
    contents = [
        _user("hi"),
        {
            "role": "model",
            "parts": [
                {"text": "let me think", "thought": True},
                {"text": "Hel", "thoughtSignature": "c2ln"},
                {"text": "lo"},
            ],
        },
        {"role": "model", "parts": [{"text": "only thinking", "thought": True}, {"thoughtSignature": "c2ln"}]},
        _user("again"),
    ]
    out = _chat({"contents": contents})
    assert out.chat["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again"},
    ]
    assert out.call.not_honoured == ()


def test_streaming_asks_for_usage_and_remembers_which_stream_shape() -> None:
    out = _chat({"contents": [_user("hi")]}, STREAM, sse=True)
    assert out.chat["stream"] is True and out.chat["stream_options"] == {"include_usage": True}
    assert out.call.stream and out.call.sse
    assert not _chat({"contents": [_user("hi")]}, STREAM).call.sse  # no alt=sse: a JSON array
    assert not _chat({"contents": [_user("hi")]}, GENERATE, sse=True).call.sse  # not a stream at all


READ_FILE_JSON_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
READ_FILE_OPENAPI = {
    "type": "OBJECT",
    "properties": {"path": {"type": "STRING", "nullable": True}},
    "required": ["path"],
}


@pytest.mark.parametrize(
    ("declaration", "parameters"),
    [
        ({"name": "read_file", "parametersJsonSchema": READ_FILE_JSON_SCHEMA}, READ_FILE_JSON_SCHEMA),
        (
            {"name": "read_file", "parameters": READ_FILE_OPENAPI},
            {"type": "object", "properties": {"path": {"type": ["string", "null"]}}, "required": ["path"]},
        ),
        ({"name": "read_file"}, {"type": "object", "properties": {}}),
    ],
)
def test_function_declarations_become_tools_in_either_schema_dialect(
    declaration: dict[str, Any], parameters: dict[str, Any]
) -> None:
    body = {"contents": [_user("hi")], "tools": [{"functionDeclarations": [{**declaration, "description": "Read."}]}]}
    tools = _chat(body).chat["tools"]
    assert tools == [
        {"type": "function", "function": {"name": "read_file", "description": "Read.", "parameters": parameters}}
    ]


def _two_tools(config: dict[str, Any]) -> dict[str, Any]:
    declarations = [{"name": "a"}, {"name": "b"}]
    return {"contents": [_user("hi")], "tools": [{"functionDeclarations": declarations}], "toolConfig": config}


@pytest.mark.parametrize(
    ("config", "choice", "names"),
    [
        ({"functionCallingConfig": {"mode": "AUTO"}}, None, ["a", "b"]),
        ({"functionCallingConfig": {"mode": "ANY"}}, "required", ["a", "b"]),
        ({"functionCallingConfig": {"mode": "NONE"}}, "none", ["a", "b"]),
        ({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["b"]}}, "required", ["b"]),
    ],
)
def test_the_tool_config_becomes_a_tool_choice(config: dict[str, Any], choice: str | None, names: list[str]) -> None:
    chat = _chat(_two_tools(config)).chat
    assert chat.get("tool_choice") == choice
    assert [t["function"]["name"] for t in chat["tools"]] == names


def _call(name: str, args: dict[str, Any], call_id: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"name": name, "args": args}
    return {"functionCall": {**call, "id": call_id} if call_id else call}


def _result(name: str, output: Any, call_id: str | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"name": name, "response": output}
    return {"functionResponse": {**result, "id": call_id} if call_id else result}


def _history(with_ids: bool) -> list[dict[str, Any]]:
    first = "c-1" if with_ids else None
    return [
        _user("read a.py and b.py"),
        {
            "role": "model",
            "parts": [
                {"text": "Reading."},
                _call("read_file", {"path": "a.py"}, first),
                _call("read_file", {"path": "b.py"}),
            ],
        },
        {
            "role": "user",
            "parts": [_result("read_file", {"output": "A"}, first), _result("read_file", {"error": "missing"})],
        },
    ]


def test_function_calls_and_results_keep_their_ids_or_get_ones_derived_from_their_place() -> None:
    messages = _chat({"contents": _history(with_ids=True)}).chat["messages"]
    derived = derived_call_id(1, 2, "read_file")
    assert messages[1] == {
        "role": "assistant",
        "content": "Reading.",
        "tool_calls": [
            {"id": "c-1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.py"}'}},
            {"id": derived, "type": "function", "function": {"name": "read_file", "arguments": '{"path":"b.py"}'}},
        ],
    }
    # A lone `output` string goes as it is; any other result as compact JSON; a result without an id answers the
    # oldest open call of its name.
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "c-1", "content": "A"},
        {"role": "tool", "tool_call_id": derived, "content": '{"error":"missing"}'},
    ]
    assert len(derived) == 9 and derived.isalnum()


def test_the_same_history_renders_the_same_messages_on_every_turn() -> None:
    history = _history(with_ids=False)
    first = _chat({"contents": history}).chat["messages"]
    later = [*history, {"role": "model", "parts": [{"text": "Done."}]}, _user("thanks")]
    again = _chat({"contents": later}).chat["messages"]
    assert again[: len(first)] == first
    assert first[1]["tool_calls"][0]["id"] != first[1]["tool_calls"][1]["id"]
    assert [m.get("tool_call_id") for m in first[2:]] == [c["id"] for c in first[1]["tool_calls"]]


def test_a_call_without_text_has_no_content_and_a_result_for_no_open_call_gets_an_id_of_its_own() -> None:
    contents = [
        _user("go"),
        {"role": "model", "parts": [_call("ls", {})]},
        {
            "role": "user",
            "parts": [_result("ls", {"output": "x"}), _result("other", {"output": "y"}), {"text": "go on"}],
        },
    ]
    messages = _chat({"contents": contents}).chat["messages"]
    assert messages[1]["content"] is None
    assert messages[2]["tool_call_id"] == messages[1]["tool_calls"][0]["id"]
    assert messages[3]["tool_call_id"] == derived_call_id(2, 1, "other")
    assert messages[4] == {"role": "user", "content": "go on"}


def test_generation_config_becomes_llama_servers_sampling_fields() -> None:
    config = {
        "temperature": 0,
        "topP": 0.9,
        "topK": 40.0,
        "maxOutputTokens": 64,
        "stopSequences": ["END"],
        "seed": 3,
        "candidateCount": 1,
        "presencePenalty": 0.5,
    }
    chat = _chat({"contents": [_user("hi")], "generationConfig": config}).chat
    expected = {"temperature": 0, "top_p": 0.9, "top_k": 40, "max_tokens": 64, "stop": ["END"], "seed": 3}
    assert {k: chat[k] for k in expected} == expected
    assert chat["presence_penalty"] == 0.5 and isinstance(chat["top_k"], int)


SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string"}, "model_choice": {"type": "string"}}}


@pytest.mark.parametrize(
    ("config", "response_format"),
    [
        (
            {"responseMimeType": "application/json", "responseJsonSchema": SCHEMA},
            {"type": "json_schema", "json_schema": {"name": "response", "schema": SCHEMA}},
        ),
        (
            {
                "responseMimeType": "application/json",
                "responseSchema": {"type": "OBJECT", "properties": {"a": {"type": "STRING"}}},
            },
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "response",
                    "schema": {"type": "object", "properties": {"a": {"type": "string"}}},
                },
            },
        ),
        ({"responseMimeType": "application/json"}, {"type": "json_object"}),
        ({"responseMimeType": "text/plain"}, None),
    ],
)
def test_a_json_response_with_its_schema_becomes_a_response_format(
    config: dict[str, Any], response_format: dict[str, Any] | None
) -> None:
    chat = _chat({"contents": [_user("route me")], "generationConfig": config}).chat
    assert chat.get("response_format") == response_format


def test_hosted_only_fields_are_taken_and_named_not_refused() -> None:
    body = {
        "contents": [_user("hi")],
        "generationConfig": {"temperature": 1, "thinkingConfig": {"includeThoughts": True, "thinkingBudget": -1}},
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        "tools": [{"googleSearch": {}}, {"functionDeclarations": [{"name": "f"}]}],
        "cachedContent": "cachedContents/x",
    }
    out = _chat(body)
    assert out.call.not_honoured == (
        "safetySettings",
        "cachedContent",
        "tools[0].googleSearch",
        "generationConfig.thinkingConfig",
    )
    assert [t["function"]["name"] for t in out.chat["tools"]] == ["f"]


def test_a_user_turn_with_an_image_keeps_typed_parts_and_a_document_becomes_a_line_of_text() -> None:
    parts = [
        {"text": "what is this?"},
        {"inlineData": {"mimeType": "image/png", "data": "iVBORw0"}},
        {"inlineData": {"mimeType": "application/pdf", "data": "JVBERi0"}},
    ]
    out = _chat({"contents": [{"role": "user", "parts": parts}]})
    assert out.chat["messages"][0]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0"}},
        {"type": "text", "text": "[an attachment of type application/pdf was left out]"},
    ]
    assert out.call.not_honoured == ("contents[0].parts[2].inlineData (application/pdf)",)


def test_a_count_tokens_body_may_wrap_its_request() -> None:
    inner = {"model": "models/gemini-2.5-pro", "contents": [_user("count me")], "systemInstruction": "S"}
    out = to_chat(orjson.dumps({"generateContentRequest": inner}), GeminiTarget("m", "countTokens"))
    assert isinstance(out, Translated)
    assert out.chat["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "count me"}]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        ([], None, "invalid_type"),
        ({}, "contents", "missing_required_parameter"),
        ({"contents": []}, "contents", "missing_required_parameter"),
        ({"contents": "hi"}, "contents", "invalid_type"),
        ({"contents": ["hi"]}, "contents[0]", "invalid_type"),
        ({"contents": [{"parts": "hi"}]}, "contents[0].parts", "invalid_type"),
        ({"contents": [{"parts": [{"text": 3}]}]}, "contents[0].parts[0].text", "invalid_type"),
        (
            {"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": []}}]}]},
            "contents[0].parts[0].functionCall.args",
            "invalid_type",
        ),
        (
            {"contents": [{"parts": [{"functionResponse": {"response": {}}}]}]},
            "contents[0].parts[0].functionResponse",
            "invalid_type",
        ),
        ({"contents": [_user("hi")], "tools": {}}, "tools", "invalid_type"),
        (
            {"contents": [_user("hi")], "tools": [{"functionDeclarations": [{"description": "no name"}]}]},
            "tools[0].functionDeclarations[0]",
            "invalid_type",
        ),
        (
            {"contents": [_user("hi")], "generationConfig": {"temperature": "hot"}},
            "generationConfig.temperature",
            "invalid_type",
        ),
        (
            {"contents": [_user("hi")], "generationConfig": {"maxOutputTokens": 1.5}},
            "generationConfig.maxOutputTokens",
            "invalid_type",
        ),
        (
            {"contents": [_user("hi")], "generationConfig": {"stopSequences": "END"}},
            "generationConfig.stopSequences",
            "invalid_type",
        ),
        (
            {"contents": [_user("hi")], "generationConfig": {"candidateCount": 2}},
            "generationConfig.candidateCount",
            "invalid_value",
        ),
    ],
)
def test_what_cannot_be_translated_is_a_problem_naming_its_field(body: Any, param: str | None, code: str) -> None:
    problem = _problem(body)
    assert (problem.param, problem.code) == (param, code)


def test_a_second_candidate_is_refused_in_words_that_say_why() -> None:
    problem = _problem({"contents": [_user("hi")], "generationConfig": {"candidateCount": 2}})
    assert problem.message == (
        "generationConfig.candidateCount must be 1: llama-server answers with one candidate (asked for 2)."
    )
