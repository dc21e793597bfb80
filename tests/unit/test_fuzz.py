"""The campaign engine end to end: find, shrink, record, replay; symptoms; dedup; interrupts."""

import json
import os
import subprocess
import sys
import math

import pytest
import torch

from harness import REGISTRY, Case
from harness.corpus import iter_corpus, load_repro, replay
from harness.execute import Symptom, run_case
from harness.fuzz import CampaignConfig, run_campaign, summary_table
from harness.pairs import PairError
from harness.tracking import NullTracker

from ..conftest import PLUGINS

SYMPTOM_PLUGIN = '''
import torch
from harness import Axes, Outcome, TargetPair, register

def build(case, device):
    return {"x": case.randn((case.n_tokens, 16), "x", device=device), "n": case.batch_size,
            "longest": max(case.seq_lens)}

def fine(inp):
    return Outcome(logprobs=torch.log_softmax(inp["x"], -1))

def crashes_on_batches(inp):
    if inp["n"] >= 2:
        raise RuntimeError("shape mismatch in the fused kernel")
    return fine(inp)

def nan_on_long(inp):
    out = torch.log_softmax(inp["x"], -1)
    if inp["longest"] >= 4:
        out = out.clone(); out[-1, 0] = float("nan")
    return Outcome(logprobs=out)

AX = Axes(n_seqs=(1, 4), seq_len=(1, 8))
register(TargetPair(name="sym.crash", kind="op", expected="aligned", build=build, trainer=fine,
                    rollout=crashes_on_batches, axes=AX))
register(TargetPair(name="sym.nan", kind="op", expected="aligned", build=build, trainer=fine,
                    rollout=nan_on_long, axes=AX))
'''


def campaign(tmp_path, names, **kw):
    cfg = CampaignConfig(pairs=REGISTRY.select(names), corpus=tmp_path / "corpus", **kw)
    return run_campaign(cfg, NullTracker(), log=lambda m: None)


def assert_minimal(pair_name, case):
    pair = REGISTRY.get(pair_name)
    assert run_case(pair, case).symptom is Symptom.DIVERGENCE
    still = [n.one_line() for n in case.smaller_neighbours() if run_case(pair, n).failed]
    assert not still, f"not minimal: these smaller cases still diverge: {still}"


def test_moe_aggregate_bf16_is_caught_minimal_and_replays_bit_for_bit(tmp_path):
    result = campaign(tmp_path, ["moe_aggregate.bf16"], max_examples=300, seed=1)
    [f] = result.findings
    assert f.symptom is Symptom.DIVERGENCE and f.status == "expected" and f.k3 > 1e-3
    assert f.path.exists() and list(iter_corpus(tmp_path / "corpus")) == [f.path]
    assert_minimal("moe_aggregate.bf16", f.case)
    repro = load_repro(f.path)
    assert repro.case == f.case and repro.metrics["k3_kl"] == f.k3
    again = replay(repro)
    assert again.bit_for_bit and again.diverges and again.evaluation.k3 == f.k3


def test_aligned_twins_are_clean(tmp_path):
    result = campaign(tmp_path, ["moe_aggregate.aligned", "router_topk.replay"], max_examples=150, seed=1)
    assert result.findings == [] and all(r.verdict == "clean" for r in result.results)
    assert not (tmp_path / "corpus").exists()


def test_a_clean_pair_whose_time_share_ran_out_says_how_far_it_got():
    import time

    from harness.fuzz import fuzz_pair, summary_table

    pair = REGISTRY.get("moe_aggregate.aligned")
    cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=100000, write_corpus=False, isolation=False)
    r = fuzz_pair(pair, cfg, seed=1, deadline=time.monotonic() + 1.0)
    assert r.verdict == "clean" and r.examples_asked == 100000 and 0 < r.examples_short < 100000
    note = f"its time share ran out after {100000 - r.examples_short} of 100000 examples, {r.examples} cases run"
    assert r.time_note == note
    from harness.fuzz import CampaignResult

    assert f"clean ({note})" in summary_table(CampaignResult(seed=1, config=cfg, results=[r], seconds=1.0))
    done = fuzz_pair(pair, cfg, seed=1, deadline=None, max_examples=5)
    assert done.examples_short == 0 and done.time_note == ""
    # an example begun whose case never came back is not a case run: no "after 1 of 100" beside 0 cases
    from harness.fuzz import time_note

    assert time_note(100, 99, 0) == "its time share ran out before its first case finished: 0 of 100 examples"
    assert time_note(100, 99, 3) == "its time share ran out after 1 of 100 examples, 3 cases run"


def test_router_topk_bf16_shrinks_to_one_token_at_a_bf16_tie(tmp_path):
    result = campaign(tmp_path, ["router_topk.bf16"], max_examples=300, seed=1)
    [f] = result.findings
    case = f.case
    assert case.seq_lens == (1,)
    pair = REGISTRY.get("router_topk.bf16")
    inputs = pair.build(case, "cpu")
    logits = (inputs["x"] @ inputs["w_router"])[0]  # the token's fp32 router scores
    boundary = logits.topk(case.top_k + 1).values[-2:]
    bf16_ulp = 2.0 ** (math.floor(math.log2(float(boundary.abs().max()))) - 7)
    assert case.tie_fraction > 0 and case.tie_gap <= bf16_ulp
    ev = run_case(pair, case)
    assert ev.divergence.flip_rate + ev.divergence.tie_flip_rate == 1.0


def test_plugin_outside_the_repo_is_fuzzed_caught_and_shrunk(tmp_path, harness_cli):
    plugin = tmp_path / "elsewhere" / "my_backend.py"
    plugin.parent.mkdir()
    # the README's example, under its own name (this process may have loaded the original already)
    plugin.write_text((PLUGINS / "lm_head_bf16.py").read_text().replace("example.", "elsewhere."))
    corpus = tmp_path / "corpus"
    code, out, err = harness_cli("fuzz", "elsewhere.lm_head_bf16", "--plugin", str(plugin), "--seed", "3",
                                 "--max-examples", "200", "--corpus", str(corpus), "--no-tracking")
    assert code == 1, err
    [path] = iter_corpus(corpus)
    repro = load_repro(path)
    assert repro.pair == "elsewhere.lm_head_bf16" and repro.status == "expected"
    REGISTRY.load_plugin(str(plugin))
    assert_minimal("elsewhere.lm_head_bf16", repro.case)
    code, out, err = harness_cli("replay", str(path), "--plugin", str(plugin))
    assert code == 1 and "bit-for-bit yes" in out
    # a repro of a pair the given plugin does not register: the plugin is named, with what it registers
    other = tmp_path / "other.json"
    other.write_text(path.read_text().replace('"elsewhere.lm_head_bf16"', '"elsewhere.nope"'))
    code, out, err = harness_cli("replay", str(other), "--plugin", str(plugin))
    assert code == 2 and "the plugin(s) loaded here" in err, err
    assert "register elsewhere.lm_head_bf16, not 'elsewhere.nope'" in err
    assert "its pair 'elsewhere.nope' is not registered here: the plugin(s) loaded here" in err  # that first
    assert not err.split("is not registered here", 1)[0].rstrip().endswith("to load it")
    assert "which is loaded" in err and "to load it" not in err, err  # (the plugin it names was passed)


def test_crashes_and_nonfinite_are_typed_findings_and_the_campaign_goes_on(tmp_path):
    plugin = tmp_path / "symptoms.py"
    plugin.write_text(SYMPTOM_PLUGIN)
    REGISTRY.load_plugin(str(plugin))
    result = campaign(tmp_path, ["sym.crash", "sym.nan", "moe_aggregate.aligned"], max_examples=60, seed=2)
    by_pair = {r.pair: r for r in result.results}
    [crash] = by_pair["sym.crash"].findings
    assert crash.symptom is Symptom.ERROR and crash.case.batch_size == 2
    repro = load_repro(crash.path)
    assert repro.error["type"] == "RuntimeError" and "fused kernel" in repro.error["traceback"]
    [nan] = by_pair["sym.nan"].findings
    assert nan.symptom is Symptom.NONFINITE and nan.case.seq_lens == (4,)
    assert by_pair["moe_aggregate.aligned"].verdict == "clean"
    assert by_pair["sym.crash"].verdict == "REGRESSION"


def test_same_signature_is_recorded_once_and_a_fixed_one_is_reopened(tmp_path):
    first = campaign(tmp_path, ["router_topk.bf16"], max_examples=50, seed=1)
    [f1] = first.findings
    second = campaign(tmp_path, ["router_topk.bf16"], max_examples=50, seed=9)
    [f2] = second.findings
    assert f2.path == f1.path and not f2.new and len(iter_corpus(tmp_path / "corpus")) == 1
    repro = load_repro(f1.path)
    repro.status = "fixed"
    repro.save()
    third = campaign(tmp_path, ["router_topk.bf16"], max_examples=50, seed=4)
    assert third.findings[0].recurrence
    reopened = load_repro(f1.path)
    assert reopened.status == "open" and reopened.history[-1]["event"] == "recurred"


