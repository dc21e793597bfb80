"""Faults a repro file can carry, and what the harness must do with each: refuse it before anything
runs with a one-paragraph message naming the field (or the limit and how to raise it), exit 2
(125 under --bisect, so `git bisect run` skips instead of blaming the commit), never a traceback,
and never stop the other repros of a folder from being replayed. Also: plugin-aware corpus files,
a hand-broken corpus file kept aside, temporary files of killed writers.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import REGISTRY, Case
from harness.corpus import (clean_stale_temps, load_plugin_for, load_repro, record_finding, replay,
                            write_json_atomic)
from harness.execute import run_case
from harness.fuzz import Finding, signature

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "tests/plugins/lm_head_bf16.py"


def first_diverging(pair_name: str, **fields) -> Case:
    """The case with these fields and the smallest seed that diverges (searched, not hard-coded)."""
    REGISTRY.load_builtins()
    for seed in range(200):
        case = Case(seed=seed, **fields)
        if run_case(REGISTRY.get(pair_name), case, "cpu", 1e-3).failed:
            return case
    raise AssertionError(f"no seed below 200 makes {pair_name} {fields} diverge")


# one token at an exact top-1 tie among 5 experts: bf16 scores break it differently for many seeds
DIVERGING = ("router_topk.bf16", first_diverging("router_topk.bf16", seq_lens=(1,), n_experts=5, top_k=1,
                                                 tie_fraction=1.0))
CLEAN = ("linear.aligned", Case(seed=3, seq_lens=(2,)))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    from harness.cli import main

    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return info.value.code, out, err


def make_repro(folder: Path, pair_case=DIVERGING, expected="diverges") -> Path:
    """A real finding written by the engine's own corpus code; returns its file."""
    REGISTRY.load_builtins()
    name, case = pair_case
    ev = run_case(REGISTRY.get(name), case, "cpu", 1e-3)
    f = Finding(pair=name, expected=expected, symptom=ev.symptom, signature=signature(name, ev) if ev.failed
                else "0" * 64, case=case, evaluation=ev, examples=1)
    if not ev.failed:  # a clean case recorded as `fixed`: a repro that must keep replaying clean
        from harness.corpus import finding_to_repro

        r = finding_to_repro(f, 1e-3, 0, "cpu", folder)
        r.status, r.symptom = "fixed", "divergence"  # it diverged once, was fixed
        return r.save(folder / name / "000000000000.json")
    return record_finding(f, folder, 1e-3, 0, "cpu")


def edit(path: Path, **changes) -> Path:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if key.startswith("case."):
            data["case"][key[5:]] = value
        elif value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def repro(tmp_path):
    return make_repro(tmp_path / "corpora")


def assert_clean_error(code, err, expected_code, *needles):
    assert code == expected_code, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


# ---------------------------------------------------------------------------------------------
# Bounded sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, limit_env", [
    ({"case.n_experts": 1_000_000_000, "case.top_k": 1}, "HARNESS_MAX_EXPERTS"),
    ({"case.seq_lens": [1_000_000_000]}, "HARNESS_MAX_TOKENS"),
    ({"case.seq_lens": [1] * 5000}, "HARNESS_MAX_SEQUENCES"),
    ({"case.params": {"vocab": 10**9}}, "HARNESS_MAX_VOCAB"),
    ({"case.params": {f"p{i}": i for i in range(100)}}, "HARNESS_MAX_PARAMS"),
    ({"case.params": {"decode": 10**9}}, "HARNESS_MAX_PARAM_INT"),
    ({"case.params": {"name": "x" * (4 * 2**20 + 1)}}, "HARNESS_MAX_PARAM_LEN"),
])
def test_an_oversized_case_is_refused_before_it_runs(repro, capsys, changes, limit_env):
    edit(repro, **changes)
    code, out, err = run_cli(capsys, "replay", "--no-bisect", str(repro))
    assert_clean_error(code, err, 2, limit_env, "above the limit")
    assert out == ""  # nothing replayed, nothing allocated
    code, _, err = run_cli(capsys, "replay", "--bisect", str(repro))
    assert_clean_error(code, err, 125, limit_env)
    code, _, err = run_cli(capsys, "show", str(repro))
    assert_clean_error(code, err, 2, limit_env)
    assert json.loads(repro.read_text())["case"]  # the file itself is untouched


