"""A sqlite store broken by an interrupted first creation is detected and repaired or recreated,
never silently turned off; a spool uploaded twice counts each campaign once."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from .conftest import logged, make_finding


def half_migrated(db: Path) -> None:
    """The state a kill during MLflow's schema migration leaves: a batch ALTER's temporary copy
    of a table, and a schema version short of the latest."""
    con = sqlite3.connect(str(db))
    con.executescript("""
        CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY);
        INSERT INTO alembic_version VALUES ('451aebb31d03');
        CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY, name VARCHAR(256));
        CREATE TABLE _alembic_tmp_experiments (experiment_id INTEGER PRIMARY KEY, name VARCHAR(256));
    """)
    con.commit()
    con.close()


def test_a_half_migrated_store_is_moved_aside_and_recreated_with_a_warning(fresh_cwd, capsys):
    from harness.mlflow_tracking import MlflowTracker, list_regressions

    db = fresh_cwd / "reports" / "mlflow.db"
    db.parent.mkdir(parents=True)
    half_migrated(db)
    broken = db.read_bytes()
    messages: list[str] = []
    f = make_finding(fresh_cwd)
    tracker = logged(MlflowTracker(log=messages.append), [f])
    assert tracker.offline_reason is None and not tracker.spooled  # tracking stayed on
    assert tracker.logged[f.id][1] == "created"
    [warning] = [m for m in messages if "unusable" in m]
    [aside] = list(db.parent.glob("mlflow.db.broken-*"))
    assert "_alembic_tmp_experiments" in warning and str(aside) in warning
    assert aside.read_bytes() == broken  # nothing deleted
    assert [r["id"] for r in list_regressions()] == [f.id]
    # `harness regressions` works on it too (it used to exit 2 advising to start a server)
    from .test_tracking import run_cli

    code, out, err = run_cli(capsys, "regressions")
    assert code == 0 and f.id in out


def test_leftover_migration_tables_in_a_store_with_runs_are_dropped_and_the_runs_kept(fresh_cwd):
    from harness.mlflow_tracking import MlflowTracker, Store, list_regressions

    f = make_finding(fresh_cwd)
    logged(MlflowTracker(log=lambda m: None), [f])
    db = fresh_cwd / "reports" / "mlflow.db"
    con = sqlite3.connect(str(db))
    con.execute("CREATE TABLE _alembic_tmp_runs (x INTEGER)")
    con.commit()
    con.close()
    Path(str(db) + ".initialised").unlink()  # as after the interrupted upgrade: not marked done
    messages: list[str] = []
    Store(log=messages.append)
    assert any("repaired" in m for m in messages), messages
    assert [r["id"] for r in list_regressions()] == [f.id]  # the regression is still there
    assert not list(db.parent.glob("mlflow.db.broken-*"))
    con = sqlite3.connect(str(db))
    assert not [r for r in con.execute("SELECT name FROM sqlite_master WHERE name LIKE '_alembic_tmp_%'")]
    con.close()


CREATE = """
import sys
from harness.mlflow_tracking import Store
Store(sys.argv[1])
"""


def test_killed_during_first_creation_the_next_campaign_gets_a_working_store(fresh_cwd):
    """SIGKILL while MLflow builds the schema (of the temporary file beside the store): no store
    is left half built, the next process creates a working one and removes the dead temporary."""
    from harness.mlflow_tracking import MlflowTracker, list_regressions

    db = fresh_cwd / "reports" / "mlflow.db"
    uri = f"sqlite:///{db}"
    killed_during = False
    for _ in range(3):  # the creation takes a second or two: poll for its temporary file, then kill
        shutil.rmtree(db.parent, ignore_errors=True)
        proc = subprocess.Popen([sys.executable, "-c", CREATE, uri], cwd=fresh_cwd)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if db.parent.exists() and list(db.parent.glob(".mlflow.db.creating.*")):
                time.sleep(0.05)
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            killed_during = True
            break
    assert killed_during, "the creation finished before it could be killed"
    assert not db.exists()  # never a half-built store in place
    assert list(db.parent.glob(".mlflow.db.creating.*"))  # the dead process's temporary database
    f = make_finding(fresh_cwd)
    tracker = logged(MlflowTracker(uri, log=lambda m: None), [f])
    assert tracker.offline_reason is None and tracker.logged[f.id][1] == "created"
    assert [r["id"] for r in list_regressions(uri)] == [f.id]
    assert not list(db.parent.glob(".mlflow.db.creating.*"))  # removed by the next creation


def test_sync_counts_each_spooled_campaign_once_however_often_it_is_uploaded(fresh_cwd):
    """Two campaigns spooled offline saw one signature; the spool is uploaded, then uploaded again
    (a restored copy): seen_count stays 2."""
    from harness.mlflow_tracking import MlflowTracker, list_regressions, sync_pending

    from .conftest import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    f = make_finding(fresh_cwd)
    spool = fresh_cwd / "reports" / "pending"
    logged(MlflowTracker(dead, log=lambda m: None), [f], seed=1)
    logged(MlflowTracker(dead, log=lambda m: None), [f], seed=2)
    assert len(list(spool.iterdir())) == 2
    copy = fresh_cwd / "spool-copy"
    shutil.copytree(spool, copy / "artifact-shard1")  # (a CI artifact downloaded into the spool: one folder deeper)
    from harness.mlflow_tracking import resolve_uri

    default = resolve_uri(None)  # the spool was meant for the dead store: name the live one
    s1 = sync_pending(default, spool_dir=spool, log=lambda m: None)
    assert (s1["created"], s1["seen"], s1["remaining"]) == (1, 1, 0)
    assert list_regressions()[0]["seen_count"] == 2
    s2 = sync_pending(default, spool_dir=copy, log=lambda m: None)
    assert (s2["created"], s2["seen"], s2["already"]) == (0, 0, 2)
    assert list_regressions()[0]["seen_count"] == 2


def test_sync_without_a_uri_uploads_to_the_store_each_campaign_was_meant_for(fresh_cwd):
    """A campaign run with --tracking-uri B spools while B is away; a plain `harness sync` later
    uploads to B (recorded in the spool), not to the default store."""
    import json

    from harness.mlflow_tracking import MlflowTracker, list_regressions, resolve_uri, sync_pending

    from .conftest import free_port

    f = make_finding(fresh_cwd)
    t = logged(MlflowTracker(f"http://127.0.0.1:{free_port()}", log=lambda m: None), [f])
    camp = fresh_cwd / "reports" / "pending" / t.uid / "campaign.json"
    meant = f"sqlite:///{fresh_cwd}/team/mlflow.db"  # as if B were this store, back now
    camp.write_text(json.dumps({**json.loads(camp.read_text()), "uri": meant}))
    s = sync_pending(spool_dir=fresh_cwd / "reports" / "pending", log=lambda m: None)
    assert s["created"] == 1 and s["remaining"] == 0 and s["uri"] == meant
    assert [r["id"] for r in list_regressions(meant)] == [f.id]
    assert not (fresh_cwd / "reports" / "mlflow.db").exists() or not list_regressions(resolve_uri(None))


def test_a_store_whose_folder_cannot_exist_is_a_one_line_reason(tmp_path):
    import pytest

    from harness.errors import UsageError
    from harness.mlflow_tracking.store import store_lock

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(UsageError, match=f"{blocker} is not a folder.*a folder you can write"):
        with store_lock(f"sqlite:///{blocker / 'sub' / 'mlflow.db'}"):
            pass
