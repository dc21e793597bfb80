"""Triage: ddmin, localization by swapping, the per-module table, routing split, the report and CLI.

The done-when findings: the committed repro of `model.moe_aggregate_bf16` (corpora/) and a
diverging case of `model.packing_positions_bug`: triage must name MoE aggregation and
positions/rotary, and the layer where each starts. The planted pairs of `tests/plugins/planted_modules.py` carry a
code-level bug in one module (same numerics on both sides) or a non-finite one: only the
per-module table (forward hooks, no argument added to the model's call) can localize them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import REGISTRY, Case
from harness.corpus import Repro, iter_corpus, load_repro
from harness.execute import Symptom
from harness.triage import ROOT as ROOT_MODULE
from harness.triage import residual_note
from harness.triage import (FLOOR_FACTOR, Localization, ModuleRow, Swap, Triage, ddmin, judged, layer_of,
                            routing_split, triage, verdict_line, write_report)

from ..conftest import PLUGINS

ROOT = Path(__file__).resolve().parents[2]
REGISTRY.load_plugin(str(PLUGINS / "planted_modules.py"))
DECODER_CASE = Case(seed=3, seq_lens=(5, 3), prompt_lens=(2, 3), logit_scale=4.0, params={"tie_layer": 0})


def made_repro(pair: str, case: Case, symptom: str = "divergence") -> Repro:
    return Repro(path=None, id=pair.replace(".", "_"), pair=pair, symptom=symptom, signature="", status="open",
                 threshold=1e-3, case=case, metrics={})


def corpus_repro(pair: str) -> Repro:
    """The pair's repro of a drift of the distributions (not its sampled-excluded-token one, k3 = inf)."""
    (repro,) = [r for r in map(load_repro, iter_corpus(ROOT / "corpora" / pair)) if float(r.metrics["k3_kl"]) != math.inf]
    return repro


def test_ddmin_finds_a_one_minimal_failing_subset():
    calls = []

    def fails(s):
        calls.append(tuple(s))
        return {"b", "e"} <= set(s)

    assert sorted(ddmin(list("abcdefgh"), fails)) == ["b", "e"]
    assert ddmin(["x"], lambda s: True) == ["x"]


def test_routing_flips_are_near_tie_within_one_step_of_the_scores_precision_and_unscored_apart():
    import torch

    from harness import Outcome, Routing
    from harness.triage import routing_split

    # token 0: a bf16 router's logits near 4 one bf16 step (0.03) apart; token 1: a gap of 1.0; token 2:
    # not flipped. The trainer's float32 scores have a gap of 0.02 at token 0: over 1e-3, and float32's
    # step there is 5e-7, so only the rollout's bf16 scores make it a near tie
    fp32 = torch.tensor([[4.00, 3.98, 0.0], [4.0, 3.0, 0.0], [4.0, 3.0, 0.0]])
    bf16 = torch.tensor([[4.0, 3.96875, 0.0], [4.0, 3.0, 0.0], [4.0, 3.0, 0.0]], dtype=torch.bfloat16)
    t = Outcome(routing={"l0": Routing(experts=torch.tensor([[0], [0], [0]]), scores=fp32)})
    r = Outcome(routing={"l0": Routing(experts=torch.tensor([[1], [1], [0]]), scores=bf16)})
    assert routing_split(t, r) == {"l0": {"tokens": 3, "near_tie": 1, "other": 1, "unscored": 0}}
    r32 = Outcome(routing={"l0": Routing(experts=torch.tensor([[1], [1], [0]]), scores=fp32)})
    assert routing_split(t, r32) == {"l0": {"tokens": 3, "near_tie": 0, "other": 2, "unscored": 0}}
    t0 = Outcome(routing={"l0": Routing(experts=torch.tensor([[0], [0], [0]]))})
    r0 = Outcome(routing={"l0": Routing(experts=torch.tensor([[1], [1], [0]]))})
    assert routing_split(t0, r0) == {"l0": {"tokens": 3, "near_tie": 0, "other": 0, "unscored": 2}}


def test_triage_names_moe_aggregation_and_the_layer_it_starts_in(tmp_path):
    t = triage(corpus_repro("model.moe_aggregate_bf16"))
    assert t.localization.minimal == ["moe_aggregate"] and t.localization.explained
    assert t.verdict.startswith("MoE aggregation precision, from layers.0 (first divergent module layers.0.moe): "
                                "expected k3 ")
    assert "all layers" not in t.verdict
    assert residual_note(t) == ""  # its only differing component is the minimal set
    assert t.first_module == "layers.0.moe"  # attention and norms of layer 0 agree bit for bit
    assert t.floor_from == "the pair with every differing component aligned"
    report = write_report(t, tmp_path)
    assert report == tmp_path / t.repro.id / "report.md"
    text = report.read_text()
    assert "MoE aggregation precision" in text and "| layers.0.moe | layers.0 |" in text
    names = {p.name for p in t.plots}
    assert {"k3_per_token.png", "modules.png", "flips.png", "swaps.png"} <= names
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in t.plots)


def test_triage_names_positions_for_the_packing_bug():
    from targets.models.moe_decoder import COMPONENTS

    c = Case(seed=5, seq_lens=(24, 24), prompt_lens=(16, 16), logit_scale=8.0, params={"tie_layer": 0})
    t = triage(made_repro("model.packing_positions_bug", c))
    assert t.localization.minimal == ["positions"] and t.localization.explained
    assert t.verdict.startswith(COMPONENTS["positions"][1] + ", from layers.0 (first divergent module layers.0.attn")
    assert t.first_module is not None and t.first_module.startswith("layers.0.attn")