def test_interrupt_keeps_what_was_found(tmp_path):
    plugin = tmp_path / "interrupt.py"
    plugin.write_text('''
import torch
from harness import Axes, Outcome, TargetPair, register
CALLS = [0]
def build(case, device):
    CALLS[0] += 1
    if CALLS[0] > 3:
        raise KeyboardInterrupt
    return torch.log_softmax(case.randn((case.n_tokens, 8), "x"), -1)
register(TargetPair(name="aaa.interrupted", kind="op", expected="aligned", build=build,
    trainer=lambda x: Outcome(logprobs=x), rollout=lambda x: Outcome(logprobs=x * 0.5),
    axes=Axes(n_seqs=(1, 3), seq_len=(1, 8))))
''')
    REGISTRY.load_plugin(str(plugin))
    result = campaign(tmp_path, ["aaa.interrupted", "moe_aggregate.aligned"], max_examples=100, seed=1)
    assert result.interrupted and [r.pair for r in result.results] == ["aaa.interrupted", "moe_aggregate.aligned"]
    cut, later = result.results
    assert cut.interrupted and cut.findings and cut.verdict == "REGRESSION"
    # the pair the interrupt came before keeps its row in the table: not run, and why
    assert later.interrupted and later.examples == 0 and later.verdict == "not run"
    row = next(line for line in summary_table(result).splitlines() if line.startswith("moe_aggregate.aligned"))
    assert "not run (the interrupt came before its first case)" in row, row
    [f] = result.findings
    assert not f.shrink_complete and f.path.exists()
    assert json.loads(f.path.read_text())["found"]["shrink_complete"] is False


def test_budget_bounds_the_campaign(tmp_path):
    import time

    t = time.monotonic()
    # (5 s: at 3 s a CI run on two loaded cores once spent the whole budget before the second pair began)
    result = campaign(tmp_path, ["moe_aggregate.aligned", "router_topk.replay"], max_examples=10**6,
                      budget=5.0, seed=1)
    assert time.monotonic() - t < 5.0 + 5.0  # a case in flight at the deadline finishes; nothing new starts
    assert all(r.examples > 0 for r in result.results), [(r.pair, r.examples, r.verdict) for r in result.results]


def test_a_budget_is_filled_with_freshly_seeded_rounds(tmp_path, monkeypatch):
    # 5 examples per round would end in well under a second; filling, the pair runs until its share
    # ends, and round 0 is the unit's own stream (the same cases as the capped campaign's, first)
    import time

    import harness.fuzz as fz

    seeds = []
    real = fz.fuzz_pair

    def spy(pair, cfg, seed, *a, **kw):
        seeds.append(seed)
        return real(pair, cfg, seed, *a, **kw)

    monkeypatch.setattr(fz, "fuzz_pair", spy)
    capped = campaign(tmp_path / "a", ["rmsnorm.aligned"], max_examples=5, budget=4.0, seed=3)
    assert len(seeds) == 1
    t = time.monotonic()
    filled = campaign(tmp_path / "b", ["rmsnorm.aligned"], max_examples=5, budget=4.0, seed=3, fill_budget=True)
    assert time.monotonic() - t > 2.0 and filled.results[0].verdict == "clean"
    assert filled.results[0].examples > 5 * capped.results[0].examples
    assert seeds[1] == seeds[0] and len(set(seeds[1:])) == len(seeds) - 1 >= 3  # distinct rounds
    assert filled.results[0].streams == 1
    # a round that finds something ends the unit; where it was found counts the rounds before it;
    # the time it leaves goes back to the clean pair that ran first (its share was half the budget)
    seeds.clear()
    logged = []
    cfg = CampaignConfig(pairs=REGISTRY.select(["rmsnorm.aligned", "router_topk.bf16"]), corpus=tmp_path / "c",
                         max_examples=5, budget=6.0, seed=3, fill_budget=True)
    t = time.monotonic()
    found = run_campaign(cfg, NullTracker(), log=logged.append)
    clean, caught = found.results
    assert caught.verdict == "caught" and len(caught.findings) == 1 and clean.verdict == "clean"
    assert caught.findings[0].cases_to_first <= caught.findings[0].examples == caught.examples  # (in all, every round)
    assert any(m.startswith("  rmsnorm.aligned:") and "more cases in" in m for m in logged), logged
    # (its first line says more rounds may follow: a trial read `clean` there, then REGRESSION in the table)
    assert "  rmsnorm.aligned: clean so far (more rounds follow if time is left) (" in "\n".join(logged), logged
    assert time.monotonic() - t > 4.0 and clean.streams == 1


def test_the_campaign_seed_is_chosen_printed_and_reproducible_even_under_ci(tmp_path, harness_cli):
    seeds = []
    for i in range(2):
        code, out, err = harness_cli("fuzz", "router_topk.bf16", "--max-examples", "20", "--no-tracking",
                                     "--corpus", str(tmp_path / f"c{i}"), env={"CI": "true"})
        assert code == 1
        seeds.append(int(err.split("campaign seed ")[1].split()[0]))
    assert seeds[0] != seeds[1]  # CI does not derandomize the campaign
    # the printed seed given back reproduces the first campaign's finding
    harness_cli("fuzz", "router_topk.bf16", "--max-examples", "20", "--no-tracking", "--seed", str(seeds[0]),
                "--corpus", str(tmp_path / "again"), env={"CI": "true"})
    files = [json.loads(next(iter(iter_corpus(tmp_path / d))).read_text()) for d in ("c0", "again")]
    assert files[0]["case"] == files[1]["case"] and files[0]["metrics"] == files[1]["metrics"]


# ---------------------------------------------------------------------------------------------
# Isolation, streams, a fair budget
# ---------------------------------------------------------------------------------------------
def test_an_isolated_campaign_finds_exactly_what_an_in_process_one_finds(tmp_path):
    runs = {}
    for isolation in (True, False):
        cfg = CampaignConfig(pairs=REGISTRY.select(["router_topk.bf16"]), corpus=tmp_path / str(isolation),
                             max_examples=40, seed=3, isolation=isolation)
        runs[isolation] = run_campaign(cfg, NullTracker(), log=lambda m: None)
    [a], [b] = runs[True].findings, runs[False].findings
    assert a.case == b.case  # metrics bit-for-bit (repr: a one-token case has pearson nan, and nan != nan)
    assert repr(a.evaluation.divergence.as_dict()) == repr(b.evaluation.divergence.as_dict())
    assert runs[True].results[0].examples == runs[False].results[0].examples
    assert runs[True].worker_restarts == 0


def test_streams_split_a_pair_into_distinct_deterministic_units_and_shards_spread_them():
    from harness.fuzz import campaign_units, shard_pairs, stream_examples, stream_seed

    pairs = REGISTRY.select(["router_topk.*", "moe_aggregate.aligned"])
    assert [(u.pair.name, u.stream) for u in campaign_units(pairs)] == [(p.name, 0) for p in shard_pairs(pairs, None)]
    for shard in ((1, 2), (2, 3)):  # one stream per pair: the same units as sharding pairs
        assert [u.pair for u in campaign_units(pairs, 1, shard)] == shard_pairs(pairs, shard)
    units = campaign_units(pairs, streams=4)
    seeds = {stream_seed(7, u.pair.name, u.stream, u.streams) for u in units}
    assert len(units) == 4 * len(pairs) and len(seeds) == len(units)  # independently seeded
    assert stream_seed(7, "router_topk.bf16", 0, 1) == stream_seed(7, "router_topk.bf16")  # 1 stream: as before
    shards = [campaign_units(pairs, 4, (i, 5)) for i in range(1, 6)]
    assert sorted(u.label for s in shards for u in s) == sorted(u.label for u in units)  # disjoint, complete
    assert all(len(s) >= 2 for s in shards)  # more shards than pairs, none idle
    assert sum(stream_examples(101, k, 4) for k in range(4)) == 101


def test_streams_of_one_pair_are_merged_and_their_findings_deduplicated(tmp_path):
    result = campaign(tmp_path, ["router_topk.bf16"], max_examples=60, seed=1, streams=3)
    [r] = result.results
    # every stream ran (a stream stops early once a failure is found, so not necessarily its share)
    assert r.streams == 3 and r.examples >= 3 and r.verdict == "caught"
    assert len({f.signature for f in r.findings}) == len(r.findings) == 1
    assert len(iter_corpus(tmp_path / "corpus")) == 1


def test_a_slow_first_case_is_not_charged_to_the_pairs_share(tmp_path):
    import time

    from harness.execute import run_case as real
    from harness.fuzz import fuzz_pair

    pair = REGISTRY.get("moe_aggregate.aligned")
    calls = []

    def evaluate(case):  # a cold start: the first case compiles for 1.5 s
        calls.append(case)
        if len(calls) == 1:
            time.sleep(1.5)
        return real(pair, case)

    cfg = CampaignConfig(pairs=[pair], max_examples=10**6)
    now = time.monotonic()
    r = fuzz_pair(pair, cfg, seed=1, deadline=now + 1.0, evaluate=evaluate, wall=now + 60)
    assert r.warmup >= 1.5 and r.examples > 1  # charged to the share, the first case would be the only one


def test_crash_and_timeout_signatures():
    from harness.execute import Evaluation
    from harness.fuzz import signature

    case = Case(seed=0, seq_lens=(1,))
    segv = Evaluation("p", case, Symptom.CRASH, error={"type": "SIGSEGV", "where": "worker"})
    abrt = Evaluation("p", case, Symptom.CRASH, error={"type": "SIGABRT", "where": "worker"})
    hang = Evaluation("p", case, Symptom.TIMEOUT, error={"type": "Timeout", "where": "worker"})
    assert len({signature("p", e) for e in (segv, abrt, hang)}) == 3


