"""Many processes logging to one fresh sqlite store at once: none crashes, every run is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
N = 5  # processes: each imports MLflow, so more cost CPU, not coverage (they all race on one fresh file)


@pytest.mark.slow
def test_five_writers_on_one_fresh_sqlite_file(fresh_cwd):
    from harness.mlflow_tracking import Store

    db = fresh_cwd / "shared" / "mlflow.db"
    uri = f"sqlite:///{db}"
    go, ready = fresh_cwd / "go", fresh_cwd / "ready"
    ready.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tracking.writer", uri, str(fresh_cwd / "corpora"), str(i),
                               str(go), str(ready)], cwd=fresh_cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(1, N + 1)]
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < N and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
        assert not db.exists()  # the store is fresh when they all start
        go.touch()
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reports = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["spooled"] == 0 and r["offline_reason"] is None for r in reports), reports

    s = Store(uri, create=False)
    campaigns = s.search("tags.`harness.kind` = 'campaign'")
    regressions = s.search("tags.`harness.kind` = 'regression'")
    assert len(campaigns) == N and all(c.info.status == "FINISHED" for c in campaigns)
    assert len(regressions) == N + 1  # one shared signature + one per writer
    [shared] = [r for r in regressions if r.data.tags["harness.signature"] == "5" * 64]
    assert shared.data.tags["harness.seen_count"] == str(N)  # every writer counted, none duplicated
    whats = sorted(r["logged"]["555555555555"] for r in reports)
    assert whats == ["created"] + ["seen"] * (N - 1)