def test_a_limit_is_raised_by_its_environment_variable(repro, monkeypatch):
    edit(repro, **{"case.n_experts": 5000, "case.top_k": 1})
    with pytest.raises(Exception, match="HARNESS_MAX_EXPERTS"):
        load_repro(repro)
    monkeypatch.setenv("HARNESS_MAX_EXPERTS", "5000")
    assert load_repro(repro).case.n_experts == 5000
    monkeypatch.setenv("HARNESS_MAX_EXPERTS", "many")
    with pytest.raises(Exception, match=r"\$HARNESS_MAX_EXPERTS='many' is not an integer"):
        load_repro(repro)


def test_an_oversized_file_is_not_parsed(repro, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_MAX_REPRO_BYTES", "100")
    code, _, err = run_cli(capsys, "replay", "--no-bisect", str(repro))
    assert_clean_error(code, err, 2, "HARNESS_MAX_REPRO_BYTES", "bytes")


# ---------------------------------------------------------------------------------------------
# Field types and ranges
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, field", [
    ({"threshold": "os.system"}, "threshold"),
    ({"threshold": "nan"}, "threshold"),
    ({"threshold": -1}, "threshold"),
    ({"threshold": 0}, "threshold"),
    ({"threshold": True}, "threshold"),
    ({"metrics": [1, 2]}, "metrics"),
    ({"metrics": {"k3_kl": "__import__('os')"}}, "metrics.k3_kl"),
    ({"metrics": {"k3_kl": 1.0, "fired": "both"}}, "metrics.fired"),
    ({"found": {"cases_to_first": -1}}, "found.cases_to_first"),
    ({"found": {"cases_total": 2.5}}, "found.cases_total"),
    ({"found": {"shrink_seconds": "inf"}}, "found.shrink_seconds"),
    ({"status": "closed"}, "status"),
    ({"symptom": "exploded"}, "symptom"),
    ({"pair": ["router_topk.bf16"]}, "pair"),
    ({"pair": "../../etc/passwd x"}, "pair"),
    ({"error": "boom"}, "error"),
    ({"history": {"a": 1}}, "history"),
    ({"loader": {"kind": "pickle"}}, "loader.kind"),
    ({"environment": [1]}, "environment"),
    ({"id": "../x"}, "id"),
    ({"threshold": 10 ** 400}, "threshold"),  # JSON ints past a float's range: refused, not an OverflowError
    ({"metrics": {"k3_kl": 10 ** 400}}, "metrics.k3_kl"),
    ({"found": {"seconds_to_first": 10 ** 400}}, "found.seconds_to_first"),
])
def test_a_field_of_the_wrong_type_or_range_is_refused(repro, capsys, changes, field):
    edit(repro, **changes)
    code, out, err = run_cli(capsys, "replay", "--no-bisect", str(repro))
    assert_clean_error(code, err, 2, f"field {field!r}")
    assert out == ""
    code, _, err = run_cli(capsys, "replay", "--bisect", str(repro))
    assert_clean_error(code, err, 125, f"field {field!r}")
    code, _, err = run_cli(capsys, "show", str(repro))
    assert_clean_error(code, err, 2, f"field {field!r}")


@pytest.mark.parametrize("field", ["temperature", "top_p", "tie_fraction", "tie_gap", "logit_scale"])
def test_a_case_number_past_a_floats_range_is_refused(repro, capsys, field):
    edit(repro, **{f"case.{field}": 10 ** 400})  # json reads such a literal as an int a float cannot hold
    code, out, err = run_cli(capsys, "replay", "--no-bisect", str(repro))
    assert_clean_error(code, err, 2, field)
    code, _, err = run_cli(capsys, "show", str(repro))
    assert_clean_error(code, err, 2, field)


def test_a_repro_without_metrics_cannot_claim_bit_for_bit(repro, capsys):
    assert replay(load_repro(repro)).bit_for_bit  # as recorded: bit-for-bit
    edit(repro, metrics=...)
    result = replay(load_repro(repro))
    assert not result.bit_for_bit and result.mismatches == {"metrics": ("missing", "measured")}
    code, out, _ = run_cli(capsys, "replay", str(repro))
    assert code == 1 and "bit-for-bit no" in out


