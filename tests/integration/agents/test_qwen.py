"""The embedded default as a user runs it: real Qwen2.5-Coder-0.5B behind `adaptive-spec serve`, two profiles."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.processes.servers import ProxyProcess, http_json, http_text
from tests.support.prompts import EDIT, SOURCE


@pytest.fixture(scope="module")
def embedded(
    qwen_gguf: Path, llama_server_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyProcess]:
    state = tmp_path_factory.mktemp("state")
    proxy = ProxyProcess("--threads", "1", "--ctx-size", "8192", env={"ADAPTIVE_SPEC_STATE_DIR": str(state)})
    yield proxy
    proxy.stop()


def _client(proxy: ProxyProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.base + "/v1", api_key="sk-none", max_retries=0, timeout=300)


def test_embedded_default_answers_correctly(embedded: ProxyProcess) -> None:
    reply = _client(embedded).chat.completions.create(
        model="anything",
        temperature=0,
        max_tokens=16,
        messages=[{"role": "user", "content": "What is 12 + 30? Reply with the number only."}],
    )
    assert "42" in (reply.choices[0].message.content or "")
    assert embedded.requests()[-1]["profile"] == "oneshot"


def _spec_counters(proxy: ProxyProcess) -> tuple[float, float]:
    values = {}
    for line in http_text_profile(proxy, "/metrics").splitlines():
        name, _, value = line.rpartition(" ")
        values[name] = value
    return (
        float(values["llamacpp:spec_decode_num_draft_tokens_total"]),
        float(values["llamacpp:spec_decode_num_accepted_tokens_total"]),
    )


def http_text_profile(proxy: ProxyProcess, path: str) -> str:
    import urllib.request

    req = urllib.request.Request(proxy.base + path, headers={"x-adaptive-spec-profile": "iterative"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return str(resp.read().decode())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_iterative_profile_drafts_on_a_copy_heavy_prompt(embedded: ProxyProcess, stream: bool) -> None:
    drafted_before, accepted_before = _spec_counters(embedded)
    client = _client(embedded)
    kwargs = {
        "model": "m",
        "temperature": 0,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": EDIT}],
        "extra_headers": {"x-adaptive-spec-profile": "iterative"},
    }
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))  # type: ignore[call-overload]
        reported = chunks[-1].model_extra["timings"]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        reported = reply.model_extra["timings"]
        text = reply.choices[0].message.content or ""
    assert "def cheapest_item" in text
    record = embedded.requests()[-1]
    assert record["profile"] == "iterative" and record["outcome"] == "finished"
    timings = record["timings"]
    assert timings["draft_n"] > 0 and timings["draft_n_accepted"] > 0
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (reported["draft_n"], reported["draft_n_accepted"])
    assert timings["predicted_n"] == reported["predicted_n"]
    drafted_after, accepted_after = _spec_counters(embedded)
    assert (drafted_after - drafted_before, accepted_after - accepted_before) == (
        timings["draft_n"],
        timings["draft_n_accepted"],
    )
    print(
        f"\ncopy-heavy edit on 'iterative': {timings['draft_n_accepted']}/{timings['draft_n']} drafts accepted, "
        f"{timings['draft_n_accepted'] / timings['predicted_n']:.0%} of {timings['predicted_n']} output tokens"
    )


def _pearson(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    vx = sum((x - mx) ** 2 for x in xs) ** 0.5
    vy = sum((y - my) ** 2 for y in ys) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0


SESSION_TURNS = [
    f"```python\n{SOURCE}\n```\n\nAdd a one-line docstring to `order_total`. Return the complete updated file.",
    "In two sentences, what does `load_items` expect the JSON file to contain?",
    "Rename `report` to `format_report`. Return the complete updated file.",
    "Write a separate function `is_prime(n: int) -> bool`. Only that function, nothing else.",
    "Change `cheapest` so it raises ValueError on an empty list. Return the complete updated file.",
    "List three test cases you would write for `Item.total_cents`, one line each.",
]


def test_counterfactual_estimate_tracks_measured_acceptance(embedded: ProxyProcess) -> None:
    client = _client(embedded)
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": "You are a careful Python assistant."}]
    estimated, measured = [], []
    for turn, prompt in enumerate(SESSION_TURNS, start=1):
        messages.append({"role": "user", "content": prompt})
        reply = client.chat.completions.create(
            model="m",
            temperature=0,
            max_tokens=300,
            messages=messages,
            extra_headers={"x-adaptive-spec-profile": "iterative", "x-session-id": "correlation"},
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        timings = embedded.requests()[-1]["timings"]
        measured.append(timings["draft_n_accepted"] / max(1, timings["predicted_n"]))
        report = http_json(embedded.base + "/adaptive/sessions?drain=1")
        session = next(s for s in report["sessions"] if s["session_id"] == "correlation")
        last = session["last_turns"][-1]
        assert last["turn"] == turn
        estimated.append(last["est_accepted_share"])
    r = _pearson(estimated, measured)
    rows = ", ".join(f"{e:.2f}/{m:.2f}" for e, m in zip(estimated, measured, strict=True))
    print(
        f"\nper-turn accepted share, estimated/measured: {rows}; Pearson r = {r:.3f} (tokenizer {report['tokenizer']})"
    )
    assert max(measured) > 0.3, "the copy-heavy turns should draft on the real server"
    assert r >= 0.5, f"estimate and measurement disagree: r = {r:.3f} ({rows})"


def test_gguf_tokenizer_matches_the_servers_tokenize(embedded: ProxyProcess, qwen_gguf: Path) -> None:
    import asyncio

    from adaptive_spec.sessions.tokenizers import llama_vocab_tokenizer

    tokenizer = llama_vocab_tokenizer(str(qwen_gguf))
    if tokenizer is None:
        pytest.fail("llama-cpp-python is not installed (it is in the test extra)")
    texts = [SOURCE, "naïve café 🙂 — «quotes»\n\tTabs", "x" * 40_000 + "\nend"]
    # What agents send: tool calls in Qwen's own tags, JSON, shell output, contractions, digits, CRLF, other scripts.
    # (Not a control token's text: the server's /tokenize parses it as the token, the statistics read it as text.)
    texts += [
        '<tool_call>\n{"name": "read", "arguments": {"path": "src/app.py"}}\n</tool_call> done',
        "$ ls -la\r\ntotal 48\r\ndrwxr-xr-x  2 me me 4096 Nov 30 12:00 .\r\n\r\n   It's 3.14159, isn't it? I'LL see",
        "日本語のテキスト、中文文本\uff0c한국어 텍스트 — ελληνικά, русский; emoji 👩‍💻🚀 and user text",
        "\n".join(f"    def method_{i}(self, x: int) -> int:\n        return x * {i}  # {i:08x}" for i in range(60)),
    ]
    ours = asyncio.run(tokenizer.encode(texts))
    # The Qwen vocabulary is run by tiktoken's BPE (its tokens and ranks, Qwen2's pre-tokenizer), ~10x faster than
    # llama.cpp's own: it must split every text as the server does.
    assert getattr(tokenizer, "engine", "") == "tiktoken"
    # Against llama.cpp's own over the whole of Unicode (every 61st code point, and letters Unicode 16 added, which
    # tiktoken's regex knows and llama.cpp's tables do not): each in a word, after a digit, before a contraction.
    from adaptive_spec.sessions.tokenizers import GgufTokenizer

    assert isinstance(tokenizer, GgufTokenizer)
    codes = [c for c in range(0, 0x110000, 61) if not 0xD800 <= c < 0xE000] + [0x1C89, 0x13460, 0x1CCF0, 0x16100]
    for k in range(0, len(codes), 40):
        text = "".join(f"x{chr(c)} {chr(c)}1{chr(c)}'s{chr(c)}\n" for c in codes[k : k + 40])
        assert tokenizer.encode_sync([text]) == [tokenizer.llama_encode(text)], [hex(c) for c in codes[k : k + 40]]
    for text, tokens in zip(texts, ours, strict=True):
        theirs = http_json(embedded.base + "/tokenize", {"content": text, "add_special": False})["tokens"]
        if len(text) <= 16_000:
            assert tokens == theirs
        else:  # long texts are tokenized in ~16 KB pieces cut at line ends: boundaries may shift by a token or two
            assert abs(len(tokens) - len(theirs)) <= 2
    assert "sessions: tokens from gguf:qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" in embedded.log()


def _proxy_counter(metrics: str, name: str, profile: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and f'profile="{profile}"' in line:
            total += float(line.rpartition(" ")[2])
    return total


def test_proxy_draft_counters_equal_llama_servers_own(embedded: ProxyProcess) -> None:
    """Every request this module sent to `iterative` went through the proxy, so the totals must agree."""
    _client(embedded).chat.completions.create(
        model="m",
        temperature=0,
        max_tokens=120,
        messages=[{"role": "user", "content": EDIT}],
        extra_headers={"x-adaptive-spec-profile": "iterative"},
    )
    drafted, accepted = _spec_counters(embedded)
    assert drafted > 0
    ours = http_text(embedded.base + "/metrics")
    assert _proxy_counter(ours, "adaptive_spec_draft_tokens_total", "iterative") == drafted
    assert _proxy_counter(ours, "adaptive_spec_draft_accepted_tokens_total", "iterative") == accepted
