"""Tool calls on the embedded model through the shipped chat template, on a REAL llama-server with the real 0.5B:
the template is the GGUF's own but for its tool-call shape, llama-server parses the model's fenced ```json calls
into schema-valid `tool_calls`, and what is not a call stays text."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from adaptive_spec.llama.models import embedded_chat_template
from tests.support.json_schema import schema_errors
from tests.support.processes.outside import agent_traffic, missing
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json

TEMPLATE = embedded_chat_template("embedded:qwen2.5-coder-0.5b")


def _tool(name: str, description: str, **properties: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {k: {"type": "string"} for k in properties}, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    _tool("read_file", "Read a file from disk", path=""),
    _tool("write_file", "Write a file to disk", path="", content=""),
]
SYSTEM = {"role": "system", "content": "You are a coding assistant. Use the tools to work on files."}
# What the shipped template changes in the GGUF's own, and nothing else (its first lines are a comment saying why).
CHANGES = [
    (
        'within a ```json fenced block:\\n```json\\n{\\"name\\": <function-name>, \\"arguments\\": '
        "<args-json-object>}\\n```<|im_end|>",
        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
        "<args-json-object>}\\n</tool_call><|im_end|>",
    ),
    ('\'\\n```json\\n{"name": "\'', '\'\\n<tool_call>\\n{"name": "\''),
    ("'}\\n```'", "'}\\n</tool_call>'"),
]


@pytest.fixture(scope="module")
def server(
    qwen_gguf: Path, llama_server_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    assert TEMPLATE is not None
    args = ("-c", "8192", "--parallel", "1", "--chat-template-file", TEMPLATE)
    server = LlamaServer(llama_server_binary, qwen_gguf, *args, log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def _chat(url: str, messages: list[Any], stream: bool, **extra: Any) -> tuple[str | None, str, list[tuple[str, str]]]:
    """(finish_reason, content, [(tool name, arguments)]) of one greedy request, streamed or not."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0, timeout=600)
    kwargs = {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": 200, **extra}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls or () if c.type == "function"
        ]
        return choice.finish_reason, choice.message.content or "", calls
    finish, text, parts = None, "", dict[int, tuple[str, str]]()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            text += c.delta.content or ""
            for delta in c.delta.tool_calls or ():
                name, args = parts.get(delta.index, ("", ""))
                function = delta.function
                parts[delta.index] = (
                    name + (function.name or "" if function else ""),
                    args + (function.arguments or "" if function else ""),
                )
    return finish, text, [parts[i] for i in sorted(parts)]


