"""Screenshots of the real TUI beside a real edit session, for the README (and a recorded feed for the tests).

Starts nothing itself: point it at a running `adaptive-spec serve --feed-content` and it runs
examples/whole_file_edits.py through it while two headless TUIs (120x36 and 80x24) watch the feed; it saves SVG
screenshots mid-stream and of the session detail, converts them to PNG with rsvg-convert when present, and keeps
the feed the wide TUI received (`tui --record`).

    python -m benchmarks.tui.screenshots --url http://127.0.0.1:8088 --out docs/images --record feed.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO

from adaptive_spec.tui.app import DashboardApp, make_app
from benchmarks.harness import ROOT

EXAMPLES = ROOT / "examples"
EXAMPLE, ONE_SHOT = EXAMPLES / "whole_file_edits.py", EXAMPLES / "openai_sdk.py"


async def _wait(predicate: object, limit_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not predicate():  # type: ignore[operator]
        if loop.time() > deadline:
            raise TimeoutError("the edit session did not get there in time")
        await asyncio.sleep(0.1)


def _streaming_on_iterative(app: DashboardApp) -> bool:
    live = [r for r in app.dashboard.live.values() if r.profile == "iterative" and r.predicted_n > 150]
    return bool(live) and app.dashboard.requests_total >= 5


async def _client(script: Path, url: str, project: str, *args: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "OPENAI_BASE_URL": f"{url.rstrip('/')}/p/{project}/v1"}
    return await asyncio.create_subprocess_exec(sys.executable, str(script), *args, env=env)


async def shoot(url: str, out: Path, rec: IO[bytes] | None, turns: int) -> None:
    """Two edit sessions in two projects and a one-shot prompt, watched by a wide and an 80x24 TUI."""
    wide, narrow = make_app(url=url, record=rec), make_app(url=url)
    async with wide.run_test(size=(120, 36)) as wpilot, narrow.run_test(size=(80, 24)) as npilot:
        await _wait(lambda: wide.connected and narrow.connected, 30)
        clients = [await _client(EXAMPLE, url, "demo", "--turns", str(turns))]
        await asyncio.sleep(20)
        clients.append(await _client(EXAMPLE, url, "webapp", "--turns", str(turns - 1)))
        clients.append(await _client(ONE_SHOT, url, "scratch"))
        await _wait(lambda: _streaming_on_iterative(wide), 3600)
        await wpilot.pause(1.0)
        wide.save_screenshot(filename="tui-dashboard.svg", path=str(out))
        narrow.save_screenshot(filename="tui-dashboard-80x24.svg", path=str(out))
        for client in clients:
            await client.wait()
        await wpilot.pause(2.0)
        await npilot.pause(0.1)
        await wpilot.press("enter")
        await wpilot.pause(1.0)
        wide.save_screenshot(filename="tui-session-detail.svg", path=str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8088")
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--record", type=Path)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--png-only", action="store_true", help="only convert the SVGs already in --out to PNG")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.png_only:
        for svg in args.out.glob("tui-*.svg"):
            to_png(svg, svg.with_suffix(".png"))
        return
    rec = args.record.open("wb") if args.record else None
    try:
        asyncio.run(shoot(args.url, args.out, rec, args.turns))
    finally:
        if rec is not None:
            rec.close()
    if shutil.which("rsvg-convert"):
        for svg in args.out.glob("tui-*.svg"):
            to_png(svg, svg.with_suffix(".png"))


def to_png(svg: Path, png: Path) -> None:
    """rsvg-convert lays out Textual's non-breaking spaces in a fallback font badly (runs collapse, then stretch):
    plain spaces with xml:space="preserve" keep the columns."""
    text = svg.read_text(encoding="utf-8").replace("&#160;", " ").replace("<svg ", '<svg xml:space="preserve" ', 1)
    fixed = png.with_suffix(".tmp.svg")
    fixed.write_text(text, encoding="utf-8")
    try:
        subprocess.run(["rsvg-convert", "-w", "1400", str(fixed), "-o", str(png)], check=True)
    finally:
        fixed.unlink()


if __name__ == "__main__":
    main()
