"""The user-facing surfaces, compared with a recorded copy (tests/data/surfaces.json): every command's options, the
proxy's routes, the APIs it tells apart (the record's `api`) with what each does, its Prometheus metric names, the
request record's and trace's fields, the live feed's event types with their fields, and the keys of each `/adaptive/*`
JSON view as a fresh proxy answers it. Moving modules
must leave them byte-identical; a deliberate change is recorded again with
`ADAPTIVE_SPEC_RECORD_SURFACES=1 pytest tests/unit/test_surfaces.py` and shows in review as a diff of that file."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from adaptive_spec.cli import main as cli_main
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.requests.apis import Api, traits
from adaptive_spec.sessions.ngram_replay import NgramParams
from adaptive_spec.sessions.service import SessionService
from adaptive_spec.sessions.statistics import ContextTracker
from adaptive_spec.telemetry import events, records
from adaptive_spec.telemetry.metrics import ProxyMetrics

RECORDED = Path(__file__).resolve().parents[1] / "data" / "surfaces.json"


def _options(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Each command's option strings and their defaults (help wording may improve; a flag or default may not
    change silently)."""
    out: dict[str, Any] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in sorted(action.choices.items()):
                out[name] = _options(sub)
        elif action.option_strings:
            default = action.default if isinstance(action.default, str | int | float | bool | type(None)) else "…"
            out[" ".join(action.option_strings)] = default
        else:
            out[f"<{action.dest}>"] = None
    return out


def _fields(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _keys(value: Any) -> Any:
    """A JSON value's shape by its keys: an object's keys with their values' shapes, a list's first item's."""
    if isinstance(value, dict):
        return {key: _keys(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return None


_VIEWS = ("/adaptive/health", "/adaptive/profiles", "/adaptive/requests", "/adaptive/route", "/adaptive/sessions")


async def _views() -> dict[str, Any]:
    """What a fresh proxy (one profile that answers nothing, sessions on, no request served yet) says at each JSON
    view."""
    sessions = SessionService(ContextTracker(NgramParams()), None)
    app = build_app(UpstreamTable([Upstream("oneshot", "http://127.0.0.1:9")]), ProxySettings(), sessions)
    async with TestClient(TestServer(app)) as client:
        out = {}
        for path in _VIEWS:
            async with client.get(path) as resp:
                out[path] = _keys(await resp.json())
        return out


def surfaces() -> dict[str, Any]:
    app = build_app(UpstreamTable([Upstream("oneshot", "http://127.0.0.1:9")]), ProxySettings())
    routes = sorted({f"{r.method} {r.resource.canonical}" for r in app.router.routes() if r.resource is not None})
    metric_names = sorted(
        {m.name for m in ProxyMetrics(frozenset({"oneshot"})).registry.collect()}  # the exposed families
    )
    feed = {
        name: _fields(cls)
        for name, cls in sorted(vars(events).items())
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and not name.startswith("_")
    }
    apis = {api.value: {k: v for k, v in dataclasses.asdict(traits(api)).items() if v} for api in Api}
    return {
        "cli": _options(cli_main._parser()),
        "routes": routes,
        "apis": apis,
        "metrics": metric_names,
        "record": _fields(records.RequestRecord),
        "timings": _fields(records.Timings),
        "events": feed,
        "views": asyncio.run(_views()),
    }


def test_the_user_facing_surfaces_are_as_recorded() -> None:
    now = json.dumps(surfaces(), indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    if os.environ.get("ADAPTIVE_SPEC_RECORD_SURFACES"):
        RECORDED.write_text(now, encoding="utf-8")
    assert RECORDED.read_text(encoding="utf-8") == now, (
        "a user-facing surface changed: if that is deliberate, record it again (see this module's docstring)"
    )
