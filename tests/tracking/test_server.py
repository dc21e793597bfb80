"""A real `mlflow server` on 127.0.0.1 (a free port), logged to over HTTP, then stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import free_port, logged, make_finding


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--artifacts-destination",
         str(tmp_path / "server-artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (uvicorn workers)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
        log.close()


@pytest.mark.slow
def test_log_list_fetch_close_over_http(fresh_cwd, mlflow_server):
    from harness.mlflow_tracking import MlflowTracker, close_regression, fetch_repro, list_regressions

    f = make_finding(fresh_cwd)
    t = logged(MlflowTracker(mlflow_server, log=lambda m: None), [f])
    assert not t.spooled and t.offline_reason is None
    run_id, what = t.logged[f.id]
    assert what == "created"
    assert not (fresh_cwd / "reports").exists()  # nothing local: it all went over HTTP

    [row] = list_regressions(mlflow_server)
    assert row["run_id"] == run_id and row["status"] == "open" and row["seen_count"] == 1
    repro = fetch_repro(f.id, mlflow_server)  # the artifact comes back through the server's proxy
    assert repro.case == f.case and repro.tracking["run_id"] == run_id

    logged(MlflowTracker(mlflow_server, log=lambda m: None), [f], seed=9)
    closed = close_regression(run_id, "wontfix", "accepted for now", mlflow_server)
    assert closed["status"] == "wontfix" and closed["seen_count"] == 2
    assert closed["corpus_updated"] == str(f.path.resolve())
    assert fetch_repro(run_id, mlflow_server).status == "wontfix"
