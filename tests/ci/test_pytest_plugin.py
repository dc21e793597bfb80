"""The pytest plugin (`pytest --harness-fuzz`): off by default and free, one item per pair, xdist
aggregation into one summary and one MLflow campaign run, a planted aligned regression fails the
run, a known one does not, and Hypothesis's CI profile does not take over under CI=true."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLANTED = Path(__file__).with_name("planted_pair.py")


def clean_env(**extra: str) -> dict:
    """The environment for a nested pytest: without the xdist variables of the session running us."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "PYTEST_ADDOPTS"}
    return {**env, **extra}


def run_pytest(args: list[str], cwd: Path = ROOT, env: dict | None = None, timeout: float = 400):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd,
                          env=clean_env(**(env or {})), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_off_by_default_imports_nothing_heavy(tmp_path):
    """Installed through pytest11 but off: a plain session never imports torch, MLflow or the engine."""
    (tmp_path / "test_plain.py").write_text(textwrap.dedent("""
        import sys

        def test_lazy():
            heavy = [m for m in ("torch", "mlflow", "harness.fuzz", "harness.execute") if m in sys.modules]
            assert not heavy, heavy
            assert "harness.pytest_plugin" in sys.modules  # loaded through the entry point
    """))
    rc, out = run_pytest(["-q", str(tmp_path / "test_plain.py")], cwd=tmp_path)
    assert rc == 0, out
    assert "1 passed" in out


def test_options_are_registered():
    rc, out = run_pytest(["--help"])
    assert rc == 0
    for flag in ("--harness-fuzz", "--harness-pairs", "--harness-budget", "--harness-seed", "--harness-profile",
                 "--shard", "--harness-no-tracking", "--harness-plugin"):
        assert flag in out, flag


@pytest.mark.parametrize("flag", ["--harness-out", "--harness-corpus"])
def test_a_file_where_the_session_writes_a_folder_is_a_usage_error_before_anything_runs(tmp_path, flag):
    (tmp_path / "afile").write_text("")
    rc, out = run_pytest(["--harness-fuzz", "--harness-pairs", "rmsnorm.aligned", "--harness-no-tracking",
                          "--harness-max-examples", "2", f"{flag}={tmp_path / 'afile' / 'sub'}"])
    assert rc == 4, out  # pytest's usage-error exit code: nothing ran, nothing went unsaved
    assert f"{tmp_path / 'afile'} is a file, not a folder" in out and "Traceback" not in out