def test_errors_of_one_raising_frame_are_told_apart_by_their_message_class():
    """An engine's errors all raise in its own `run`: what the message says (numbers and paths taken
    out) tells two bugs apart, and keeps one bug raised on other inputs one. The pair's call site
    is kept beside it (`caller`, for people)."""
    import json as _json

    from harness import Outcome, TargetPair
    from harness.execute import run_case
    from harness.fuzz import signature

    texts = {1: "x", 2: "[1 2]", 3: "[1 2, 3]", 4: "[1]"}  # json's raw_decode raises all three errors

    def engine(inp):
        _json.loads(texts[inp["n"]])
        return Outcome(logprobs=torch.log_softmax(inp["x"], -1))

    pair = TargetPair(name="lib.raises", kind="op", expected="aligned",
                      build=lambda c, d: {"n": c.batch_size, "x": c.token_randn(8, "x")},
                      trainer=lambda i: Outcome(logprobs=torch.log_softmax(i["x"], -1)), rollout=engine)
    evs = {n: run_case(pair, Case(seed=1, seq_lens=(1,) * n)) for n in (1, 2, 3)}
    for n, ev in evs.items():  # one raising frame for all three, called from this test's engine
        assert ev.symptom is Symptom.ERROR and ev.error["where"] == "decoder.py:raw_decode", (n, ev.error)
        assert ev.error["caller"] == "test_fuzz.py:engine"
    sig = {n: signature(pair.name, ev) for n, ev in evs.items()}
    assert sig[1] != sig[2]  # "Expecting value" and "Expecting ',' delimiter": two bugs
    assert sig[2] == sig[3]  # the delimiter at column 4 and at column 7: one
    assert run_case(pair, Case(seed=1, seq_lens=(1,) * 4)).symptom is not Symptom.ERROR



@pytest.mark.parametrize("name, n, per_example", [("moe_aggregate.aligned", None, 3), ("moe_aggregate.aligned", 0, 0),
                                                  ("moe_aggregate.aligned", 2, 2), ("model.aligned", None, 1)])
def test_each_hypothesis_example_is_followed_by_its_uniform_cases(name, n, per_example):
    """Op pairs run three uniform cases per Hypothesis example by default, model pairs one;
    `uniform_per_example` sets it (0: Hypothesis alone). The mix is deterministic given the seed."""
    from harness.fuzz import fuzz_pair, pair_seed, uniform_per_example
    from harness.strategies import uniform_cases

    pair = REGISTRY.get(name)
    examples = 4 if pair.kind == "model" else 12
    cfg = CampaignConfig(pairs=[pair], seed=2, max_examples=examples, write_corpus=False, uniform_per_example=n)
    assert uniform_per_example(pair, cfg) == per_example
    runs = []
    for _ in range(2):
        seen: list = []

        def evaluate(case, seen=seen):
            seen.append(case)
            return run_case(pair, case)

        r = fuzz_pair(pair, cfg, pair_seed(2, name), deadline=None, evaluate=evaluate)
        assert not r.findings
        runs.append([(c.seed, c.seq_lens, c.logit_scale) for c in seen])  # (a uniform case takes the example's params)
    assert runs[0] == runs[1]
    import random

    rng = random.Random(pair_seed(2, name) ^ 0x5DEECE66D)  # the stream's own uniform RNG
    stream = [(u.seed, u.seq_lens, u.logit_scale) for u in
              (uniform_cases(pair.axes, rng, log_gap=True) for _ in range(per_example * examples * 3))]
    taken, hypothesis = 0, 0
    for key in runs[0]:
        if taken < len(stream) and key == stream[taken]:
            taken += 1
        else:  # a Hypothesis case comes only between whole groups of uniform cases
            assert taken % per_example == 0 if per_example else taken == 0
            hypothesis += 1
    assert hypothesis >= examples // 2
    assert taken >= per_example * hypothesis - per_example and taken % max(per_example, 1) == 0


def test_the_campaign_climbs_what_the_verdict_reads(monkeypatch):
    # a passing case whose sampled tokens' k3 is tiny but whose exact KL is near the line: the score
    # Hypothesis climbs is the KL (the verdict's larger mean), not the sampled k3
    import hypothesis

    from harness.fuzz import fuzz_pair

    pair = REGISTRY.get("rmsnorm.aligned")
    targeted = []
    monkeypatch.setattr(hypothesis, "target", lambda v, label="": targeted.append((label, v)) or v)

    def evaluate(case):
        ev = run_case(pair, case)
        ev.divergence.k3_kl, ev.divergence.k3_expected, ev.divergence.kl = 1e-9, 2e-4, 5e-4
        return ev

    fuzz_pair(pair, CampaignConfig(pairs=[pair]), seed=1, deadline=None, evaluate=evaluate, max_examples=5)
    assert targeted and all(t == ("score", 5e-4) for t in targeted)


def test_the_summary_table_says_when_shrinking_was_cut_short():
    from harness.case import Case
    from harness.execute import run_case
    from harness.fuzz import CampaignResult, Finding, PairResult, signature, summary_table

    pair = REGISTRY.get("moe_aggregate.bf16")
    case = Case(seed=4090854905, seq_lens=(2,), seq_ids=(46916,), n_experts=16, top_k=7, logit_scale=33.39888714660706,
                dtype="bfloat16")  # (its corpus repro's case)
    ev = run_case(pair, case)
    assert ev.failed
    rows = []
    for complete in (True, False):
        f = Finding(pair=pair.name, expected=pair.expected, symptom=ev.symptom, signature=signature(pair.name, ev),
                    case=case, evaluation=ev, examples=9, shrink_complete=complete, shrink_seconds=4.0)
        cfg = CampaignConfig(pairs=[pair], seed=1)
        r = PairResult(pair.name, pair.expected, examples=9, seconds=1.0, findings=[f])
        rows.append(summary_table(CampaignResult(seed=1, config=cfg, results=[r], seconds=1.0)))
    assert "shrunk in 4.0s" in rows[0] and "cut short" not in rows[0]
    assert "shrinking cut short after 4.0s" in rows[1]


def test_a_pairs_own_timeout_wins_over_the_campaigns_and_the_command_lines_per_pair_one_over_both():
    cfg = CampaignConfig(pairs=[], timeout=60.0, timeouts={"a.hangs": 2.0})
    assert cfg.timeout_for("b.plain") == 60.0  # no timeout of its own: the campaign's
    assert cfg.timeout_for("b.compiled", 600.0) == 600.0  # a compiling backend's longer one
    assert cfg.timeout_for("b.may_hang", 3.0) == 3.0  # ... and a shorter one (it was max(campaign, own))
    assert cfg.timeout_for("a.hangs", 3.0) == 2.0  # `--timeout GLOB=S` overrides the pair's own


def test_a_pairs_own_threshold_wins_over_the_campaigns_and_the_command_lines_per_pair_one_over_both():
    from dataclasses import replace

    own = replace(REGISTRY.get("attention.aligned"), name="t.accepted", threshold=0.01)
    plain = replace(REGISTRY.get("attention.aligned"), name="t.plain")
    cfg = CampaignConfig(pairs=[own, plain], threshold=0.002)
    assert cfg.threshold_of("t.plain") == 0.002 and cfg.threshold_of("t.accepted") == 0.01
    assert cfg.own_thresholds() == {"t.accepted": 0.01}
    cfg = CampaignConfig(pairs=[own, plain], thresholds={"t.accepted": 0.005, "t.plain": 0.0001})
    assert cfg.threshold_of("t.accepted") == 0.005 and cfg.threshold_of("t.plain") == 0.0001
    for bad in (0, -1.0, float("nan"), float("inf"), "0.01", True):
        with pytest.raises(PairError, match="threshold="):
            replace(own, threshold=bad).validate()
    # any real number is a line (a numpy scalar read from a config, a Fraction): a plain float from then on
    import numpy as np
    from fractions import Fraction

    for number in (np.float32(0.02), np.int64(1), Fraction(1, 50), np.float64(0.02)):
        lined = replace(own, threshold=number, timeout=np.float32(30))
        lined.validate()
        assert isinstance(lined.threshold, float) and lined.threshold == pytest.approx(float(number))
        assert type(lined.timeout) is float and json.dumps({"t": lined.threshold})


def test_threshold_options_are_parsed_with_a_clear_error_for_each_mistake():
    from harness.cli import parse_thresholds
    from harness.errors import UsageError

    pairs = [REGISTRY.get("attention.aligned"), REGISTRY.get("model.aligned")]
    assert parse_thresholds(["0.002", "model.*=0.01"], pairs) == (0.002, {"model.aligned": 0.01})
    assert parse_thresholds([], pairs) == (1e-3, {})
    for bad, words in (("=3", "empty GLOB before '='"), ("model.*=0", "K3 > 0"),
                       ("x", "K3 > 0"), ("nosuch.*=0.1", "no selected pair matches")):
        with pytest.raises(UsageError, match=words):
            parse_thresholds([bad], pairs)


def test_timeout_options_are_parsed_with_a_clear_error_for_each_mistake():
    from harness.cli import parse_timeouts
    from harness.errors import UsageError

    pairs = [REGISTRY.get("attention.aligned"), REGISTRY.get("model.aligned")]
    assert parse_timeouts(["30", "model.*=300"], pairs) == (30.0, {"model.aligned": 300.0})
    for bad, words in (("=3", "empty GLOB before '='"), ("model.*=0", "SECONDS > 0"), ("x", "SECONDS > 0"),
                       ("nosuch.*=3", "no selected pair matches")):
        with pytest.raises(UsageError, match=words):
            parse_timeouts([bad], pairs)


def test_a_pair_that_waited_behind_anothers_first_case_says_so_not_that_its_time_ran_out():
    from harness.fuzz import PairResult

    r = PairResult("ort.fp16", "diverges", waited_for="ort.aligned", examples_asked=100, examples_short=100)
    assert r.verdict == "not run" and r.time_note.startswith("it waited behind ort.aligned's first case")
    assert "time share" not in r.time_note


