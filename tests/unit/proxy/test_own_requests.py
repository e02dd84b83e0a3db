"""The requests the proxy sends at start of its own accord are records of their own, marked as the proxy's, and
counted in its metrics as llama-server counts them."""

from __future__ import annotations

from adaptive_spec.llama.probe import ProbeRequest
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.requests.app_keys import HISTORY, METRICS


def test_a_start_up_probe_is_the_proxys_own_record_and_counts_in_its_metrics() -> None:
    answer = {"content": "!", "timings": {"prompt_n": 2, "cache_n": 0, "predicted_n": 1, "prompt_ms": 1.0}}
    probes = [
        ProbeRequest("ngram", 0, "/completion", answer, None, 1_800_000_000.0, 12.0),
        ProbeRequest("ngram", 1, "/completion", None, "HTTP 503", 1_800_000_000.0, 3.0),
    ]
    table = UpstreamTable(
        [Upstream("ngram", "http://127.0.0.1:9"), Upstream("ngram", "http://127.0.0.1:10", replica=1)]
    )
    app = build_app(table, ProxySettings(), probes=probes)
    done, failed = app[HISTORY].latest()
    assert (done.own, done.client, done.profile, done.status) == (
        "speculation types probe",
        "adaptive-spec",
        "ngram",
        200,
    )
    assert done.timings is not None and (done.timings.prompt_n, done.timings.predicted_n) == (2, 1)
    assert (failed.own, failed.replica, failed.outcome, failed.error) == (
        "speculation types probe",
        1,
        "failed",
        "HTTP 503",
    )
    exposed = {(sample.name, sample.value) for family in app[METRICS].registry.collect() for sample in family.samples}
    assert ("adaptive_spec_prompt_tokens_total", 2.0) in exposed and (
        "adaptive_spec_predicted_tokens_total",
        1.0,
    ) in exposed