def test_a_finding_the_corpus_cannot_take_fails_its_item(tmp_path):
    """A demonstration caught but not on disk (the pair's corpus folder is a file here; a full disk or a
    read-only folder alike) is not a green item: nothing would replay it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "router_topk.bf16").write_text("")  # where the pair's folder would be
    rc, out = run_pytest(["--harness-fuzz", "--harness-pairs", "router_topk.bf16", "--harness-no-tracking",
                          "--harness-max-examples", "20", f"--harness-corpus={corpus}", f"--harness-out={tmp_path / 'o'}"])
    assert rc == 1, out
    assert "router_topk.bf16: 1 finding(s) could not be written to the corpus" in out and "1 failed" in out
    # ... and it is kept with the session's outputs, which a CI job uploads
    [kept] = (tmp_path / "o").glob("new-repros*/router_topk.bf16/*.json")
    assert f"saved instead to {kept}" in out, out
    from harness.corpus import load_repro

    assert load_repro(kept).pair == "router_topk.bf16"
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["unwritten"] == [kept.stem]


def test_bad_profile_is_a_usage_error(tmp_path):
    rc, out = run_pytest(["--harness-fuzz", "--harness-profile", "weekly", "--harness-no-tracking",
                          "--harness-out", str(tmp_path)])
    assert rc == 4, out  # pytest's usage-error exit code
    assert "no campaign profile named 'weekly'" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("option, value, needle", [
    ("--harness-threshold", "-1", "--harness-threshold '-1': '-1' is not a finite number > 0"),
    ("--harness-threshold", "0", "--harness-threshold '0': '0' is not a finite number > 0"),
    ("--harness-threshold", "nan", "--harness-threshold 'nan': 'nan' is not a finite number > 0"),
    ("--harness-threshold", "q.*=abc", "--harness-threshold 'q.*=abc': 'abc' is not a finite number > 0"),
    ("--harness-threshold", "nomatch*=0.01", "--harness-threshold 'nomatch*=0.01': no selected pair matches 'nomatch*'"),
    ("--harness-timeout", "lin*=3,", "--harness-timeout 'lin*=3,': '3,' is not a finite number > 0"),
    ("--harness-timeout", "nomatch*=30", "--harness-timeout 'nomatch*=30': no selected pair matches 'nomatch*'"),
    ("--harness-budget", "0", "--harness-budget 0.0 must be a finite number of seconds > 0"),
    ("--harness-budget", "inf", "--harness-budget inf must be a finite number of seconds > 0"),
    ("--harness-max-examples", "0", "--harness-max-examples 0 must be >= 1"),
    ("--harness-max-examples", "-5", "--harness-max-examples -5 must be >= 1"),
])
def test_invalid_numeric_options_are_usage_errors_never_green(tmp_path, option, value, needle):
    corpus = tmp_path / "corpus"
    # the last session's outputs, which a usage error must leave as they are (its repros not uploaded yet)
    (tmp_path / "new-repros" / "p").mkdir(parents=True)
    (tmp_path / "new-repros" / "p" / "r.json").write_text("{}")
    (tmp_path / "summary.md").write_text("last night")
    rc, out = run_pytest(["--harness-fuzz", "--harness-pairs", "linear.aligned", option, value,
                          "--harness-no-tracking", "--harness-corpus", str(corpus), "--harness-out", str(tmp_path)])
    assert rc == 4, out  # pytest's usage-error exit code: not green, and nothing ran
    assert needle in out and "Traceback" not in out
    assert "passed" not in out and not corpus.exists()  # no bogus repros
    assert (tmp_path / "new-repros" / "p" / "r.json").exists() and (tmp_path / "summary.md").read_text() == "last night"


def test_the_summary_names_each_pairs_line_and_how_its_judged_means_spread(tmp_path):
    """A night's table read against the wrong line misleads: a pair judged at its own line says so under
    *expected*, summary.md gives the session's line, and *judged p90* where 90% of the cases were judged."""
    from tests.conftest import PLUGINS

    rc, out = run_pytest(["--harness-fuzz", "--harness-plugin", str(PLUGINS / "accepted_gap.py"), "--harness-pairs",
                          "gap.accepted", "--harness-pairs", "linear.aligned", "--harness-max-examples", "30",
                          "--harness-seed", "1", "--harness-no-tracking", "--harness-corpus", str(tmp_path / "c"),
                          "--harness-out", str(tmp_path / "out")])
    assert rc == 0, out
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "threshold 0.001 (a pair judged at another line says it under *expected*)" in md, md
    header = next(line for line in md.splitlines() if line.startswith("| pair |"))
    cells = {line.split(" | ")[0][2:]: dict(zip(header.strip("| ").split(" | "), line.strip("| ").split(" | ")))
             for line in md.splitlines() if line.startswith("| gap.") or line.startswith("| linear.")}
    gap, plain = cells["gap.accepted"], cells["linear.aligned"]
    assert gap["expected"] == "aligned (line 0.02)" and plain["expected"] == "aligned", cells
    # (the accepted gap's cases are judged near 0.006: over the default line, under its own)
    assert 0.001 < float(gap["judged p90"]) <= float(gap["max judged"]) < 0.02, gap
    assert "aligned (line 0.02)" in out and "judged p90" in out
    rc, out = run_pytest(["--harness-fuzz", "--harness-plugin", str(PLUGINS / "accepted_gap.py"), "--harness-pairs",
                          "gap.accepted", "--harness-threshold", "gap.accepted=0.01", "--harness-max-examples", "12",
                          "--harness-seed", "1", "--harness-no-tracking", "--harness-corpus", str(tmp_path / "c"),
                          "--harness-out", str(tmp_path / "out")])
    assert rc == 0 and "aligned (line 0.01)" in out, out