def test_swapping_explains_each_single_component_pair(tmp_path):
    """Generic check over the model registry: a pair whose profiles differ in one component is
    localized to exactly that component on a case that diverges; the LM head of every decoded token
    is in the module table."""
    pair = REGISTRY.get("model.moe_aggregate_bf16")
    prof = pair.profiles
    lm = prof.variant(prof.trainer, {**prof.trainer, "lm_head": "bfloat16"})
    c = Case(seed=3, seq_lens=(6, 4), prompt_lens=(3, 2), logit_scale=16.0, temperature=0.7, params={"tie_layer": 0})
    from harness.execute import run_case

    assert run_case(lm, c).failed
    reg = type("R", (), {"get": staticmethod(lambda name: lm)})()
    t = triage(made_repro(pair.name, c), registry=reg)
    assert t.localization.minimal == ["lm_head"]
    assert t.first_module == "lm_head" and t.first_layer == "lm_head"
    assert t.verdict.startswith("LM-head precision, at lm_head (first divergent module): expected k3 ")
    report = write_report(t, tmp_path).read_text()
    assert "starts: **lm_head**." in report and "(layer lm_head)" not in report  # (not a numbered layer)
    rows = {m.name: m for m in t.modules}
    assert rows["lm_head"].tokens == c.n_tokens  # the prefill's row and every decode step's
    assert all(m.tokens == c.n_tokens for m in t.modules)


def test_a_code_level_bug_in_one_module_is_named_against_an_aligned_runs_floor():
    """Same numerics profile on both sides, so swapping has nothing to swap: the per-module table
    names the module, and its floor comes from model.aligned (the same modules), not from the
    finding's own pair (whose errors include the bug)."""
    t = triage(made_repro("planted.moe_norm_weight", DECODER_CASE))
    assert t.k3 > 1e-3 and t.localization is not None and t.localization.differing == []
    assert t.first_module == "layers.1.moe_norm" and t.first_layer == "layers.1"
    assert t.floor_from.startswith("model.aligned")
    assert t.verdict.startswith("code-level difference (both paths run the same numerics profile")
    assert "divergence starts from layers.1 (first divergent module layers.1.moe_norm)" in t.verdict
    rows = {m.name: m for m in t.modules}
    bug = rows["layers.1.moe_norm"]
    assert bug.error > 1e-2 and bug.floor < 1e-4  # the floor is layout noise, not the bug itself
    assert not any(m.exceeds for m in t.modules[:t.modules.index(bug)])


def test_a_plain_torch_model_needs_no_argument_in_its_call():
    """A model whose forward takes only token ids, called once packed (trainer) and once per
    sequence in reverse order at a temperature (rollout): positions are tied to rows by their output."""
    import inspect

    pair = REGISTRY.get("planted.tiny_lm.block_bias")
    model = pair.build(Case(seed=0, seq_lens=(1,)), "cpu")["modules"]["rollout"]
    assert list(inspect.signature(model.forward).parameters) == ["ids"]
    t = triage(made_repro(pair.name, Case(seed=3, seq_lens=(5, 3, 2), logit_scale=2.0)))
    assert [m.name for m in t.modules] == ["embed", "blocks.0", "blocks.1", "head", ROOT_MODULE]
    assert all(m.tokens == 10 for m in t.modules)
    assert t.first_module == "blocks.1" and t.floor_from == "planted.tiny_lm.aligned"
    assert t.verdict.startswith("expected k3 ") and "divergence starts at blocks.1 (first divergent module)" in t.verdict
    aligned = triage(made_repro("planted.tiny_lm.aligned", Case(seed=3, seq_lens=(5, 3, 2), logit_scale=2.0)))
    assert aligned.first_module is None and max(m.error for m in aligned.modules) < 1e-6


def test_a_model_called_on_1d_token_ids_gets_its_per_module_table():
    """A model without a batch dimension ((T,) ids in, (T, V) logits out): the call's positions come
    from its 1-D integer ids. Its first 2-D tensor was taken for (batch, positions) before (an
    attention mask, or here the logits), and the table was empty, blaming truncated rows."""
    case = Case(seed=3, seq_lens=(5, 3, 2), logit_scale=2.0)
    t = triage(made_repro("planted.tiny_lm.flat_block_bias", case))
    assert [m.name for m in t.modules] == ["embed", "blocks.0", "blocks.1", "head", ROOT_MODULE], t.notes
    assert all(m.tokens == 10 for m in t.modules) and t.first_module == "blocks.1"


def test_a_router_whose_logits_agree_but_whose_choice_does_not_is_named_by_its_other_outputs():
    """A module returning several tensors has a row per output (`name[i]`): a router bug that leaves
    its logits equal shows at its weights / chosen experts, before the experts and the block."""
    case = Case(seed=3, seq_lens=(5, 3, 2), logit_scale=2.0)
    t = triage(made_repro("planted.tiny_moe.router_choice", case))
    rows = {m.name: m for m in t.modules}
    assert rows["blocks.0.router"].error == 0.0  # the logits: equal on both paths
    assert rows["blocks.0.router[1]"].error > 1e-2 and rows["blocks.0.router[2]"].error > 1e-2
    # the weights and the experts both differ: the choice is named (the weights follow from it)
    assert t.first_module == "blocks.0.router[2]" and t.floor_from == "planted.tiny_moe.aligned"
    assert any("blocks.0.router[2] is the ids it chose" in n for n in t.notes), t.notes
    assert not any(m.exceeds for m in t.modules[:t.modules.index(rows["blocks.0.router[1]"])])
    aligned = triage(made_repro("planted.tiny_moe.aligned", case))
    assert aligned.first_module is None and max(m.error for m in aligned.modules) < 1e-6


