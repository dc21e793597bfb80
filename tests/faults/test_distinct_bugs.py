"""Every divergence of a pair has one signature (pair and symptom: nothing says where a numerical
difference came from). A repro of that signature stands for a new finding only while its own case
still fails: a different bug found after the first one is gone gets a repro of its own and is new
(a nightly item fails on it), and a repro whose shrinking was cut short takes a later, smaller case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import Axes, Outcome, TargetPair
from harness.corpus import load_repro
from harness.fuzz import CampaignConfig, run_campaign

BUG = {"which": "batch"}  # what the trainer gets wrong; the tests switch it, as a code change would
VOCAB = 64


def _build(case, device):
    return {"x": case.token_randn(VOCAB, "logits", device=device) * case.logit_scale, "case": case}


def _rollout(inp):
    return Outcome(logprobs=torch.log_softmax(inp["x"], -1))


def _trainer(inp):
    x, case = inp["x"], inp["case"]
    if BUG["which"] == "batch" and case.batch_size >= 2:  # a batched kernel path that is wrong
        x = x * 1.5
    if BUG["which"] == "long" and max(case.seq_lens) >= 3:  # a position-dependent one
        x = x * 0.5
    return Outcome(logprobs=torch.log_softmax(x, -1))


@pytest.fixture
def pair():
    return TargetPair(name="distinct.demo", kind="op", expected="aligned", build=_build, trainer=_trainer,
                      rollout=_rollout, axes=Axes(n_seqs=(1, 4), seq_len=(1, 8), logit_scale=(1.0, 4.0)),
                      description="a trainer whose bug changes between runs")


def _campaign(pair, corpus, bug, seed=1, log=None):
    BUG["which"] = bug
    cfg = CampaignConfig(pairs=[pair], seed=seed, max_examples=40, corpus=corpus, isolation=False)
    [finding] = run_campaign(cfg, log=log or (lambda m: None)).results[0].findings
    return finding


def test_a_different_bug_after_the_first_is_gone_is_a_new_repro_and_the_old_one_says_to_close(pair, tmp_path):
    corpus = tmp_path / "corpora"
    first = _campaign(pair, corpus, "batch")
    assert first.new and first.case.batch_size == 2
    logged: list[str] = []
    second = _campaign(pair, corpus, "long", log=logged.append)  # the batch bug is gone, another came
    assert second.new, "a different bug was filed as the known one"
    assert second.path != first.path and second.id != first.id
    assert second.base_signature == first.signature  # the same pair and symptom ...
    assert max(second.case.seq_lens) == 3 and second.case.batch_size == 1  # ... its own minimal case
    repro = load_repro(second.path)
    assert repro.case == second.case and repro.signature == second.signature
    assert json.loads(second.path.read_text())["base_signature"] == first.signature
    assert any(str(first.path) in m and "no longer fails" in m for m in logged)
    again = _campaign(pair, corpus, "long", seed=2)  # found again: the second repro is the one
    assert not again.new and again.path == second.path and again.signature == second.signature
    back = _campaign(pair, corpus, "batch", seed=3)  # the first bug came back: its own repro
    assert not back.new and back.path == first.path
    assert sorted(p.name for p in (corpus / pair.name).glob("*.json")) == sorted([first.path.name, second.path.name])


def test_a_repro_whose_shrinking_was_cut_short_takes_a_smaller_case(pair, tmp_path):
    corpus = tmp_path / "corpora"
    first = _campaign(pair, corpus, "batch")
    data = json.loads(first.path.read_text())
    small = data["case"]
    data["case"] = {**small, "seq_lens": [5, 4, 3], "prompt_lens": [], "seq_ids": [], "order": []}  # what a
    # campaign cut short by its budget leaves
    data["found"]["shrink_complete"] = False
    first.path.write_text(json.dumps(data))
    again = _campaign(pair, corpus, "batch", seed=2)
    assert not again.new and again.path == first.path
    repro = load_repro(first.path)
    assert repro.case == again.case and repro.case.batch_size == 2
    assert repro.found["shrink_complete"] is True and repro.status == "open"
    assert repro.history[-1]["event"] == "shrunk further"
    assert repro.history[-1]["replaced_case"]["seq_lens"] == [5, 4, 3]
    # its metrics are this campaign's: computed here, with this process's thread count
    import torch

    from harness.env import machine_differences, recorded_threads

    assert not machine_differences(repro.environment) and recorded_threads(repro.environment) == torch.get_num_threads()
    data = json.loads(first.path.read_text())  # a fully shrunk repro is left alone by later campaigns
    _campaign(pair, corpus, "batch", seed=3)
    assert json.loads(first.path.read_text()) == data


def test_a_repro_whose_case_was_edited_by_hand_is_not_taken_for_a_fixed_bug(pair, tmp_path):
    """Someone tried a variant by editing the repro's case (to one that passes). The next campaign
    still runs that case to tell (an edited repro must not swallow a different bug); it passes, so
    the finding gets its own repro, and the log says the old one's case was edited (not that its bug
    is fixed and should be closed). A repro whose case still fails takes the finding, edited or not."""
    corpus = tmp_path / "corpora"
    first = _campaign(pair, corpus, "batch")
    data = json.loads(first.path.read_text())
    data["case"] = {**data["case"], "seq_lens": [1], "seq_ids": [], "order": [], "probe": 0}  # one sequence: passes
    first.path.write_text(json.dumps(data))
    assert load_repro(first.path).case_edited
    logged: list[str] = []
    again = _campaign(pair, corpus, "batch", seed=2, log=logged.append)
    assert again.new and again.path != first.path
    assert any(f"the case of {first.path} was edited by hand since it was recorded and passes now" in m
               for m in logged), logged
    assert not any("no longer fails" in m for m in logged)
    third = _campaign(pair, corpus, "batch", seed=3)  # the unedited repro is tried first, and is the bug
    assert not third.new and third.path == again.path


def _two_bugs(inp):
    x, case = inp["x"], inp["case"]
    if case.batch_size >= 5:
        raise ValueError("the batched kernel rejects this shape")
    if case.batch_size >= 2:
        x = x.clone()
        x[0, 0] = float("nan")
    return Outcome(logprobs=torch.log_softmax(x, -1))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_every_distinct_failure_a_campaign_meets_is_reported(tmp_path, seed):
    """An error on 5+ sequences and NaN on 2-4: every kind of failure the campaign evaluated is a
    finding, including one first met while another was being polished (shrinking the error from 5+
    sequences passes through the NaN)."""
    from harness.execute import run_case
    from harness.fuzz import fuzz_pair, signature

    pair = TargetPair(name="distinct.two_bugs", kind="op", expected="aligned", build=_build, trainer=_two_bugs,
                      rollout=_rollout, axes=Axes(n_seqs=(1, 8), seq_len=(1, 4)), description="two bugs")
    cfg = CampaignConfig(pairs=[pair], seed=seed, max_examples=30, corpus=tmp_path / "corpora", isolation=False)
    seen = set()

    def evaluate(case):
        ev = run_case(pair, case)
        if ev.failed:
            seen.add(ev.symptom.value)
        return ev

    findings = fuzz_pair(pair, cfg, seed, deadline=None, evaluate=evaluate).findings
    by_symptom = {f.symptom.value: f for f in findings}
    assert set(by_symptom) == seen and len(findings) == len(seen), [(f.symptom, f.case.one_line()) for f in findings]
    if "nonfinite" in by_symptom:
        assert by_symptom["nonfinite"].case.batch_size == 2
    if "error" in by_symptom:
        assert by_symptom["error"].case.batch_size == 5
    assert len({signature(pair.name, f.evaluation) for f in findings}) == len(findings)


def _noisy(inp):  # the global RNG: other values on every call
    return Outcome(logprobs=torch.log_softmax(inp["x"] + 0.3 * torch.randn(inp["x"].shape), -1))


def test_a_finding_from_a_pair_that_is_not_deterministic_says_so(tmp_path):
    pair = TargetPair(name="distinct.noisy", kind="op", expected="aligned", build=_build, trainer=_trainer,
                      rollout=_noisy, axes=Axes(n_seqs=(1, 2), seq_len=(1, 4)), description="global RNG")
    BUG["which"] = "none"
    logged: list[str] = []
    cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=20, corpus=tmp_path / "corpora", isolation=False)
    [finding] = run_campaign(cfg, log=logged.append).results[0].findings
    assert finding.deterministic is False
    assert load_repro(finding.path).found["deterministic"] is False
    assert any("distinct.noisy is not deterministic given its case" in m for m in logged)
    clean = TargetPair(name="distinct.clean_bug", kind="op", expected="aligned", build=_build, trainer=_trainer,
                       rollout=_rollout, axes=Axes(n_seqs=(1, 2), seq_len=(1, 4)), description="deterministic")
    BUG["which"] = "batch"
    [f] = run_campaign(CampaignConfig(pairs=[clean], seed=1, max_examples=20, corpus=tmp_path / "c2",
                                      isolation=False), log=lambda m: None).results[0].findings
    assert f.deterministic and "deterministic" not in load_repro(f.path).found


def test_a_repro_records_the_thread_count_its_isolated_worker_computed_with(tmp_path):
    """The worker keeps the thread count it started with; the campaign process may have another by
    the time a finding is recorded (a fixture, a pair's own setting). The repro, and a smaller case
    a later campaign gives it, must name the worker's: replay runs with it."""
    from harness import REGISTRY
    from harness.env import recorded_threads
    from harness.fuzz import Executor

    pair = REGISTRY.get("rmsnorm.cast_order")
    corpus = tmp_path / "corpora"
    before = torch.get_num_threads()
    cfg = CampaignConfig(pairs=[pair], seed=2, max_examples=30, corpus=corpus, isolation=True)
    try:
        torch.set_num_threads(1)
        ex = Executor(cfg)
        ex.prepare(None)
        torch.set_num_threads(2)
        try:
            [first] = run_campaign(cfg, log=lambda m: None, executor=ex).results[0].findings
            assert recorded_threads(load_repro(first.path).environment) == ex.worker.threads == 1
            data = json.loads(first.path.read_text())  # cut short at a larger case
            data["case"] = {**data["case"], "seq_lens": [12], "prompt_lens": [], "seq_ids": [], "order": []}
            data["found"]["shrink_complete"] = False
            data.pop("case_fingerprint", None)
            first.path.write_text(json.dumps(data))
            run_campaign(CampaignConfig(pairs=[pair], seed=3, max_examples=30, corpus=corpus, isolation=True),
                         log=lambda m: None, executor=ex)
        finally:
            ex.close()
    finally:
        torch.set_num_threads(before)
    repro = load_repro(first.path)
    assert repro.history[-1]["event"] == "shrunk further"
    assert repro.environment["metrics_recorded_on"]["torch_threads"] == 1 == recorded_threads(repro.environment)


def test_a_bad_thread_count_in_a_repro_is_named(tmp_path):
    from harness.errors import UsageError

    src = next((Path(__file__).resolve().parents[2] / "corpora" / "rmsnorm.cast_order").glob("*.json"))
    for env_patch in ({"metrics_recorded_on": {"torch_threads": "2"}}, {"torch_threads": 0},
                      {"metrics_recorded_on": ["not", "an", "object"]}):
        data = json.loads(src.read_text())
        data["environment"].update(env_patch)
        path = tmp_path / src.name
        path.write_text(json.dumps(data))
        with pytest.raises(UsageError, match="environment"):
            load_repro(path)


def test_a_fully_shrunk_repro_takes_a_later_fully_shrunk_case_that_is_strictly_smaller(pair, tmp_path):
    """Another campaign's shrink reached a smaller minimum of the same bug: the repro takes it (the
    smaller case is the one a person reads), says so in its history, and the finding says what changed."""
    corpus = tmp_path / "corpora"
    first = _campaign(pair, corpus, "batch")
    data = json.loads(first.path.read_text())
    data["case"] = {**data["case"], "seq_lens": [2, 3], "prompt_lens": [], "seq_ids": [], "order": []}  # a local minimum
    first.path.write_text(json.dumps(data))
    assert load_repro(first.path).found["shrink_complete"] is True
    again = _campaign(pair, corpus, "batch", seed=2)
    assert not again.new and again.path == first.path and again.updated == "a smaller case"
    repro = load_repro(first.path)
    assert repro.case == again.case and repro.case.n_tokens < 5 and repro.status == "open"
    assert repro.history[-1]["replaced_case"]["seq_lens"] == [2, 3]


def test_a_finding_the_corpus_holds_as_wontfix_is_reported_as_wontfix_not_open(pair, tmp_path):
    corpus = tmp_path / "corpora"
    first = _campaign(pair, corpus, "batch")
    data = json.loads(first.path.read_text())
    data["status"] = "wontfix"
    first.path.write_text(json.dumps(data))
    again = _campaign(pair, corpus, "batch", seed=2)
    assert not again.new and again.status == "wontfix" and load_repro(first.path).status == "wontfix"