def test_an_error_repro_named_before_message_classes_is_adopted_and_another_message_is_its_own(tmp_path):
    """A corpus written when an error's signature was its type and raising frame: the same error now
    is that repro (its id, MLflow run and history go on); another message of the same frame is a
    repro of its own, and replay tells the two apart."""
    import json as _json

    from harness import Outcome, TargetPair
    from harness.corpus import load_repro, record_finding, replay
    from harness.execute import run_case
    from harness.fuzz import Finding, legacy_error_signature, signature

    texts = {1: "x", 2: "[1 2]"}

    def engine(inp):
        _json.loads(texts[inp["n"]])

    pair = TargetPair(name="lib.legacy", kind="op", expected="aligned",
                      build=lambda c, d: {"n": c.batch_size, "x": c.token_randn(8, "x")},
                      trainer=lambda i: Outcome(logprobs=torch.log_softmax(i["x"], -1)), rollout=engine)
    REGISTRY.register(pair)

    def finding(n):
        case = Case(seed=1, seq_lens=(1,) * n)
        ev = run_case(pair, case)
        return Finding(pair=pair.name, expected="aligned", symptom=ev.symptom, signature=signature(pair.name, ev),
                       case=case, evaluation=ev, examples=1)

    first = finding(1)
    path = record_finding(first, tmp_path, 1e-3, 1, "cpu")
    legacy = legacy_error_signature(pair.name, first.evaluation.error)
    data = _json.loads(path.read_text())
    data["signature"] = legacy  # as an older harness named it
    old = path.with_name(f"{legacy[:12]}.json")
    old.write_text(_json.dumps(data))
    path.unlink()
    again = finding(1)
    assert record_finding(again, tmp_path, 1e-3, 1, "cpu") == old and not again.new and again.id == legacy[:12]
    other = finding(2)
    assert record_finding(other, tmp_path, 1e-3, 1, "cpu") != old and other.new
    # replaying the old repro's case against the other bug's message: not the recorded failure
    repro = load_repro(old)
    repro.error = {**repro.error, "message": other.evaluation.error["message"]}
    assert "error" in replay(repro).mismatches


def test_a_message_class_keeps_the_words_and_drops_what_varies_with_the_case():
    from harness.fuzz import message_class

    assert message_class("shape [3, 64] vs [4, 64, 2] in /tmp/x/y.py at 0x7f3a") == "shape [#] vs [#] in <path> at #"
    assert message_class("idx=17 must be within [-16,15]") == message_class("idx=23 must be within [-16,15]")
    assert message_class("Expecting value") != message_class("Expecting ',' delimiter")
    assert message_class("first line\nsecond 12") == "first line"


def test_a_demonstration_not_caught_in_its_first_round_is_not_called_missed_before_its_last(tmp_path):
    import torch

    from harness import Axes, Outcome, TargetPair

    same = TargetPair(name="demo.never", kind="op", expected="diverges",
                      build=lambda case, device: torch.log_softmax(case.randn((case.n_tokens, 8), "x"), -1),
                      trainer=lambda x: Outcome(logprobs=x), rollout=lambda x: Outcome(logprobs=x.clone()),
                      axes=Axes(n_seqs=(1, 2), seq_len=(1, 3)))
    logged = []
    cfg = CampaignConfig(pairs=[same], corpus=tmp_path / "c", max_examples=3, budget=2.0, seed=3, fill_budget=True)
    result = run_campaign(cfg, NullTracker(), log=logged.append)
    assert result.results[0].verdict == "MISSED", logged  # the pair's verdict, at the end
    first = [m for m in logged if m.startswith("  demo.never:") and "cases in" in m][0]
    assert "MISSED" not in first and "not caught yet (more rounds follow if time is left)" in first, logged


def test_an_interrupt_whose_exception_python_dropped_still_stops_the_campaign_at_the_next_case(tmp_path):
    """A signal landing inside a weakref callback or __del__ (SQLAlchemy's, say): Python prints
    'Exception ignored' and drops the KeyboardInterrupt the handler raised. The handler's flag is
    read between cases, so the campaign stops there and keeps what it found."""
    import torch

    import harness.fuzz as fz
    from harness import Axes, Outcome, TargetPair

    calls = [0]

    def build(case, device):
        calls[0] += 1
        if calls[0] == 4:
            fz._SIGNALLED[0] = True  # what _Signals._handle sets before its exception was dropped
        return torch.log_softmax(case.randn((case.n_tokens, 8), "x"), -1)

    pair = TargetPair(name="demo.dropped_signal", kind="op", expected="diverges", build=build,
                      trainer=lambda x: Outcome(logprobs=x), rollout=lambda x: Outcome(logprobs=x * 1.5),
                      axes=Axes(n_seqs=(1, 3), seq_len=(1, 4)))
    cfg = CampaignConfig(pairs=[pair], corpus=tmp_path / "c", max_examples=10**6, budget=60.0, seed=3)
    t = __import__("time").monotonic()
    result = run_campaign(cfg, NullTracker(), log=lambda m: None)
    assert result.interrupted and __import__("time").monotonic() - t < 30 and calls[0] <= 5, calls
    [r] = result.results
    assert r.findings and all(f.interrupted and not f.shrink_complete for f in r.findings)
    assert all(f.cases_to_first >= 1 for f in r.findings)  # when it was first seen, not "after 0 cases"
    again = run_campaign(CampaignConfig(pairs=[REGISTRY.get("rmsnorm.aligned")], corpus=tmp_path / "d",
                                        max_examples=3, seed=3), NullTracker(), log=lambda m: None)
    assert not again.interrupted


def test_the_budget_is_a_wall_for_units_not_started_yet(tmp_path):
    """Hundreds of streams and a short budget: the units left when the budget ends do not start
    (each start costs a Hypothesis setup: 1000 streams ran 24 s past a 3 s budget)."""
    import time

    logged = []
    cfg = CampaignConfig(pairs=[REGISTRY.get("rmsnorm.aligned")], corpus=tmp_path / "c", max_examples=10**6,
                         budget=1.5, seed=3, streams=1000)
    t = time.monotonic()
    result = run_campaign(cfg, NullTracker(), log=logged.append)
    assert time.monotonic() - t < 1.5 + 5.0, logged[-3:]
    assert any("more unit(s) started: not run" in m for m in logged), logged[-3:]
    [r] = result.results
    assert r.pair == "rmsnorm.aligned" and r.streams == 1000  # every stream accounted for, run or not
    assert r.examples_short > 0 and "ran out" in r.time_note, r.time_note  # not clean over what was asked
    assert r.examples_asked == cfg.max_examples  # the streams never started count what they were to run


def test_a_pairs_memory_note_adds_up_its_workers():
    """A worker retired after replacements and the current one: the note keeps the largest growth and
    the replacements of both (not the current worker's alone)."""
    from types import SimpleNamespace

    from harness.fuzz import CampaignConfig, Executor

    ex = Executor(CampaignConfig(pairs=[], seed=0))
    ex._memory_retired.append({"p": [1500.0, 2]})
    ex.worker = SimpleNamespace(memory_seen={"p": [900.0, 1], "q": [0.0, 0]})
    assert ex.memory_note("p") == ("memory: the worker grew by 1500 MiB over its cases (a path that keeps memory "
                                   "across cases?); replaced at the cap 3 time(s)")
    assert ex.memory_note("other") == ""
    ex.worker = None


def test_a_missed_demonstration_says_whether_its_paths_differed_at_all():
    """A patch that changes nothing the path runs leaves the judged means at float noise: "more
    examples or budget" would send its author the wrong way."""
    from harness.fuzz import PairResult, missed_hint

    same = missed_hint(PairResult("x.patch", "diverges", examples=300, max_score=7e-12), 1e-3)
    assert "agreed to float rounding" in same and "more examples" not in same
    under = missed_hint(PairResult("x.weak", "diverges", examples=300, max_score=4e-4), 1e-3)
    assert "max judged 0.0004 of the line 0.001" in under and "more examples" in under
    # real but far under the line (a rollout one optimizer step stale at 1e-5): not "more examples" either
    far = missed_hint(PairResult("x.stale", "diverges", examples=300, max_score=5e-8, entropy_sum=600.0,
                                 entropy_cases=300), 1e-3)
    assert far.startswith("max judged 5e-08, 2e+04x under the line 0.001 at its largest") and "more examples" not in far


def test_a_demonstration_missed_over_a_near_deterministic_rollout_says_so_not_more_examples(tmp_path):
    """A random model whose LM head is tied to its embedding repeats its last token (mean entropy
    0.08 nats): its bf16 rollout stayed under the line, and "more examples" sent its user the wrong
    way. The campaign keeps the rollout's mean entropy and the hint names it."""
    import torch

    from harness import Axes, Outcome, TargetPair

    def build(case, device):
        x = case.randn((case.n_tokens, 64), "x")
        x[:, 0] += 9.0  # one token takes almost all the mass: entropy ~0.05 nats
        return x

    peaked = TargetPair(name="demo.peaked", kind="op", expected="diverges", build=build,
                        trainer=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)),
                        rollout=lambda x: Outcome(logprobs=torch.log_softmax(x.bfloat16().float(), -1)),
                        axes=Axes(n_seqs=(1, 3), seq_len=(1, 8)))
    result = run_campaign(CampaignConfig(pairs=[peaked], corpus=tmp_path / "c", max_examples=20, seed=1),
                          NullTracker(), log=lambda m: None)
    r = result.results[0]
    assert r.verdict == "MISSED" and r.entropy_cases == r.examples > 0, r
    hint = missed_hint_of(r)
    assert "near-deterministic rollout (mean entropy" in hint and "more examples" not in hint, hint
    # ... and a rollout that is not near-deterministic keeps the plain hint
    from harness.fuzz import PairResult
    plain = missed_hint_of(PairResult("x.weak", "diverges", examples=3, max_score=4e-4, entropy_sum=3.0, entropy_cases=3))
    assert "more examples" in plain and "near-deterministic" not in plain


def missed_hint_of(r):
    from harness.fuzz import missed_hint

    return missed_hint(r, 1e-3)