def test_a_nonfinite_finding_names_the_first_module_with_nan_or_inf(tmp_path):
    t = triage(made_repro("planted.moe_norm_overflow", DECODER_CASE, "nonfinite"))
    assert t.evaluation.symptom is Symptom.NONFINITE
    assert t.nonfinite is not None and t.nonfinite.module == "layers.1.moe_norm" and t.nonfinite.paths == ["trainer"]
    assert t.verdict.startswith("non-finite output (NaN/inf) in the trainer log-probabilities: first appears at "
                                "module layers.1.moe_norm (trainer path, layer layers.1)")
    assert "did not evaluate" not in t.verdict
    text = write_report(t, tmp_path).read_text()
    assert "## Non-finite values" in text and "**layers.1.moe_norm**" in text


def test_what_the_other_differing_components_leave_is_said_where_it_is_above_the_floor(tmp_path):
    """A bf16 rollout differs in several components; its minimal set (activations and router scores)
    explains the case, and what the others leave once it is aligned is said, with which of them move
    it one by one: each may be a bug of its own under the line on this case."""
    t = triage(corpus_repro("model.bf16_rollout"))
    note = residual_note(t)
    loc = t.localization
    assert loc.explained and loc.k3_minimal_aligned > 10 * max(loc.k3_all_aligned, 1e-12), loc
    assert note.startswith("with ") and f"aligned, k3 {loc.k3_minimal_aligned:.3g} remains" in note
    # one by one: aligning the LM head too takes a third of it away; the other two change it by under a tenth
    assert "still moves this case, under the line here: LM-head precision (aligning it too: " in note, note
    assert "(MoE aggregation precision, KV-cache dtype: no change on this case)" in note and "bug of its own" in note
    assert loc.residual_by["lm_head"] <= 0.9 * loc.k3_minimal_aligned < loc.residual_by["moe_aggregate"] / 0.9
    assert note in write_report(t, tmp_path).read_text()


def test_layer_names_and_single_layer_verdicts():
    assert layer_of("model.layers.3.mlp.gate") == "model.layers.3"
    assert layer_of("layers.0") == "layers.0" and layer_of("lm_head") == "lm_head"
    assert layer_of("layers.0[3]") == "layers.0" and layer_of("model.layers.2.mlp.gate[1]") == "model.layers.2"
    assert layer_of("lm_head[1]") == "lm_head[1]"  # outside the numbered layers: its own
    ev = SimpleNamespace(symptom=Symptom.DIVERGENCE, error=None, divergence=None)
    loc = Localization(differing=["router"], swaps=[Swap("router", "router score precision", "float32", "bfloat16",
                                                         1e-5, 2e-2)],
                       minimal=["router"], k3_minimal_only=0.02, k3_minimal_aligned=1e-5, k3_all_aligned=1e-5, runs=3,
                       explained=True)
    one_layer = Triage(repro=None, pair=None, k3=0.02, threshold=1e-3, evaluation=ev, localization=loc,
                       modules=[ModuleRow("layers.0.mlp.gate", 0.3, 1e-6, 4)], first_module="layers.0.mlp.gate")
    assert verdict_line(one_layer) == ("router score precision, from layers.0 (first divergent module "
                                       "layers.0.mlp.gate, in layers.0.mlp): k3 0.0200 -> 0.0000 when aligned")
    no_table = Triage(repro=None, pair=None, k3=0.02, threshold=1e-3, evaluation=ev, localization=loc)
    assert verdict_line(no_table) == "router score precision: k3 0.0200 -> 0.0000 when aligned"
    assert FLOOR_FACTOR > 1
    # the root module's own code is named as such, not as a module called "output"
    root = Triage(repro=None, pair=None, k3=0.02, threshold=1e-3, evaluation=ev, localization=loc,
                  modules=[ModuleRow(ROOT_MODULE, 0.3, 1e-6, 4)], first_module=ROOT_MODULE)
    assert verdict_line(root) == ("router score precision, in the root module's own code (after its last exposed "
                                  "submodule): k3 0.0200 -> 0.0000 when aligned")


def test_the_verdict_leads_with_the_judged_k3_and_gives_every_figure_before_and_after():
    """The expected k3 is what the verdict judged: it is the k3 shown, with its value once aligned,
    beside the exact KL's; the sampled tokens' mean k3 is in the report, not the verdict."""
    div = SimpleNamespace(k3_expected=0.0031, k3_kl=0.0011, kl=0.0045, fired="k3+kl")
    ev = SimpleNamespace(symptom=Symptom.DIVERGENCE, error=None, divergence=div, k3=0.0011)
    assert judged(ev) == 0.0031
    loc = Localization(differing=["combine"], swaps=[], minimal=["combine"], k3_minimal_only=0.0031,
                       k3_minimal_aligned=2e-6, k3_all_aligned=2e-6, runs=3, explained=True, kl_minimal_aligned=3e-6)
    t = Triage(repro=None, pair=None, k3=judged(ev), threshold=1e-3, evaluation=ev, localization=loc)
    assert verdict_line(t) == "combine: expected k3 0.0031 -> 0.0000, KL 0.0045 -> 0.0000 when aligned"


