"""`harness shrink`: a repro whose shrinking was cut short is shrunk further from its own case."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import Case
from harness.corpus import load_repro, replay
from harness.env import machine_differences, recorded_threads
from harness.reshrink import shrink_file
from harness.tracking import NullTracker

ROOT = Path(__file__).resolve().parents[2]
BIG = Case(seed=3, seq_lens=(5, 7, 3, 6))  # attention.mask_leak diverges on it (k3 ~0.5)

# A plugin kept outside the repository: a leak across packed sequences (two or more diverge), a kernel
# that cannot take a batch of one (SIGSEGV), and, on request, a slow case that says when it runs a
# smaller batch than four (for the interrupt test).
PLUGIN = """
import os, pathlib, signal, time, torch
from harness import Axes, Outcome, TargetPair, register

def build(case, device):
    return {"x": case.token_randn(8, "x"), "lens": case.seq_lens}

def trainer(inp):
    return Outcome(logprobs=torch.log_softmax(inp["x"], -1))

def rollout(inp):
    lens = inp["lens"]
    if len(lens) == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(float(os.environ.get("LEAKY_SLEEP", "0")))
    mark = os.environ.get("LEAKY_MARK")
    if mark and len(lens) < 4:
        if pathlib.Path(mark).exists():  # a smaller case was accepted: hold the next one, whatever the machine's speed
            time.sleep(float(os.environ.get("LEAKY_HOLD", "0")))
        pathlib.Path(mark).touch()
    return Outcome(logprobs=torch.log_softmax(inp["x"] * 0.5, -1))

register(TargetPair(name="leaky.pack", kind="op", expected="aligned", build=build, trainer=trainer,
                    rollout=rollout, axes=Axes(n_seqs=(1, 4), seq_len=(1, 8))))