def test_xdist_campaigns_share_the_cores_among_their_torch_threads(monkeypatch):
    """torch's default, a thread per core in every xdist worker, oversubscribed the machine (a run
    1.4x slower on 2 cores, `reports/scripts/xdist_threads.py`); each worker gets cores // workers
    threads, less one for the campaign beside its worker process where that leaves two or more (a
    lone `harness fuzz` on a loaded 2-core machine ran many times slower on 2 threads), unless the
    count was chosen."""
    import os

    import torch

    from harness.fuzz import share_threads_among_campaigns

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    try:
        torch.set_num_threads(8)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
        assert share_threads_among_campaigns(isolated=False) is None and torch.get_num_threads() == 8  # in-process
        assert share_threads_among_campaigns() == 7 and torch.get_num_threads() == 7  # one core for the campaign
        torch.set_num_threads(8)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        assert share_threads_among_campaigns(isolated=False) == 2 and torch.get_num_threads() == 2
        torch.set_num_threads(8)
        assert share_threads_among_campaigns() == 1 and torch.get_num_threads() == 1  # 8 // 3 - 1
        torch.set_num_threads(8)
        monkeypatch.setenv("OMP_NUM_THREADS", "8")  # chosen: kept
        assert share_threads_among_campaigns() is None and torch.get_num_threads() == 8
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "16")  # more workers than cores: one each
        assert share_threads_among_campaigns() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_finding_keeps_the_worst_judged_mean_its_cases_reached():
    """`Finding.peak`: what severity reads; the minimal case is the smallest still over the line."""
    import math

    from harness import REGISTRY
    from harness.fuzz import CampaignConfig, run_campaign

    cfg = CampaignConfig(pairs=[REGISTRY.get("rmsnorm.eps_placement")], seed=3, max_examples=30, write_corpus=False,
                         isolation=False)
    (f,) = run_campaign(cfg, log=lambda m: None).results[0].findings
    assert math.isfinite(f.peak) and f.peak >= f.evaluation.score > cfg.threshold, (f.peak, f.evaluation.score)


def test_a_mean_just_over_a_round_line_does_not_print_as_the_line():
    from harness.execute import headline

    assert headline({"k3_expected": 0.0010016, "kl": 1e-4, "k3_kl": 1e-4}, None) == "k3=0.001002"
    assert headline({"k3_expected": 0.0009999, "kl": 1e-4, "k3_kl": 1e-4}, None) == "k3=0.0009999"
    assert headline({"k3_expected": 0.00238, "kl": 1e-4, "k3_kl": 1e-4}, None) == "k3=0.00238"


def test_a_gap_floor_keeps_an_aligned_split_k_router_clean_and_without_it_the_exact_tie_flips(tmp_path):
    """Both paths route in float32, the rollout summing the router GEMM in two halves: at an exact tie
    their rounding picks different experts (flagged), and `RoutingAxes(min_gap=1e-5)` keeps every
    drawn gap above that noise (clean)."""
    REGISTRY.load_plugin(str(PLUGINS / "gap_floor.py"))
    result = campaign(tmp_path, ["gapfloor.*"], max_examples=150, seed=1)
    [f] = result.findings
    assert f.pair == "gapfloor.none" and f.symptom is Symptom.DIVERGENCE and f.case.tie_gap == 0.0
    floor = {r.pair: r for r in result.results}["gapfloor.floor"]
    assert floor.verdict == "clean" and floor.examples >= 150 and floor.max_score < 1e-6, floor


def test_an_unfinished_note_names_the_budget_option_of_its_command_and_where_the_case_was():
    from harness.fuzz import PairResult, unfinished_note

    stack = ('Thread 0x01 (most recent call first):\n  File "/x/threading.py", line 1 in wait\n\n'
             'Current thread 0x02 (most recent call first):\n  File "/p/engine.py", line 44 in decode\n'
             '  File "/h/execute.py", line 221 in run_paths\n')
    r = PairResult(pair="p.x", expected="aligned", unfinished=61.0, unfinished_stack=stack)
    cli, pytest_note = unfinished_note(r, 5.0), unfinished_note(r, 5.0, "--harness-budget")
    assert "Without --budget it becomes" in cli and "Without --harness-budget it becomes" in pytest_note
    assert cli.endswith('where it was when stopped: File "/p/engine.py", line 44 in decode <- '
                        'File "/h/execute.py", line 221 in run_paths'), cli


def test_a_missed_demonstration_with_router_replay_says_replay_removes_a_routing_difference():
    from types import SimpleNamespace

    from harness.fuzz import PairResult, missed_hint

    r = PairResult(pair="p.replay", expected="diverges", examples=50, max_score=5e-4, entropy_sum=100.0,
                   entropy_cases=50)
    plain = missed_hint(r, 1e-3)
    assert plain.endswith("more examples, budget or wider axes?")
    diluted = PairResult(pair="p", expected="diverges", examples=50, max_score=6.7e-4, max_seq_score=2.3e-3,
                         entropy_sum=100.0, entropy_cases=50)  # one sample over the line, the batch under it
    assert "one sequence's own mean reached 0.0023" in missed_hint(diluted, 1e-3)
    assert "verdict_over='sequence'" in missed_hint(diluted, 1e-3)
    replayed = missed_hint(r, 1e-3, SimpleNamespace(profiles=SimpleNamespace(replay=True)))
    assert "with router replay" in replayed and "demonstrated by the pair without replay" in replayed
    # an expert or combine difference is not sent to the pair without replay (it needs trained weights)
    assert "moe_aggregate.*" in replayed and "trained weights" in replayed


def test_a_missed_demonstration_over_a_near_uniform_model_says_so():
    """A trial's randomly initialised GraniteMoE checkpoint: its bf16 demonstration was missed at
    4.4e-5 with 'more examples, budget or wider axes?', where its outputs were nearly uniform."""
    from types import SimpleNamespace

    from harness.fuzz import PairResult, missed_hint

    def hint(entropy: float) -> str:
        r = PairResult(pair="p.bf16", expected="diverges", examples=50, max_score=4.4e-5, entropy_sum=50 * entropy,
                       entropy_cases=50)
        return missed_hint(r, 1e-3, SimpleNamespace(profiles=SimpleNamespace(model=SimpleNamespace(vocab=1024),
                                                                               replay=False)))

    assert "over a near-uniform rollout (mean entropy 6.9 nats of at most log 1024 = 6.93)" in hint(6.9)
    assert "realistic init" in hint(6.9)
    assert hint(4.0).endswith("more examples, budget or wider axes?")


def test_merged_results_count_every_round_and_keep_the_finding_that_wrote_the_file(tmp_path):
    """A later round's finding counts the rounds before it in both its first sighting and its cases in
    all (a repro said "after 295 cases ... (128 cases in all)"); of two streams' findings of one
    signature, the one that wrote the corpus file stands for it (a summary described the other
    stream's case beside that file's path)."""
    from harness.execute import Evaluation
    from harness.fuzz import Finding, PairResult, _merge

    def finding(seed, new, path):
        case = Case(seed=seed, seq_lens=(2,))
        ev = Evaluation("p", case, Symptom.DIVERGENCE)
        return Finding(pair="p", expected="aligned", symptom=Symptom.DIVERGENCE, signature="p/divergence", case=case,
                       evaluation=ev, examples=10, shrink_complete=True, path=path, new=new, cases_to_first=4)

    first = PairResult("p", "aligned", examples=100)
    later = PairResult("p", "aligned", examples=10, findings=[finding(1, True, None)])
    _merge(first, later, rounds=True)
    [f] = first.findings
    assert (f.cases_to_first, f.examples, first.examples) == (104, 110, 110)
    path = tmp_path / "p" / "x.json"
    known = PairResult("p", "aligned", examples=5, findings=[finding(2, False, path)])  # (stream 0: found it second)
    _merge(known, PairResult("p", "aligned", examples=5, findings=[finding(3, True, path)]))
    assert [f.case.seed for f in known.findings] == [3]
    unwritten = PairResult("p", "aligned", examples=5, findings=[finding(2, True, path)])  # (harness fuzz: the first
    _merge(unwritten, PairResult("p", "aligned", examples=5, findings=[finding(3, True, None)]))  # is the one recorded)
    assert [f.case.seed for f in unwritten.findings] == [2]


def test_a_slow_pairs_first_failure_goes_straight_to_the_polish_pass():
    """`CampaignConfig.slow_case_seconds`: a pair whose cases cost that much skips Hypothesis's shrinking
    (hundreds of small steps, minutes at a real vocabulary) and the polish pass shrinks its first failure:
    every case run after the first sighting is a polish evaluation. Here every pair counts as slow (0 s),
    against never (the default for fast pairs), on the same Hypothesis-only campaign."""
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.tracking import NullTracker

    def finding(slow: float):
        cfg = CampaignConfig(pairs=[REGISTRY.get("lm_head.bf16")], seed=1, max_examples=60, write_corpus=False,
                             isolation=False, slow_case_seconds=slow, uniform_per_example=0)
        (f,) = run_campaign(cfg, NullTracker(), log=lambda m: None).results[0].findings
        return f

    hypothesis, polish_only = finding(1e9), finding(0.0)
    assert hypothesis.cases_to_first == polish_only.cases_to_first  # the same campaign up to the failure
    assert hypothesis.examples - hypothesis.cases_to_first > hypothesis.polish_evaluations  # Hypothesis shrank first
    assert polish_only.examples - polish_only.cases_to_first == polish_only.polish_evaluations
    assert polish_only.shrink_complete and polish_only.neighbours  # polished to the end: its neighbours pass


