"""Remote prefill between two REAL llama-servers (tiny model) with separate slot directories, the "remote" reached
only through its kv-relay: the proxy chooses by the cost model, the restored slot is reused (`cache_n`), the greedy
text equals a local prefill's, no slot file is left on either side; a throttled link makes it prefill here; a relay
running another model is refused at start with both hashes named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.kv.slot_files import file_sha256
from adaptive_spec.relay.service import RATE_ENV
from tests.support.processes.relay import RelayProcess
from tests.support.processes.servers import LlamaServer, ProxyProcess, chat_record, http_json, http_text, wait_until

KEY = "pp-relay-key"
# A slow local box: its prefill prior is 20 tokens/s (it has not measured a long prompt yet), the remote's 5,000.
POLICY = "[estimator]\nprefill_tps = 20.0\n"
LONG = "Here is the log:\n" + "\n".join(f"line {i}: value={i * 7 % 13} status=ok" for i in range(140)) + "\nSum up."


class Rig:
    def __init__(self, binary: str, gguf: Path, home: Path, relay_env: dict[str, str] | None = None) -> None:
        self.home = home
        self.local_slots, self.remote_slots = home / "local-slots", home / "remote-slots"
        self.local_slots.mkdir(parents=True)
        self.remote_slots.mkdir()
        args = ("-c", "8192", "--parallel", "1", "--spec-type", "none")
        self.local = LlamaServer(binary, gguf, *args, "--slot-save-path", str(self.local_slots), log_dir=home / "logs")
        self.remote = LlamaServer(
            binary, gguf, *args, "--slot-save-path", str(self.remote_slots), log_dir=home / "logs"
        )
        self.relay = RelayProcess(self.remote_slots, gguf, KEY, server=self.remote.url, env=relay_env)
        (home / "relay.key").write_text(KEY + "\n")
        (home / "policy.toml").write_text(POLICY)
        self.proxy = ProxyProcess(
            "--profile",
            f"main={self.local.url}",
            "--slot-dir",
            str(self.local_slots),
            "--policy",
            str(home / "policy.toml"),
            "--pp-server",
            self.relay.base,
            "--pp-key-file",
            str(home / "relay.key"),
            "--pp-min-tokens",
            "500",
            "--pp-prefill-tps",
            "5000",
            env={"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")},
        )

    def stop(self) -> None:
        self.proxy.stop()
        self.relay.stop()
        self.remote.stop()
        self.local.stop()


@pytest.fixture(scope="module")
def rig(llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    rig = Rig(llama_server_binary, tiny_gguf, tmp_path_factory.mktemp("pp"))
    yield rig
    rig.stop()


def _direct(server: LlamaServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The same request straight to the local server, prefilling everything (no cache)."""
    body = {"messages": messages, "temperature": 0, "seed": 1, "max_tokens": 24, "cache_prompt": False}
    return dict(http_json(server.url + "/v1/chat/completions", body))


def test_a_long_prompt_is_prefilled_remotely_and_decoded_here(rig: Rig) -> None:
    messages = [{"role": "user", "content": LONG}]
    record = chat_record(rig.proxy, messages, 24, **{"x-session-id": "long"})
    pp = record["remote_prefill"]
    assert pp is not None and pp["ok"], (record["reason"], pp, rig.proxy.log()[-3000:])
    assert "remote prefill of" in record["reason"] and "saves" in record["reason"], record["reason"]
    prompt_tokens = record["timings"]["prompt_n"] + record["timings"]["cache_n"]
    assert prompt_tokens > 3000
    # The local server reused what the remote prefilled: only the last token is evaluated again.
    assert record["timings"]["cache_n"] >= pp["tokens"] - 2 and record["timings"]["prompt_n"] < 10, record["timings"]
    assert pp["bytes"] > 100 * pp["tokens"]
    assert list(rig.remote_slots.iterdir()) == []
    # The head store saves this session's head through the local slot directory after the answer, then moves it out.
    wait_until(lambda: list(rig.local_slots.iterdir()) == [], 60, "the local slot directory to be empty again")
    learned = http_json(rig.proxy.base + "/adaptive/route")["remote_prefill"]
    assert learned["counts"] == {"ok": 1, "failed": 0}
    assert learned["estimates"]["bytes_per_token"] == pytest.approx(pp["bytes"] / pp["tokens"], rel=0.05)
    direct = _direct(rig.local, messages)
    assert direct["timings"]["cache_n"] == 0
    assert record["text"] == direct["choices"][0]["message"]["content"]
    metrics = http_text(rig.proxy.base + "/metrics")  # fed by the RemotePrefillDone event on the bus
    assert "adaptive_spec_remote_prefill_done_total 1.0" in metrics
    assert "adaptive_spec_remote_prefill_chosen_total 1.0" in metrics
    assert "adaptive_spec_remote_prefill_transfer_bytes_count 1.0" in metrics
    assert KEY not in rig.proxy.log() and not any(KEY in line for line in rig.relay.lines)