"""


def cut_short_repro(tmp_path: Path, case: Case = BIG, pair: str = "attention.mask_leak") -> Path:
    """The committed mask-leak repro as a campaign cut short would have left it: a big case."""
    src = next((ROOT / "corpora" / "attention.mask_leak").glob("*.json"))
    dst = tmp_path / pair / src.name
    dst.parent.mkdir(parents=True)
    data = json.loads(src.read_text())
    data["pair"] = pair
    data["case"] = case.to_json()
    data.pop("case_fingerprint")
    data["found"]["shrink_complete"] = False
    dst.write_text(json.dumps(data, indent=2))
    return dst


def plugin_repro(tmp_path: Path) -> tuple[Path, Path]:
    plugin = tmp_path / "outside" / "leaky.py"
    plugin.parent.mkdir()
    plugin.write_text(PLUGIN)
    path = cut_short_repro(tmp_path, BIG, pair="leaky.pack")
    data = json.loads(path.read_text())
    data["loader"] = {"kind": "plugin_file", "path": str(plugin)}
    path.write_text(json.dumps(data, indent=2))
    return path, plugin


def test_a_cut_short_repro_is_shrunk_to_its_minimal_case_and_replays_bit_for_bit(tmp_path, harness_cli):
    path = cut_short_repro(tmp_path)
    lines: list[str] = []
    assert shrink_file(path, budget=300, max_evals=500, log=lines.append, tracking=False) == "shrunk"
    assert "4 sequence(s), 21 scored token(s)" in lines[0] and "-> 2 sequence(s)" in lines[0], lines
    repro = load_repro(path)
    assert repro.case.batch_size == 2 and repro.case.n_tokens <= 4  # two sequences sharing a row leak
    # what the simpler neighbours of the new case gave, as this shrink ran them: each passes
    assert repro.neighbours and all(r["symptom"] == "none" for r in repro.neighbours), repro.neighbours
    assert repro.found["shrink_complete"] is True and not repro.case_edited
    last = repro.history[-1]
    assert last["event"] == "shrunk further" and Case.from_json(last["replaced_case"]) == BIG
    # the new metrics were computed here, with the repro's thread count: said beside the finding's environment
    on = repro.environment["metrics_recorded_on"]
    assert not machine_differences(repro.environment) and on["torch_threads"] == recorded_threads(repro.environment)
    assert last["note"] == "`harness shrink`" and last["seconds"] > 0 and last["cases_tried"] > 0
    res = replay(repro)
    assert res.diverges and res.compared and res.mismatches == {}
    # `show` says the case was shrunk after the campaign's shrink, by what, and how long that took
    code, out, err = harness_cli("show", str(path))
    assert code == 0 and "then shrunk further 1 time(s)" in out and "by `harness shrink` in " in out, out + err
    # shrinking again finds nothing simpler and leaves the file alone
    before = path.read_text()
    lines.clear()
    assert shrink_file(path, budget=300, max_evals=500, log=lines.append, tracking=False) == "minimal"
    assert path.read_text() == before and "minimal" in lines[0]


def test_max_evals_that_run_out_keep_what_was_shrunk_and_say_so(tmp_path):
    path = cut_short_repro(tmp_path)
    lines: list[str] = []
    assert shrink_file(path, budget=300, max_evals=2, log=lines.append, tracking=False) == "cut short"
    assert "--max-evals ran out: run again to go on" in lines[0]
    repro = load_repro(path)
    assert repro.found["shrink_complete"] is False and repro.case.n_tokens < BIG.n_tokens


def shrink_cli(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from harness.reshrink import shrink_command

    res = CliRunner().invoke(shrink_command, list(args))
    return res.exit_code, res.output


def test_a_repro_that_no_longer_fails_is_not_touched(tmp_path):
    path = cut_short_repro(tmp_path, Case(seed=3, seq_lens=(12,)))  # one sequence: no leak
    before = path.read_text()
    code, out = shrink_cli("--no-tracking", str(path))
    assert code == 1, out
    assert "does not fail" in out and "no failure: passes" in out and "harness replay" in out
    assert "1 does not fail" in out
    assert path.read_text() == before


def test_an_error_of_another_type_is_not_the_recorded_failure(tmp_path):
    path = cut_short_repro(tmp_path)
    data = json.loads(path.read_text())  # recorded as a ValueError; the pair now diverges instead
    data.update(symptom="error", error={"type": "ValueError", "message": "x", "where": "f", "traceback": ""})
    path.write_text(json.dumps(data))
    before = path.read_text()
    lines: list[str] = []
    assert shrink_file(path, budget=60, max_evals=10, log=lines.append, tracking=False) == "does not fail"
    assert "recorded error ValueError; its case now gives divergence" in lines[0], lines
    assert path.read_text() == before


def test_a_smaller_case_that_crashes_is_another_failure_and_shrinking_goes_on(tmp_path):
    """Cases run in a worker process: one sequence segfaults, which is not the recorded divergence."""
    from harness.cli import load_plugins

    path, plugin = plugin_repro(tmp_path)
    load_plugins((str(plugin),))
    lines: list[str] = []
    assert shrink_file(path, budget=300, max_evals=500, plugins=(str(plugin),), log=lines.append,
                       tracking=False) == "shrunk", lines
    repro = load_repro(path)
    assert repro.case.seq_lens == (1, 1) and repro.symptom == "divergence"


def test_sigterm_keeps_the_smallest_case_so_far_and_exits_130(tmp_path):
    path, plugin = plugin_repro(tmp_path)
    mark = tmp_path / "smaller"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LEAKY_SLEEP": "0.2", "LEAKY_MARK": str(mark), "LEAKY_HOLD": "60"}
    proc = subprocess.Popen([sys.executable, "-m", "harness", "shrink", "--no-tracking", "--plugin", str(plugin),
                             str(path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # the smaller case comes back and is accepted; the next one is running
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "interrupted" in out and "the smallest case so far is saved" in out, out
    repro = load_repro(path)
    assert repro.found["shrink_complete"] is False and repro.case.batch_size < 4
    assert repro.history[-1]["event"] == "shrunk further"


def test_the_regression_run_in_mlflow_gets_the_shrunk_case(tmp_path):
    from harness import REGISTRY
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.mlflow_tracking.lifecycle import fetch_repro, show_regression
    from harness.tracking import make_tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = CampaignConfig(pairs=[REGISTRY.get("attention.mask_leak")], seed=1, max_examples=30,
                         corpus=tmp_path / "corpus")
    assert run_campaign(cfg, make_tracker(uri), log=lambda m: None).findings
    [path] = (tmp_path / "corpus").rglob("*.json")
    data = json.loads(path.read_text())  # as a campaign cut short would have left it
    data["case"], data["found"]["shrink_complete"] = BIG.to_json(), False
    data.pop("case_fingerprint")
    path.write_text(json.dumps(data))
    lines: list[str] = []
    assert shrink_file(path, budget=300, max_evals=500, log=lines.append, tracking_uri=uri) == "shrunk"
    assert "MLflow regression run" in lines[-1] and "updated" in lines[-1], lines
    repro = load_repro(path)
    reg = show_regression(repro.id, uri)
    assert reg["case"] == repro.case.one_line() and "Shrunk further" in reg["note"]
    assert fetch_repro(repro.id, uri).case == repro.case  # `harness replay --run-id` replays the shrunk case
    # the metrics went at the last sighting's step, later: the run's latest values are the shrunk case's
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    history = client.get_metric_history(reg["run_id"], "kl")
    assert {m.step for m in history} == {0} and len(history) == 2
    assert client.get_run(reg["run_id"]).data.metrics["kl"] == repro.metrics["kl"]

    # a campaign whose shrinking was cut short at what is already the minimal case: `shrink` finds it
    # minimal and says so in the file and in MLflow
    data = json.loads(path.read_text())
    data["found"]["shrink_complete"] = False
    path.write_text(json.dumps(data))
    client.set_tag(reg["run_id"], "harness.shrink_complete", "false")
    lines.clear()
    assert shrink_file(path, budget=300, max_evals=500, log=lines.append, tracking_uri=uri) == "minimal"
    assert "shrink marked complete, metrics and repro artifact updated" in lines[-1], lines
    reg = show_regression(repro.id, uri)
    assert client.get_run(reg["run_id"]).data.tags["harness.shrink_complete"] == "true"
    assert "Shrink completed" in reg["note"] and fetch_repro(repro.id, uri).found["shrink_complete"] is True
    # the note's commands read this store, which is not the default one: they name it
    assert f"--tracking-uri {uri} --run-id {reg['run_id']}" in reg["note"], reg["note"]


def test_shrinking_another_corpus_copy_of_a_bug_leaves_its_regression_run_alone(tmp_path):
    """The same bug found by a tracked campaign (its minimal case in the run) and again into another
    corpus with --no-tracking, cut short: shrinking that copy with the store named must not give the
    run a larger case (a trial's run said 7 tokens in its header and 9 in its metrics)."""
    from harness import REGISTRY
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.mlflow_tracking.lifecycle import show_regression
    from harness.tracking import make_tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = CampaignConfig(pairs=[REGISTRY.get("attention.mask_leak")], seed=1, max_examples=30,
                         corpus=tmp_path / "corpus")
    assert run_campaign(cfg, make_tracker(uri), log=lambda m: None).findings
    [tracked] = (tmp_path / "corpus").rglob("*.json")
    before = show_regression(load_repro(tracked).id, uri)
    copy = tmp_path / "nightly" / tracked.parent.name / tracked.name  # the --no-tracking campaign's corpus
    copy.parent.mkdir(parents=True)
    data = json.loads(tracked.read_text())
    data["case"], data["found"]["shrink_complete"] = BIG.to_json(), False
    data.pop("case_fingerprint")
    copy.write_text(json.dumps(data))
    for gone in (False, True):  # the run names the other file (here), then a file this machine does not have
        if gone:
            tracked.rename(tmp_path / "moved.json")
            copy.write_text(json.dumps(data))
        lines: list[str] = []
        assert shrink_file(copy, budget=300, max_evals=4, log=lines.append, tracking_uri=uri) == "cut short"
        assert load_repro(copy).case.n_tokens > load_repro(tmp_path / "moved.json" if gone else tracked).case.n_tokens
        assert "was left as it is" in lines[-1], lines
        assert ("no larger than this shrink's" if gone else f"it records the corpus file {tracked}") in lines[-1]
        after = show_regression(before["run_id"], uri)
        assert after["case"] == before["case"] and "Shrunk further" not in after["note"]


def test_shrink_without_a_store_says_no_regression_run_was_updated(tmp_path, monkeypatch):
    """A campaign run with --tracking-uri, then `harness shrink FILE` without it: the regression run
    kept the cut-short case and shrink said nothing. It says so now, with the option that updates it."""
    from harness import REGISTRY
    from harness.fuzz import CampaignConfig, run_campaign

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # (no reports/mlflow.db here: the default store does not exist)
    cfg = CampaignConfig(pairs=[REGISTRY.get("attention.mask_leak")], seed=1, max_examples=30,
                         corpus=tmp_path / "corpus")
    assert run_campaign(cfg, NullTracker(), log=lambda m: None).findings
    [path] = (tmp_path / "corpus").rglob("*.json")
    data = json.loads(path.read_text())
    data["case"], data["found"]["shrink_complete"] = BIG.to_json(), False
    data.pop("case_fingerprint")
    path.write_text(json.dumps(data))
    lines: list[str] = []
    assert shrink_file(path, budget=300, max_evals=500, log=lines.append) == "shrunk"
    assert "no regression run was updated" in lines[-1] and "--tracking-uri URI" in lines[-1], lines


def test_a_timeout_repro_is_judged_at_its_recorded_timeout(tmp_path):
    """Hanging cases cost the recorded timeout each (not a cold-start allowance), and the shrunk
    repro keeps that timeout."""
    from harness.cli import load_plugins

    faults = ROOT / "tests" / "plugins" / "faults.py"
    load_plugins((str(faults),))
    path = cut_short_repro(tmp_path, Case(seed=3, seq_lens=(3, 2, 2)), pair="faults.hang")
    data = json.loads(path.read_text())
    data.update(symptom="timeout", loader={"kind": "plugin_file", "path": str(faults)}, metrics={},
                error={"type": "Timeout", "message": "the case ran longer than the per-case timeout of 1 s",
                       "where": "", "traceback": "", "timeout_s": 1.0})
    path.write_text(json.dumps(data))
    lines: list[str] = []
    t = time.monotonic()
    assert shrink_file(path, budget=120, max_evals=100, plugins=(str(faults),), log=lines.append,
                       tracking=False) == "shrunk", lines
    assert time.monotonic() - t < 60
    repro = load_repro(path)
    assert repro.case.seq_lens == (1, 1) and repro.symptom == "timeout" and repro.error["timeout_s"] == 1.0


def test_a_folder_is_the_repros_whose_shrinking_was_cut_short(tmp_path):
    path = cut_short_repro(tmp_path)  # cut short: shrunk
    done = json.loads(path.read_text())
    done["found"]["shrink_complete"], done["id"] = True, "0" * 12
    (path.parent / f"{'0' * 12}.json").write_text(json.dumps(done))  # complete: left alone
    fixed = {**done, "id": "1" * 12, "status": "fixed"}
    (path.parent / f"{'1' * 12}.json").write_text(json.dumps(fixed))  # fixed: left alone
    before = {p.name: p.read_text() for p in path.parent.glob("*.json") if p != path}
    code, out = shrink_cli("--no-tracking", str(tmp_path))
    assert code == 0, out
    assert "2 repro(s) in the folder(s) are fully shrunk (or fixed) and left alone" in out and "1 shrunk" in out
    assert {p.name: p.read_text() for p in path.parent.glob("*.json") if p != path} == before
    code, out = shrink_cli("--no-tracking", str(path.parent / f"{'1' * 12}.json"))
    assert code == 0 and "fixed" in out and "nothing to shrink" in out, out


def test_shrinking_a_case_edited_by_hand_says_the_replaced_metrics_are_the_case_before_the_edit(tmp_path):
    path = cut_short_repro(tmp_path)
    data = json.loads(path.read_text())
    data["case_fingerprint"] = "0" * 16  # the metrics are another case's: what an edit by hand leaves
    path.write_text(json.dumps(data, indent=2))
    assert load_repro(path).case_edited
    assert shrink_file(path, budget=300, max_evals=500, log=lambda _: None, tracking=False) == "shrunk"
    repro = load_repro(path)
    last = repro.history[-1]
    assert last["event"] == "shrunk further" and last["replaced_case_edited_by_hand"] is True
    assert not repro.case_edited  # the new metrics are the new case's


def test_a_smaller_case_replacing_metrics_with_inf_saves_them_as_json(tmp_path):
    """Replaced metrics go into the history as the repro held them; an inf among them (a sampled
    token the trainer excludes) must be written as "inf", not refused by the JSON writer (the
    campaign lost the smaller case with a traceback)."""
    from harness import REGISTRY
    from harness.execute import run_case

    path = cut_short_repro(tmp_path)
    data = json.loads(path.read_text())
    data["metrics"]["k3_kl"] = "inf"
    path.write_text(json.dumps(data, indent=2))
    repro = load_repro(path)
    assert repro.metrics["k3_kl"] == float("inf")
    small = Case(seed=3, seq_lens=(2, 1))
    ev = run_case(REGISTRY.get("attention.mask_leak"), small)
    repro.take_smaller_case(small, ev, True, "cpu", 1, note="test")
    repro.save(path)
    again = load_repro(path)
    assert again.case == small and again.history[-1]["replaced_metrics"]["k3_kl"] == "inf"
    # a campaign's smaller case says whether that case ran the same twice; `harness shrink` keeps the flag
    again.take_smaller_case(Case(seed=3, seq_lens=(1, 1)), ev, True, "cpu", 1, deterministic=False)
    assert again.found["deterministic"] is False
    again.take_smaller_case(small, ev, True, "cpu", 1)
    assert again.found["deterministic"] is False
    again.take_smaller_case(small, ev, True, "cpu", 1, deterministic=True)
    assert "deterministic" not in again.found


def test_a_smaller_case_that_cannot_be_written_is_printed_as_json_and_exits_3(tmp_path, monkeypatch):
    """A full disk (or a read-only folder) when the smaller case is written: the work is not lost
    (the repro is printed whole as JSON on stderr), the file is as it was, and the exit is 3."""
    from click.testing import CliRunner

    from harness.corpus import Repro
    from harness.reshrink import shrink_command

    path = cut_short_repro(tmp_path)
    before = path.read_text()

    def full_disk(self, where=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Repro, "save", full_disk)
    res = CliRunner().invoke(shrink_command, [str(path), "--no-tracking", "--budget", "300"])
    assert res.exit_code == 3, res.output
    assert f"error: could not write {path}: No space left on device" in res.output and "Traceback" not in res.output
    line = next(x for x in res.output.splitlines() if x.startswith("{"))
    assert Case.from_json(json.loads(line)["case"]).n_tokens < BIG.n_tokens  # the smaller case, whole
    assert "1 not written" in res.output and path.read_text() == before


def test_rerecord_goes_on_past_a_file_it_cannot_write(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from harness.corpus import Repro
    from harness.rerecord import rerecord_command

    import shutil

    src = next((ROOT / "corpora" / "moe_aggregate.bf16").glob("*.json"))
    path = tmp_path / "moe_aggregate.bf16" / src.name
    path.parent.mkdir()
    shutil.copy(src, path)
    data = json.loads(path.read_text())
    data["metrics"]["k3_kl"] = data["metrics"]["k3_kl"] * (1 + 1e-15) + 1e-18  # last bits to rewrite
    path.write_text(json.dumps(data))
    before = path.read_text()

    def read_only(self, where=None):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(Repro, "save", read_only)
    res = CliRunner().invoke(rerecord_command, [str(path)])
    assert res.exit_code == 2 and "not written" in res.output and "Read-only file system" in res.output, res.output
    assert "Traceback" not in res.output and path.read_text() == before