def test_a_campaign_says_what_sizes_its_cases_reached_and_what_its_worker_held():
    """`PairResult.largest` (each size axis's largest case) and `worker_peak_mib` (the isolated worker's
    resident memory while the pair's cases ran), in the campaign's MLflow metrics too: what a clean
    verdict covered, and what a machine needs for the pair."""
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.mlflow_tracking.payload import campaign_metrics
    from harness.tracking import NullTracker

    cfg = CampaignConfig(pairs=[REGISTRY.get("model.aligned")], seed=1, max_examples=12, write_corpus=False,
                         isolation=True)
    result = run_campaign(cfg, NullTracker(), log=lambda m: None)
    (r,) = result.results
    b, p, resp, tokens = r.largest
    assert r.verdict == "clean" and b >= 2 and resp >= 2 and tokens >= resp + p, r.largest
    lo, hi = REGISTRY.get("model.aligned").axes.n_seqs
    assert lo <= b <= hi and r.largest_text.startswith(f"largest: {b} sequences")
    assert r.worker_peak_mib > 50  # (torch alone is more than that)
    m = campaign_metrics(result)
    assert m["pair.model.aligned.largest_tokens"] == tokens and m["pair.model.aligned.worker_peak_mib"] == r.worker_peak_mib


def test_a_pairs_worker_memory_is_its_peak_not_what_stays_resident_after_a_case(tmp_path):
    """A path whose temporaries are large and freed before it returns (a trainer's (T, V) logits): the
    worker's size read between cases missed them (this test's heavy pair read 188 MiB before). It is the
    process's peak (VmHWM), started over for each pair."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc (Linux)")
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.tracking import NullTracker

    plugin = tmp_path / "mem_pairs.py"
    plugin.write_text(
        "import torch\nfrom harness import Axes, Outcome, TargetPair, register\n"
        "def build(case, device):\n    return torch.log_softmax(case.token_randn(8, 'x'), -1)\n"
        "def heavy(x):  # 400 MiB of float32 touched, then freed before the outcome goes back\n"
        "    big = torch.ones(100 * 2**20)\n    return Outcome(logprobs=x + 0 * float(big[-1]))\n"
        "for name, rollout in (('mem.heavy', heavy), ('mem.light', lambda x: Outcome(logprobs=x.clone()))):\n"
        "    register(TargetPair(name=name, kind='op', expected='aligned', build=build, rollout=rollout,\n"
        "        trainer=lambda x: Outcome(logprobs=x), axes=Axes(n_seqs=(1, 2), seq_len=(1, 3), pad_sides=('right',))))\n")
    REGISTRY.load_plugin(str(plugin))
    cfg = CampaignConfig(pairs=[REGISTRY.get("mem.heavy"), REGISTRY.get("mem.light")], seed=1, max_examples=3,
                         write_corpus=False, isolation=True)
    result = run_campaign(cfg, NullTracker(), log=lambda m: None)
    peak = {r.pair: r.worker_peak_mib for r in result.results}
    assert peak["mem.heavy"] > peak["mem.light"] + 300, peak


def test_hypothesis_does_not_shrink_a_divergence_to_the_edge_of_the_line():
    """A failure by less than `shrink.EDGE_MARGIN` over the line is a finding when it comes first, but not a
    step Hypothesis's shrinker may take: without the margin, this campaign's repro reads 1.0009x the line (its
    logit scale shrunk to the edge, where another CPU's last bits may read it clean); with it, 1.52x."""
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.tracking import NullTracker

    cfg = CampaignConfig(pairs=[REGISTRY.get("moe_aggregate.bf16")], seed=7, max_examples=80, write_corpus=False,
                         isolation=False, uniform_per_example=0)
    (f,) = run_campaign(cfg, NullTracker(), log=lambda m: None).results[0].findings
    assert f.evaluation.score > 1.2e-3 and f.case.n_tokens == 1, (f.evaluation.score, f.case.one_line())


def test_hypothesis_scans_the_local_modules_before_a_campaigns_clock_starts():
    """Hypothesis's first draw in a process scans every local module's source for constants (0.4-1.1 s in a
    folder without its cache, reports/scripts/hypothesis_scan.py): left to the first draw it took the first
    pair's time share, and a 2 s campaign's pair read "not run" on a loaded machine."""
    import sys

    providers = pytest.importorskip("hypothesis.internal.conjecture.providers")
    if not hasattr(providers, "_get_local_constants"):
        pytest.skip("this Hypothesis has no local-constants scan to warm")
    from harness.fuzz import warm_hypothesis

    import harness.shrink  # noqa: F401 - (a module loaded since the last scan, if none was)
    warm_hypothesis()
    assert providers._sys_modules_len == len(sys.modules)


def test_a_second_bug_far_above_the_minimal_one_is_kept_as_the_findings_severe_case(tmp_path, harness_cli):
    """Shrinking keeps the simplest trigger over the line: with two bugs in one rollout that is the
    milder (a head 3% off, at temperature 1), and the temperature bug that reached 100x it was shrunk
    away. The campaign shrinks its worst case too, kept far above the minimal one: the severe case
    names the second bug, the repro keeps it, `show` prints it and `triage --severe` localizes it."""
    plugin = PLUGINS / "two_bugs.py"
    corpus = tmp_path / "corpus"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code, out, err = harness_cli("fuzz", "user.two_bugs", "--plugin", str(plugin), "--seed", "1", "--max-examples",
                                 "60", "--corpus", str(corpus), "--tracking-uri", store, cwd=tmp_path)
    assert code == 1, err
    [path] = iter_corpus(corpus)
    repro = load_repro(path)
    assert repro.case.temperature == 1.0 and repro.metrics["k3_expected"] < 0.01  # the mild bug, minimal
    sev = repro.found["severe"]
    worst = Case.from_json(sev["case"])
    assert worst.temperature != 1.0 and worst.batch_size == 1 and worst.n_tokens == 1, worst
    from harness.fuzz import SEVERE_FACTOR

    assert sev["judged"] >= sev["bar"] >= SEVERE_FACTOR * repro.metrics["k3_expected"]
    assert sev["peak"] >= sev["judged"] and sev["bar"] >= sev["peak"] / SEVERE_FACTOR
    assert "severe: its cases reached" in err and "harness triage --severe --plugin" in err, err
    code, out, _ = harness_cli("regressions", "show", repro.id, "--tracking-uri", store, cwd=tmp_path)
    assert code == 0 and f"**Severe case.** `{worst.one_line(brief=True)}`" in out, out
    code, out, err = harness_cli("show", str(path), "--plugin", str(plugin), cwd=tmp_path)
    assert code == 0 and "severe case: this finding's campaign reached" in out and worst.one_line() in out, out
    code, out, err = harness_cli("triage", "--severe", str(path), "--plugin", str(plugin), "--no-tracking",
                                 "--reports", str(tmp_path / "reports"), cwd=tmp_path)
    assert code == 0 and f"severe case of {repro.id}" in out and (tmp_path / "reports" / f"{repro.id}-severe").is_dir()
    report = (tmp_path / "reports" / f"{repro.id}-severe" / "report.md").read_text()
    assert "this report is of its severe case" in report and "triage again: `harness triage --severe" in report
    assert "(recorded " not in report  # (the recorded metrics are the minimal case's)
    # the judged value of the severe case, replayed, is the one recorded
    assert f"expected k3 {sev['judged']:.3g}" in out, out
    # a repro without one says so
    clean = tmp_path / "plain.json"
    data = json.loads(path.read_text())
    del data["found"]["severe"]
    clean.write_text(json.dumps(data))
    code, out, err = harness_cli("triage", "--severe", str(clean), "--plugin", str(plugin), "--no-tracking",
                                 "--reports", str(tmp_path / "reports"), cwd=tmp_path)
    assert code == 2 and "has no severe case to triage" in err, err
    # the mild bug fixed: its open repro replays clean, said as such, not as a list of moved metrics
    fixed = tmp_path / "fixed" / "two_bugs.py"
    fixed.parent.mkdir()
    fixed.write_text(plugin.read_text().replace('0.03 * inp["noise"]', '0.0 * inp["noise"]'))
    code, out, err = harness_cli("replay", str(path), "--plugin", str(fixed), cwd=tmp_path)
    assert code == 0 and "-> now clean" in out and "bit-for-bit no: it no longer fails (fixed? once it is: `harness " \
        f"regressions close {repro.id} --status fixed --plugin " in out and "--note 'fixed by ...'`, with --tracking-uri where its campaign logged to a store other than the " \
        "default, --no-tracking for a corpus kept without MLflow)" in out and "k3_kl:" not in out, out
    # ... and its severe case, the temperature bug, still fails: said by replay and by the corpus test
    assert "but its severe case (found.severe) still fails (divergence k3=" in out, out
    tested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                             "harness.corpus_tests", f"--harness-plugin={fixed}", f"--harness-corpus={corpus}",
                             "-k", "test_replay"], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert tested.returncode == 1 and "open regression no longer diverges" in tested.stdout \
        and "but its severe case (found.severe) still fails" in tested.stdout, tested.stdout + tested.stderr
    # (its close command names the plugin this run was given, not the one the repro was recorded with)
    assert f"--status fixed --plugin {fixed} --corpus-file" in tested.stdout, tested.stdout
    # closing it as fixed keeps the severe case as an open repro of its own, in the corpus and MLflow
    code, out, err = harness_cli("regressions", "close", repro.id, "--status", "fixed", "--note", "head fixed",
                                 "--plugin", str(fixed), "--tracking-uri", store, cwd=tmp_path)
    assert code == 0 and "its severe case still fails (divergence k3=" in out and "now open repro" in out, out + err
    [second] = [p for p in iter_corpus(corpus) if p != path]
    kept = load_repro(second)
    assert kept.status == "open" and kept.case == worst and load_repro(path).status == "fixed"
    assert kept.found["by"] == f"the severe case of {repro.id}, still failing when {repro.id} was closed as fixed"
    assert kept.base_signature == repro.signature != kept.signature
    code, out, _ = harness_cli("regressions", "--tracking-uri", store, "--status", "open", cwd=tmp_path)
    assert code == 0 and kept.id in out and repro.id not in out, out
    code, out, _ = harness_cli("replay", str(second), "--plugin", str(fixed), cwd=tmp_path)
    assert code == 1 and "bit-for-bit yes" in out, out
    # recorded again by hand, it is that repro (the closed one's case passes: not its recurrence)
    code, out, err = harness_cli("record", "user.two_bugs", "--case", str(second), "--plugin", str(fixed),
                                 "--corpus", str(corpus), cwd=tmp_path)
    assert code == 1 and f": {second}" in out and "already in corpus" in out and "this case is not saved" in out \
        and "shrink it" not in out, out + err
    assert load_repro(path).status == "fixed"