def test_on_the_real_model_the_greedy_text_equals_a_local_prefills(
    llama_server_binary: str, qwen_gguf: Path, tmp_path: Path
) -> None:
    rig = Rig(llama_server_binary, qwen_gguf, tmp_path)
    try:
        messages = [{"role": "user", "content": LONG}]
        record = chat_record(rig.proxy, messages, 24, **{"x-session-id": "qwen"})
        assert record["remote_prefill"]["ok"], (record["reason"], record["remote_prefill"])
        assert record["timings"]["cache_n"] >= record["remote_prefill"]["tokens"] - 2 > 1500, record["timings"]
        assert record["text"] == _direct(rig.local, messages)["choices"][0]["message"]["content"]
        assert list(rig.remote_slots.iterdir()) == []
        wait_until(lambda: list(rig.local_slots.iterdir()) == [], 60, "the head store to move its head out")
    finally:
        rig.stop()


def test_a_short_prompt_is_prefilled_here(rig: Rig) -> None:
    record = chat_record(rig.proxy, [{"role": "user", "content": "hello there"}], 8, **{"x-session-id": "short"})
    assert record["remote_prefill"] is None and "remote" not in record["reason"]


def test_when_the_relay_is_gone_the_prompt_is_prefilled_here_with_the_same_text(rig: Rig) -> None:
    rig.relay.stop()  # the last test of this rig
    # A prompt no stored head shares a block with: a route asks one move, and a head it could restore comes first.
    messages = [{"role": "user", "content": "Once more. " + LONG}]
    record = chat_record(rig.proxy, messages, 24, **{"x-session-id": "unlucky"})
    assert record["status"] == 200 and record["remote_prefill"]["ok"] is False, record
    assert "remote prefill failed" in record["reason"] and "prefilled here" in record["reason"], record["reason"]
    assert record["text"] == _direct(rig.local, messages)["choices"][0]["message"]["content"]
    # Nothing left in the slot directory: the warm-start store's save of this first turn passes through it on its
    # way to the heads directory, so it is given a moment.
    wait_until(lambda: list(rig.local_slots.iterdir()) == [], 15, "an empty slot directory")
    assert 'adaptive_spec_remote_prefill_fallbacks_total{reason="unreachable"} 1.0' in http_text(
        rig.proxy.base + "/metrics"
    )


@pytest.fixture()
def slow_rig(llama_server_binary: str, tiny_gguf: Path, tmp_path: Path) -> Iterator[Rig]:
    rig = Rig(llama_server_binary, tiny_gguf, tmp_path, relay_env={RATE_ENV: "100000"})  # 100 kB/s
    yield rig
    rig.stop()


def test_over_a_slow_link_the_prompt_is_prefilled_here_and_the_reason_says_why(slow_rig: Rig) -> None:
    record = chat_record(slow_rig.proxy, [{"role": "user", "content": LONG}], 24, **{"x-session-id": "long"})
    assert record["remote_prefill"] is None
    assert "prefill here" in record["reason"] and "transfer" in record["reason"], record["reason"]
    assert record["timings"]["cache_n"] == 0
    routes = http_json(slow_rig.proxy.base + "/adaptive/requests")["requests"]
    assert len(routes) == 1


def test_a_relay_serving_another_model_is_refused_at_start(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_gguf.read_bytes() + b"\0")  # another file: another hash (the relay only hashes it)
    slots = tmp_path / "slots"
    slots.mkdir()
    (tmp_path / "relay.key").write_text(KEY)
    relay = RelayProcess(slots, other, KEY, server="http://127.0.0.1:9")
    server = LlamaServer(llama_server_binary, tiny_gguf, "-c", "2048", "--slot-save-path", str(slots), log_dir=tmp_path)
    try:
        with pytest.raises(AssertionError) as failed:
            ProxyProcess(
                "--profile",
                f"main={server.url}",
                "--slot-dir",
                str(slots),
                "--pp-server",
                relay.base,
                "--pp-key-file",
                str(tmp_path / "relay.key"),
                env={"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state")},
                ready_timeout=120,
            )
        message = str(failed.value)
        assert file_sha256(tiny_gguf) in message and file_sha256(other) in message, message
    finally:
        server.stop()
        relay.stop()