def test_fired_and_kl_excluded_are_recorded_and_an_older_repro_without_them_replays_bit_for_bit(repro):
    data = json.loads(repro.read_text())
    assert data["metrics"]["fired"] in ("k3", "kl", "k3+kl") and "kl_excluded" in data["metrics"]
    assert load_repro(repro).metrics["fired"] == replay(load_repro(repro)).evaluation.divergence.fired
    older = {k: v for k, v in data["metrics"].items() if k not in ("fired", "kl_excluded")}
    edit(repro, metrics=older)  # written before the two existed
    result = replay(load_repro(repro))
    assert result.diverges and result.bit_for_bit, result.mismatches
    edit(repro, metrics={**older, "k3_kl": 1.0})  # a key both have still counts, bit for bit
    assert set(replay(load_repro(repro)).mismatches) == {"k3_kl"}


def test_show_of_an_unknown_pair_exits_2_after_printing_the_case(repro, capsys):
    edit(repro, pair="nowhere.to_be_found")
    code, out, err = run_cli(capsys, "show", str(repro))
    assert_clean_error(code, err, 2, "nowhere.to_be_found")
    assert "case (minimal)" in out and "n_experts" in out  # what the file holds is still shown


# ---------------------------------------------------------------------------------------------
# One bad file does not stop the others
# ---------------------------------------------------------------------------------------------
def test_replay_of_a_folder_skips_unreadable_files_and_replays_the_rest(tmp_path, capsys):
    corpus = tmp_path / "corpora"
    good = make_repro(corpus, CLEAN, expected="aligned")
    bad_json = corpus / "x" / "aaaaaaaaaaaa.json"
    bad_json.parent.mkdir(parents=True)
    bad_json.write_text("{ not json")
    huge = shutil.copy(good, corpus / "x" / "bbbbbbbbbbbb.json")
    edit(Path(huge), **{"case.seq_lens": [10**9]})
    unknown = shutil.copy(good, corpus / "x" / "cccccccccccc.json")
    edit(Path(unknown), pair="gone.pair")
    code, out, err = run_cli(capsys, "replay", "--no-bisect", str(corpus))
    assert code == 2, err  # the good one is clean, but not everything could be replayed
    assert f"{good}: pair linear.aligned" in out and "now clean" in out, err
    for p in (bad_json, huge, unknown):
        assert f"skipped {p}" in err
    assert "3 repro(s) skipped, 1 replayed" in err and "Traceback" not in err
    code, _, _ = run_cli(capsys, "replay", "--bisect", str(corpus))
    assert code == 125
    # a diverging repro among them: exit 1 wins (bisect must see "bad")
    make_repro(corpus)
    code, out, err = run_cli(capsys, "replay", "--bisect", str(corpus))
    assert code == 1 and "now divergence" in out and "skipped" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_is_skipped(tmp_path, capsys):
    corpus = tmp_path / "corpora"
    good = make_repro(corpus, CLEAN, expected="aligned")
    locked = Path(shutil.copy(good, corpus / "linear.aligned" / "111111111111.json"))
    locked.chmod(0)
    try:
        code, out, err = run_cli(capsys, "replay", "--no-bisect", str(corpus))
    finally:
        locked.chmod(0o644)
    assert code == 2 and f"skipped {locked}" in err and "cannot be read" in err and "now clean" in out


# ---------------------------------------------------------------------------------------------
# Plugin-aware corpus
# ---------------------------------------------------------------------------------------------
def test_a_plugin_repro_records_its_loader_and_replays_in_a_fresh_process(tmp_path, capsys, monkeypatch,
                                                                          harness_cli):
    monkeypatch.chdir(ROOT)
    corpus = tmp_path / "corpora"
    code, out, err = run_cli(capsys, "fuzz", "example.lm_head_bf16", "--plugin", PLUGIN, "--seed", "1",
                             "--max-examples", "200", "--corpus", str(corpus), "--no-tracking")
    assert code == 1, err
    [path] = list((corpus / "example.lm_head_bf16").glob("*.json"))
    data = json.loads(path.read_text())
    assert data["loader"] == {"kind": "plugin_file", "path": PLUGIN}
    assert data["environment"]["torch"] and data["environment"]["harness"]
    assert f"replay: harness replay --plugin {PLUGIN} {path}" in err  # the printed command works as printed
    # a fresh process, no --plugin: the repro's own plugin file (inside this repository) is loaded
    code, out, err = harness_cli("replay", str(corpus))
    assert code == 1 and "pair example.lm_head_bf16" in out and "bit-for-bit yes" in out, err
    code, out, err = harness_cli("show", str(path))
    assert code == 0 and f"replay: harness replay --plugin {PLUGIN} {path}" in out, err
    # a repro whose shrinking was cut short: the command that goes on names the plugin too (it had
    # printed `harness shrink FILE`, which skips a plugin's repro), and the store of its regression run
    from harness.corpus import shrink_command_for

    assert shrink_command_for("example.lm_head_bf16", path, "sqlite:////elsewhere/mlflow.db") == \
        f"harness shrink --plugin {PLUGIN} --tracking-uri sqlite:////elsewhere/mlflow.db {path}"
    # a module plugin is never imported on the repro's say-so: skipped with the fix, the rest go on
    mod = Path(shutil.copy(path, path.with_name("dddddddddddd.json")))
    edit(mod, loader={"kind": "module", "module": "antigravity"}, pair="example.other")
    code, out, err = harness_cli("replay", "--no-bisect", str(corpus))
    assert code == 1 and "pass --plugin=antigravity" in err and "bit-for-bit yes" in out
    # a plugin file outside the repository is not loaded either
    edit(mod, loader={"kind": "plugin_file", "path": "/tmp/evil.py"})
    assert "outside this repository" in load_plugin_for(load_repro(mod))


