"""bench/load.py, the load tool users point at their own deployment, run as a user
would (`python -m bench.load --url … --api-key …`) against a real server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio

from tests.conftest import App
from tests.test_tenancy import signed_in

ROOT = Path(__file__).resolve().parents[1]


async def test_the_load_tool_reports_every_delivery_and_plots_it(app: App, tenants, tmp_path: Path):
    alpha = tenants[0]
    async with await signed_in(app, alpha.owner) as owner:
        key = (await owner.call("apikey.create", name="load", member_id=alpha.owner.member_id,
                                workspace_id=alpha.workspace_id))["key"]
    output, plot = tmp_path / "load.json", tmp_path / "load.png"
    done = await trio.run_process(
        [sys.executable, "-m", "bench.load", "--url", app.url, "--api-key", key, "--subscribers", "3",
         "--senders", "2", "--rate", "20", "--duration", "1.5", "--output", str(output), "--plot", str(plot)],
        cwd=ROOT, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    report = json.loads(output.read_text())
    sends, deliveries = report["sends"], report["deliveries"]
    assert sends["attempted"] == sends["acknowledged"] == 30 and not sends["refused"]
    assert deliveries["received"] == deliveries["expected"] == 90
    assert 0 < deliveries["latency_ms"]["p50"] <= deliveries["latency_ms"]["p99"] <= deliveries["latency_ms"]["max"]
    assert sum(second["delivered"] for second in report["per_second"]) == 90
    assert report["config"]["api_key"] == "(hidden)" and key not in output.read_text()
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert b"load:" in done.stderr  # the progress bar
    assert b"deliveries: 90/90" in done.stdout