def test_a_missed_demonstration_is_in_the_summary(tmp_path):
    """One case cannot catch the rotary demonstration (it needs a large start): MISSED is reported
    on the terminal and in summary.json and summary.md, and the run is not failed for it."""
    rc, out = run_pytest(["--harness-fuzz", "--harness-pairs", "rotary.bf16_angles", "--harness-max-examples", "1",
                          "--harness-seed", "1", "--harness-no-tracking", "--harness-corpus", str(tmp_path / "c"),
                          "--harness-out", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    if summary["pairs"][0]["verdict"] != "MISSED":
        pytest.skip(f"seed 1 caught the demonstration in one case ({summary['pairs'][0]['verdict']})")
    assert rc == 0, out
    assert summary["missed_demonstrations"] == ["rotary.bf16_angles"]
    assert "missed demonstrations: 1 of 1 not caught: rotary.bf16_angles" in out
    assert "**Missed demonstrations (1)**: rotary.bf16_angles" in (tmp_path / "out" / "summary.md").read_text()


@pytest.mark.slow
def test_sigterm_to_the_xdist_controller_is_an_interrupt_with_a_summary(tmp_path):
    """A CI timeout sends SIGTERM to pytest: the session stops as on Ctrl-C (exit 2, pytest's
    interrupted), the summary keeps the pair that finished and lists the one it interrupted, and
    the MLflow campaign run is closed as KILLED, not left RUNNING."""
    import signal
    import time

    from mlflow import MlflowClient

    started = tmp_path / "started"
    plugin = tmp_path / "slow_pairs.py"
    plugin.write_text(textwrap.dedent(f"""
        import pathlib, time, torch
        from harness import Axes, Outcome, TargetPair, register

        def build(case, device):
            return case.token_randn(8, "x")

        def quick(x):
            return Outcome(logprobs=torch.log_softmax(x, -1))

        def slow(x):
            pathlib.Path({str(started)!r}).touch()
            time.sleep(0.7)
            return quick(x)

        for name, path in (("slow.a_quick", quick), ("slow.b_slow", slow), ("slow.c_slow", slow)):
            register(TargetPair(name=name, kind="op", expected="aligned", build=build, trainer=path, rollout=path,
                                axes=Axes(n_seqs=(1, 2), seq_len=(1, 3))))
    """))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out_dir = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--harness-fuzz", "-n", "2",
                             f"--harness-plugin={plugin}", "--harness-pairs", "slow.*", "--harness-max-examples", "5",
                             "--harness-tracking-uri", uri, f"--harness-corpus={tmp_path / 'corpus'}",
                             f"--harness-out={out_dir}"], cwd=ROOT, env=clean_env(OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    # the quick pair's 20-odd cases are done and its worker has moved on to the second slow pair (so its
    # output, where xdist hands results over, never comes): the slow pairs' cases take a minute more
    time.sleep(8.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    summary = json.loads((out_dir / "summary.json").read_text())
    verdicts = {d["pair"]: d["verdict"] for d in summary["pairs"]}
    assert verdicts["slow.a_quick"] == "clean", out
    # the slow pairs were running: each says how far it got from the counts its item left (not "not run")
    for name in ("slow.b_slow", "slow.c_slow"):
        assert verdicts[name].startswith("interrupted after ") and verdicts[name].endswith(": no verdict"), verdicts
    assert {d["pair"]: d["examples"] for d in summary["pairs"]}["slow.b_slow"] > 0
    assert "slow.b_slow (interrupted after " in out
    assert summary["interrupted"] is True and "this summary was written when the session stopped" in \
        (out_dir / "summary.md").read_text()
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("harness")
    [camp] = client.search_runs([exp.experiment_id], "tags.`harness.kind` = 'campaign'")
    assert camp.info.status == "KILLED" and camp.data.metrics["cases"] > 0  # the finished pair's cases


def test_an_xdist_worker_whose_controller_is_gone_stops_as_on_ctrl_c(tmp_path):
    """A worker outlives a killed controller (SIGKILL, a runner torn down): it notices it was
    re-parented and stops as on Ctrl-C (its campaign writes what it found and ends) instead of
    fuzzing on for the rest of its budget."""
    import time

    done = tmp_path / "stopped"
    # (what a campaign's handler does with SIGTERM: stop as on Ctrl-C; here, say so and end. SIGINT is
    # ignored in a process started in the background, as CI starts pytest: the watch must not use it)
    child = (f"import os, signal, time, harness.pytest_plugin as p\n"
             f"signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
             f"signal.signal(signal.SIGTERM, lambda *a: (open({str(done)!r}, 'w').close(), os._exit(0)))\n"
             f"p._stop_with_the_controller(0.1)\n"
             f"open({str(tmp_path / 'ready')!r}, 'w').close()\n"
             f"time.sleep(60)\n")
    parent = (f"import subprocess, sys, time, pathlib\n"
              f"subprocess.Popen([sys.executable, '-c', {child!r}])\n"
              f"while not pathlib.Path({str(tmp_path / 'ready')!r}).exists():\n    time.sleep(0.05)\n")
    subprocess.run([sys.executable, "-c", parent], cwd=ROOT, env=clean_env(), timeout=120, check=True)
    deadline = time.monotonic() + 30
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert done.exists()


def test_an_interrupted_pair_with_some_streams_done_says_so(tmp_path):
    """A demonstration one of whose four streams finished without a catch is not MISSED; a pair whose
    interrupted item wrote a repro (its result never came back) is not "not run": what it found is
    counted from its copy in new-repros."""
    from types import SimpleNamespace

    from harness.pytest_plugin import _not_run

    units = [{"pair": p, "expected": e, "stream": i} for p, e in (("d.demo", "diverges"), ("a.ok", "aligned"))
             for i in range(4)] + [{"pair": q, "expected": "aligned", "stream": 0} for q in ("y.found", "z.queued")]
    fs = SimpleNamespace(units=lambda: units, seed=1, out=tmp_path / "out", shard=None, corpus=tmp_path / "corpus")
    (fs.out / "new-repros" / "y.found").mkdir(parents=True)
    (fs.out / "new-repros" / "y.found" / "abc123.json").write_text(json.dumps(
        {"pair": "y.found", "signature": "s", "symptom": "divergence", "status": "open", "metrics": {"kl": 0.01}}))
    done = [{"pair": "d.demo", "stream": 2, "verdict": "MISSED"}] + [{"pair": "a.ok", "stream": i, "verdict": "clean"}
                                                                     for i in range(4)]
    results = [{"pair": "d.demo", "expected": "diverges", "verdict": "MISSED", "findings": [], "examples": 5},
               {"pair": "a.ok", "expected": "aligned", "verdict": "clean", "findings": [], "examples": 20}]
    added = _not_run(fs, results, done)
    assert [d["verdict"] for d in results] == ["MISSED (interrupted: 1/4 streams)", "clean"]
    assert [(d["pair"], d["verdict"]) for d in added] == [
        ("y.found", "REGRESSION (interrupted; 1 finding(s) before the stop: in new-repros/y.found/)"),
        ("z.queued", "not run (interrupted)")]
    # a demonstration whose interrupted stream wrote a crash is BROKEN, and keeps its streams note
    (fs.out / "new-repros" / "d.demo").mkdir(parents=True)
    (fs.out / "new-repros" / "d.demo" / "c0ffee.json").write_text(json.dumps({"pair": "d.demo", "symptom": "crash"}))
    results[0]["verdict"] = "MISSED"
    _not_run(fs, results, done)
    assert results[0]["verdict"] == ("BROKEN (interrupted; 1 finding(s) before the stop: in new-repros/d.demo/; "
                                     "interrupted: 1/4 streams)"), results[0]["verdict"]
    (f,) = added[0]["findings"]  # (summary.json's new_aligned_regressions lists new findings of aligned pairs)
    assert f["id"] == "abc123" and f["new"] and f["path"] == str(tmp_path / "corpus" / "y.found" / "abc123.json")
    # an item that was running left its counts so far: its pair ran, and says how far (it said "not run", 0 cases)
    (fs.out / ".progress").mkdir()
    (fs.out / ".progress" / "z.queued#0.json").write_text(json.dumps(
        {"pair": "z.queued", "stream": 0, "examples": 7, "seconds": 3.5, "max_score": 2e-9, "max_k3": 1e-9}))
    (fs.out / ".progress" / "a.ok#1.json").write_text(json.dumps(  # (a finished stream's: its result counts)
        {"pair": "a.ok", "stream": 1, "examples": 3, "seconds": 1.0, "max_score": 0.5, "max_k3": 0.5}))
    results[1]["max_score"] = results[1]["max_k3"] = 0.0
    results[1]["seconds"] = 2.0
    added = _not_run(fs, results, done)
    assert [(d["pair"], d["verdict"], d["examples"]) for d in added][1] == (
        "z.queued", "interrupted after 7 cases (max judged 2e-09): no verdict", 7)
    assert results[1]["examples"] == 20 and results[1]["max_score"] == 0.0


def test_collect_only_lists_the_items_and_writes_nothing(tmp_path):
    out_dir = tmp_path / "out"
    rc, out = run_pytest(["--harness-fuzz", "--co", "-q", "--harness-pairs", "router_topk.*",
                          f"--harness-tracking-uri=sqlite:///{tmp_path / 'mlflow.db'}", f"--harness-out={out_dir}"])
    assert "harness-fuzz::router_topk.bf16" in out and "harness-fuzz::router_topk.replay" in out, out
    assert not out_dir.exists() and not (tmp_path / "mlflow.db").exists()  # no summary, no empty campaign run


def test_a_plugin_and_no_pairs_named_collects_the_plugins_pairs_only(tmp_path):
    """A user's nightly with its own plugin (the README's `# your own pairs` line) runs its pairs, not
    every built-in one (whose demonstrations' repros would land in the user's corpus)."""
    plugin = ROOT / "tests" / "plugins" / "two_bugs.py"
    rc, out = run_pytest(["--harness-fuzz", "--co", "-q", f"--harness-plugin={plugin}", "--harness-no-tracking"],
                         cwd=tmp_path)
    items = [line for line in out.splitlines() if "harness-fuzz::" in line]
    assert sorted(i.split("::")[-1] for i in items) == ["user.two_bugs", "user.two_bugs_rare"], out
    assert f"running the 2 pair(s) of {plugin}" in out, out
    # ... and one that registers nothing (register() forgotten) is a usage error, not every built-in pair
    empty = tmp_path / "empty.py"
    empty.write_text("from harness import TargetPair\n")
    rc, out = run_pytest(["--harness-fuzz", f"--harness-plugin={empty}", "--harness-no-tracking",
                          "--harness-out", str(tmp_path / "out")], cwd=tmp_path)
    assert rc == 4 and "registered no pair" in out and "passed" not in out and "Traceback" not in out, out


def test_xdist_one_summary_one_campaign_run(tmp_path):
    """Two workers share the pairs; the controller aggregates one summary and one campaign run."""
    from mlflow import MlflowClient

    from harness.fuzz import pair_seed
    from harness.profiles import nightly_seed

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out_dir = tmp_path / "out"
    rc, out = run_pytest(["--harness-fuzz", "-n", "2", "--harness-pairs", "router_topk.*", "--harness-budget", "15",
                          "--harness-max-examples", "40", "--harness-profile", "nightly", "--harness-run-id", "4242",
                          "--harness-tracking-uri", uri, "--harness-corpus", str(tmp_path / "corpus"),
                          "--harness-out", str(out_dir)])
    assert rc == 0, out
    summary = json.loads((out_dir / "summary.json").read_text())
    seed = nightly_seed("4242")
    assert summary["seed"] == seed and "run id 4242" in summary["seed_origin"]
    verdicts = {d["pair"]: d["verdict"] for d in summary["pairs"]}
    assert verdicts == {"router_topk.bf16": "caught", "router_topk.replay": "clean"}, out
    assert {d["worker"] for d in summary["pairs"]} == {"gw0", "gw1"}  # one pair on each worker
    assert all(d["seed"] == pair_seed(seed, d["pair"]) for d in summary["pairs"])  # the controller's seed
    assert "demonstrations caught: 1; aligned clean: 1" in out

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("harness")
    campaigns = client.search_runs([exp.experiment_id], "tags.`harness.kind` = 'campaign'")
    assert len(campaigns) == 1
    camp = campaigns[0]
    assert camp.info.run_id == summary["campaign_run_id"]
    assert camp.data.params["seed"] == str(seed) and camp.data.params["profile"] == "nightly"
    assert camp.data.metrics["cases"] == sum(d["examples"] for d in summary["pairs"])
    assert camp.data.metrics["findings"] == 1
    regressions = client.search_runs([exp.experiment_id], "tags.`harness.kind` = 'regression'")
    assert [r.data.tags["harness.pair"] for r in regressions] == ["router_topk.bf16"]
    assert regressions[0].data.tags["mlflow.parentRunId"] == camp.info.run_id  # logged by a worker, under it
    # ... and seen by the controller's campaign (workers running streams of one pair count once)
    seen_by = [k for k in regressions[0].data.tags if k.startswith("harness.seen_by.")]
    from harness.profiles import night_uid

    assert seen_by == [f"harness.seen_by.{night_uid('4242')}"]  # (its run id's night: what every shard counts as)

    # the morning report reads the per-pair cases the controller logged on the campaign run
    from click.testing import CliRunner

    from harness.report import report_command

    report = tmp_path / "nightly.md"
    res = CliRunner().invoke(report_command, ["--tracking-uri", uri, "--out", str(report)])
    assert res.exit_code == 0, res.output
    cases = {d["pair"]: d["examples"] for d in summary["pairs"]}
    assert f"| router_topk.replay | aligned | 0 | 0 | 0 | {cases['router_topk.replay']} |" in report.read_text()
    assert f"| router_topk.bf16 | diverges | 1 | 0 | 0 | {cases['router_topk.bf16']} |" in report.read_text()


@pytest.mark.slow
def test_planted_aligned_regression_fails_then_is_known(tmp_path):
    """A new finding of an aligned pair fails its item with a readable message; once in the corpus,
    the same finding is a known regression (xfail) and the run passes."""
    args = ["--harness-fuzz", "--harness-plugin", str(PLANTED), "--harness-pairs", "planted.*", "--harness-seed", "7",
            "--harness-max-examples", "20", "--harness-no-tracking", "--harness-corpus", str(tmp_path / "corpus"),
            "--harness-out", str(tmp_path / "out")]
    rc, out = run_pytest(args)
    assert rc == 1, out
    assert "aligned pair planted.aligned_bias: 1 new regression(s)" in out
    assert "minimal case: " in out and "k3 " in out
    repro = next((tmp_path / "corpus" / "planted.aligned_bias").glob("*.json"))
    assert f"replay: harness replay --plugin {PLANTED} {repro}" in out
    assert (tmp_path / "out" / "new-repros" / "planted.aligned_bias" / repro.name).exists()
    assert f"repro file(s) to commit to {tmp_path / 'corpus'}/ (copied to {tmp_path / 'out' / 'new-repros'}/): " \
        f"planted.aligned_bias/{repro.stem}.json (new)" in out, out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["new_aligned_regressions"] == [repro.stem]

    rc, out = run_pytest(args + ["-rx"])
    assert rc == 0, out
    assert "1 xfailed" in out and "known regression(s) of planted.aligned_bias" in out
    assert f"{repro.stem} (seen again, " in out and "on this run's case; the corpus file holds its own" in out, out
    assert not (tmp_path / "out" / "new-repros").exists()  # last night's copy is gone: nothing new tonight
    assert "repro file(s) to commit" not in out

    # two streams of one pair, one fresh corpus: the first to find the bug fails its item, the other
    # says the finding is this run's (not "already in the corpus"); the rerun line keeps the streams
    fresh = [a if a != str(tmp_path / "corpus") else str(tmp_path / "corpus2") for a in args]
    rc, out = run_pytest(fresh + ["-rx", "--harness-streams", "2"])
    assert rc == 1 and "1 failed" in out and "1 xfailed" in out, out
    assert "found by another stream of this run" in out and "already in the corpus" not in out, out
    assert "--harness-streams 2" in out.split("rerun: ")[1].splitlines()[0]


def test_hypothesis_ci_profile_does_not_take_over(tmp_path):
    """Under CI=true Hypothesis loads its derandomizing `ci` profile; the engine's explicit settings
    still make the campaign seed decide the cases (different seeds, different cases)."""
    script = textwrap.dedent("""
        import json
        import hypothesis
        from harness import REGISTRY
        from harness import fuzz

        assert hypothesis.settings.default.derandomize, "the ci profile should be active under CI=true"
        seen = []
        real = fuzz.run_case
        def spy(pair, case, *a, **k):
            seen.append(case.key())
            return real(pair, case, *a, **k)
        fuzz.run_case = spy
        pair = REGISTRY.get("router_topk.replay")
        keys = {}
        for run, seed in (("a", 1), ("b", 2), ("c", 1)):
            seen.clear()
            fuzz.fuzz_pair(pair, fuzz.CampaignConfig(pairs=[pair], max_examples=8), seed, None)
            keys[run] = list(seen)
        print(json.dumps(keys))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CI": "true"})
    assert proc.returncode == 0, proc.stderr
    keys = json.loads(proc.stdout.strip().splitlines()[-1])
    assert keys["a"] == keys["c"]  # the seed reproduces the cases
    assert keys["a"] != keys["b"]  # and a different seed draws different ones: not derandomized


def test_cuda_device(tmp_path):
    """On a machine without CUDA --harness-device cuda is a usage error that says what to do; with
    CUDA, one pair is fuzzed on the GPU."""
    import torch

    args = ["--harness-fuzz", "--harness-device", "cuda", "--harness-pairs", "router_topk.replay",
            "--harness-max-examples", "10", "--harness-no-tracking", "--harness-corpus", str(tmp_path / "corpus"),
            "--harness-out", str(tmp_path / "out")]
    rc, out = run_pytest(args)
    if torch.cuda.is_available():
        assert rc == 0, out
        assert json.loads((tmp_path / "out" / "summary.json").read_text())["pairs"][0]["verdict"] == "clean"
    else:
        assert rc == 4, out
        assert "--harness-device cuda was asked for but torch sees no CUDA device" in out and "Traceback" not in out


def test_fuzz_options_on_the_command_line_without_harness_fuzz_are_a_usage_error(tmp_path):
    """`pytest --shard 1/2` alone would run the whole suite unsplit and say nothing; the same options
    in PYTEST_ADDOPTS (a project's defaults for its nightly) leave a plain run alone."""
    (tmp_path / "test_plain.py").write_text("def test_ok():\n    pass\n")
    rc, out = run_pytest(["--shard", "1/2", str(tmp_path / "test_plain.py")], cwd=tmp_path)
    assert rc == 4 and "--shard choose(s) what a fuzz campaign runs: add --harness-fuzz" in out, out
    rc, out = run_pytest([str(tmp_path / "test_plain.py")], cwd=tmp_path, env={"PYTEST_ADDOPTS": "--harness-pairs x"})
    assert rc == 0 and "1 passed" in out, out


@pytest.mark.slow
def test_a_regression_open_in_mlflow_but_not_in_a_fresh_checkouts_corpus_is_known(tmp_path):
    """An ephemeral CI runner checks out a corpus its repro was never committed to: the finding is
    new to that corpus, but the MLflow store holds it as an open regression from an earlier night.
    It is a known regression (xfail) that says to commit its repro, not a new one failing every night."""
    store = f"--harness-tracking-uri=sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["--harness-fuzz", f"--harness-plugin={PLANTED}", "--harness-pairs", "planted.aligned_bias",
            "--harness-max-examples", "20", store, f"--harness-out={tmp_path / 'out'}", "-rx"]
    rc, out = run_pytest(args + [f"--harness-corpus={tmp_path / 'night1'}", "--harness-seed", "7"])
    assert rc == 1 and "1 new regression(s)" in out, out
    rc, out = run_pytest(args + [f"--harness-corpus={tmp_path / 'night2'}", "--harness-seed", "8"])
    assert rc == 0 and "1 xfailed" in out and "is a regression in MLflow" in out, out
    assert "but was not in this checkout's corpus: commit" in out, out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["new_aligned_regressions"] == []


_START_PROBE = """
import json, os, sys
from pathlib import Path

def _children():  # this process's child processes' command lines (Linux /proc)
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().split(") ")[1].split()[1] == str(os.getpid()):
                out.append((stat.parent / "cmdline").read_bytes().replace(b"\\0", b" ").decode())
        except (OSError, IndexError):
            pass
    return out

Path(os.environ["PROBE_OUT"]).write_text(json.dumps({
    "rewriting": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "AssertionRewritingHook"],
    "fork_server": any("multiprocessing.forkserver" in c for c in _children()),
}))
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads child processes from Linux /proc")
@pytest.mark.parametrize("extra", [[], ["--harness-no-isolation"]])
def test_a_fuzz_session_starts_the_fork_server_early_and_rewrites_no_asserts(tmp_path, extra):
    """With --harness-fuzz no module is assertion-rewritten (no test file is collected; rewriting the
    plugins' packages re-compiled them in every process where bytecode is not cached), and the fork
    server is already importing when the pairs load (a plugin file is imported then), unless cases run
    in this process. A plain session keeps pytest's rewriting."""
    (tmp_path / "probe.py").write_text(_START_PROBE)
    out = tmp_path / "probe.json"
    rc, text = run_pytest(["--harness-fuzz", "--harness-plugin", str(tmp_path / "probe.py"), "--harness-pairs",
                           "rmsnorm.aligned", "--harness-max-examples", "1", "--harness-no-tracking",
                           f"--harness-corpus={tmp_path / 'corpus'}", f"--harness-out={tmp_path / 'out'}", *extra],
                          cwd=tmp_path, env={"PROBE_OUT": str(out)})
    assert rc == 0, text
    seen = json.loads(out.read_text())
    assert seen == {"rewriting": [], "fork_server": not extra}, seen
    (tmp_path / "test_plain.py").write_text("import json, os\nfrom pathlib import Path\n\n"
                                            "def test_probe():\n    exec(Path('probe.py').read_text())\n")
    rc, text = run_pytest(["-q", str(tmp_path / "test_plain.py")], cwd=tmp_path, env={"PROBE_OUT": str(out)})
    assert rc == 0, text
    assert json.loads(out.read_text())["rewriting"] == ["AssertionRewritingHook"]


def test_an_unknown_pair_names_the_pytest_option_that_loads_a_plugin(tmp_path):
    rc, out = run_pytest(["--harness-fuzz", "--harness-pairs", "mine.aligned", "--harness-no-tracking",
                          "--harness-out", str(tmp_path / "out"), "--harness-corpus", str(tmp_path / "c"), "-q"])
    assert rc != 0 and "no target pair named 'mine.aligned'" in out, out
    assert "`--harness-plugin=path/to/file.py`" in out and "`--plugin path" not in out, out


_SLOW_CASES = '''
import time, torch
from harness import Axes, Outcome, TargetPair, register

def build(case, device):
    time.sleep(0.5)
    return case.token_randn(16, "x")

def path(x):
    return Outcome(logprobs=torch.log_softmax(x, -1))

for name in ("slowcase.a", "slowcase.b"):
    register(TargetPair(name=name, kind="op", expected="aligned", build=build, trainer=path, rollout=path,
                        axes=Axes(n_seqs=(1, 2), seq_len=(1, 4))))
'''


def test_a_session_that_tested_nothing_is_not_a_pass_and_an_empty_shard_is_not_an_error(tmp_path):
    """A budget too small for any case (a pair's cold start runs before its budget: here every case
    takes 0.5 s): each pair is skipped (not run, not passed) and the session exits 4 (`harness fuzz`
    exits 2: nothing was tested). A shard left without pairs (more CI jobs than pairs) exits 0 with a
    note instead of pytest's 'no tests ran' (5), which failed spare matrix jobs."""
    base = ["--harness-fuzz", "--harness-no-tracking", "--harness-corpus", str(tmp_path / "c"), "-q", "-rs"]
    (tmp_path / "slow.py").write_text(_SLOW_CASES)
    rc, out = run_pytest(base + ["--harness-plugin", str(tmp_path / "slow.py"), "--harness-pairs", "slowcase.*",
                                 "--harness-budget", "0.01", "--harness-out", str(tmp_path / "o1")], cwd=tmp_path)
    assert rc == 4, out
    assert "2 skipped" in out and "not run: the budget ended before its first case came back" in out, out
    assert "error: no case ran" in out and "UNFINISHED" not in out, out
    rc, out = run_pytest(base + ["--harness-pairs", "lm_head.aligned", "--shard", "2/2",
                                 "--harness-out", str(tmp_path / "o2")])
    assert rc == 0, out
    assert "shard 2/2 got no pair of this selection" in out, out
    assert "warning: shard 2/2 with a fresh seed" in out, out  # (no --harness-seed: each job would draw its own)


def test_a_shard_that_ran_some_streams_of_a_demonstration_does_not_call_it_missed():
    from types import SimpleNamespace

    from harness.fuzz import NOT_HERE
    from harness.pytest_plugin import _split_streams_missed

    units = [{"pair": "demo.split", "stream": 0}, {"pair": "demo.whole", "stream": 0}, {"pair": "demo.whole", "stream": 1}]
    fs = SimpleNamespace(shard=(2, 2), streams=2, units=lambda: units, notes=[])
    results = [{"pair": "demo.split", "verdict": "MISSED"}, {"pair": "demo.whole", "verdict": "MISSED"}]
    _split_streams_missed(fs, results)
    assert [d["verdict"] for d in results] == [NOT_HERE, "MISSED"]  # (every stream of demo.whole ran here)
    assert fs.notes and fs.notes[0].startswith("demo.split: not caught by this shard's streams (1 of 2)")


def test_a_finding_whose_shrinking_the_budget_cut_short_gives_the_command_that_goes_on(tmp_path):
    faults = str(Path(__file__).resolve().parents[1] / "plugins" / "faults.py")
    rc, out = run_pytest(["--harness-fuzz", f"--harness-plugin={faults}", "--harness-pairs", "faults.diverges",
                          "--harness-budget", "2", "--harness-seed", "1", "--harness-no-tracking", "-q",
                          "--harness-corpus", str(tmp_path / "c"), "--harness-out", str(tmp_path / "o")],
                         env={"FAULTS_SLEEP": "0.3"})  # (each case 0.3 s: a 2 s budget stops its shrinking)
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    [cut] = summary["shrink_cut_short"]
    assert cut["pair"] == "faults.diverges" and cut["command"].startswith("harness shrink --plugin ") \
        and "faults.py --no-tracking " in cut["command"]
    assert f"{cut['id']} (faults.diverges): shrinking was cut short" in out, out
    assert "Shrinking cut short (1)" in (tmp_path / "o" / "summary.md").read_text()


_SLOW_START = '''
import time, torch
from harness import Axes, Outcome, TargetPair, register
LOADED = []

def build(case, device):
    if not LOADED:  # a model's first load in a process: seconds
        time.sleep(4.0)
        LOADED.append(1)
    return case.token_randn(16, "x")

def path(x):
    return Outcome(logprobs=torch.log_softmax(x, -1))

register(TargetPair(name="slowstart.aligned", kind="model", expected="aligned", build=build, trainer=path, rollout=path,
                    axes=Axes(n_seqs=(1, 2), seq_len=(1, 4))))
'''


def test_a_pairs_cold_start_is_not_charged_to_its_budget(tmp_path):
    """A trial's nightly: `--harness-budget 8 --harness-streams 2` gave each stream 4 s, and its model
    pairs' first cases (transformers' import, the model's build) ran past that: UNFINISHED, a failed
    night, where `harness fuzz --budget 60` ran them. The first case runs before the budget starts."""
    (tmp_path / "slow.py").write_text(_SLOW_START)
    rc, out = run_pytest(["--harness-fuzz", "--harness-plugin", str(tmp_path / "slow.py"), "--harness-pairs",
                          "slowstart.aligned", "--harness-budget", "2", "--harness-streams", "2", "--harness-seed", "1",
                          "--harness-no-tracking", f"--harness-corpus={tmp_path / 'c'}",
                          f"--harness-out={tmp_path / 'out'}", "-q", "-s"], cwd=tmp_path)
    assert rc == 0 and "2 passed" in out and "UNFINISHED" not in out, out
    assert "slowstart.aligned: cold start 4." in out and "before its budget" in out, out
