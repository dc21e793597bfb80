"""`harness rerecord` rewrites recorded metrics only where the verdict is unchanged."""
import json
import shutil
from pathlib import Path

import pytest

from harness.rerecord import rerecord_file

ROOT = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path) -> Path:
    src = next((ROOT / "corpora" / "moe_aggregate.bf16").glob("*.json"))
    dst = tmp_path / "moe_aggregate.bf16" / src.name
    dst.parent.mkdir()
    shutil.copy(src, dst)
    return _here(dst)


def _here(path: Path) -> Path:
    """The copy with its metrics as this machine computes them: the corpus was recorded on one CPU, and
    another's kernels move the last bits (what rerecord is for), so each test starts from a repro that
    replays bit-for-bit here."""
    assert rerecord_file(path)[0] in ("unchanged", "rewritten")
    return path


def test_last_bit_changes_are_rewritten_and_recorded_in_history(tmp_path):
    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data["metrics"]["k3_kl"] = data["metrics"]["k3_kl"] * (1 + 1e-15) + 1e-18  # as an older harness had it
    path.write_text(json.dumps(data))
    outcome, _ = rerecord_file(path)
    assert outcome == "rewritten"
    after = json.loads(path.read_text())
    assert after["history"][-1]["event"] == "rerecorded" and after["metrics"]["k3_kl"] != data["metrics"]["k3_kl"]
    assert rerecord_file(path)[0] == "unchanged"


def test_a_repro_with_nan_metrics_that_replays_as_recorded_is_unchanged(tmp_path):
    src = ROOT / "corpora" / "router.tie_break" / "f1d3b55cfe64.json"  # pearson "nan": one token
    assert '"nan"' in src.read_text()
    dst = tmp_path / "router.tie_break" / src.name
    dst.parent.mkdir()
    shutil.copy(src, dst)
    before = _here(dst).read_text()
    assert '"nan"' in before
    assert rerecord_file(dst) == ("unchanged", "")
    assert dst.read_text() == before


def test_a_changed_verdict_is_left_alone(tmp_path):
    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data["status"] = "fixed"  # claims the divergence is gone; the replay still diverges
    path.write_text(json.dumps(data))
    before = path.read_text()
    outcome, detail = rerecord_file(path)
    assert outcome == "verdict changed" and "replay gives divergence" in detail
    assert path.read_text() == before


def test_a_fixed_repro_that_replays_clean_keeps_the_bugs_metrics(tmp_path, harness_cli):
    # the fix is in: the repro's pair now runs the fixed code (here: the aligned twin), so it replays
    # clean; its recorded metrics are the bug's, so neither the corpus test's bit-for-bit check nor
    # rerecord applies to it
    from harness.corpus import load_repro, replay

    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data.update(status="fixed", pair="moe_aggregate.aligned")
    path.write_text(json.dumps(data))
    res = replay(load_repro(path))
    assert not res.diverges and not res.compared and res.bit_for_bit and res.mismatches
    before = path.read_text()
    assert rerecord_file(path)[0] == "unchanged" and path.read_text() == before
    code, out, err = harness_cli("replay", str(path))
    assert code == 0 and "-> now clean" in out and "bit-for-bit not compared (a fixed repro" in out, out + err