def test_the_corpus_tests_replay_a_repro_of_a_plugin_kept_outside_the_repository(tmp_path, harness_cli):
    """A team's own pairs live in their own file; their repros sit in the project's corpus. The
    corpus tests skip them (with the option that loads them), and replay them with it."""
    proj, outside = tmp_path / "proj", tmp_path / "outside"
    (proj / "tests").mkdir(parents=True)
    outside.mkdir()
    shutil.copy(ROOT / "tests" / "test_corpus.py", proj / "tests" / "test_corpus.py")
    subprocess.run(["git", "init", "-q", str(proj)], check=True)
    plugin = shutil.copy(ROOT / PLUGIN, outside / "my_pairs.py")
    code, out, err = harness_cli("fuzz", "example.lm_head_bf16", "--plugin", plugin, "--seed", "1", "--max-examples",
                                 "200", "--corpus", str(proj / "corpora"), "--no-tracking", cwd=proj)
    assert code == 1 and list((proj / "corpora").rglob("*.json")), err

    def corpus_tests(*extra):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               "tests/test_corpus.py", *extra], cwd=proj, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)

    skipped = corpus_tests()
    assert "1 skipped" in skipped.stdout and f"pass --harness-plugin={plugin} to load it" in skipped.stdout, \
        skipped.stdout + skipped.stderr
    replayed = corpus_tests(f"--harness-plugin={plugin}")
    assert replayed.returncode == 0 and "2 passed" in replayed.stdout and "skipped" not in replayed.stdout, \
        replayed.stdout + replayed.stderr
    broken = corpus_tests(f"--harness-plugin={outside / 'missing.py'}")
    assert broken.returncode != 0 and "does not exist" in broken.stderr and "Traceback" not in broken.stderr
    # a nightly's corpus kept outside the repository: --harness-corpus replays it (it had replayed
    # the repository's corpora/ alone, green over nothing of the nightly's)
    shutil.move(str(proj / "corpora"), str(outside / "corpus"))
    moved = corpus_tests(f"--harness-plugin={plugin}", f"--harness-corpus={outside / 'corpus'}")
    assert moved.returncode == 0 and "2 passed" in moved.stdout, moved.stdout + moved.stderr
    gone = corpus_tests(f"--harness-corpus={outside / 'nowhere'}")
    said = gone.stdout + gone.stderr
    assert gone.returncode == 4 and "no such folder" in said and "corpus_root" not in said, said
    # another repository runs the packaged corpus tests with `--harness-corpus=corpora`: its own corpora/
    # (the literal value had meant the harness repository's: 26 passed, none of theirs), and with no
    # option, the corpora/ of the working directory
    shutil.copytree(outside / "corpus", outside / "corpora")
    for extra in (["--harness-corpus=corpora"], []):
        theirs = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                                 "harness.corpus_tests", f"--harness-plugin={plugin}", *extra], cwd=outside,
                                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        assert theirs.returncode == 0 and "2 passed" in theirs.stdout, theirs.stdout + theirs.stderr
    # a damaged repro fails its own test with what is wrong, not the harness's source around a raise
    damaged = next((outside / "corpus").rglob("*.json"))
    damaged.write_text(damaged.read_text()[:300])
    res = corpus_tests(f"--harness-plugin={plugin}", f"--harness-corpus={outside / 'corpus'}", "-k", "test_replay")
    assert res.returncode == 1 and "1 failed" in res.stdout and "not valid JSON" in res.stdout, res.stdout
    assert "raise UsageError" not in res.stdout, res.stdout
    assert "During handling of the above exception" not in res.stdout, res.stdout  # (said once)