def test_routing_split_counts_near_tie_and_other_flips():
    import torch

    from harness import Outcome, Routing

    scores_t = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.6, 0.3, 0.05, 0.05]])
    t = Outcome(routing={"l": Routing(experts=torch.tensor([[0], [0]]), scores=scores_t)})
    r = Outcome(routing={"l": Routing(experts=torch.tensor([[0], [1]]), scores=scores_t)})
    assert routing_split(t, r) == {"l": {"tokens": 2, "near_tie": 0, "other": 1, "unscored": 0}}
    near = torch.tensor([[0.4, 0.3999, 0.1, 0.1001], [0.6, 0.3, 0.05, 0.05]])
    t2 = Outcome(routing={"l": Routing(experts=torch.tensor([[0], [0]]), scores=near)})
    r2 = Outcome(routing={"l": Routing(experts=torch.tensor([[1], [0]]), scores=near)})
    assert routing_split(t2, r2) == {"l": {"tokens": 2, "near_tie": 1, "other": 0, "unscored": 0}}


def test_triage_without_profiles_or_modules_still_reports(tmp_path):
    """An op pair exposes neither: triage reports metrics and routing, and says what is missing."""
    pair = REGISTRY.get("router_topk.bf16")
    c = Case(seed=1, seq_lens=(16,), n_experts=8, top_k=2, tie_fraction=1.0, tie_gap=1e-4, logit_scale=8.0)
    t = triage(made_repro(pair.name, c))
    assert t.localization is None and t.modules == []
    assert "the pair exposes neither numerics profiles nor torch modules to localize further (a path that is not " \
           "torch, an ONNX Runtime session say, names its tensors in `Outcome.intermediates`" in t.verdict
    assert t.flips and sum(v["near_tie"] for v in t.flips.values()) > 0
    assert write_report(t, tmp_path).exists()


def test_named_intermediates_of_a_path_that_is_not_torch_say_where_the_divergence_starts(tmp_path):
    """Two paths without torch modules (numpy here, as an ONNX Runtime session's outputs would be) name
    their stages in `Outcome.intermediates`: triage compares them in the trainer's order, takes the
    noise floor from the family's aligned pair, and names the first stage over it (the rollout's
    projection that drops an input feature), not the float16 activation before it, whose error the
    aligned pair has too (over the absolute minimum floor: without the reference it would be named)."""
    import numpy as np
    import torch

    from harness import Axes, Outcome, TargetPair
    from harness.pairs import Registry

    def build(case, device):
        return {"x": case.token_randn(16, "x").double().numpy(), "w": np.random.default_rng(0).normal(size=(16, 32))}

    def path(role, bug=False):
        def run(inp):
            x, w = inp["x"], inp["w"]
            act = np.tanh(x) if role == "trainer" else np.tanh(x.astype(np.float16)).astype(np.float64)  # (T, 16)
            logits = act[:, :-1] @ w[:-1] if bug else act @ w  # (T, 32); the bug: the last feature dropped
            named = {"act": act, "logits": logits, **({"rollout_only": act} if bug else {})}
            return Outcome(logprobs=torch.log_softmax(torch.from_numpy(logits), -1), intermediates=named)
        return run

    reg = Registry()
    axes = Axes(n_seqs=(1, 2), seq_len=(1, 8), pad_sides=("right",), logit_scale=(1.0, 1.0))
    for name, bug in (("npy.aligned", False), ("npy.dropped_feature", True)):
        reg.register(TargetPair(name=name, kind="op", expected="aligned", build=build, trainer=path("trainer"),
                                rollout=path("rollout", bug), axes=axes))
    c = Case(seed=4, seq_lens=(6, 3))
    t = triage(made_repro("npy.dropped_feature", c), registry=reg)
    assert t.evaluation.failed and [m.name for m in t.intermediates] == ["act", "logits"], t.intermediates
    act, logits = t.intermediates
    assert 1e-5 < act.error < act.floor and t.intermediates_floor_from == "npy.aligned"
    assert logits.error > 0.05 and logits.exceeds and logits.tokens == 9 and t.first_intermediate == "logits"
    assert "divergence starts at the named intermediate logits (relative error" in t.verdict, t.verdict
    assert any("only one path names rollout_only" in n for n in t.notes), t.notes
    text = write_report(t, tmp_path).read_text()
    assert "## Divergence per named intermediate" in text and "| logits |" in text


def test_a_pair_with_no_aligned_sibling_takes_its_intermediates_floor_from_its_aligned_variant():
    """A user's ONNX-style pair registered aligned, with a bug planted in its rollout's `feature`
    component and no other aligned pair of its family: the named intermediates' floor is the pair
    itself with every differing component aligned (it fell back to the absolute minimum 1e-6, over
    which the float16 activation's own error, the engine's by design, was named)."""
    import numpy as np
    import torch

    from harness import Axes, Outcome, Profiles, TargetPair
    from harness.pairs import Registry

    def build(case, device):
        return {"x": case.token_randn(16, "x").double().numpy(), "w": np.random.default_rng(0).normal(size=(16, 32))}

    def path(role, feature):
        def run(inp):
            x, w = inp["x"], inp["w"]
            act = np.tanh(x) if role == "trainer" else np.tanh(x.astype(np.float16)).astype(np.float64)  # (T, 16)
            logits = act[:, :-1] @ w[:-1] if feature == "dropped" else act @ w  # (T, 32)
            return Outcome(logprobs=torch.log_softmax(torch.from_numpy(logits), -1),
                           intermediates={"act": act, "logits": logits})
        return run

    axes = Axes(n_seqs=(1, 2), seq_len=(1, 8), pad_sides=("right",), logit_scale=(1.0, 1.0))

    def make(tr, ro):
        return TargetPair(name="solo.aligned", kind="op", expected="aligned", build=build,
                          trainer=path("trainer", tr["feature"]), rollout=path("rollout", ro["feature"]), axes=axes,
                          profiles=Profiles(trainer=tr, rollout=ro, make=make))

    reg = Registry()
    reg.register(make({"feature": "all"}, {"feature": "dropped"}))
    t = triage(made_repro("solo.aligned", Case(seed=4, seq_lens=(6, 3))), registry=reg)
    assert t.localization is not None and t.localization.minimal == ["feature"], t.localization
    assert t.intermediates_floor_from == "the pair with every differing component aligned", t.intermediates_floor_from
    act, logits = t.intermediates
    assert 1e-5 < act.error < act.floor and logits.exceeds and t.first_intermediate == "logits", t.intermediates
    # the same pair's rollout replaced by hand (dataclasses.replace keeps the profiles, whose make builds
    # the pair it came from): not localized through variants of another pair, and said so
    import dataclasses

    replaced = dataclasses.replace(make({"feature": "all"}, {"feature": "all"}), name="solo.replaced",
                                   rollout=path("rollout", "dropped"))
    reg.register(replaced)
    t = triage(made_repro("solo.replaced", Case(seed=4, seq_lens=(6, 3))), registry=reg)
    assert t.evaluation.failed and t.localization is None, t.localization
    [note] = [n for n in t.notes if n.startswith("not localized: the pair's Profiles.make does not rebuild it")]
    assert "dataclasses.replace" in note and "(passes)" in note and "(fails)" in note, note