def test_a_case_edited_by_hand_is_not_compared_until_rerecorded(tmp_path, harness_cli):
    """A person trying a variant of a repro edits its case: the recorded metrics are then another
    case's, so replay says so instead of listing metric "mismatches"; a save for another reason keeps
    the old fingerprint; rerecord records the edited case's metrics and fingerprint."""
    from harness.corpus import load_repro, replay

    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    assert data["case_fingerprint"] and not load_repro(path).case_edited  # (the corpus files carry one)
    data["case"]["seed"] = data["case"]["seed"] + 1
    path.write_text(json.dumps(data))
    repro = load_repro(path)
    assert repro.case_edited
    res = replay(repro)
    assert res.evaluation.failed and not res.compared and res.bit_for_bit
    rc, out, err = harness_cli("replay", str(path))
    assert rc == 1 and "bit-for-bit not compared (its case was edited since it was recorded" in out, (out, err)
    assert "`harness rerecord " in out and "` records this case's" in out, out
    passing = tmp_path / "passing.json"  # (an edited case that passes: rerecord refuses it, so restore it instead)
    passing.write_text(json.dumps({**data, "case": {**data["case"], "seq_lens": [1], "logit_scale": 1.0,
                                                    **({"seq_ids": []} if data["case"].get("seq_ids") else {})}}))
    rc, out, err = harness_cli("replay", str(passing))
    assert rc == 0 and "this case passes, which rerecord refuses" in out and "restore its case from git" in out, out
    repro.save()  # e.g. `harness regressions close` changing its status: still the old case's metrics
    assert load_repro(path).case_edited
    assert rerecord_file(path)[0] == "rewritten"
    after = load_repro(path)
    assert not after.case_edited and after.case.seed == data["case"]["seed"]
    assert "edited by hand" in after.history[-1]["note"]
    again = replay(after)
    assert again.compared and again.bit_for_bit, again.mismatches


def test_a_bad_fingerprint_is_a_usage_error(tmp_path, harness_cli):
    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data["case_fingerprint"] = "not hex!"
    path.write_text(json.dumps(data))
    rc, out, err = harness_cli("replay", str(path))
    assert rc == 2 and "field 'case_fingerprint'" in err and "Traceback" not in err


OUTSIDE_PLUGIN = '''
import torch
from harness import Axes, Outcome, TargetPair, register

def build(case, device):
    return {"x": case.randn((case.n_tokens, 16), "x", device=device)}

register(TargetPair(name="outside.diverges", kind="op", expected="diverges", build=build,
                    trainer=lambda i: Outcome(logprobs=torch.log_softmax(i["x"], -1)),
                    rollout=lambda i: Outcome(logprobs=torch.log_softmax(i["x"] * 0.5, -1)),
                    axes=Axes(n_seqs=(1, 2), seq_len=(1, 4))))
'''


def test_a_repro_of_a_plugin_outside_the_repository_is_rerecorded_with_plugin(tmp_path, harness_cli):
    plugin = tmp_path / "outside_pairs.py"
    plugin.write_text(OUTSIDE_PLUGIN)
    rc, out, err = harness_cli("fuzz", "--plugin", str(plugin), "outside.diverges", "--max-examples", "5", "--seed",
                               "1", "--corpus", str(tmp_path / "corpus"), "--no-tracking", cwd=tmp_path)
    assert rc == 1, (out, err)
    [path] = (tmp_path / "corpus").rglob("*.json")
    rc, out, err = harness_cli("rerecord", str(path), cwd=tmp_path)
    assert rc == 2 and "skipped" in out and "--plugin" in out, (out, err)  # (as replay: cannot be replayed here)
    rc, out, err = harness_cli("rerecord", "--plugin", str(plugin), str(path), cwd=tmp_path)
    assert rc == 0 and "unchanged" in out, (out, err)


def test_a_fixed_repro_whose_case_was_edited_keeps_its_bugs_metrics(tmp_path):
    """Rerecord of a `fixed` repro that replays clean after a hand edit renews only its fingerprint:
    its metrics stay the bug's, as for any fixed repro."""
    from harness.corpus import load_repro

    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data.update(status="fixed", pair="moe_aggregate.aligned")  # the fix is in: replays clean
    data["case"]["seed"] += 1
    path.write_text(json.dumps(data))
    assert load_repro(path).case_edited
    outcome, detail = rerecord_file(path)
    assert outcome == "rewritten" and "the bug's metrics kept" in detail
    after = load_repro(path)
    assert not after.case_edited and after.metrics == load_repro(path).metrics
    assert json.loads(path.read_text())["metrics"] == data["metrics"]