def test_the_corpus_tests_refuse_a_demonstration_status_on_a_pair_registered_aligned(tmp_path):
    """`expected` marks a demonstration pair's divergence (it must keep being caught). Set by hand on
    a repro of a pair registered aligned, it would pass a regression as long as it kept diverging."""
    proj = tmp_path / "proj"
    (proj / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "test_corpus.py", proj / "tests" / "test_corpus.py")
    src = next((ROOT / "corpora" / "attention.mask_leak").glob("*.json"))
    dst = proj / "corpora" / "attention.aligned" / src.name
    dst.parent.mkdir(parents=True)
    data = json.loads(src.read_text())
    assert data["status"] == "expected"
    data["pair"] = "attention.aligned"
    dst.write_text(json.dumps(data, indent=2))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_corpus.py", "-k",
                          "test_replay"], cwd=proj, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 1 and "1 failed" in res.stdout, res.stdout + res.stderr
    assert "status 'expected' is for a demonstration pair" in res.stdout and "set the file's status to 'open'" in \
        res.stdout, res.stdout


def test_a_pair_that_cannot_run_here_is_not_a_repro_that_still_fails(repro, tmp_path, capsys):
    """A pair raising a harness error (its checkpoint folder is gone) could not run: replay says so
    and exits 2 (125 under --bisect: git bisect skips the commit), not 1 ("still diverges")."""
    plugin = tmp_path / "gone.py"
    plugin.write_text(
        "from harness import Outcome, TargetPair, register\nfrom harness.errors import UsageError\n"
        "def build(case, device):\n    raise UsageError('/ckpt/step-100 is not a checkpoint directory')\n"
        "register(TargetPair(name='gone.ckpt', kind='op', expected='aligned', build=build,\n"
        "    trainer=lambda i: Outcome(), rollout=lambda i: Outcome()))\n")
    edit(repro, pair="gone.ckpt", loader={"kind": "plugin_file", "path": str(plugin)})
    code, _, err = run_cli(capsys, "replay", "--no-bisect", "--plugin", str(plugin), str(repro))
    assert_clean_error(code, err, 2, "could not run: UsageError: /ckpt/step-100 is not a checkpoint directory")
    code, _, err = run_cli(capsys, "replay", "--bisect", "--plugin", str(plugin), str(repro))
    assert code == 125, err
    code, _, err = run_cli(capsys, "triage", "--plugin", str(plugin), str(repro), "--no-tracking", "--reports",
                           str(tmp_path / "reports"))  # (not an empty report, exit 0)
    assert_clean_error(code, err, 2, "cannot be triaged here: its pair 'gone.ckpt' could not run: UsageError: "
                       "/ckpt/step-100 is not a checkpoint directory")


def test_a_repro_with_a_path_escaping_the_repository_is_not_loaded(repro):
    edit(repro, pair="example.escape", loader={"kind": "plugin_file", "path": "../../../tmp/x.py"})
    why = load_plugin_for(load_repro(repro))
    assert why is not None and ("outside this repository" in why or "not in this checkout" in why)


# ---------------------------------------------------------------------------------------------
# Writing the corpus
# ---------------------------------------------------------------------------------------------
def test_a_hand_broken_corpus_file_is_kept_aside_not_replaced(tmp_path, capsys):
    corpus = tmp_path / "corpora"
    path = make_repro(corpus)
    path.write_text(path.read_text().replace('"status": "expected"', '"status": "maybe"'))
    broken = path.read_text()
    name, case = DIVERGING
    ev = run_case(REGISTRY.get(name), case, "cpu", 1e-3)
    f = Finding(pair=name, expected="diverges", symptom=ev.symptom, signature=signature(name, ev), case=case,
                evaluation=ev, examples=1)
    messages = []
    record_finding(f, corpus, 1e-3, 0, "cpu", log=messages.append)
    [aside] = [p for p in path.parent.glob(f"{path.name}.broken-*") if not p.name.endswith(".why")]
    assert aside.read_text() == broken  # nothing lost
    assert aside.with_name(aside.name + ".why").exists()  # with what it was and why (tests/faults/test_corpus_aside.py)
    assert load_repro(path).status == "expected"  # the new finding is in place
    assert f.new  # new to the corpus (announced as such), not "already in corpus"
    assert len(messages) == 1 and str(aside) in messages[0] and "status" in messages[0]


