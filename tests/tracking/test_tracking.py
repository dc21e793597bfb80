"""MLflow as the system of record: runs, notes, artifacts, dedup, triage, offline spool and sync.

Real MLflow throughout (an embedded sqlite store in a temporary folder), no mocks.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import REGISTRY, Case
from harness.corpus import load_repro, record_finding
from harness.execute import run_case
from harness.fuzz import CampaignConfig, run_campaign

from .conftest import DIVERGING, free_port, logged, make_finding

ROTARY = ("rotary.bf16_angles", Case(seed=0, seq_lens=(2,), params={"start": 256}))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """The real command line, in process: (exit code, stdout, stderr)."""
    from harness.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def store(uri=None):
    from harness.mlflow_tracking import Store

    return Store(uri, create=False)


def campaign_runs(s):
    return s.search("tags.`harness.kind` = 'campaign'")


def regression_runs(s):
    return s.search("tags.`harness.kind` = 'regression'")


# ---------------------------------------------------------------------------------------------
def test_import_harness_does_not_import_mlflow():
    code = "import sys, harness, harness.tracking, harness.fuzz; print('mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_store_location_defaults_to_reports_of_cwd_and_honours_env(fresh_cwd, monkeypatch):
    from harness.mlflow_tracking import default_spool, resolve_uri, sqlite_path

    assert resolve_uri() == f"sqlite:///{fresh_cwd.resolve()}/reports/mlflow.db"
    assert default_spool() == fresh_cwd.resolve() / "reports" / "pending"
    assert sqlite_path("sqlite:///rel/x.db") == fresh_cwd.resolve() / "rel" / "x.db"
    assert resolve_uri("sqlite:///rel/x.db") == f"sqlite:///{fresh_cwd.resolve()}/rel/x.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert resolve_uri() == "http://127.0.0.1:5999"
    assert resolve_uri("sqlite:////abs/y.db") == "sqlite:////abs/y.db"  # an explicit URI wins


def test_severity_bands():
    from harness.mlflow_tracking import severity

    assert severity("divergence", 0.002, 1e-3) == "low"
    assert severity("divergence", 0.02, 1e-3) == "medium"
    assert severity("divergence", 0.2, 1e-3) == "high"
    assert severity("nonfinite", float("nan"), 1e-3) == "critical"
    assert severity("error", None, 1e-3) == "critical"
    assert severity("crash", None, 1e-3) == "critical"  # a path that kills its process
    assert severity("timeout", None, 1e-3) == "high"  # a path that hangs


# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_campaigns_round_trip_on_embedded_store(fresh_cwd):
    """One campaign run, one nested regression run per signature; a second campaign dedups."""
    from harness.mlflow_tracking import MlflowTracker

    pairs = REGISTRY.select(["rmsnorm.eps_placement", ROTARY[0]])

    def campaign(seed):
        tracker = MlflowTracker(log=lambda m: None)
        cfg = CampaignConfig(pairs=pairs, seed=seed, max_examples=15, corpus=fresh_cwd / "corpora")
        result = run_campaign(cfg, tracker, log=lambda m: None)
        assert not tracker.spooled and tracker.offline_reason is None
        return result

    first = campaign(1)
    sigs = {f.signature for f in first.findings}
    assert len(sigs) == 2, [f.pair for f in first.findings]
    assert (fresh_cwd / "reports" / "mlflow.db").exists()  # the default store, under the cwd

    s = store()
    [camp] = campaign_runs(s)
    assert camp.data.params["seed"] == "1" and camp.data.params["max_examples"] == "15"
    assert set(camp.data.params["pairs"].split(",")) == {p.name for p in pairs}
    for key in ("threshold", "device", "shard", "harness_version", "torch_version", "git_commit", "budget"):
        assert key in camp.data.params
    assert camp.data.metrics["findings"] == 2 and camp.data.metrics["findings_divergence"] == 2
    assert camp.data.metrics["cases"] == first.examples and camp.data.metrics["cases_per_second"] > 0
    assert camp.info.status == "FINISHED"

    regs = regression_runs(s)
    assert len(regs) == 2
    for f in first.findings:
        [run] = [r for r in regs if r.data.tags["harness.signature"] == f.signature]
        t = run.data.tags
        assert t["mlflow.parentRunId"] == camp.info.run_id
        assert t["harness.finding_id"] == f.id and t["harness.pair"] == f.pair
        assert t["harness.status"] == "expected" and t["harness.expected"] == "diverges"
        assert t["harness.seen_count"] == "1" and t["harness.recurrence"] == "false"
        assert t["harness.first_seen"] == t["harness.last_seen"]
        assert t["harness.severity"] in ("low", "medium", "high")
        assert Path(t["harness.corpus_path"]) == f.path.resolve()
        note = t["mlflow.note.content"]
        assert f.case.one_line() in note and f"harness replay --run-id {run.info.run_id}" in note
        assert f"{f.k3:.4g}" in note
        assert run.data.params["case.seed"] == str(f.case.seed)
        assert json.loads(run.data.params["case.seq_lens"]) == list(f.case.seq_lens)
        assert run.data.metrics["k3_kl"] == pytest.approx(f.k3)
        for m in ("k3_seq_max", "kl", "kl_excluded", "max_abs_dlogp", "flip_rate"):
            assert m in run.data.metrics
        assert t["harness.fired"] == f.evaluation.divergence.fired != "" and f"**{t['harness.fired']}**" in note
        assert run.data.metrics["found.cases_to_first"] == f.cases_to_first >= 1
        assert run.data.metrics["found.cases_total"] == f.examples
        assert run.data.metrics["found.shrink_seconds"] == pytest.approx(f.shrink_seconds, abs=1e-3)
        assert f"after {f.cases_to_first} case(s) in " in note and "; shrunk in " in note
        # artifacts: the repro replays the same case, the table has one row per token, the plot is a PNG
        tmp = fresh_cwd / "dl" / f.id
        repro = load_repro(s.client.download_artifacts(run.info.run_id, f"repro/{f.id}.json", str(tmp)))
        assert repro.case == f.case and repro.signature == f.signature
        with open(s.client.download_artifacts(run.info.run_id, f"per_token/{f.id}.csv", str(tmp))) as fh:
            rows = list(csv.DictReader(fh))
        assert len(rows) == f.case.n_tokens
        assert sum(float(r["k3"]) for r in rows) / len(rows) == pytest.approx(f.k3)
        png = Path(s.client.download_artifacts(run.info.run_id, f"plots/{f.id}_k3.png", str(tmp)))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    second = campaign(2)
    assert {f.signature for f in second.findings} == sigs
    assert len(campaign_runs(s)) == 2
    regs2 = regression_runs(s)
    assert len(regs2) == 2  # no new regression run
    for run in regs2:
        t = run.data.tags
        assert t["harness.seen_count"] == "2" and t["harness.last_seen"] >= t["harness.first_seen"]
        assert t["mlflow.parentRunId"] == camp.info.run_id  # stays under the campaign that found it
    history = s.client.get_metric_history(regs2[0].info.run_id, "k3_kl")
    assert sorted(m.step for m in history) == [0, 1]  # one k3 per night that saw it


def test_close_then_replay_then_recurrence(fresh_cwd, capsys):
    """`regressions close` sets the status in MLflow and in the corpus file; replay shows it; a
    fixed regression seen again is reopened as a recurrence, and a re-upload counts once."""
    from harness.mlflow_tracking import MlflowTracker, list_regressions

    f = make_finding(fresh_cwd)
    t1 = logged(MlflowTracker(log=lambda m: None), [f])
    run_id, what = t1.logged[f.id]
    assert what == "created"

    code, out, err = run_cli(capsys, "regressions", "--status", "open")
    assert code == 0 and f.id in out and "open" in out
    code, out, err = run_cli(capsys, "regressions", "show", f.id)
    assert code == 0 and f.case.one_line() in out and f"plots/{f.id}_k3.png" in out

    # still diverging: `close --status fixed` replays it and refuses; nothing changes anywhere
    before = f.path.read_text()
    code, out, err = run_cli(capsys, "regressions", "close", f.id, "--status", "fixed", "--note", "fixed by abc123")
    assert code == 2 and "still diverges" in err and "--status wontfix" in err and "Traceback" not in err
    assert f.path.read_text() == before and list_regressions(status="fixed") == []
    # the fix lands (here: the corpus file's threshold says what is acceptable now), then it closes
    data = json.loads(before)
    data["threshold"] = 100.0
    f.path.write_text(json.dumps(data))
    code, out, err = run_cli(capsys, "regressions", "close", f.id, "--status", "fixed", "--note", "fixed by abc123")
    assert code == 0, err
    from harness.mlflow_tracking.lifecycle import who_closes

    assert who_closes() not in ("", "unknown")
    assert json.loads(f.path.read_text())["history"][-1]["by"] == who_closes()
    assert "sqlite" not in f.path.read_text() and str(fresh_cwd) not in f.path.read_text()  # no local store path
    [row] = list_regressions(status="fixed")
    assert row["run_id"] == run_id and row["id"] == f.id
    repro = load_repro(f.path)
    assert repro.status == "fixed"
    assert repro.history[-1]["event"] == "closed" and repro.history[-1]["note"] == "fixed by abc123"
    assert repro.history[-1]["run_id"] == run_id
    assert "fixed by abc123" in store().client.get_run(run_id).data.tags["mlflow.note.content"]
    # its headline says the status it has now, not the one it was created with (a trial read "status open" there)
    assert "status **fixed** (earlier open; the end of this note says why)" in \
        store().client.get_run(run_id).data.tags["mlflow.note.content"]
    # closed again, the repro file given as ID: nothing changes (no second entry in its history)
    entries = len(repro.history)
    code, out, err = run_cli(capsys, "regressions", "close", str(f.path), "--status", "fixed", "--note", "again")
    assert code == 0 and f"regression {f.id} ({f.pair}) is already fixed" in out and "nothing changed" in out, out + err
    assert len(load_repro(f.path).history) == entries
    code, out, err = run_cli(capsys, "regressions", "show", str(f.path))
    assert code == 0 and f.case.one_line() in out, out + err

    code, out, err = run_cli(capsys, "regressions", "show", f.id)
    assert code == 0 and f"by {who_closes()} as fixed: fixed by abc123" in out, out
    code, out, err = run_cli(capsys, "replay", "--run-id", run_id)
    assert code == 1 and "[fixed]" in out and "closed as fixed and fails again: the bug is back" in out  # (status from MLflow)
    code, out, err = run_cli(capsys, "replay", "--run-id", f.id, "--json")
    assert json.loads(out)[0]["status"] == "fixed"

    t2 = logged(MlflowTracker(log=lambda m: None), [f], seed=8)
    assert t2.logged[f.id] == (run_id, "reopened")
    [row] = list_regressions()
    assert row["status"] == "open" and row["recurrence"] and row["seen_count"] == 2
    assert row["last_case"] == f.case.one_line()  # (the case the latest sighting's metrics are of)
    assert row["k3"] == pytest.approx(f.k3) and row["k3_expected"] == pytest.approx(f.evaluation.divergence.k3_expected)
    assert "Recurrence" in store().client.get_run(run_id).data.tags["mlflow.note.content"]
    code, out, err = run_cli(capsys, "regressions", "show", f.id)  # the close note is history now, not a reason
    assert code == 0 and "reopened " in out and "the close note said: fixed by abc123" in out, out
    assert "as fixed:" not in out
    # the store reopened it, its corpus file still says fixed (restored with git, say): the list says so
    code, out, err = run_cli(capsys, "regressions")
    assert code == 0 and "open (recurrence); corpus file: fixed" in out, out
    assert f"1 regression(s) whose corpus file says another status than the store: {f.id} (store open, file fixed)" \
        in out, out
    code, out, err = run_cli(capsys, "regressions", "--json")
    assert json.loads(out)[0]["corpus_status"] == "fixed"

    # the same campaign uploading the same finding again (a retried sync) changes nothing, nor does
    # an earlier campaign's upload repeated after a later one (a restored spool)
    from harness.mlflow_tracking import Store, finding_payload, log_regression

    payload = finding_payload(f, 1e-3, 8, "cpu")
    assert log_regression(Store(), payload, None, t2.uid) == (run_id, "already-known")  # (t1 created it: for t2 a known one)
    assert log_regression(Store(), payload, None, t1.uid) == (run_id, "already")
    assert list_regressions()[0]["seen_count"] == 2


def test_the_note_of_a_crash_says_it_died_and_lists_only_the_artifacts_it_has():
    from harness.mlflow_tracking import regression_note, severity

    p = {"pair": "mine.kernel", "symptom": "crash", "metrics": {}, "per_token": {}, "expected": "aligned",
         "error": {"type": "SIGSEGV", "where": "worker", "message": "the worker died of signal 11"},
         "severity": severity("crash", None, 1e-3), "status": "open", "case_line": "seed=1 seq_lens=[7]",
         "id": "abcdefabcdef", "threshold": 1e-3, "seen_at": "now", "campaign_seed": 3, "device": "cpu",
         "signature": "f" * 64, "examples": 10, "corpus_path": None}
    note = regression_note(p, "run1")
    assert "Severity **critical**" in note and "The worker process running the case died (`SIGSEGV`)" in note
    assert "`repro/abcdefabcdef.json` (no per-token metrics: the case crashed)." in note
    assert "per_token/" not in note and "plots/" not in note
    # commands to paste: a plugin file or corpus path with a space in it is one shell word
    note = regression_note(dict(p, plugin="/tmp/my pairs/own pairs.py", corpus_path="/tmp/c d/mine.kernel/x.json"),
                           "run1")
    assert "harness replay --plugin '/tmp/my pairs/own pairs.py' '/tmp/c d/mine.kernel/x.json'" in note, note
    assert "harness triage --run-id run1 --plugin '/tmp/my pairs/own pairs.py'" in note, note


def test_bad_ids_and_statuses_are_usage_errors(fresh_cwd, capsys):
    f = make_finding(fresh_cwd)
    from harness.mlflow_tracking import MlflowTracker

    logged(MlflowTracker(log=lambda m: None), [f])
    code, out, err = run_cli(capsys, "regressions", "close", "ffffffffffff", "--status", "fixed", "--note", "x")
    assert code == 2 and "no regression 'ffffffffffff'" in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "regressions", "close", f.id, "--status", "open", "--note", "x")
    assert code == 2
    code, out, err = run_cli(capsys, "replay", "--run-id", "not-an-id")
    assert code == 2 and "not a regression id" in err
    # a store named by the user that is not there (a typo) is an error, not "no regressions": a CI gate
    # on open regressions must not pass on it; the default store of a fresh checkout is just empty
    code, out, err = run_cli(capsys, "regressions", "--tracking-uri", f"sqlite:///{fresh_cwd}/none.db")
    assert code == 2 and "there is no MLflow store at" in err and "Traceback" not in err
    (fresh_cwd / "elsewhere").mkdir()
    os.chdir(fresh_cwd / "elsewhere")  # (fresh_cwd's fixture puts the working directory back)
    code, out, err = run_cli(capsys, "regressions")
    assert code == 0 and "no regressions" in out


# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_unreachable_store_spools_and_sync_uploads_once(fresh_cwd, capsys):
    """A closed port: the campaign ends within budget + ~10 s, findings are in corpora/ and
    reports/pending/, and `harness sync` uploads each exactly once even when run twice."""
    from harness.mlflow_tracking import MlflowTracker, list_regressions

    port = free_port()  # bound then released: nothing listens there
    warnings = []
    budget = 60.0  # generous: max_examples bounds the work; the budget bounds the wall time
    t0 = time.monotonic()
    tracker = MlflowTracker(f"http://127.0.0.1:{port}", log=warnings.append)
    cfg = CampaignConfig(pairs=REGISTRY.select(["rmsnorm.eps_placement", ROTARY[0]]), seed=1, max_examples=15,
                         budget=budget, corpus=fresh_cwd / "corpora")
    result = run_campaign(cfg, tracker, log=lambda m: None)
    elapsed = time.monotonic() - t0
    assert elapsed < budget + 10, f"campaign with an unreachable store took {elapsed:.1f}s"
    assert tracker.seconds < 10
    ids = {f.id for f in result.findings}
    assert len(ids) == 2
    assert all(f.path.exists() for f in result.findings)  # the corpus has every finding
    spool = fresh_cwd / "reports" / "pending" / tracker.uid
    assert {p.stem for p in spool.glob("*.json")} == ids | {"campaign"}
    assert any("harness sync" in w and "unreachable" in w for w in warnings), warnings
    assert "cannot connect" in json.loads((spool / "campaign.json").read_text())["offline_reason"]
    backup = fresh_cwd / "spool-copy"
    shutil.copytree(spool, backup)

    live = f"sqlite:///{fresh_cwd}/live/mlflow.db"
    code, out, err = run_cli(capsys, "sync", "--tracking-uri", live)
    assert code == 0, err
    assert "created 2" in out and not spool.exists()
    code, out, err = run_cli(capsys, "sync", "--tracking-uri", live)
    assert code == 0 and "0 campaign(s)" in out
    # even a spool that was uploaded but not deleted (a crash in between) is not counted twice
    shutil.copytree(backup, spool)
    code, out, err = run_cli(capsys, "sync", "--tracking-uri", live, "--json")
    summary = json.loads(out)
    assert summary["already"] == 2 and summary["created"] == 0 and summary["remaining"] == 0

    rows = list_regressions(live)
    assert {r["id"] for r in rows} == ids and all(r["seen_count"] == 1 for r in rows)
    s = store(live)
    [camp] = campaign_runs(s)
    assert camp.data.params["seed"] == "1" and camp.data.metrics["findings"] == 2
    assert all(r["campaign_run_id"] == camp.info.run_id for r in rows)


def test_sync_to_an_unreachable_store_keeps_the_spool(fresh_cwd, capsys):
    from harness.mlflow_tracking import MlflowTracker

    f = make_finding(fresh_cwd)
    dead = f"http://127.0.0.1:{free_port()}"
    t = logged(MlflowTracker(dead, log=lambda m: None), [f])
    assert len(t.spooled) == 1
    code, out, err = run_cli(capsys, "sync", "--tracking-uri", dead)
    assert code == 1 and "still pending 1" in out
    assert (fresh_cwd / "reports" / "pending" / t.uid / f"{f.id}.json").exists()


@pytest.mark.slow
def test_cli_fuzz_quick_path_logs_to_the_default_store(fresh_cwd, capsys):
    """`harness fuzz` with tracking on by default, from a fresh folder."""
    code, out, err = run_cli(capsys, "fuzz", ROTARY[0], "--max-examples", "10", "--seed", "1")
    assert code == 1, err  # a finding
    assert (fresh_cwd / "reports" / "mlflow.db").exists() and "warning" not in err
    # a new store is said (a mistyped --tracking-uri path would otherwise split the findings silently)
    assert f"mlflow: created a new store at {fresh_cwd / 'reports' / 'mlflow.db'} (none was there)" in err, err
    code, out, err = run_cli(capsys, "fuzz", ROTARY[0], "--max-examples", "3", "--seed", "2")
    assert "created a new store" not in err
    code, out, err = run_cli(capsys, "regressions", "--json")
    [row] = json.loads(out)
    assert row["pair"] == ROTARY[0] and row["status"] == "expected"
    code, out, err = run_cli(capsys, "fuzz", ROTARY[0], "--max-examples", "10", "--seed", "1", "--no-tracking")
    assert code == 1
    assert json.loads(run_cli(capsys, "regressions", "--json")[1])[0]["seen_count"] == 2  # (seed 2 saw it too)


@pytest.mark.slow
def test_a_server_that_accepts_but_never_answers_is_given_up_within_about_10s(fresh_cwd, monkeypatch):
    """The TCP probe passes; MLflow's bounded timeout and single retry end the wait (its defaults
    would wait about four minutes); the finding is spooled."""
    import socket
    import threading

    from harness.mlflow_tracking import HTTP_LIMITS, MlflowTracker

    for key in HTTP_LIMITS:  # the bounds the tracker sets, not whatever the calling shell has
        monkeypatch.delenv(key, raising=False)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(srv.accept()) for _ in range(16)], daemon=True).start()
    try:
        f = make_finding(fresh_cwd)
        t = logged(MlflowTracker(f"http://127.0.0.1:{srv.getsockname()[1]}", log=lambda m: None), [f])
    finally:
        srv.close()
        for conn, _ in held:
            conn.close()
    assert t.offline_reason and "MlflowException" in t.offline_reason
    assert t.seconds < 12, f"gave up after {t.seconds:.1f}s"
    assert [p.name for p in t.spooled] == [f"{f.id}.json"]


def test_triage_by_finding_id_attaches_its_report_to_the_regression_run(tmp_path, harness_cli):
    from harness.fuzz import CampaignConfig
    from harness.mlflow_tracking import MlflowTracker, open_store

    from .conftest import make_finding

    uri = f"sqlite:///{tmp_path}/store.db"
    finding = make_finding(tmp_path)
    tracker = MlflowTracker(uri)
    tracker.campaign_started(CampaignConfig(pairs=[], seed=1), 1, [])
    tracker.finding(finding)
    code, out, err = harness_cli("triage", "--run-id", finding.id, "--tracking-uri", uri, "--reports",
                                 str(tmp_path / "reports"), cwd=tmp_path)
    assert code == 0, err
    assert "attached to MLflow run" in err
    store = open_store(uri)
    run = store.find_regression(finding.id)
    names = {a.path for a in store.client.list_artifacts(run.info.run_id, "triage")}
    assert "triage/report.md" in names
    verdict = run.data.tags["harness.triage_verdict"]
    assert verdict and verdict.split(":")[0] in out + err  # the verdict printed is the one tagged
    code, out, err = harness_cli("regressions", "show", finding.id, "--tracking-uri", uri, cwd=tmp_path)
    assert code == 0 and "harness.triage_verdict" in out, out + err


def test_close_with_a_corpus_file_checks_it_before_changing_anything(fresh_cwd, capsys):
    """--corpus-file names the file to update: another regression's repro, or a path that is not
    there, is a usage error (exit 2) and neither MLflow nor any file changes."""
    import shutil

    from harness.mlflow_tracking import MlflowTracker

    f = make_finding(fresh_cwd)
    logged(MlflowTracker(log=lambda m: None), [f])
    other = fresh_cwd / "other" / "some.pair" / "0123456789ab.json"
    other.parent.mkdir(parents=True)
    data = json.loads(f.path.read_text())
    data.update(id="0123456789ab", pair="rmsnorm.eps_placement")
    other.write_text(json.dumps(data))
    before = other.read_text()
    code, out, err = run_cli(capsys, "regressions", "close", f.id, "--status", "wontfix", "--note", "n",
                             "--corpus-file", str(other))
    assert code == 2 and "that repro is 0123456789ab of pair rmsnorm.eps_placement" in err, err
    assert other.read_text() == before
    assert store().find_regression(f.id).data.tags["harness.status"] == "open"
    code, out, err = run_cli(capsys, "regressions", "close", f.id, "--status", "wontfix", "--note", "n",
                             "--corpus-file", str(fresh_cwd / "nope.json"))
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    assert store().find_regression(f.id).data.tags["harness.status"] == "open"
    shutil.copy(f.path, fresh_cwd / "mine.json")  # its own repro, wherever it lives: accepted
    code, out, err = run_cli(capsys, "regressions", "close", f.id, "--status", "wontfix", "--note", "n",
                             "--corpus-file", str(fresh_cwd / "mine.json"))
    assert code == 0, err
    assert json.loads((fresh_cwd / "mine.json").read_text())["status"] == "wontfix"


def test_a_corpus_file_that_cannot_be_written_leaves_mlflow_as_it_was(fresh_cwd, capsys, monkeypatch):
    """Closing writes MLflow and the corpus file: when the file's write fails (a full disk; a read-only
    folder as a user without root), MLflow is put back and the command says so in one paragraph."""
    from harness.corpus import Repro
    from harness.mlflow_tracking import MlflowTracker

    f = make_finding(fresh_cwd)
    logged(MlflowTracker(log=lambda m: None), [f])
    before = f.path.read_text()
    note_before = store().find_regression(f.id).data.tags.get("mlflow.note.content", "")

    def full_disk(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Repro, "save", full_disk)
    code, out, err = run_cli(capsys, "regressions", "close", f.id, "--status", "wontfix", "--note", "n")
    assert code == 2 and "could not be written (No space left on device)" in err and "Traceback" not in err, err
    tags = store().find_regression(f.id).data.tags
    assert tags["harness.status"] == "open" and tags.get("mlflow.note.content", "") == note_before
    assert "harness.closed_at" not in tags and "harness.triage_note" not in tags  # (deleted, not set to "")
    assert f.path.read_text() == before


def test_a_tracking_uri_no_store_takes_is_a_usage_error_not_an_outage(fresh_cwd, capsys):
    from harness.mlflow_tracking.store import check_scheme
    from harness.errors import UsageError

    for ok in ("sqlite:///x.db", "file:///tmp/m", "http://host:5000", "postgresql+psycopg2://u@h/db", "/tmp/mlruns",
               "C:\\mlruns"):
        check_scheme(ok)
    with pytest.raises(UsageError, match="no MLflow tracking store takes the scheme 'bogus'"):
        check_scheme("bogus://x")
    code, out, err = run_cli(capsys, "fuzz", "router.aligned", "--tracking-uri", "bogus://x", "--max-examples", "2")
    assert code == 2 and "--no-tracking" in err and "Traceback" not in err
    assert not (fresh_cwd / "reports" / "pending").exists()  # nothing spooled for a store that can never exist


def test_a_regression_whose_k3_is_infinite_lists_as_inf_not_nan(fresh_cwd, capsys):
    """MLflow takes finite metrics only: a sampled token the trainer gives probability 0 (k3 = inf)
    was logged without its k3, and `harness regressions` listed it as nan. The infinite ones are named
    in a tag and read back as inf (strict JSON: the string "inf")."""
    import torch

    from harness import Axes, Outcome, TargetPair
    from harness.mlflow_tracking import MlflowTracker

    def build(case, device):  # token 0 holds nearly all of the rollout's mass
        return case.token_randn(8, "logits") * 0.1 + 20.0 * (torch.arange(8) == 0)

    def trainer(x):  # keeps token 0 out: the rollout, sampling it, gets k3 = inf
        return Outcome(logprobs=torch.log_softmax(x.masked_fill(torch.arange(8) == 0, float("-inf")), -1))

    pair = TargetPair(name="t.excluded", kind="op", expected="aligned", build=build, trainer=trainer,
                      rollout=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)),
                      axes=Axes(n_seqs=(1, 2), seq_len=(1, 8), pad_sides=("right",), logit_scale=(1.0, 1.0)))
    tracker = MlflowTracker(log=lambda m: None)
    cfg = CampaignConfig(pairs=[pair], seed=3, max_examples=10, corpus=fresh_cwd / "corpora", isolation=False)
    [f] = run_campaign(cfg, tracker, log=lambda m: None).findings
    assert f.evaluation.divergence.k3_kl == float("inf")
    [run] = regression_runs(store())
    assert "k3_kl" not in run.data.metrics and "k3_kl" in run.data.tags["harness.infinite_metrics"].split(",")
    code, out, _ = run_cli(capsys, "regressions", "--json")
    [row] = json.loads(out)
    assert code == 0 and row["k3"] == "inf" and row["verdict_mean"] == ["k3", "inf"], row
    code, out, _ = run_cli(capsys, "regressions")
    assert code == 0 and f.id in out and " inf " in out and "nan" not in out, out


def test_a_smaller_case_a_later_campaign_writes_to_the_corpus_file_becomes_the_runs_repro(fresh_cwd, capsys):
    """A trial's `harness replay --run-id` replayed the first sighting's case after the corpus file
    had taken a smaller one: the run's repro artifact (and `harness.case`) follow the corpus file."""
    from harness.fuzz import Finding, signature
    from harness.mlflow_tracking import MlflowTracker, fetch_repro, list_regressions

    from .conftest import first_diverging

    pair = REGISTRY.get(DIVERGING[0])
    big = first_diverging(DIVERGING[0], seq_lens=(3, 2), n_experts=5, top_k=1, tie_fraction=1.0)
    small = DIVERGING[1]
    ev_big, ev_small = (run_case(pair, c, "cpu", 1e-3) for c in (big, small))
    assert signature(pair.name, ev_big) == signature(pair.name, ev_small)

    def finding(case, ev):
        f = Finding(pair=pair.name, expected="aligned", symptom=ev.symptom, signature=signature(pair.name, ev),
                    case=case, evaluation=ev, examples=1)
        f.shrink_complete = True
        record_finding(f, fresh_cwd / "corpora", 1e-3, 7, "cpu")
        return f

    first = finding(big, ev_big)
    logged(MlflowTracker(log=lambda m: None), [first], seed=7)
    [reg] = list_regressions()
    assert fetch_repro(reg["run_id"]).case == big
    later = finding(small, ev_small)
    assert later.updated == "a smaller case" and load_repro(later.path).case == small
    logged(MlflowTracker(log=lambda m: None), [later], seed=8)
    [reg] = list_regressions()
    assert reg["seen_count"] == 2 and fetch_repro(reg["run_id"]).case == small
    code, out, _ = run_cli(capsys, "regressions", "show", reg["id"])
    assert "#### Minimal case replaced" in out and small.one_line(brief=True) in out, out
    code, out, _ = run_cli(capsys, "replay", "--run-id", reg["run_id"])
    assert code == 1 and "bit-for-bit yes" in out, out
    # a --pair glob with a typo says which pairs the store's regressions are of
    code, out, _ = run_cli(capsys, "regressions", "--pair", "routr_*")
    assert code == 0 and "no regressions with pair routr_*" in out and "are of router_topk.bf16" in out, out