def test_metrics_from_another_machine_are_compared_only_on_the_recording_one(tmp_path, harness_cli):
    """Kernels pick their code by processor (numpy's and torch's SIMD exp, the BLAS), so a repro's last
    bits hold on the machine and software it was recorded on. Replay elsewhere says so rather than
    calling it a regression, unless the difference is more than last bits; rerecord makes the metrics
    this machine's and records its facts beside the finding's environment, which stays."""
    from harness.corpus import load_repro, replay
    from harness.env import environment, machine_differences

    here = environment("cpu")
    assert not machine_differences(here) and here["cpu"]
    other = {**here, "cpu": "Some Other CPU (torch AVX2)", "numpy": "1.0.0"}
    diff = machine_differences(other)
    assert len(diff) == 2 and diff[0].startswith("numpy: '1.0.0'") and "Some Other CPU" in diff[1]
    assert any(d.startswith("cpu: not recorded") for d in machine_differences({k: v for k, v in here.items()
                                                                               if k != "cpu"}))
    assert machine_differences({"cpu": "x\n" * 100})[-1].count("\n") == 0  # untrusted text: one line, cut
    assert machine_differences([]) == ["environment: not recorded"]

    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data["environment"].pop("metrics_recorded_on", None)
    data["environment"].update(cpu="Some Other CPU (torch AVX2)", torch="2.12.0")
    data["metrics"]["entropy"] = data["metrics"]["entropy"] * (1 + 4e-16)  # that machine's last bits
    path.write_text(json.dumps(data))
    res = replay(load_repro(path))
    assert not res.bit_for_bit and not res.beyond_noise()
    code, out, err = harness_cli("replay", str(path))
    assert code == 1 and "bit-for-bit no" in out and "recorded on another machine or software (torch: '2.12.0'" \
        in out and "these are within them" in out, out + err

    # more than last bits: a doubled k3 and another symptom are not another machine's rounding
    worse = {**data, "symptom": "nonfinite", "metrics": {**data["metrics"], "k3_kl": 2 * data["metrics"]["k3_kl"]}}
    (tmp_path / "worse.json").write_text(json.dumps(worse))
    assert set(replay(load_repro(tmp_path / "worse.json")).beyond_noise()) == {"symptom", "k3_kl"}

    assert rerecord_file(path)[0] == "rewritten"
    after = json.loads(path.read_text())
    assert after["environment"]["cpu"] == "Some Other CPU (torch AVX2)"  # where the bug was found: kept
    assert after["environment"]["torch"] == "2.12.0"
    assert after["environment"]["metrics_recorded_on"]["cpu"] == here["cpu"]
    assert not machine_differences(after["environment"]) and "differed_in" in after["history"][-1]
    assert rerecord_file(path) == ("unchanged", "")

    # a file whose metrics this machine reproduces although recorded elsewhere: its facts are added
    del after["environment"]["metrics_recorded_on"]
    path.write_text(json.dumps(after))
    outcome, detail = rerecord_file(path)
    assert outcome == "rewritten" and "bit for bit" in detail
    final = json.loads(path.read_text())
    assert final["metrics"] == after["metrics"] and final["environment"]["metrics_recorded_on"]["cpu"] == here["cpu"]
    assert final["history"][-1]["differed_in"] and final["environment"]["torch"] == "2.12.0"


def test_a_metric_moved_beyond_noise_is_not_rerecorded_unless_accepted(tmp_path, harness_cli):
    """rerecord is for last bits: a k3 that moved 10x with the same verdict is a change to look at;
    --accept-changes rewrites it (a metric now computed differently), and the history keeps the old."""
    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data["metrics"]["k3_expected"] = 10 * data["metrics"]["k3_expected"]
    path.write_text(json.dumps(data))
    before = path.read_text()
    outcome, detail = rerecord_file(path)
    assert outcome == "metrics changed" and "k3_expected" in detail and "--accept-changes" in detail
    assert path.read_text() == before
    code, out, err = harness_cli("rerecord", str(path))
    assert code == 1 and "metrics changed" in out, out + err
    code, out, err = harness_cli("rerecord", "--accept-changes", "--note", "reduction order changed on purpose",
                                 str(path))
    assert code == 0 and "rewritten" in out and "metric(s) moved: k3_expected" in out, out + err
    last = json.loads(path.read_text())["history"][-1]
    assert last["changed_beyond_noise"] == ["k3_expected"] and last["why"] == "reduction order changed on purpose"
    assert last["replaced_metrics"]["k3_expected"] == data["metrics"]["k3_expected"]