def test_corpus_files_get_the_umask_mode_and_killed_writers_temps_are_removed(tmp_path):
    old = os.umask(0o022)
    try:
        p = tmp_path / "a" / "x.json"
        write_json_atomic(p, {"a": 1})
        assert stat.S_IMODE(p.stat().st_mode) == 0o644
        p.chmod(0o640)
        write_json_atomic(p, {"a": 2})  # an existing file keeps its mode
        assert stat.S_IMODE(p.stat().st_mode) == 0o640
    finally:
        os.umask(old)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = p.parent / f".x.json.{dead}.k2j3h4.tmp"
    stale.write_text("{")
    mine = p.parent / f".x.json.{os.getpid()}.abc.tmp"
    mine.write_text("{")
    legacy = p.parent / ".x.json.k2j3h4q1.tmp"  # written before temp names carried the pid
    legacy.write_text("{")
    assert clean_stale_temps(p.parent) == [stale]
    assert not stale.exists() and mine.exists() and p.exists() and legacy.exists()  # legacy: too recent to tell
    os.utime(legacy, (time.time() - 7200, time.time() - 7200))
    assert clean_stale_temps(p.parent) == [legacy]


def test_temporary_corpus_files_are_git_ignored():
    out = subprocess.run(["git", "check-ignore", "-q", "corpora/pair.x/.abc123abc123.json.4242.x8y9.tmp"],
                         cwd=ROOT, capture_output=True)
    assert out.returncode == 0


