"""Triage: ddmin, localization by swapping, the per-module table, routing split, the report and CLI.

The two done-when findings are the committed repros of `model.moe_aggregate_bf16` and
`model.packing_positions_bug` (corpora/): triage must name MoE aggregation and positions/rotary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import REGISTRY, Case
from harness.corpus import Repro, iter_corpus, load_repro
from harness.triage import ddmin, routing_split, triage, write_report

ROOT = Path(__file__).resolve().parents[2]


def corpus_repro(pair: str) -> Repro:
    (path,) = iter_corpus(ROOT / "corpora" / pair)
    return load_repro(path)


def test_ddmin_finds_a_one_minimal_failing_subset():
    calls = []

    def fails(s):
        calls.append(tuple(s))
        return {"b", "e"} <= set(s)

    assert sorted(ddmin(list("abcdefgh"), fails)) == ["b", "e"]
    assert ddmin(["x"], lambda s: True) == ["x"]


def test_triage_names_moe_aggregation(tmp_path):
    t = triage(corpus_repro("model.moe_aggregate_bf16"))
    assert t.localization.minimal == ["moe_aggregate"] and t.localization.explained
    assert t.verdict.startswith("MoE aggregation precision, all layers: k3 ")
    assert t.first_module == "layers.0.moe"  # attention and norms of layer 0 agree bit for bit
    report = write_report(t, tmp_path)
    assert report == tmp_path / t.repro.id / "report.md"
    text = report.read_text()
    assert "MoE aggregation precision" in text and "layers.0.moe" in text
    names = {p.name for p in t.plots}
    assert {"k3_per_token.png", "modules.png", "flips.png", "swaps.png"} <= names
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in t.plots)


def test_triage_names_positions_for_the_packing_bug():
    t = triage(corpus_repro("model.packing_positions_bug"))
    assert t.localization.minimal == ["positions"] and t.localization.explained
    assert "positions of packed sequences (rotary)" in t.verdict
    assert t.first_module is not None and t.first_module.startswith("layers.0.attn")


def test_swapping_explains_each_single_component_pair():
    """Generic check over the model registry: a pair whose profiles differ in one component is
    localized to exactly that component on a case that diverges."""
    pair = REGISTRY.get("model.moe_aggregate_bf16")
    prof = pair.profiles
    lm = prof.variant(prof.trainer, {**prof.trainer, "lm_head": "bfloat16"})
    c = Case(seed=2, seq_lens=(6, 4), logit_scale=8.0, params={"decode": 2, "temperature": 0.7, "tie_layer": 0})
    from harness.execute import run_case

    assert run_case(lm, c).failed
    repro = Repro(path=None, id="lmhead", pair=pair.name, symptom="divergence", signature="", status="open",
                  threshold=1e-3, case=c, metrics={})
    reg = type("R", (), {"get": staticmethod(lambda name: lm)})()
    t = triage(repro, registry=reg)
    assert t.localization.minimal == ["lm_head"]
    assert t.first_module == "lm_head"


def test_routing_split_counts_near_tie_and_other_flips():
    import torch

    from harness import Outcome, Routing

    scores_t = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.6, 0.3, 0.05, 0.05]])
    t = Outcome(routing={"l": Routing(experts=torch.tensor([[0], [0]]), scores=scores_t)})
    r = Outcome(routing={"l": Routing(experts=torch.tensor([[0], [1]]), scores=scores_t)})
    assert routing_split(t, r) == {"l": {"tokens": 2, "near_tie": 0, "other": 1}}
    near = torch.tensor([[0.4, 0.3999, 0.1, 0.1001], [0.6, 0.3, 0.05, 0.05]])
    t2 = Outcome(routing={"l": Routing(experts=torch.tensor([[0], [0]]), scores=near)})
    r2 = Outcome(routing={"l": Routing(experts=torch.tensor([[1], [0]]), scores=near)})
    assert routing_split(t2, r2) == {"l": {"tokens": 2, "near_tie": 1, "other": 0}}


def test_triage_without_profiles_or_modules_still_reports(tmp_path):
    """An op pair exposes neither: triage reports metrics and routing, and says what is missing."""
    pair = REGISTRY.get("router_topk.bf16")
    c = Case(seed=1, seq_lens=(16,), n_experts=8, top_k=2, tie_fraction=1.0, tie_gap=1e-4, logit_scale=8.0)
    repro = Repro(path=None, id="op", pair=pair.name, symptom="divergence", signature="", status="open",
                  threshold=1e-3, case=c, metrics={})
    t = triage(repro)
    assert t.localization is None and t.modules == []
    assert t.flips and sum(v["near_tie"] for v in t.flips.values()) > 0
    assert write_report(t, tmp_path).exists()


@pytest.mark.slow
def test_cli_triage_writes_the_report_and_prints_the_verdict(harness_cli, tmp_path):
    path = str(next(iter(iter_corpus(ROOT / "corpora" / "model.moe_aggregate_bf16"))))
    code, out, err = harness_cli("triage", path, "--reports", str(tmp_path), "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["minimal"] == ["moe_aggregate"] and got["verdict"].startswith("MoE aggregation precision")
    assert Path(got["report"]).exists() and len(got["plots"]) == 4


def test_cli_triage_needs_a_file_or_a_run_id(harness_cli, tmp_path):
    code, out, err = harness_cli("triage")
    assert code == 2 and "exactly one of FILE" in err and "Traceback" not in err
    bad = tmp_path / "x.json"
    bad.write_text("{")
    code, out, err = harness_cli("triage", str(bad))
    assert code == 2 and "not valid JSON" in err