@pytest.mark.slow
def test_cli_triage_writes_the_report_and_prints_the_verdict(harness_cli, tmp_path):
    path = str(next(iter(iter_corpus(ROOT / "corpora" / "model.moe_aggregate_bf16"))))
    code, out, err = harness_cli("triage", path, "--reports", str(tmp_path), "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["minimal"] == ["moe_aggregate"] and got["verdict"].startswith("MoE aggregation precision")
    assert got["first_module"] == "layers.0.moe" and got["first_layer"] == "layers.0"
    assert Path(got["report"]).exists() and len(got["plots"]) == 4


def test_cli_triage_needs_a_file_or_a_run_id(harness_cli, tmp_path):
    code, out, err = harness_cli("triage")
    assert code == 2 and "exactly one of FILE" in err and "Traceback" not in err
    bad = tmp_path / "x.json"
    bad.write_text("{")
    code, out, err = harness_cli("triage", str(bad))
    assert code == 2 and "not valid JSON" in err


def test_triage_on_hugging_face_models_needs_no_argument_in_their_call():
    """transformers models (their forward untouched) get the per-module table and a layer in the verdict."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    c = Case(seed=0, seq_lens=(6, 4), prompt_lens=(3, 5))
    trap = triage(made_repro("hf.qwen3.packed_cache_trap", c))
    assert trap.k3 > 1e-3 and trap.localization.explained
    assert trap.first_module == "model.layers.0.self_attn.o_proj"  # attention mixes across the packed rows
    assert ", from model.layers.0 (first divergent module model.layers.0.self_attn.o_proj, in model.layers.0.self_attn): expected k3" in trap.verdict
    assert {m.name: m.tokens for m in trap.modules}["lm_head"] == c.n_tokens
    bf16 = triage(made_repro("hf.qwen3_moe.bf16_rollout", c))
    if bf16.k3 > 1e-3 and bf16.localization.explained:
        # the minimal set's divergence starts where it adds to what the other components give alone,
        # not at the embedding that every bf16 component already rounds
        assert bf16.first_module is not None and bf16.first_module.startswith("model.layers.")
        assert "all layers" not in bf16.verdict and ", from model.layers." in bf16.verdict


@pytest.mark.parametrize("k", [5, 2])
def test_a_head_cut_to_top_k_on_one_path_is_where_the_divergence_starts(k):
    """A rollout whose LM head cuts its logits to the top k (-inf elsewhere) differs from the trainer
    only where one path is -inf: their finite entries agree. That is an error of inf (log 0 on one
    path only), not NaN, which no floor exceeds (no module had been named). At k = 2 a row has too
    few finite values to be tied to its position by them: the HF paths name each row's position
    (`ROW_POSITIONS`), so the table has every row (it had none)."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    import torch

    from targets.hf import FP32, hf_pair, register_patch
    from targets.hf.backend import PATCHES
    from targets.hf.configs import TINY

    class TopFive(torch.nn.Module):
        def __init__(self, head: torch.nn.Module) -> None:
            super().__init__()
            self.inner = head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.inner(x)
            return y.masked_fill(y < y.topk(k, dim=-1).values[..., -1:], float("-inf"))

    register_patch(f"test_head_top{k}", lambda model: setattr(model, "lm_head", TopFive(model.lm_head)))
    try:
        pair = hf_pair(f"user.head_top{k}", TINY["qwen3"], FP32, FP32.replace(patch=f"test_head_top{k}"), expected="diverges")
        reg = type("R", (), {"get": staticmethod(lambda name: pair)})()
        t = triage(made_repro(pair.name, Case(seed=0, seq_lens=(6, 4), prompt_lens=(3, 5))), registry=reg)
        from targets.hf.backend import path_model

        rollout = path_model(pair.profiles.model, FP32.replace(patch=f"test_head_top{k}").model_key, "cpu")
        assert rollout.keeps  # (a head that cuts to -inf takes the rows cut too)
    finally:
        PATCHES.pop(f"test_head_top{k}", None)
    rows = {m.name: m for m in t.modules}
    assert t.k3 > 1e-3 and rows["lm_head"].error == math.inf and rows["lm_head"].exceeds, t.modules
    assert t.first_module == "lm_head" and all(rows[n].error < 1e-4 for n in rows if n.startswith("model.")), t.modules
    assert rows["lm_head"].tokens == 10 and not any("could not be tied" in n for n in t.notes), t.notes
    assert any("error of inf" in n and "lm_head" in n for n in t.notes), t.notes


def test_a_bf16_engine_on_a_dense_model_is_triaged_by_the_components_it_has():
    """BF16 says router bfloat16, which a dense model does not have: the pair neither shows nor swaps
    it (a swap of body and lm_head back left a variant differing only in the router, which hf_pair
    refuses: triage of every dense bf16 finding exited 2)."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    pair = REGISTRY.get("hf.qwen3.bf16_rollout")
    assert "router" not in pair.description and pair.profiles.rollout["router"] == pair.profiles.trainer["router"]
    t = triage(made_repro("hf.qwen3.bf16_rollout", Case(seed=4, seq_lens=(6, 4), prompt_lens=(3, 5))))  # (over the line)
    assert set(t.localization.differing) == {"body", "lm_head", "packing", "head_rows"}, t.localization.differing  # (no router)
    assert t.k3 > 1e-3 and t.localization.explained and "model dtype" in t.verdict, t.verdict


def test_a_plugin_pair_with_harness_profiles_is_localized():
    """`harness.Profiles` is the whole protocol for a pair of your own: triage swaps its components
    and names the one that explains the divergence, with its label."""
    import torch

    from harness import Axes, Outcome, PairError, Profiles, TargetPair

    def cast(x, setting):  # "exact", or a fixed-point engine's rounding to quarters
        return x if setting == "exact" else torch.round(x * 4) / 4

    def make(name, t_set, r_set):
        def build(case, device):
            return {"x": case.randn((case.n_tokens, 64), "x", device=device) * case.logit_scale}

        def path(settings):
            def run(inp):  # two stages, each at its own precision
                x = cast(inp["x"] * 3.0, settings["scale"])
                return Outcome(logprobs=torch.log_softmax(cast(x, settings["head"]), -1))
            return run

        return TargetPair(name=name, kind="op", expected="diverges", build=build, trainer=path(t_set),
                          rollout=path(r_set), axes=Axes(n_seqs=(1, 2), seq_len=(1, 4)),
                          profiles=Profiles(trainer=t_set, rollout=r_set,
                                            labels={"head": "LM-head precision", "scale": "input scaling precision"},
                                            make=lambda t, r: make(name, t, r)))

    pair = make("profiles.head_fixed_point", {"scale": "exact", "head": "exact"}, {"scale": "exact", "head": "quarters"})
    REGISTRY.register(pair)
    t = triage(made_repro(pair.name, Case(seed=2, seq_lens=(4, 3))))
    assert t.localization.minimal == ["head"] and t.verdict.startswith("LM-head precision: expected k3 "), t.verdict
    with pytest.raises(PairError, match="differ"):
        Profiles(trainer={"a": "x"}, rollout={"b": "y"}, make=lambda t, r: None)
    # a make that raises, or returns no pair, is the pair's to fix: one paragraph, not a traceback
    import dataclasses

    from harness.errors import UsageError

    def broken(t, r):
        raise KeyError("precision")

    for bad, words in ((broken, "raised KeyError: 'precision'"), (lambda t, r: None, "returned NoneType, not a TargetPair")):
        odd = make("profiles.bad_make", {"scale": "exact", "head": "exact"}, {"scale": "exact", "head": "quarters"})
        odd = dataclasses.replace(odd, profiles=Profiles(trainer=odd.profiles.trainer, rollout=odd.profiles.rollout,
                                                         make=bad))
        with pytest.raises(UsageError, match="its Profiles.make") as e:
            triage(made_repro(odd.name, Case(seed=2, seq_lens=(4, 3))), registry=SimpleNamespace(get=lambda n: odd))
        assert words in str(e.value), str(e.value)


def test_the_verdict_on_an_error_quotes_the_pairs_own_message():
    from harness.triage import verdict_line

    err = {"type": "ValueError", "where": "my_pairs.py:trainer",
           "message": "trainer logprobs have shape (3, 64), expected (4, vocab)\nmore detail"}
    t = SimpleNamespace(localization=None, evaluation=SimpleNamespace(symptom=Symptom.ERROR, error=err))
    line = verdict_line(t)
    assert line.startswith("the case raised ValueError: trainer logprobs have shape (3, 64), expected "
                           "(4, vocab) (at my_pairs.py:trainer)") and "more detail" not in line
    t.evaluation.symptom = Symptom.CRASH
    assert verdict_line(t).startswith("the worker running this case died: ")


def test_a_modules_entry_without_the_rollouts_module_is_named_not_ignored():
    """A rollout engine that is not a torch module (ONNX Runtime, say) exposes only the trainer's:
    the report says why there is no per-module table, instead of dropping the entry silently."""
    import torch

    from harness import Outcome, TargetPair

    base = REGISTRY.get("planted.tiny_lm.block_bias")

    def build(case, device):
        inp = base.build(case, device)
        inp["engine"] = inp["modules"]["rollout"]
        inp["modules"] = {"trainer": inp["modules"]["trainer"]}
        return inp

    def rollout(inp):
        rows = [torch.log_softmax(inp["engine"](ids[None])[0] * inp["scale"], -1) for ids in inp["ids"]]
        return Outcome(logprobs=torch.cat(rows))

    REGISTRY.register(TargetPair(name="planted.half_exposed", kind="model", expected="diverges", build=build,
                                 trainer=base.trainer, rollout=rollout, axes=base.axes, devices=("cpu",)))
    t = triage(made_repro("planted.half_exposed", Case(seed=3, seq_lens=(5, 3, 2), logit_scale=2.0)))
    assert t.k3 > 1e-3 and not t.modules
    assert any("has no 'rollout' torch module, so there is no per-module table" in n for n in t.notes), t.notes


def _triage_with_engine(name, base, engine):
    """Triage of `base`'s pair with `engine` as the rollout's exposed torch module (its paths unchanged)."""
    from harness import TargetPair

    def build(case, device):
        inp = base.build(case, device)
        inp["modules"] = {"trainer": inp["modules"]["trainer"], "rollout": engine}
        return inp

    REGISTRY.register(TargetPair(name=name, kind="model", expected="diverges", build=build, trainer=base.trainer,
                                 rollout=base.rollout, axes=base.axes, devices=("cpu",)))
    return triage(made_repro(name, Case(seed=3, seq_lens=(5, 3, 2), logit_scale=2.0)))


def test_modules_only_one_path_runs_are_named_in_a_note():
    """An engine that wraps a layer in its own module (`blocks.1.inner`) has modules the trainer does
    not: the table cannot compare them, and a note says which instead of leaving them out silently."""
    import copy

    import torch
    from torch import nn

    base = REGISTRY.get("planted.tiny_lm.block_bias")
    engine = copy.deepcopy(base.build(Case(seed=0, seq_lens=(1,)), "cpu")["modules"]["rollout"])

    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    engine.blocks[1] = Wrapped(engine.blocks[1])
    t = _triage_with_engine("planted.wrapped_engine", base, engine)
    assert "blocks.1" in {m.name for m in t.modules} and "blocks.1.inner" not in {m.name for m in t.modules}
    assert any("1 module(s) only the rollout runs are not in it" in n and "blocks.1.inner" in n for n in t.notes), t.notes


def test_the_first_token_over_the_line_is_named_by_its_offset_into_the_sequence():
    """A position bug (from offset 48) in a minimal case that keeps clean tokens before it: the mean
    fires, and the line says where the per-token values cross."""
    import numpy as np

    from harness.triage import first_over_line

    case = Case(seed=0, seq_lens=(29, 4), prompt_lens=(23, 0))
    pos = np.concatenate([np.arange(29), np.arange(4)])
    seq = np.repeat([0, 1], [29, 4])
    k3e = np.where((seq == 0) & (23 + pos >= 48), 0.02, 1e-9)
    div = SimpleNamespace(per_token={"sequence": seq, "position": pos, "k3": np.zeros(33), "k3_expected": k3e,
                                     "kl": np.zeros(33)})
    line = first_over_line(div, case, 1e-3)
    assert line.startswith("first token over the line: sequence 0, response token 25 (0-based) after a 23-token prompt "
                           "(offset 48), per-token value 0.02; 4 of 33 tokens over it, the 25 before it in that "
                           "sequence under it; in case order (the outcome's rows, 33 in all) the first over it is "
                           "row 25 (this one)"), line
    # a row-count bug (a kernel chunked by 28 rows: rows 28 on) shows in case order, beside the offsets
    div.per_token["k3_expected"] = np.where(np.arange(33) >= 28, 0.02, 1e-9)
    line = first_over_line(div, case, 1e-3)
    assert line.startswith("first token over the line: sequence 1, response token 0 (0-based),") and line.endswith(
        "the first over it is row 28 (sequence 0, response token 28)"), line
    div.per_token["k3_expected"] = np.full(33, 5e-4)
    assert first_over_line(div, case, 1e-3) == ""  # no token over the line: nothing to point at
    div.per_token["k3"] = np.where(np.arange(33) == 30, math.inf, 0.0)  # ... but one drew a token of probability 0
    assert first_over_line(div, case, 1e-3).startswith(
        "first token over the line: sequence 1, response token 1 (0-based), sampled k3 inf (expected k3 / KL 0.0005); 1 of 33")
    div.per_token["k3"] = np.zeros(33)
    div.per_token["k3_expected"] = div.per_token["kl"] = np.full(33, math.nan)  # (all NaN: no warning, nothing)
    assert first_over_line(div, case, 1e-3) == ""
    div.per_token["k3"] = np.where(pos == 2, math.inf, 0.0)  # a sampled token the trainer excludes
    assert "sequence 1, response token 2 (0-based)," in first_over_line(div, case, 1e-3)
    # in a group of samples of one prompt (GRPO): which sample, and which one fills a prefix cache
    grouped = Case(seed=0, seq_lens=(29, 4), prompt_lens=(23, 23), seq_ids=(0, 1), prompt_ids=(0, 0))
    div.per_token["k3"] = np.where(np.arange(33) == 31, math.inf, 0.0)  # (sequence 1's response token 2)
    assert ", sample 2 of the 2 sequences 0, 1 that share its prompt (sequence 0, first in batch order, fills a " \
           "prefix cache)" in first_over_line(div, grouped, 1e-3)


def test_triage_prints_where_the_tokens_cross_the_line(tmp_path):
    t = triage(made_repro("planted.tiny_lm.block_bias", Case(seed=3, seq_lens=(5, 3, 2), logit_scale=2.0)))
    assert t.first_over.startswith("first token over the line: sequence ")
    path = write_report(t, tmp_path)
    assert t.first_over in path.read_text()


def test_a_module_both_paths_run_but_one_cannot_tie_to_token_rows_is_not_called_one_sided():
    """A module the rollout first calls on a slice of rows (one expert's tokens, say) runs on both
    paths: the note says its outputs could not be tied to token rows, not that only one path runs it."""
    import copy

    import torch

    base = REGISTRY.get("planted.tiny_lm.block_bias")
    engine = copy.deepcopy(base.build(Case(seed=0, seq_lens=(1,)), "cpu")["modules"]["rollout"])
    plain = engine.forward

    def sliced_first(ids: torch.Tensor) -> torch.Tensor:
        # blocks.1 first called on one row, no token position (the first call is what triage keeps)
        engine.blocks[1](engine.embed(ids).reshape(-1, engine.blocks[1].in_features)[:1])
        return plain(ids)

    engine.forward = sliced_first
    t = _triage_with_engine("planted.sliced_engine", base, engine)
    assert not any("only the trainer runs" in n and "blocks.1," in n + "," for n in t.notes), t.notes
    assert any("module(s) both paths run are not in it, the rollout's outputs of them not being tied" in n
               and "blocks.1" in n for n in t.notes), t.notes


def test_a_deliberate_minus_inf_cut_is_log_zero_not_a_module_with_nan_or_inf():
    """A rollout head that keeps its 5 largest logits (-inf elsewhere: an engine's default top-k) is
    a divergence, not a non-finite finding: its -inf is log 0, not a non-finite value (triage had
    named it the "first module with NaN/inf")."""
    import copy

    import torch

    class TopKHead(torch.nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            return y.masked_fill(y < y.topk(5, -1).values[..., -1:], float("-inf"))

    base = REGISTRY.get("planted.tiny_lm.aligned")
    tiny = base.build(Case(seed=0, seq_lens=(1,)), "cpu")["modules"]["trainer"]
    buggy = copy.deepcopy(tiny)
    buggy.head.__class__ = TopKHead
    name = "planted.tiny_lm.head_topk_test"
    if name not in REGISTRY:
        from harness import register

        register(base.build.__globals__["tiny_pair"](name, "diverges", buggy, "the rollout's head keeps its top 5"))
    t = triage(made_repro(name, Case(seed=3, seq_lens=(5, 3, 2), logit_scale=2.0)))
    assert t.nonfinite is None, t.nonfinite
    assert "NaN" not in t.verdict and t.verdict.startswith("expected k3 "), t.verdict


def test_rows_a_path_names_are_filed_where_it_says_and_a_bad_naming_falls_back_to_correlation():
    import torch

    from harness.triage import _Call, _named_rows

    calls = [_Call(batch=2, seq=4), _Call(batch=2, seq=1)]
    named = torch.tensor([[0, 1, 3], [1, 0, 0]])
    assert _named_rows(calls, named, 2) == {0: (0, 1, 3), 1: (1, 0, 0)}
    assert _named_rows(calls, named, 3) is None  # (not one per row)
    assert _named_rows(calls, torch.tensor([[0, 1, 4], [1, 0, 0]]), 2) is None  # (a position past the call's)
    assert _named_rows(calls, torch.tensor([[2, 0, 0], [1, 0, 0]]), 2) is None  # (a call it did not make)
    assert _named_rows(calls, None, 2) is None


def test_a_swap_the_rollout_cannot_take_is_shown_as_such(tmp_path):
    """An HF rollout always runs a row per sequence and its LM head where it samples: the swaps where
    it would take the trainer's packing or head rows change nothing, so the table says n/a there and
    those components are aligned by the trainer taking the rollout's; the head-rows label says which
    side runs what."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    t = triage(made_repro("hf.qwen3.packed_cache_trap", Case(seed=0, seq_lens=(6, 4), prompt_lens=(3, 5))))
    swaps = {s.component: s for s in t.localization.swaps}
    for c in ("packing", "head_rows"):
        assert math.isnan(swaps[c].k3_rollout_aligned) and math.isfinite(swaps[c].k3_trainer_aligned), swaps[c]
    assert swaps["head_rows"].label == "LM-head rows (every position on the trainer, the scored positions only on the rollout)"
    write_report(t, tmp_path)
    assert "| n/a |" in t.report.read_text() and t.localization.explained, t.verdict


def test_the_console_says_why_a_triage_has_no_per_module_table():
    from harness.triage import ModuleRow, Triage, missing_table_lines

    note = ("per-module table: 1 of the trainer's 1 token rows have fewer than 3 finite values (cut to a top-k under "
            "3, ...), so they cannot be tied ... (none)")
    t = Triage(repro=None, pair=None, k3=0.9, threshold=1e-3, evaluation=None, notes=[note, "another note"])
    assert missing_table_lines(t) == ["no " + note]
    t.modules = [ModuleRow.__new__(ModuleRow)]  # a table: nothing to explain on the console
    assert missing_table_lines(t) == []


def test_many_other_aligned_pairs_do_not_crowd_the_reference_out():
    """A plugin with many aligned model pairs (named before `model.aligned`) pushed the reference of a
    planted pair built on the registered model out of the candidates tried: no floor. Candidates that
    share the pair's triage components and axes are tried first."""
    import dataclasses

    base = REGISTRY.get("planted.tiny_lm.aligned")
    crowd = [dataclasses.replace(base, name=f"aaa.aligned{i}") for i in range(14)]
    by_name = {p.name: p for p in crowd}
    reg = SimpleNamespace(get=lambda name: by_name.get(name) or REGISTRY.get(name),
                          all=lambda: [*REGISTRY.all(), *crowd])
    t = triage(made_repro("planted.moe_norm_weight", DECODER_CASE), registry=reg)
    assert t.floor_from.startswith("model.aligned"), t.floor_from