def test_the_onnx_backend_leaves_no_temporary_folder(tmp_path):
    pytest.importorskip("onnxruntime", reason="the ONNX Runtime backend needs onnxruntime")
    code = ("from harness import REGISTRY, Case; from harness.execute import run_case; REGISTRY.load_builtins(); "
            "ev = run_case(REGISTRY.get('model.onnxruntime'), Case(seed=1, seq_lens=(2,)), 'cpu', 1e-3); "
            "print(ev.symptom.value)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "none", out.stderr
    left = [p.name for p in tmp_path.rglob("*") if p.name != ".ses"]  # .ses: onnxruntime's own session id file
    assert left == []  # the export folder was removed, the session runs from memory


@pytest.mark.parametrize("args", [("fuzz", "linear.aligned", "--threshold", "nan"),
                                  ("fuzz", "linear.aligned", "--budget", "inf"),
                                  ("replay", "--threshold", "nan", "x.json"),
                                  # (click's FloatRange lets NaN through every bound: a trial's triage said
                                  # "under the threshold nan now" and exited 0; shrink ran with --budget nan)
                                  ("triage", "--threshold", "nan", "x.json"),
                                  ("shrink", "--budget", "nan", "x.json"),
                                  ("score", "x.jsonl", "--pair", "p", "--top-p", "nan"),
                                  ("gpucheck", "--budget", "nan")])
def test_a_non_finite_threshold_or_budget_is_a_usage_error(tmp_path, capsys, args):
    code, out, err = run_cli(capsys, *args, *(("--no-tracking", "--corpus", str(tmp_path)) if args[0] == "fuzz"
                                              else ()))
    assert code == 2 and "is not a finite number" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_a_repro_records_the_backend_libraries_the_process_imported(tmp_path):
    pytest.importorskip("onnxruntime", reason="needs onnxruntime to be installed")
    import onnxruntime

    from harness.corpus import finding_to_repro

    name, case = DIVERGING
    ev = run_case(REGISTRY.get(name), case, "cpu", 1e-3)
    f = Finding(pair=name, expected="diverges", symptom=ev.symptom, signature=signature(name, ev), case=case,
                evaluation=ev, examples=1)
    env = finding_to_repro(f, 1e-3, 0, "cpu", tmp_path).environment
    assert env["onnxruntime"] == onnxruntime.__version__ and env["torch"] and env["harness"]


def test_outside_any_git_checkout_a_plugin_file_is_never_loaded_by_itself(repro, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a git checkout: nothing marks which files are the project's
    (tmp_path / "planted.py").write_text("raise SystemExit('a repro must not run this')\n")
    edit(repro, pair="example.planted", loader={"kind": "plugin_file", "path": "planted.py"})
    why = load_plugin_for(load_repro(repro))
    assert why is not None and "pass --plugin=PATH" in why


def test_show_of_a_repro_without_its_first_sighting_counts_shrinking_in(repro, capsys):
    """A repro written before `found.cases_to_first` existed (or outside a campaign) says only the total."""
    assert "cases_to_first" not in json.loads(repro.read_text())["found"]
    code, out, _ = run_cli(capsys, "show", str(repro))
    assert code == 0 and "; 1 cases in all, shrinking included" in out


def test_the_onnx_graph_carries_no_weights_so_a_real_size_config_exports():
    """The weights are graph inputs, not initializers: the serialized graph's size does not grow with
    them, so the 5 GB `LARGE` config stays far under protobuf's 2 GB limit (the graph is held in
    memory; external data would need its folder to outlive the export)."""
    pytest.importorskip("onnxruntime", reason="the ONNX Runtime backend needs onnxruntime")
    from targets.backends.onnxruntime import exported, session
    from targets.models.moe_decoder import FP32, TINY, ModelConfig, MoEDecoder

    wide = ModelConfig(vocab=4096, hidden=128, experts=16, expert_hidden=128)
    sizes = {}
    for cfg in (TINY, wide):
        graph, names = exported(cfg, FP32)
        weights = sum(p.numel() * 4 for p in MoEDecoder(cfg).parameters())
        assert len(graph) < weights / 8, (len(graph), weights)
        feeds = {i.name for i in session(cfg, FP32, "cpu").get_inputs()}
        assert {f"m.{n}" for n in names} <= feeds  # every weight is fed with the case's values
        sizes[cfg] = (len(graph), weights)
    assert sizes[wide][1] > 4 * sizes[TINY][1] and sizes[wide][0] < 2 * sizes[TINY][0]


def _project_and_plugin(tmp_path, family: str, scale: str) -> tuple[Path, Path]:
    """A git project holding the corpus test, and a plugin outside it registering `<family>.pair`, whose
    rollout scales the logits by `scale` (a Python expression: 0.5 is a bug, 1.0 none)."""
    proj = tmp_path / "proj"
    (proj / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "test_corpus.py", proj / "tests" / "test_corpus.py")
    subprocess.run(["git", "init", "-q", str(proj)], check=True)
    plugin = tmp_path / "outside" / f"{family}.py"
    plugin.parent.mkdir()
    plugin.write_text(
        "import os, torch\nfrom harness import Axes, Outcome, TargetPair, register\n"
        "def build(case, device):\n    return case.token_randn(8, 'x')\n"
        "def trainer(x):\n    return Outcome(logprobs=torch.log_softmax(x, -1))\n"
        f"def rollout(x):\n    s = {scale}\n"
        "    return Outcome(logprobs=torch.log_softmax(x * s, -1))\n"
        f"register(TargetPair(name='{family}.pair', kind='op', expected='aligned', build=build, trainer=trainer,\n"
        "                    rollout=rollout, axes=Axes(n_seqs=(1, 2), seq_len=(1, 4))))\n")
    return proj, plugin


def test_an_open_regression_that_replays_clean_fails_with_the_command_that_closes_it(tmp_path, harness_cli):
    """The corpus test of a bug fixed since: one line, the close command with the plugin and the file
    (it printed the test's source around a bare `pytest.fail`)."""
    proj, plugin = _project_and_plugin(tmp_path, "fixable", "0.5 if os.environ.get('FIXABLE_BUG') else 1.0")
    code, _, err = harness_cli("fuzz", "fixable.pair", "--plugin", str(plugin), "--seed", "1", "--max-examples", "20",
                               "--corpus", str(proj / "corpora"), "--no-tracking", cwd=proj,
                               env={"FIXABLE_BUG": "1"})
    assert code == 1, err
    [repro] = (proj / "corpora").rglob("*.json")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_corpus.py",
                          f"--harness-plugin={plugin}", "-k", "test_replay"], cwd=proj, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "FIXABLE_BUG": ""}, timeout=300)
    assert res.returncode == 1 and "open regression no longer diverges" in res.stdout, res.stdout + res.stderr
    assert (f"`harness regressions close {repro.stem} --status fixed --plugin {plugin} --corpus-file "
            in res.stdout), res.stdout
    assert "def test_replay" not in res.stdout, res.stdout  # (no test source around the failure)