def _valid(calls: list[tuple[str, str]], tools: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The calls, each naming one of `tools` with arguments its schema accepts."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = []
    for name, arguments in calls:
        assert name in schemas, f"{name!r} is not one of the tools {sorted(schemas)}"
        args = json.loads(arguments)
        assert schema_errors(schemas[name], args) == [], (name, args)
        out.append((name, args))
    return out


def test_the_template_is_the_ggufs_own_but_for_the_tool_call_shape(qwen_gguf: Path) -> None:
    import gguf

    field = gguf.GGUFReader(str(qwen_gguf)).fields["tokenizer.chat_template"]
    own = bytes(field.parts[field.data[0]]).decode()
    assert TEMPLATE is not None
    shipped = Path(TEMPLATE).read_text()
    assert shipped.startswith("{#-")
    body = shipped.split("-#}\n", 1)[1]
    assert "<tool_call>" not in body
    for ours, theirs in CHANGES:
        assert body.count(ours) == 1, ours
        body = body.replace(ours, theirs)
    assert body == own


def test_the_server_runs_the_shipped_template(server: LlamaServer) -> None:
    props = http_json(server.url + "/props")
    assert props["chat_template_caps"]["supports_tool_calls"] is True
    assert props["chat_template"].strip() == Path(str(TEMPLATE)).read_text().strip()  # it drops the last newline


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_file_task_returns_schema_valid_tool_calls(server: LlamaServer, choice: str, stream: bool) -> None:
    """`auto`: the model picks the tool (all of them offered); `required` is asked with `write_file` alone, so the call
    must be that one, its arguments a file's content (which of several tools a 0.5B model picks when it must call one
    differs between CPUs: on one here it read the file it was asked to create)."""
    ask = "Show me what is in hello.py." if choice == "auto" else "Create hello.py that prints hello."
    tools = TOOLS if choice == "auto" else [t for t in TOOLS if t["function"]["name"] == "write_file"]
    finish, _text, calls = _chat(
        server.url, [SYSTEM, {"role": "user", "content": ask}], stream, tools=tools, tool_choice=choice
    )
    assert finish == "tool_calls"
    (name, args), *_ = _valid(calls, tools)
    assert name == ("read_file" if choice == "auto" else "write_file")
    assert args["path"].startswith("hello")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_plain_question_stays_text(server: LlamaServer, stream: bool) -> None:
    ask = {"role": "user", "content": "What does the acronym HTTP stand for?"}
    finish, text, calls = _chat(server.url, [SYSTEM, ask], stream, tools=TOOLS)
    assert (finish, calls) == ("stop", [])
    assert "Hypertext Transfer Protocol" in text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_python_block_is_not_a_tool_call(server: LlamaServer, stream: bool) -> None:
    ask = "How do I reverse a string in Python? Answer with a short python code block, do not use any tool."
    finish, text, calls = _chat(server.url, [{"role": "user", "content": ask}], stream, tools=TOOLS)
    assert (finish, calls) == ("stop", [])
    assert text.startswith("```python\n") and "[::-1]" in text
    # The reply's last "```" is kept. Stock b11434 holds it back as the possible start of a call's "```json" and never
    # gives it back, even once the reply is finished (patch 0004).
    assert text.rstrip().endswith("```"), text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_result_is_followed_by_the_next_call(server: LlamaServer, stream: bool) -> None:
    messages = [
        SYSTEM,
        {"role": "user", "content": "Add a docstring to greet() in hello.py."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "hello.py"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "def greet(name):\n    return f'hello {name}'\n"},
    ]
    finish, _text, calls = _chat(server.url, messages, stream, tools=TOOLS)
    assert finish == "tool_calls"
    (name, args), *_ = _valid(calls, TOOLS)
    assert (name, args["path"]) == ("write_file", "hello.py")


def _opencode_turn() -> dict[str, Any]:
    """opencode's first tool turn as recorded (its own system prompt and ten tools), read where it lies: the
    recordings are opencode's text and stay out of this repository."""
    for line in agent_traffic("opencode.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["truth"]["kind"] == "main" and record["body"].get("tools"):
            return dict(record)
    missing("no opencode tool turn in the recordings")


@pytest.mark.timeout(1200)  # ~7k tokens of system prompt and tools to prefill at -t 1
def test_an_opencode_request_through_the_proxy_returns_a_schema_valid_call(
    qwen_gguf: Path, llama_server_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    record = _opencode_turn()
    body = {**record["body"], "temperature": 0, "seed": 1, "max_tokens": 300}
    state = tmp_path_factory.mktemp("state")
    proxy = ProxyProcess("--threads", "1", "--ctx-size", "16384", env={"ADAPTIVE_SPEC_STATE_DIR": str(state)})
    try:
        session = {"x-session-id": record["headers"]["x-session-id"]}
        extra = {k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens", "temperature", "seed")}
        extra.pop("stream", None)
        extra.pop("stream_options", None)
        finish, _text, calls = _chat(proxy.base, body["messages"], True, extra_headers=session, **extra)
        assert finish == "tool_calls" and calls
        valid = _valid(calls, body["tools"])
        print(f"\nopencode's first tool turn through the proxy: {valid}")
        served = proxy.requests()[-1]
        assert served["outcome"] == "finished"
    finally:
        proxy.stop()


def _looping(times: int) -> list[Any]:
    """A history that ends with the same write made `times` times, each answered: the loop small models fall into."""
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "Create hello.py that prints hello."}]
    for i in range(times):
        call = {"name": "write_file", "arguments": '{"path": "hello.py", "content": "print(\'hello\')"}'}
        messages.append(
            {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "type": "function", "function": call}]}
        )
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "Wrote file successfully."})
    return messages


