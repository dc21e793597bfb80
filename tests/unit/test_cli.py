"""The command-line contract: exit codes and one-paragraph errors for bad input."""

import json
from pathlib import Path

import pytest

from harness.corpus import iter_corpus, load_repro


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    """A real repro, found once for the module."""
    from harness import REGISTRY
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.tracking import NullTracker

    corpus = tmp_path_factory.mktemp("corpus")
    cfg = CampaignConfig(pairs=[REGISTRY.get("router_topk.bf16")], seed=1, max_examples=50, corpus=corpus)
    run_campaign(cfg, NullTracker(), log=lambda m: None)
    [path] = iter_corpus(corpus)
    return path


def test_list_shows_pairs_and_json(harness_cli):
    code, out, _ = harness_cli("list")
    assert code == 0
    for name in ("moe_aggregate.bf16", "moe_aggregate.aligned", "router_topk.bf16", "router_topk.replay"):
        assert name in out
    code, out, _ = harness_cli("list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["router_topk.bf16"]["expected"] == "diverges" and rows["router_topk.bf16"]["kind"] == "op"
    assert "routing" in rows["router_topk.bf16"]["axes"] and rows["router_topk.replay"]["devices"]


def test_show_and_replay_a_repro(found, harness_cli):
    code, out, _ = harness_cli("show", str(found))
    assert code == 0
    assert "router_topk.bf16" in out and "inputs:" in out and "w_router" in out
    assert f"replay: harness replay {found}" in out
    data = json.loads(found.read_text())
    fired, how = data["metrics"]["fired"], data["found"]
    assert 1 <= how["cases_to_first"] <= how["cases_total"] and how["seconds_to_first"] >= 0 <= how["shrink_seconds"]
    assert (f"after {how['cases_to_first']} cases in {how['seconds_to_first']:.1f} s; shrunk in "
            f"{how['shrink_seconds']:.1f} s ({how['cases_total']} cases in all)") in out
    assert f"over the threshold: {fired} (judged k3 " in out and "the expected k3 over the vocabulary" in out and "rollout mass the trainer excludes 0" in out
    # the simpler neighbours the shrink ran around the minimal case, from the repro: each passes
    rows = data["neighbours"]
    assert rows and all(r["symptom"] == "none" and r["judged"] <= data["threshold"] for r in rows), rows
    assert "simpler cases shrinking ran (none fails as this one does" in out and rows[0]["change"] in out
    code, out, _ = harness_cli("replay", str(found))
    assert code == 1 and "bit-for-bit yes" in out
    from harness.metrics import verdict_mean

    name, value = verdict_mean(data["metrics"])  # the mean the verdict read, not the sampled k3
    assert f"recorded divergence {name}={value:.3g} -> now divergence {name}={value:.3g}" in out
    code, out, _ = harness_cli("replay", str(found), "--json")
    [row] = json.loads(out)
    assert row["bit_for_bit"] and row["symptom"] == "divergence"
    # the JSON carries the mean the verdict read and which fired, not only the sampled k3
    assert row["verdict_mean"] == row["recorded_verdict_mean"] == [name, value] and row["fired"] == fired
    assert row["k3_expected"] == data["metrics"]["k3_expected"] and row["kl"] == data["metrics"]["kl"]


def test_replay_exits_0_once_the_case_no_longer_diverges(found, harness_cli):
    code, out, _ = harness_cli("replay", str(found), "--threshold", "100")
    assert code == 0 and "now clean" in out


def write(path, text):
    path.write_text(text)
    return str(path)


def loop(path):
    if not path.is_symlink():
        path.symlink_to(path)
    return str(path)


@pytest.mark.parametrize("make,words", [
    (lambda d, f: str(d / "missing.json"), "does not exist"),
    (lambda d, f: loop(d / "loop.json"), "symbolic link to nothing"),
    (lambda d, f: write(d / "bad.json", "{not json"), "is not valid JSON"),
    (lambda d, f: write(d / "cut.json", '{"pair": "x",\n "note": "cut off'),
     "is not valid JSON (Unterminated string starting at line 2, column 10)"),
    (lambda d, f: write(d / "schema.json", json.dumps({"schema": "other/9", "pair": "x"})), "has top-level \"schema\": \"other/9\""),
    (lambda d, f: write(d / "case.json", f.read_text().replace('"top_k": ', '"top_k": 99, "x": ')),
     "invalid case"),
    (lambda d, f: write(d / "pair.json", f.read_text().replace("router_topk.bf16", "gone.pair")),
     "not registered"),
])
def test_bad_repro_files_get_a_message_and_exit_2(tmp_path, found, harness_cli, make, words):
    code, out, err = harness_cli("replay", make(tmp_path, found))
    assert code == 2, (out, err)
    assert words in err and "Traceback" not in err and err.startswith("error: ")
    code, _, err = harness_cli("show", make(tmp_path, found))
    if words != "not registered":  # show prints a repro even when its pair is gone
        assert code == 2 and words in err and "Traceback" not in err


def test_unknown_pair_and_broken_plugin_exit_2(tmp_path, harness_cli):
    code, _, err = harness_cli("fuzz", "no.such.pair", "--no-tracking")
    assert code == 2 and "no target pair named 'no.such.pair'" in err and "Traceback" not in err
    code, _, err = harness_cli("fuzz", "--pairs", "no.such.pair", "--no-tracking")  # the option spelling too
    assert code == 2 and "no target pair named 'no.such.pair'" in err and "Traceback" not in err
    assert "a pair from your own file needs `--plugin path/to/file.py`" in err
    # a plugin loaded that registers nothing (a forgotten register call): named, not "pass --plugin"
    empty = write(tmp_path / "empty.py", "from harness import TargetPair\n")
    code, _, err = harness_cli("fuzz", "--plugin", empty, "mine.aligned", "--no-tracking")
    assert code == 2 and f"plugin {empty!r} loaded but registered no pair" in err, err
    mine = write(tmp_path / "mine.py", "from harness import TargetPair, Outcome, register\n"
                 "register(TargetPair(name='mine.aligned', kind='op', expected='aligned', build=lambda c, d: None,"
                 " trainer=lambda i: Outcome(), rollout=lambda i: Outcome()))\n")
    code, _, err = harness_cli("fuzz", "--plugin", mine, "mine.alignd", "--no-tracking")  # a typo
    assert code == 2 and "Did you mean mine.aligned" in err and f"register 1 pair(s) from {mine}, not this one" in err
    broken = write(tmp_path / "broken.py", "raise ValueError('half-written plugin')\n")
    code, _, err = harness_cli("list", "--plugin", broken)
    assert code == 2 and "half-written plugin" in err and "Traceback" not in err
    (tmp_path / "my plugins").mkdir()
    spaced = write(tmp_path / "my plugins" / "broken.py", "raise ValueError('half-written plugin')\n")
    code, _, err = harness_cli("list", "--plugin", spaced)  # the command it gives, pasted, runs that file
    assert code == 2 and f"Run `python '{spaced}'` to see the full error" in err, err
    gone = write(tmp_path / "gone.py", "from harness.errors import UsageError\n"  # (as hf_pairs on a gone checkpoint)
                 "raise UsageError(\"'/ckpt' is not a checkpoint directory\")\n")
    code, _, err = harness_cli("list", "--plugin", gone)  # a harness error of the plugin's own: which plugin
    assert code == 2 and f"plugin {gone!r} stopped while registering its pairs: '/ckpt' is not a checkpoint" in err \
        and "Traceback" not in err, err
    bad_pair = write(tmp_path / "badpair.py", "from harness import TargetPair, register\n"
                     "register(TargetPair(name='x.y', kind='op', expected='sometimes', build=None,"
                     " trainer=None, rollout=None))\n")
    code, _, err = harness_cli("list", "--plugin", bad_pair)
    assert code == 2 and "expected='sometimes'" in err and "Traceback" not in err
    tuple_params = write(tmp_path / "tupleparams.py", "from harness import Axes, Outcome, TargetPair, register\n"
                         "register(TargetPair(name='x.t', kind='op', expected='aligned', build=lambda c, d: None,"
                         " trainer=lambda i: Outcome(), rollout=lambda i: Outcome(),"
                         " axes=Axes(params={'temperature': (0.5, 2.0)})))\n")
    code, _, err = harness_cli("fuzz", "x.t", "--plugin", tuple_params, "--no-tracking")
    assert code == 2 and "not a Hypothesis strategy" in err and "Traceback" not in err


def test_replay_of_a_missing_pair_skips_during_git_bisect(tmp_path, found, harness_cli):
    path = write(tmp_path / "pair.json", found.read_text().replace("router_topk.bf16", "gone.pair"))
    code, _, err = harness_cli("replay", "--bisect", path)
    assert code == 125 and "not registered" in err


def test_ctrl_c_exits_130_and_keeps_what_was_found(tmp_path):
    """SIGINT during a campaign: exit 130, the findings made so far already on disk."""
    import os
    import signal
    import subprocess
    import sys
    import time

    corpus = tmp_path / "corpus"
    proc = subprocess.Popen([sys.executable, "-m", "harness", "fuzz", "moe_aggregate.bf16", "router_topk.replay",
                             "--max-examples", "1000000", "--seed", "1", "--no-tracking", "--corpus", str(corpus)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not iter_corpus(corpus) and time.monotonic() < deadline:  # pairs run in name order
        time.sleep(0.5)
    time.sleep(1.0)  # now inside the long clean pair
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert [p.parent.name for p in iter_corpus(corpus)] == ["moe_aggregate.bf16"]


@pytest.mark.parametrize("err,words", [
    (ConnectionError("connection refused"), "operating-system error: ConnectionError: connection refused"),
    (PermissionError(13, "Permission denied", "/some/reports"), "file-system error: Permission denied '/some/reports'"),
])
def test_an_os_error_at_the_top_is_one_paragraph_and_exit_2_not_1(monkeypatch, capsys, err, words):
    """Exit 1 means findings: an OSError that reaches the command line (a server down, a folder it
    cannot write) is said in one paragraph and exits 2."""
    from harness.cli import main
    from harness.pairs import REGISTRY

    def fail():
        raise err

    monkeypatch.setattr(REGISTRY, "all", fail)
    with pytest.raises(SystemExit) as e:
        main(["list"])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_bench_models_with_no_matching_pair_writes_nothing(harness_cli, tmp_path):
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n\n<!-- bench:models -->\nmeasured before\n<!-- /bench:models -->\n")
    code, _, err = harness_cli("bench", "models", "linear.*", "--out", str(report))
    assert code == 2 and "no CPU model pair matches" in err and "Traceback" not in err, err
    assert "measured before" in report.read_text()


def test_a_shard_out_of_range_names_i_and_n():
    from harness.cli import parse_shard
    from harness.errors import UsageError

    with pytest.raises(UsageError, match=r"i = 3 must lie between 1 and N = 2"):
        parse_shard("3/2")
    assert parse_shard("2/2") == (2, 2)


def test_bench_overhead_of_a_plugin_pair_records_a_command_that_reruns_it(tmp_path, monkeypatch):
    """The recorded command named no --plugin (it failed as written) and claimed OMP_NUM_THREADS=1
    whatever the environment said."""
    from harness.bench import overhead
    from harness.pairs import REGISTRY

    plugin = write(tmp_path / "mine.py", "import torch\nfrom harness import Axes, Outcome, TargetPair, register\n"
                   "def build(case, device):\n    return case.token_randn(16, 'x')\n"
                   "def path(x):\n    return Outcome(logprobs=torch.log_softmax(x, -1))\n"
                   "register(TargetPair(name='minebench.aligned', kind='op', expected='aligned', build=build,"
                   " trainer=path, rollout=path, axes=Axes(n_seqs=(1, 2), seq_len=(1, 4))))\n")
    REGISTRY.load_plugin(plugin)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    text = overhead(("minebench.aligned",), 4, tmp_path / "b.md", rounds=1, plugins=(plugin,))
    assert f"Command: `harness bench overhead --plugin {plugin} --cases 4 'minebench.aligned'`" in text, text


def test_harness_check_runs_the_contract_check_from_the_command_line(tmp_path, harness_cli):
    plugin = write(tmp_path / "checked.py", "import torch\nfrom harness import Axes, Outcome, TargetPair, register\n"
                   "def build(case, device):\n    return case.token_randn(16, 'x')\n"
                   "def good(x):\n    return Outcome(logprobs=torch.log_softmax(x, -1))\n"
                   "def unseeded(x):\n    return Outcome(logprobs=torch.log_softmax(x + 1e-3 * torch.randn_like(x), -1))\n"
                   "ax = Axes(n_seqs=(1, 2), seq_len=(1, 4))\n"
                   "register(TargetPair(name='checked.good', kind='op', expected='aligned', build=build, trainer=good,"
                   " rollout=good, axes=ax))\n"
                   "register(TargetPair(name='checked.unseeded', kind='op', expected='aligned', build=build, trainer=good,"
                   " rollout=unseeded, axes=ax))\n")
    code, out, err = harness_cli("check", "--plugin", plugin, "checked.good", "--cases", "3")
    assert code == 0 and "checked.good: PASS (3 cases)" in out, out + err
    code, out, err = harness_cli("check", "--plugin", plugin, "checked.*", "--cases", "3")
    assert code == 1 and "checked.unseeded: FAIL" in out and "checked.good: PASS" in out, out + err
    assert "1 pair(s) break the contract: checked.unseeded" in err and "Traceback" not in err
    code, out, err = harness_cli("check", "checked.nope")
    assert code == 2 and "no target pair named 'checked.nope'" in err


def test_harness_check_fails_a_pair_that_hangs_or_crashes_and_goes_on(tmp_path, harness_cli):
    """A pair whose rollout hangs on cases of more than 3 tokens had kept `harness check` running for
    as long as anyone waited (it ran in-process, with no timeout); a crash took the command with it."""
    plugin = write(tmp_path / "stuck.py", "import os, time, torch\nfrom harness import Axes, Outcome, TargetPair, register\n"
                   "def build(case, device):\n    return case.token_randn(16, 'x')\n"
                   "def good(x):\n    return Outcome(logprobs=torch.log_softmax(x, -1))\n"
                   "def hangs(x):\n    if x.shape[0] > 3:\n        time.sleep(3600)\n    return good(x)\n"
                   "def dies(x):\n    os.abort()\n"
                   "ax = Axes(n_seqs=(1, 2), seq_len=(1, 4))\n"
                   "register(TargetPair(name='stuck.a_hangs', kind='op', expected='aligned', build=build, trainer=good,"
                   " rollout=hangs, axes=ax))\n"
                   "register(TargetPair(name='stuck.b_dies', kind='op', expected='aligned', build=build, trainer=good,"
                   " rollout=dies, axes=ax))\n"
                   "register(TargetPair(name='stuck.c_good', kind='op', expected='aligned', build=build, trainer=good,"
                   " rollout=good, axes=ax))\n")
    code, out, err = harness_cli("check", "--plugin", plugin, "stuck.*", "--cases", "8", "--timeout", "3", timeout=200)
    assert code == 1, out + err
    assert "stuck.a_hangs: FAIL" in out and "did not return within 3 s: a hang?" in out and "Where it was: File" in out, out
    assert "in hangs" in out and "--timeout 'stuck.a_hangs=SECONDS'" in out, out
    assert "stuck.b_dies: FAIL" in out and "the worker process died" in out, out
    assert "stuck.c_good: PASS (8 cases)" in out, out
    assert "2 pair(s) break the contract: stuck.a_hangs, stuck.b_dies" in err and "Traceback" not in err, err


def test_harness_check_of_a_pair_whose_setup_fails_is_cannot_run_not_a_contract_break(harness_cli):
    """A checkpoint folder without weights: `check` said FAIL (the same error once per case, exit 1),
    where `score --model` on it said one paragraph and exit 2."""
    plugin = str(Path(__file__).resolve().parents[1] / "plugins" / "faults.py")
    code, out, err = harness_cli("check", "--plugin", plugin, "faults.setup_gone", "--cases", "3")
    assert code == 2 and "faults.setup_gone: CANNOT RUN here:" in out and "FAIL" not in out, out + err


def test_harness_record_makes_a_known_failing_case_a_repro(harness_cli, tmp_path):
    """A case known to fail (given as a repro file's case, JSON or the printed one-line form) becomes a
    repro of the pair, marked as given by hand, with the shrink command to run next; a passing case
    records nothing (exit 0); a field that is not a case field is a usage error."""
    from harness.case import Case
    from harness.cli import parse_case

    source = next(iter(sorted((Path(__file__).resolve().parents[2] / "corpora" / "moe_aggregate.bf16").glob("*.json"))))
    case = Case.from_json(json.loads(source.read_text())["case"])
    assert parse_case(str(source)) == case and parse_case(json.dumps(case.to_json())) == case
    assert parse_case(case.one_line()) == case  # (what the harness prints, read back)
    from harness.errors import UsageError

    with pytest.raises(UsageError, match="gives seed more than once"):  # (the second had silently won)
        parse_case("seed=1 seed=2 seq_lens=[1]")
    code, out, err = harness_cli("record", "moe_aggregate.bf16", "--case", case.one_line(), "--corpus", str(tmp_path))
    assert code == 1, err
    [path] = list(tmp_path.rglob("*.json"))
    assert f"-> {path}" in out and "shrink it: harness shrink --no-tracking" in out, out
    repro = json.loads(path.read_text())
    assert repro["found"]["by"] == "harness record" and Case.from_json(repro["case"]) == case
    code, out, err = harness_cli("show", str(path))
    assert "by `harness record` from a case given by hand" in out, out
    code, out, err = harness_cli("record", "moe_aggregate.aligned", "--case", case.one_line(), "--corpus",
                                 str(tmp_path / "none"))
    assert code == 0 and "the case passes" in out and not (tmp_path / "none").exists(), (out, err)
    code, out, err = harness_cli("record", "moe_aggregate.bf16", "--case", "seed=1 batch=4")
    assert code == 2 and "batch is not a case field" in err and "Traceback" not in err, err


def test_a_corpus_kept_without_mlflow_is_closed_with_no_tracking(tmp_path, harness_cli):
    """A nightly run with --no-tracking was told to close its fixed repro with `harness regressions
    close`, which needs a store. `--no-tracking` closes the corpus file alone, after the same replay."""
    src = '''import torch
from harness import Axes, Outcome, TargetPair, register

def build(case, device):
    return case.token_randn(16, "logits")

register(TargetPair(name="user.off", kind="op", expected="aligned", build=build,
                    trainer=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)),
                    rollout=lambda x: Outcome(logprobs=torch.log_softmax(x * SCALE, -1)),
                    axes=Axes(n_seqs=(1, 2), seq_len=(1, 4), pad_sides=("right",), logit_scale=(1.0, 1.0))))
'''
    (tmp_path / "bug.py").write_text("SCALE = 1.2\n" + src)
    (tmp_path / "fixed.py").write_text("SCALE = 1.0\n" + src)
    corpus = tmp_path / "corpus"
    code, _, err = harness_cli("fuzz", "--plugin", str(tmp_path / "bug.py"), "--max-examples", "5", "--seed", "1",
                               "--corpus", str(corpus), "--no-tracking", cwd=tmp_path)
    assert code == 1, err
    [path] = iter_corpus(corpus)
    rid = path.stem
    # the plugin given to show (kept elsewhere, renamed) is the one its printed commands name
    (tmp_path / "renamed.py").write_text((tmp_path / "bug.py").read_text())
    code, out, err = harness_cli("show", "--plugin", "renamed.py", str(path), cwd=tmp_path)
    assert code == 0 and f"replay: harness replay --plugin renamed.py {path}" in out, out + err
    code, out, err = harness_cli("regressions", "close", rid, "--status", "fixed", "--note", "scale fixed",
                                 "--no-tracking", "--plugin", str(tmp_path / "bug.py"), "--corpus-file", str(path),
                                 cwd=tmp_path)
    assert code == 2 and "still diverges" in err and load_repro(path).status == "open", err
    code, out, err = harness_cli("regressions", "close", rid, "--status", "fixed", "--note", "scale fixed",
                                 "--no-tracking", "--plugin", str(tmp_path / "fixed.py"), cwd=tmp_path)
    assert code == 2 and "pass it, --corpus-file" in err, err
    data = json.loads(path.read_text())  # (a severe case edited past reading: the second-bug check cannot run)
    data["found"]["severe"] = {"case": 1}
    path.write_text(json.dumps(data))
    code, out, err = harness_cli("regressions", "close", str(path), "--status", "fixed", "--note", "scale fixed",
                                 "--no-tracking", "--plugin", str(tmp_path / "fixed.py"), cwd=tmp_path)
    assert code == 0 and f"corpus file {path}: status fixed" in out and "MLflow" not in out, out + err
    assert f"warning: regression {rid}'s severe case (found.severe) does not read" in err, err
    # recording another pair's repro file by hand runs its case on this pair, and says so
    code, out, err = harness_cli("record", "rmsnorm.aligned", "--case", str(path), "--corpus", str(tmp_path / "c2"),
                                 cwd=tmp_path)
    assert f"note: {path} is a repro of pair user.off; its case runs on rmsnorm.aligned here" in err, err
    repro = load_repro(path)
    assert repro.status == "fixed" and repro.history[-1]["note"] == "scale fixed"
    assert not (tmp_path / "reports" / "mlflow.db").exists()


def test_show_lays_out_a_packed_trainers_rows(found, harness_cli, tmp_path):
    """A packing bug's repro (two sequences, one row) did not say where a packed trainer puts them:
    `show` prints `case.packed_rows()` and the sequence boundaries inside a row."""
    data = json.loads(found.read_text())
    data["case"].update(seq_lens=[3, 2, 4], row_capacity=6, probe=0, seq_ids=[])
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    code, out, _ = harness_cli("show", str(edited))
    assert code == 0 and "a packed trainer's rows (case.packed_rows(): first fit in packing order, capacity 6 " \
        "tokens): [[0, 1], [2]]; sequence boundaries inside a row: 0|1" in out, out


def test_harness_check_says_how_far_a_slow_pairs_check_got(tmp_path, monkeypatch, capsys):
    """A real-vocabulary pair's check ran 3.5 minutes with nothing printed: a line every
    CHECK_PROGRESS_SECONDS counts the runs of its paths so far."""
    import harness.cli as cli
    from harness.pairs import REGISTRY
    from harness.worker import Worker

    plugin = write(tmp_path / "slowcheck.py", "import torch\nfrom harness import Axes, Outcome, TargetPair, register\n"
                   "def build(case, device):\n    return case.token_randn(16, 'x')\n"
                   "def path(x):\n    return Outcome(logprobs=torch.log_softmax(x, -1))\n"
                   "register(TargetPair(name='slowcheck.good', kind='op', expected='aligned', build=build, trainer=path,"
                   " rollout=path, axes=Axes(n_seqs=(1, 2), seq_len=(1, 4))))\n")
    REGISTRY.load_plugin(plugin)
    monkeypatch.setattr(cli, "CHECK_PROGRESS_SECONDS", 0.0)
    with Worker(plugins=(plugin,)) as worker:
        verdict, text, _ = cli._check_one(REGISTRY.get("slowcheck.good"), 2, "cpu", worker, 60.0)
    err = capsys.readouterr().err
    assert verdict == "PASS", text
    assert "  slowcheck.good: 1 run(s) of its paths in " in err and "(each case runs twice, then derived cases" in err, err


def test_bench_metrics_writes_its_section_and_says_when_the_machine_was_loaded(tmp_path, monkeypatch, capsys):
    """`harness bench metrics` at one small size: the table, and, measured at a load average over the
    core count (where ratios move far either way), a warning in the section and on stderr."""
    import os

    from harness.bench_metrics import metrics_bench

    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    body = metrics_bench((512,), (64,), "cpu", 1, 1, None, tmp_path / "B.md", timeout=300)
    assert "| 512 | 64 |" in body and "**Measured under load" in body, body
    assert "warning: load average 99.0" in capsys.readouterr().err
    assert "<!-- bench:metrics -->" in (tmp_path / "B.md").read_text()


def test_a_repro_without_recorded_metrics_says_so_and_how_to_record_them(tmp_path, found, harness_cli):
    """A file whose metrics were cut read "recorded divergence k3=nan": it says it holds none, and the
    rerecord that writes this case's (after which it replays bit for bit)."""
    data = json.loads(found.read_text())
    data.pop("metrics")
    cut = tmp_path / "router_topk.bf16" / found.name
    cut.parent.mkdir()
    cut.write_text(json.dumps(data))
    code, out, err = harness_cli("replay", str(cut))
    assert code == 1 and "recorded divergence no metrics -> now divergence" in out, out + err
    assert f"`harness rerecord --accept-changes {cut}` records this case's" in out, out
    code, out, err = harness_cli("rerecord", "--accept-changes", str(cut))
    assert code == 0, out + err
    code, out, err = harness_cli("replay", str(cut))
    assert code == 1 and "bit-for-bit yes" in out, out + err