def test_a_campaign_with_a_plugin_and_no_pairs_named_runs_the_plugins_pairs(tmp_path, harness_cli):
    """A user's nightly with its own plugin runs its own pairs, not the 70 built-in ones (whose
    demonstrations' repros would land in its corpus); '*' still runs them all."""
    plugin = PLUGINS / "two_bugs.py"
    code, out, err = harness_cli("fuzz", "--plugin", str(plugin), "--max-examples", "3", "--seed", "2",
                                 "--corpus", str(tmp_path / "corpus"), "--no-tracking", cwd=tmp_path)
    assert code in (0, 1) and f"no pairs named: running the 2 pair(s) of {plugin}" in err, err
    table = [line.split()[0] for line in out.splitlines() if line and not line.startswith(("pair ", "\n"))]
    assert {"user.two_bugs", "user.two_bugs_rare"} <= set(table), out
    assert not any(name.startswith(("moe_", "hf.", "model.")) for name in table), out
    # a plugin that registers nothing (register() forgotten) runs nothing: not every built-in pair instead
    empty = tmp_path / "empty pairs.py"
    empty.write_text("from harness import TargetPair  # (register() never called)\n")
    code, out, err = harness_cli("fuzz", "--plugin", str(empty), "--max-examples", "3", "--no-tracking",
                                 "--corpus", str(tmp_path / "corpus2"), cwd=tmp_path)
    assert code == 2 and "registered no pair" in err and "Nothing was run" in err, out + err
    assert not (tmp_path / "corpus2").exists() and "cases in" not in out + err
    code, out, err = harness_cli("fuzz", "linear.aligned", "--max-examples", "1", "--no-tracking", "--corpus",
                                 str(tmp_path / "corpra"), cwd=tmp_path)  # (a typo'd corpus folder: said)
    assert code == 0 and f"note: corpus folder {tmp_path / 'corpra'} does not exist yet" in err, err
    code, out, err = harness_cli("fuzz", "--plugin", str(plugin), "--plugin", str(empty), "--max-examples", "2",
                                 "--seed", "2", "--corpus", str(tmp_path / "corpus"), "--no-tracking", cwd=tmp_path)
    assert code in (0, 1) and f"warning: plugin '{empty}' registered no pair of its own" in err, err


def test_a_campaign_without_a_budget_says_how_long_its_examples_would_still_take():
    """--max-examples alone on a slow pair: the progress lines estimate the minutes left at its rate."""
    import time as _time

    from harness import Axes, Outcome, TargetPair

    began = []

    def build(case, device):
        return torch.zeros(sum(case.seq_lens), 8)

    def path(x):
        began.append(began[0] if began else _time.monotonic())
        if _time.monotonic() - began[0] > 2.6:
            raise KeyboardInterrupt
        _time.sleep(0.02)
        return Outcome(logprobs=torch.log_softmax(x, -1))

    pair = TargetPair(name="t.slow_eta", kind="op", expected="aligned", build=build, trainer=path, rollout=path,
                      axes=Axes(n_seqs=(1, 2), seq_len=(1, 4), pad_sides=("right",), logit_scale=(1.0, 1.0)))
    lines = []
    cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=2000, isolation=False)
    try:  # (the interrupt ends the campaign, as a Ctrl-C would)
        run_campaign(cfg, tracker=NullTracker(), log=lines.append)
    except KeyboardInterrupt:
        pass
    said = [line for line in lines if "min more for its 2000 examples at this rate" in line]
    assert said, lines


def test_after_a_finding_the_campaign_looks_on_for_a_worse_case(monkeypatch):
    """A slow pair's search stops at its first failure, here the simplest case: a bug only batches of
    exactly 5 sequences have (`user.two_bugs_rare`) was not drawn before it. Uniform cases after the
    shrink, within the pair's examples, find it, and it becomes the severe case."""
    import harness.fuzz as fuzz

    REGISTRY.load_plugin(str(PLUGINS / "two_bugs.py"))
    pair = REGISTRY.get("user.two_bugs_rare")
    # as for a model pair whose cases take a second or more: its first failure (here the first example,
    # the simplest case, on the mild bug) goes straight to the polish pass, and no other case runs before
    cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=60, isolation=False, uniform_per_example=0,
                         slow_case_seconds=0.0)
    monkeypatch.setattr(fuzz, "SEVERE_SEARCH_CASES", 0)
    [f] = fuzz.fuzz_pair(pair, cfg, seed=fuzz.pair_seed(1, pair.name), deadline=None).findings
    assert f.case.batch_size != 5 and f.severe is None and f.peak < fuzz.SEVERE_FACTOR * f.evaluation.score
    monkeypatch.undo()
    [f] = fuzz.fuzz_pair(pair, cfg, seed=fuzz.pair_seed(1, pair.name), deadline=None).findings
    assert f.case.batch_size != 5 and f.severe is not None, f
    assert f.severe.case.seq_lens == (1,) * 5 and f.severe.judged > 50 * f.evaluation.score


def test_streams_of_one_pair_keep_the_worst_severe_case_any_of_them_saw():
    from harness.corpus import Severe
    from harness.execute import Evaluation
    from harness.fuzz import Finding, PairResult, _merge

    case = Case(seed=1, seq_lens=(1,))

    def finding(severe_score):
        f = Finding(pair="p", expected="aligned", symptom=Symptom.DIVERGENCE, signature="s" * 64, case=case,
                    evaluation=Evaluation(pair="p", case=case, symptom=Symptom.DIVERGENCE), examples=3)
        f.severe = None if severe_score is None else Severe(case, severe_score, "", 1.0, 9.0, True)
        return f

    into = PairResult("p", "aligned", findings=[finding(None)])
    for score in (2.0, 5.0, 3.0):
        _merge(into, PairResult("p", "aligned", findings=[finding(score)]))
    [kept] = into.findings
    assert kept.severe.judged == 5.0
    # as a repro and a worker's result hold it: inf (a sampled token the trainer excludes) included
    sev = Severe(case, float("inf"), "k3=inf", float("inf"), float("inf"), False)
    assert Severe.from_json(json.loads(json.dumps(sev.to_json(), allow_nan=False))) == sev
    assert sev.keeping.startswith("a sampled token the trainer excludes") and Severe.from_json({"case": 1}) is None


def test_a_failure_its_own_inputs_do_not_reproduce_is_noise_not_a_regression(tmp_path):
    """A rollout whose run-to-run noise crosses the line now and then (a trial's +-5% jitter): its
    minimal case, run again, came back clean, yet it was written as an open regression, and every
    night added another that replayed clean and asked to be closed. A failure fewer than half of its
    runs show is said as the pair's noise and recorded nowhere; a pair that fails every time is still
    a finding (tests above)."""
    from harness import Axes, Outcome, TargetPair

    seen = set()

    def build(case, device):
        return case.token_randn(16, "logits"), case.token_randn(16, "noise")

    def rollout(x):  # off the first time it meets its inputs only: a race lost once, never again
        key = x[0].numpy().tobytes()
        off = key not in seen
        seen.add(key)
        return Outcome(logprobs=torch.log_softmax(x[0] + (0.3 * x[1] if off else 0), -1))

    pair = TargetPair(name="t.noisy", kind="op", expected="aligned", build=build, rollout=rollout,
                      trainer=lambda x: Outcome(logprobs=torch.log_softmax(x[0], -1)),
                      axes=Axes(n_seqs=(1, 2), seq_len=(1, 4), pad_sides=("right",), logit_scale=(1.0, 1.0)))
    lines: list[str] = []
    cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=20, corpus=tmp_path / "corpus", isolation=False)
    res = run_campaign(cfg, NullTracker(), log=lines.append)
    assert not res.findings and not iter_corpus(tmp_path / "corpus"), res.findings
    [r] = res.results
    assert len(r.flaky) == 1 and "not reproducible (the pair's noise)" in r.flaky[0]
    [warning] = [line for line in lines if line.startswith("warning: t.noisy")]
    assert "its run-to-run noise alone crosses the line" in warning and "then clean k3=0" in warning, warning
    assert "it failed in 1 of 6 runs of those inputs" in warning and "Not recorded as a regression" in warning
    assert "noise: divergence k3=" in summary_table(res)


def test_a_known_repro_a_campaign_changes_is_marked_updated_for_the_nightly_upload(tmp_path):
    """A nightly rewrote a committed repro's severe case in its workspace and uploaded nothing, so a
    throwaway runner lost it. The finding now says what it changed (`Finding.updated`), and the
    pytest plugin copies such a file to new-repros/ with the new ones."""
    from harness.corpus import Severe, load_repro, record_finding
    from harness.fuzz import Finding

    pair = REGISTRY.get("rmsnorm.eps_placement")
    case = Case(seed=1, seq_lens=(4,))
    ev = run_case(pair, case)  # (its metrics, whatever they are: what the file holds is the point here)

    def finding(judged):
        f = Finding(pair=pair.name, expected="aligned", symptom=Symptom.DIVERGENCE, signature="a" * 64, case=case,
                    evaluation=ev, examples=3)
        f.severe = Severe(case, judged, f"k3={judged}", 1.0, judged, True)
        return f

    first = finding(2.0)
    path = record_finding(first, tmp_path, 1e-3, 1, "cpu")
    assert first.new and not first.updated
    worse, milder = finding(5.0), finding(3.0)
    assert record_finding(worse, tmp_path, 1e-3, 1, "cpu") == path and worse.updated == "a worse severe case"
    assert record_finding(milder, tmp_path, 1e-3, 1, "cpu") == path and not milder.updated
    assert load_repro(path).found["severe"]["judged"] == 5.0