def test_show_says_when_its_case_is_not_the_one_its_metrics_describe(tmp_path, harness_cli):
    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data["found"]["shrink_complete"] = False
    path.write_text(json.dumps(data))
    code, out, err = harness_cli("show", str(path))
    assert code == 0 and "case (shrinking cut short: not minimal yet):" in out, out + err
    data["case"]["seed"] += 1  # edited by hand: the recorded metrics are another case's
    path.write_text(json.dumps(data))
    code, out, err = harness_cli("show", str(path))
    assert code == 0 and "case (edited by hand since it was recorded):" in out, out + err
    assert "metrics of the case as recorded, not of this one" in out


def test_every_fact_that_differs_is_named_and_bad_facts_are_refused(tmp_path):
    from harness.corpus import load_repro
    from harness.env import environment, machine_differences
    from harness.errors import UsageError

    here = environment("cpu")
    # a partial metrics_recorded_on: the facts it lacks are the finding's
    env = {**here, "metrics_recorded_on": {"cpu": "Intel Xeon (torch AVX2)"}}
    assert [d.split(":")[0] for d in machine_differences(env)] == ["cpu"]
    other = {k: "x" for k in ("torch", "numpy", "platform", "device", "cpu")}
    assert len(machine_differences(other)) == 5
    for patch, field in (({"found": {"shrink_complete": "no"}}, "found.shrink_complete"),
                         ({"environment": {"cpu": 12}}, "environment.cpu")):
        sub = tmp_path / field
        sub.mkdir()
        path = _copy(sub)
        data = json.loads(path.read_text())
        for k, v in patch.items():
            data[k].update(v)
        path.write_text(json.dumps(data))
        with pytest.raises(UsageError, match=field.replace(".", r"\.")):
            load_repro(path)


def test_a_repro_recorded_as_not_deterministic_is_held_to_its_failure_only(tmp_path, harness_cli):
    """A pair that is not a function of its case (found so: `found.deterministic: false`) gives other
    metrics on every run: replay, the corpus test and rerecord hold it to its failure, which they
    can check, and say why; a changed failure still counts."""
    import importlib.util

    from harness.corpus import load_repro, replay

    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data["metrics"]["k3_kl"] *= 3  # another draw of a noisy pair
    data["metrics"]["kl"] *= 0.5
    path.write_text(json.dumps(data))
    assert replay(load_repro(path)).beyond_noise()  # as a deterministic repro: a change to look at
    data["found"]["deterministic"] = False
    path.write_text(json.dumps(data))
    res = replay(load_repro(path))
    assert res.nondeterministic and res.mismatches and not res.failure_mismatches()
    code, out, err = harness_cli("replay", str(path))
    assert code == 1 and "recorded as not deterministic" in out and "it fails the way it was recorded" in out, out + err
    outcome, detail = rerecord_file(path)
    assert outcome == "unchanged" and "not deterministic" in detail
    assert json.loads(path.read_text()) == data
    # the corpus test's own check passes it (which mean fired is part of the draw); a changed failure fails it
    spec = importlib.util.spec_from_file_location("corpus_test", ROOT / "tests" / "test_corpus.py")
    corpus_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus_test)
    corpus_test.check_recorded_metrics(path, load_repro(path), res)
    data["metrics"]["fired"] = "kl" if data["metrics"]["fired"] != "kl" else "k3"
    path.write_text(json.dumps(data))
    corpus_test.check_recorded_metrics(path, load_repro(path), replay(load_repro(path)))
    data["symptom"] = "nonfinite"
    path.write_text(json.dumps(data))
    res = replay(load_repro(path))
    assert list(res.failure_mismatches()) == ["symptom"]
    with pytest.raises(AssertionError, match="fails another way than recorded"):
        corpus_test.check_recorded_metrics(path, load_repro(path), res)
    # a draw that comes back clean says so (not "it now fails another way (symptom)")
    data["symptom"], data["pair"], data["status"] = "divergence", "moe_aggregate.aligned", "open"
    path.write_text(json.dumps(data))
    code, out, err = harness_cli("replay", str(path))
    assert "now clean" in out and "this draw came back clean" in out and "fails another way" not in out, out + err