def test_show_says_when_routing_flipped_and_why_pearson_is_nan(capsys):
    """A trial's shrunk bf16-combine repro kept its near ties and temperature: what it caught came
    through a routing flip, which show did not say; a one-token repro's `pearson nan` had no word."""
    flipped = ROOT / "corpora" / "model.bf16_rollout" / "c6198e045f27.json"  # one token, flip_rate 0.5
    code, out, _ = run_cli(capsys, "show", str(flipped))
    assert code == 0 and "routing flipped: the two paths chose other experts for 50.0% of routed" in out, out
    assert f"`harness triage {flipped}` splits flips from the rest" in out
    assert "pearson            nan (a correlation needs 2 or more tokens)" in out
    code, out, _ = run_cli(capsys, "show", str(ROOT / "corpora" / "moe_aggregate.bf16" / next(
        (ROOT / "corpora" / "moe_aggregate.bf16").glob("*.json")).name))
    assert code == 0 and "routing flipped" not in out, out


def test_the_close_command_names_the_mlflow_server_a_repro_records_and_never_a_local_file():
    """A repro closed against a shared MLflow server records its URI (the same for everyone): the printed
    close command carries it, quoted; a local store's file is not recorded (it means nothing elsewhere),
    so the command stays without it and the words beside it say when to add one."""
    from harness.corpus import CLOSE_FLAGS_HINT, iter_corpus, load_repro

    repro = load_repro(next(iter(iter_corpus(ROOT / "corpora"))))
    repro.tracking = {"run_id": "abc"}
    assert "--tracking-uri" not in repro.close_command()
    repro.tracking = {"run_id": "abc", "uri": "http://mlflow.internal:5000/a b"}
    assert " --tracking-uri 'http://mlflow.internal:5000/a b' --corpus-file " in repro.close_command(), \
        repro.close_command()
    assert "--tracking-uri where its campaign logged to a store other than the default" in CLOSE_FLAGS_HINT


def test_a_corpus_replay_without_its_plugin_says_so_and_can_be_made_to_fail(tmp_path, harness_cli):
    """A nightly's replay step run without the --harness-plugin its repros need passed with every repro
    skipped (`1 passed, 3 skipped`, exit 0): the summary now says why they were skipped, and
    --harness-no-skips fails them."""
    proj, plugin = _project_and_plugin(tmp_path, "unreg", "0.5")
    code, _, err = harness_cli("fuzz", "unreg.pair", "--plugin", str(plugin), "--seed", "1", "--max-examples", "10",
                               "--corpus", str(proj / "corpora"), "--no-tracking", cwd=proj)
    assert code == 1, err
    (proj / "elsewhere").mkdir()  # (run from another folder: the recorded plugin path is not inside it)
    shutil.move(str(plugin), str(proj / "elsewhere" / "gone.py"))
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_corpus.py", "-k", "test_replay"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(base, cwd=proj, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "1 skipped" in res.stdout, res.stdout + res.stderr
    assert "harness corpus: 1 repro(s) skipped because their pairs cannot be loaded here" in res.stdout, res.stdout
    res = subprocess.run(base + ["--harness-no-skips"], cwd=proj, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 1 and "(--harness-no-skips: a repro that cannot replay here fails)" in res.stdout, \
        res.stdout + res.stderr


def test_printed_commands_quote_a_plugin_path_and_a_repro_path_a_shell_would_split(tmp_path, monkeypatch):
    """A plugin file or a corpus under a folder with a space in its name: every command the harness
    prints for a repro (replay, shrink, close, rerecord, triage) quotes them, so it runs as pasted."""
    import shlex

    from harness.corpus import iter_corpus, load_repro
    from harness.triage import _triage_command

    monkeypatch.chdir(tmp_path)
    repro = load_repro(next(iter(iter_corpus(ROOT / "corpora"))))
    repro.loader = {"kind": "plugin_file", "path": str(tmp_path / "my plugins" / "p.py")}
    repro.path = tmp_path / "night corpus" / "x.json"
    for cmd in (repro.replay_command(), repro.close_command(), _triage_command(repro),
                f"harness rerecord{repro.plugin_flags()} x"):
        words = shlex.split(cmd)
        assert words[words.index("--plugin") + 1] == "my plugins/p.py", cmd
    assert shlex.split(repro.replay_command())[-1] == "night corpus/x.json", repro.replay_command()
    assert shlex.split(repro.close_command())[shlex.split(repro.close_command()).index("--corpus-file") + 1] == \
        "night corpus/x.json"