def test_a_clean_pair_that_came_near_the_line_names_its_closest_case():
    """A trial's aligned pair reached 47% of the line in one case and nothing said which: a clean pair
    whose cases came within a tenth of the line names its closest case, and how to keep it."""
    from harness import Axes, Outcome, TargetPair
    from harness.fuzz import near_miss_line

    pair = TargetPair(name="t.near", kind="op", expected="aligned",
                      build=lambda case, device: case.token_randn(64, "logits") * case.logit_scale,
                      trainer=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)),
                      rollout=lambda x: Outcome(logprobs=torch.log_softmax(x.bfloat16().float(), -1)),
                      axes=Axes(n_seqs=(1, 4), seq_len=(1, 8), pad_sides=("right",), logit_scale=(1.0, 6.0)))
    lines: list[str] = []
    res = run_campaign(CampaignConfig(pairs=[pair], seed=1, max_examples=30, write_corpus=False, isolation=False),
                       NullTracker(), log=lines.append)
    [r] = res.results
    assert not r.findings and 1e-4 <= r.max_score < 1e-3, r.max_score
    assert run_case(pair, r.max_case).score == r.max_score  # (the case it names is the one that gave it)
    [said] = [line for line in lines if "closest to the line" in line]
    assert f"on {r.max_case.one_line()}; to keep it" in said and "`harness record t.near --case '" in said, said
    assert "--threshold 0.0001`" in said
    r.max_score = 0.000997  # (just under the line: never "100% of it")
    assert "(99.7% of it)" in near_miss_line(r, 1e-3)
    assert "`harness record --plugin '/tmp/my pairs.py' t.near --case '" in near_miss_line(r, 1e-3, ["/tmp/my pairs.py"])
    r.max_score = 1e-5  # (far under the line: nothing said)
    assert near_miss_line(r, 1e-3) == ""


@pytest.mark.slow
def test_a_pair_judged_at_its_own_line_passes_its_accepted_gap_and_fails_its_regression(tmp_path, harness_cli):
    """`TargetPair(threshold=...)`: an accepted gap (judged up to ~0.006, over the default line) is
    clean at the pair's own line 0.02, a regression of it is found and shrunk to its trigger (6
    tokens), recorded at that line; `--threshold GLOB=K3` judges the gap at the default line again."""
    plugin = str(PLUGINS / "accepted_gap.py")
    corpus = tmp_path / "corpora"
    code, out, err = harness_cli("fuzz", "--plugin", plugin, "--max-examples", "30", "--seed", "1", "--no-tracking",
                                 "--corpus", str(corpus), cwd=tmp_path)
    assert code == 1 and "threshold 0.001 (own lines: gap.accepted 0.02, gap.regressed 0.02)" in err, err
    row = next(line for line in out.splitlines() if line.startswith("gap.accepted "))
    assert "aligned (line 0.02)  clean" in row, out  # (the table's values read against the pair's own line)
    assert "gap.accepted" not in {p.parent.name for p in iter_corpus(corpus)}, out
    [path] = list(iter_corpus(corpus))
    repro = load_repro(path)
    assert repro.pair == "gap.regressed" and repro.threshold == 0.02 and repro.case.n_tokens == 6, repro.case
    code, out, err = harness_cli("fuzz", "--plugin", plugin, "gap.accepted", "--max-examples", "10", "--seed", "1",
                                 "--no-tracking", "--corpus", str(corpus), "--threshold", "gap.*=0.001", cwd=tmp_path)
    assert code == 1 and "threshold 0.001\n" in err and "own lines" not in err and "gap.accepted" in {
        p.parent.name for p in iter_corpus(corpus)}, out + err
    code, out, err = harness_cli("fuzz", "--plugin", plugin, "--threshold", "nosuch.*=0.1", cwd=tmp_path)
    assert code == 2 and "no selected pair matches 'nosuch.*'" in err, err


def test_a_pairs_judged_means_are_counted_in_tenth_of_a_decade_bins_and_read_as_quantiles():
    """"How far apart are the paths?" is more than the largest case: a clean pair's line says where half
    and 90% of its cases were judged (upper edges of 10^0.1-wide bins, capped at the largest), merged
    over streams, and carried through pytest-xdist's JSON."""
    from harness.fuzz import PairResult, _merge
    from harness.pytest_plugin import _pair_result, _pair_result_json

    r = PairResult("t.spread", "aligned")
    for v in [1e-6] * 50 + [1e-4] * 40 + [3e-3] * 10:
        r.note_score(v)
        r.max_score = max(r.max_score, v)
    r.note_score(float("nan"))  # (no metrics: not counted)
    assert sum(r.judged_bins.values()) == 100
    assert 1e-6 <= r.judged_quantile(0.5) <= 1e-6 * 10 ** 0.1
    assert 1e-4 <= r.judged_quantile(0.9) <= 1e-4 * 10 ** 0.1
    assert r.judged_quantile(1.0) == 3e-3  # (capped at the largest)
    assert r.spread_text.startswith("judged: half the cases under 1.26e-06, 90% under 0.000126"), r.spread_text
    other = PairResult("t.spread", "aligned")
    other.note_score(0.0)
    _merge(r, other)
    assert sum(r.judged_bins.values()) == 101 and r.judged_quantile(0.0) == 0.0
    back = _pair_result(json.loads(json.dumps(_pair_result_json(r))))
    assert back.judged_bins == r.judged_bins
    assert PairResult("t.few", "aligned").spread_text == ""
    zeros = PairResult("t.zeros", "aligned")  # (an aligned pair agreeing bit for bit on most cases)
    for v in [0.0] * 60 + [1e-4] * 40:
        zeros.note_score(v)
        zeros.max_score = max(zeros.max_score, v)
    assert zeros.spread_text.startswith("judged: half the cases at 0, 90% under 0.0001"), zeros.spread_text


def test_mlflow_gets_each_pairs_own_line_and_how_its_judged_values_spread():
    from dataclasses import replace

    from harness.fuzz import CampaignResult, PairResult
    from harness.mlflow_tracking.payload import campaign_metrics, campaign_payload

    own = replace(REGISTRY.get("attention.aligned"), name="t.accepted", threshold=0.02)
    cfg = CampaignConfig(pairs=[own, REGISTRY.get("attention.aligned")])
    params = campaign_payload(cfg, 1, cfg.pairs, "uid")["params"]
    assert params["threshold"] == "0.001" and params["own_thresholds"] == "t.accepted=0.02", params
    r = PairResult("t.accepted", "aligned", examples=3, threshold=0.02)
    for v in (1e-5, 2e-5, 0.004):
        r.note_score(v)
        r.max_score = max(r.max_score, v)
    m = campaign_metrics(CampaignResult(seed=1, config=cfg, results=[r]))
    assert m["pair.t.accepted.max_judged"] == 0.004 and 1e-5 <= m["pair.t.accepted.judged_p50"] <= 2e-5 * 10 ** 0.1
    assert m["pair.t.accepted.judged_p90"] == 0.004


def test_a_replay_at_another_line_says_so_and_never_offers_to_close_the_repro(tmp_path, harness_cli):
    """A trial replayed an open repro with `--threshold` above its value: the same metrics, and replay
    said "it no longer fails (fixed? ... close --status fixed)". Only the line moved: it says that."""
    plugin = str(PLUGINS / "accepted_gap.py")
    corpus = tmp_path / "corpora"
    code, _, err = harness_cli("fuzz", "--plugin", plugin, "gap.regressed", "--max-examples", "10", "--seed", "1",
                               "--no-tracking", "--corpus", str(corpus), cwd=tmp_path)
    assert code == 1, err
    [path] = list(iter_corpus(corpus))
    code, out, err = harness_cli("replay", "--plugin", plugin, "--threshold", "5", str(path), cwd=tmp_path)
    assert "(judged at --threshold 5; recorded at 0.02:" in out and "close" not in out and "fixed?" not in out, out
    code, out, err = harness_cli("replay", "--plugin", plugin, str(path), cwd=tmp_path)
    assert code == 1 and "judged at --threshold" not in out and "bit-for-bit yes" in out, out
    # GLOB=K3 moves the matching pairs' repros only; a GLOB that matches none of them is a usage error
    code, out, err = harness_cli("replay", "--plugin", plugin, "--threshold", "gap.*=5", str(path), cwd=tmp_path)
    assert code == 0 and "(judged at --threshold 5; recorded at 0.02:" in out, out + err
    code, out, err = harness_cli("replay", "--plugin", plugin, "--threshold", "other.*=5", str(path), cwd=tmp_path)
    assert code == 2 and "--threshold 'other.*=5': no selected pair matches 'other.*'" in err, out + err
    # `harness list` says which pairs have a line of their own
    code, out, _ = harness_cli("list", "--plugin", plugin)
    assert "gap.regressed" in out and "aligned (own line 0.02)" in out and "2 judged at a line of their own" in out
    code, out, _ = harness_cli("list", "--json", "--plugin", plugin)
    assert {r["name"]: r["threshold"] for r in json.loads(out)}["gap.regressed"] == 0.02