@pytest.fixture(scope="module")
def guarded_proxy(server: LlamaServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    state = tmp_path_factory.mktemp("guard-state")
    proxy = ProxyProcess("--profile", f"oneshot={server.url}", env={"ADAPTIVE_SPEC_STATE_DIR": str(state)})
    yield proxy
    proxy.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_third_identical_call_is_answered_in_text_on_the_cached_prefix(
    guarded_proxy: ProxyProcess, stream: bool
) -> None:
    session = {"x-session-id": f"loop-{stream}"}
    _chat(guarded_proxy.base, _looping(1), stream, tools=TOOLS, extra_headers=session)
    first = guarded_proxy.requests()[-1]
    finish, text, calls = _chat(guarded_proxy.base, _looping(3), stream, tools=TOOLS, extra_headers=session)
    assert (finish, calls) == ("stop", []), text
    assert text.strip()
    record = guarded_proxy.requests()[-1]
    assert record["repeat_guard"] == "write_file ×3 in a row, same arguments: note added, text answer asked"
    # tool_choice "none" keeps the tools in the prompt: the earlier turn's prefix is reused, not prefilled again.
    assert record["timings"]["cache_n"] >= first["timings"]["prompt_n"] + first["timings"]["cache_n"] - 8


def _anthropic_looping(times: int) -> dict[str, Any]:
    """`_looping` as an Anthropic /v1/messages body: each write a `tool_use` block, each result a `tool_result`."""
    messages: list[Any] = [{"role": "user", "content": "Create hello.py that prints hello."}]
    for i in range(times):
        use = {"type": "tool_use", "id": f"c{i}", "name": "write_file", "input": {"path": "hello.py", "content": "x"}}
        messages.append({"role": "assistant", "content": [use]})
        result = {"type": "tool_result", "tool_use_id": f"c{i}", "content": "Wrote file successfully."}
        messages.append({"role": "user", "content": [result]})
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    return {
        "model": "m",
        "max_tokens": 120,
        "temperature": 0,
        "system": SYSTEM["content"],
        "tools": tools,
        "messages": messages,
    }


def test_the_patched_server_answers_anthropic_tool_choice_none_in_text(server: LlamaServer) -> None:
    """Patch 0005: the same first turn that ends in a call under {"type": "auto"} is text under {"type": "none"}."""

    def ask(choice: str) -> dict[str, Any]:
        body = {**_anthropic_looping(0), "tool_choice": {"type": choice}}
        return dict(http_json(server.url + "/v1/messages", body, timeout=600))

    auto, none = ask("auto"), ask("none")
    assert "tool_use" in [b["type"] for b in auto["content"]], auto
    assert [b["type"] for b in none["content"]] == ["text"] and none["stop_reason"] == "end_turn", none


def test_a_third_identical_call_on_messages_is_answered_in_text(guarded_proxy: ProxyProcess) -> None:
    """Claude Code's loop: on /v1/messages the guard asks for {"type": "none"}, which the patched server honours."""
    url = guarded_proxy.base + "/v1/messages"
    session = {"x-session-id": "loop-messages"}
    request = urllib.request.Request(
        url, json.dumps(_anthropic_looping(3)).encode(), {"content-type": "application/json", **session}
    )
    with urllib.request.urlopen(request, timeout=600) as resp:
        reply = json.loads(resp.read())
    assert reply["stop_reason"] == "end_turn", reply
    assert [b["type"] for b in reply["content"]] == ["text"] and reply["content"][0]["text"].strip(), reply
    record = guarded_proxy.requests()[-1]
    assert record["repeat_guard"] == "write_file ×3 in a row, same arguments: note added, text answer asked"


def test_a_second_identical_call_gets_the_note_and_keeps_its_tools(guarded_proxy: ProxyProcess) -> None:
    _chat(guarded_proxy.base, _looping(2), False, tools=TOOLS, extra_headers={"x-session-id": "loop-note"})
    record = guarded_proxy.requests()[-1]
    assert record["outcome"] == "finished"
    assert record["repeat_guard"] == "write_file ×2 in a row, same arguments: note added"


def test_work_that_is_not_a_loop_is_sent_as_it_came(guarded_proxy: ProxyProcess) -> None:
    messages = [*_looping(1), {"role": "user", "content": "Now make it print hello world."}]
    _chat(guarded_proxy.base, messages, False, tools=TOOLS, extra_headers={"x-session-id": "no-loop"})
    assert guarded_proxy.requests()[-1]["repeat_guard"] is None


def test_codex_s_call_less_tool_output_is_answered_instead_of_refused(
    server: LlamaServer, guarded_proxy: ProxyProcess
) -> None:
    """Codex CLI 0.171 sends its goal feature's output without a call_id; llama-server refuses the whole turn."""
    body = {
        "model": "m",
        "max_output_tokens": 16,
        "temperature": 0,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Create hello.py."}]},
            {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "hello.py"},
        ],
    }
    with pytest.raises(urllib.error.HTTPError) as refused:
        http_json(server.url + "/v1/responses", body)
    assert refused.value.code == 400 and "Cannot determine type" in refused.value.read().decode()
    answer = http_json(guarded_proxy.base + "/v1/responses", body)
    assert answer["status"] == "completed"
    record = guarded_proxy.requests()[-1]
    assert record["status"] == 200
    assert record["repaired"] == "1 function_call_output without a call_id (goal_objective) sent as a user message"