def test_a_corpus_folder_that_cannot_be_read_is_named_not_left_out(tmp_path, monkeypatch):
    """`Path.rglob` skips a folder it cannot list without a word: its repros would drop out of
    replay, shrink, rerecord and the corpus test. It is listed, and loading it says why."""
    import os

    from harness.corpus import iter_corpus, load_many_tolerant

    good = _copy(tmp_path)
    locked = tmp_path / "router.tie_break"
    locked.mkdir()
    (locked / "0123456789ab.json").write_text("{}")
    real_scandir, real_listdir = os.scandir, os.listdir

    def deny(fn):
        def inner(path=".", *a, **k):
            if os.fspath(path).rstrip("/").endswith("router.tie_break"):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return fn(path, *a, **k)
        return inner

    monkeypatch.setattr(os, "scandir", deny(real_scandir))  # (as a user without root, chmod 000 does this)
    monkeypatch.setattr(os, "listdir", deny(real_listdir))
    assert iter_corpus(tmp_path) == sorted([good, locked])
    repros, skipped = load_many_tolerant([tmp_path])
    assert [r.id for r in repros] == [good.stem]
    assert [s.path for s in skipped] == [locked] and "cannot be read (Permission denied)" in skipped[0].reason


def test_a_repro_of_a_built_in_pair_that_is_gone_says_renamed_or_removed(tmp_path):
    from harness.corpus import load_plugin_for, load_repro

    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data.update(pair="moe_aggregate.bf16_renamed", loader={"kind": "builtin"})
    path.write_text(json.dumps(data))
    from harness.pairs import Registry

    why = load_plugin_for(load_repro(path), registry=Registry())  # (a registry no test loaded plugins into)
    assert "was built in (targets/) when it was recorded and is not registered now: renamed or removed" in why
    data["loader"] = {}  # recorded before repros said how their pair was loaded
    path.write_text(json.dumps(data))
    assert "renamed" in load_plugin_for(load_repro(path), registry=Registry())  # (either wording: plugins loaded or not)


def test_a_hugging_face_repro_without_transformers_asks_for_the_extra_not_a_rename(tmp_path, monkeypatch):
    import targets.hf
    from harness.corpus import load_plugin_for, load_repro

    path = _copy(tmp_path)
    data = json.loads(path.read_text())
    data.update(pair="hf.unregistered.bf16_rollout", loader={"kind": "builtin"})
    path.write_text(json.dumps(data))
    monkeypatch.setattr(targets.hf, "AVAILABLE", False)
    from harness.pairs import Registry

    why = load_plugin_for(load_repro(path), registry=Registry())
    assert "install the hf extra" in why and "renamed" not in why


def test_the_corpus_tests_name_the_rerecord_command_of_the_file_that_moved(tmp_path):
    from harness.corpus import load_repro, replay
    from harness.corpus_tests import check_recorded_metrics

    src = next((ROOT / "corpora" / "rmsnorm.cast_order").glob("*.json"))
    data = json.loads(src.read_text())
    data["metrics"]["kl"] = 2 * data["metrics"]["kl"] + 1e-6  # moved beyond any machine's last bits
    path = tmp_path / src.name
    path.write_text(json.dumps(data))
    with pytest.raises(AssertionError) as e:
        check_recorded_metrics(path, load_repro(path), replay(load_repro(path)))
    assert f" {path}` rewrites them" in str(e.value) and "`harness rerecord" in str(e.value), str(e.value)