def test_closing_a_repro_found_without_mlflow_says_to_close_its_file_alone(fresh_cwd, capsys):
    f = make_finding(fresh_cwd)  # (written to corpora/, logged nowhere: a campaign with --no-tracking)
    path = str(Path(f.path).relative_to(fresh_cwd))
    code, out, err = run_cli(capsys, "regressions", "close", path, "--status", "wontfix", "--note", "x")
    assert code == 2 and "Traceback" not in err
    assert f"`harness regressions close {path} --status wontfix --note ... --no-tracking`" in err, err
    code, out, err = run_cli(capsys, "regressions", "close", path, "--status", "wontfix", "--note", "x", "--no-tracking")
    assert code == 0 and load_repro(path).status == "wontfix", out + err


def test_a_regression_closed_by_mistake_is_reopened_with_a_note(fresh_cwd, capsys):
    """A wontfix by mistake hides every later sighting of the bug: `regressions reopen` puts it back to
    open in MLflow and in its corpus file (history and note say so); the file alone with --no-tracking."""
    from harness.mlflow_tracking import MlflowTracker, list_regressions

    f = make_finding(fresh_cwd)
    logged(MlflowTracker(log=lambda m: None), [f])
    code, out, err = run_cli(capsys, "regressions", "close", f.id, "--status", "wontfix", "--note", "looked benign")
    assert code == 0 and load_repro(f.path).status == "wontfix", out + err
    code, out, err = run_cli(capsys, "regressions", "reopen", f.id, "--note", "wontfix by mistake: a real bug")
    assert code == 0 and "status open in MLflow" in out, out + err
    repro = load_repro(f.path)
    assert repro.status == "open" and repro.history[-1]["event"] == "reopened"
    assert repro.history[-1]["from"] == "wontfix" and repro.history[-1]["note"] == "wontfix by mistake: a real bug"
    [reg] = list_regressions()
    assert reg["status"] == "open"
    code, out, _ = run_cli(capsys, "regressions", "show", f.id)
    assert "#### Reopened" in out and "(wontfix by mistake: a real bug); the close note said: looked benign" in out, out
    code, out, _ = run_cli(capsys, "regressions", "reopen", f.id, "--note", "again")
    assert code == 0 and "is already open" in out, out
    # a corpus kept without MLflow: the file alone
    code, out, err = run_cli(capsys, "regressions", "close", str(f.path), "--status", "wontfix", "--note", "x",
                             "--no-tracking")
    code, out, err = run_cli(capsys, "regressions", "reopen", str(f.path), "--note", "y", "--no-tracking")
    assert code == 0 and load_repro(f.path).status == "open", out + err
