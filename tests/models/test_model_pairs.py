"""Full-model pairs: the contract, the two paths' bookkeeping, and detection quality.

Fast tests cover the paths (prompt + response layout, batched KV-cache decode, sampling, packing,
replay, the planted bugs' triggers); the `slow` ones run fixed-seed campaigns (each diverging model
pair caught and shrunk; the aligned pairs clean over sampled cases). `model.compiled` pays Inductor
compilations (tens of seconds) and is exercised by one slow test.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import REGISTRY, Case, check_pair
from harness.execute import DEFAULT_THRESHOLD, run_case, run_paths
from harness.fuzz import CampaignConfig, run_campaign
from harness.tracking import NullTracker
from targets.models import paths, schema1
from targets.models.moe_decoder import KV_LATE_FROM, TINY, weights

FAST_PAIRS = ["model.aligned", "model.bf16_rollout", "model.bf16_rollout.replay", "model.moe_aggregate_bf16",
              "model.packing_positions_bug", "model.kv_cache_late_fp8", "model.sampling_top_k_default",
              "model.temperature_twice", "model.rotary_bf16", "model.left_pad_positions", "model.onnxruntime"]
pytestmark = pytest.mark.usefixtures("one_thread")
DIVERGES = [n for n in FAST_PAIRS if REGISTRY.get(n).expected == "diverges"]




def case(**kw):
    base = dict(seed=7, seq_lens=(5, 3, 6), prompt_lens=(4, 0, 9), pad_side="left", logit_scale=4.0,
                params={"tie_layer": 0})
    base.update(kw)
    return Case(**base)


@pytest.mark.parametrize("name", FAST_PAIRS)
def test_model_pair_conforms(name):
    check_pair(name, n_cases=3)


def test_weights_are_a_cached_function_of_config_and_seed():
    assert weights(TINY, 3) is weights(TINY, 3)
    assert not torch.equal(weights(TINY, 3)["embed.weight"], weights(TINY, 4)["embed.weight"])


def test_layout_does_not_change_float32_logprobs():
    """Packing (row capacity counts prompt + response), order and pad side move no float32 result."""
    pair = REGISTRY.get("model.aligned")
    ref_t, ref_r = run_paths(pair, case(), "cpu")
    for layout in (dict(row_capacity=15), dict(row_capacity=18, order=(2, 0, 1)), dict(pad_side="right")):
        t, r = run_paths(pair, case(**layout), "cpu")
        assert torch.equal(r.tokens, ref_r.tokens), layout
        assert (t.logprobs - ref_t.logprobs).abs().max() < 1e-5, layout
        assert (r.logprobs - ref_r.logprobs).abs().max() < 1e-5, layout


def test_rollout_decodes_every_response_token_with_the_case_sampling():
    pair = REGISTRY.get("model.aligned")
    c = case(temperature=0.7, sample_top_k=20, top_p=0.9)
    inp = pair.build(c, "cpu")
    out = pair.rollout(inp)
    assert out.tokens.shape == (c.n_tokens,) and out.logprobs.shape == (c.n_tokens, TINY.vocab)
    kept = torch.isfinite(out.logprobs)  # (T, V) the truncated distribution the token was drawn from
    assert bool((kept.sum(-1) <= 20).all()) and bool((kept.sum(-1) >= 1).all())
    assert bool(kept[torch.arange(c.n_tokens), out.tokens].all())  # every token inside its kept set
    assert torch.allclose(out.logprobs.exp().sum(-1), torch.ones(c.n_tokens), atol=1e-5)
    assert set(out.routing) == {f"layers.{i}" for i in range(TINY.layers)}
    for j, p in enumerate(inp.prefixes):
        assert len(p) == 1 + c.prompt_len(j)  # BOS + prompt (no context on CPU)
        assert torch.equal(p[1:], c.prompt_tokens(j, TINY.vocab, low=2))


def test_kv_cache_decode_matches_the_teacher_forced_trainer():
    c = case(seq_lens=(40, 7), prompt_lens=(3, 30), temperature=1.3, top_p=0.95, tie_fraction=0.5, tie_gap=1e-3)
    ev = run_case(REGISTRY.get("model.aligned"), c)
    assert not ev.failed and ev.k3 < 1e-9 and abs(ev.divergence.kl) < 1e-6


def test_dropping_a_sequence_leaves_the_others_tokens_alone():
    """Per-sequence streams and a batch-independent sampler: what shrinking relies on."""
    pair = REGISTRY.get("model.aligned")
    c = case(seq_ids=(11, 22, 33))
    full = pair.rollout(pair.build(c, "cpu")).tokens
    less = c.drop_sequence(1)
    assert less.ids == (11, 33)
    got = pair.rollout(pair.build(less, "cpu")).tokens
    assert torch.equal(got, torch.cat([full[:5], full[8:]]))


def test_schema1_repros_run_the_schema1_layout():
    c = Case.from_json({"schema": 1, "seed": 3, "seq_lens": [4, 2], "params": {"decode": 2, "temperature": 0.7}})
    assert c.streams == "single"
    pair = REGISTRY.get("model.aligned")
    inp = pair.build(c, "cpu")
    assert isinstance(inp, schema1.Schema1Inputs) and inp.decode == 2
    out = pair.rollout(inp)
    assert torch.equal(out.tokens[:2], inp.prompt[:2])  # schema 1: the first n - decode tokens are prompt
    assert run_case(pair, c).k3 < 1e-9


def test_router_replay_reuses_the_rollout_experts():
    pair = REGISTRY.get("model.bf16_rollout.replay")
    trainer, rollout = run_paths(pair, case(tie_fraction=1.0, tie_gap=1e-4), "cpu")
    for layer, r in rollout.routing.items():
        assert torch.equal(trainer.routing[layer].experts, r.experts)


def test_replay_alone_does_not_close_the_gap_when_aggregation_precision_differs():
    """Replay removes every flip, yet the expected k3 stays over the threshold; aligning the MoE
    aggregation too brings it under (about half of this case's gap is the aggregation's)."""
    pair = REGISTRY.get("model.bf16_rollout.replay")
    c = Case(seed=22, seq_lens=(8,), logit_scale=6.0, params={"tie_layer": 0})
    ev = run_case(pair, c)
    d = ev.divergence
    assert ev.failed and d.flip_rate == 0.0 and d.tie_flip_rate == 0.0 and d.k3_expected > DEFAULT_THRESHOLD
    prof = pair.profiles
    fixed = prof.variant(prof.trainer, {**prof.rollout, "moe_aggregate": "float32"})
    aligned = run_case(fixed, c)
    assert not aligned.failed and aligned.divergence.k3_expected < d.k3_expected / 2


def test_positions_bug_is_invisible_without_packing():
    pair = REGISTRY.get("model.packing_positions_bug")
    single = Case(seed=3, seq_lens=(9,), prompt_lens=(5,), logit_scale=8.0)
    # one sequence per row: run-on positions are the right ones, exactly the fixed twin's computation
    assert run_case(pair, single).k3 == run_case(REGISTRY.get("model.rotary_bf16"), single).k3
    packed = Case(seed=1, seq_lens=(16, 16), prompt_lens=(64, 64), logit_scale=8.0)
    assert run_case(pair, packed).k3 > DEFAULT_THRESHOLD


def test_tie_floor_keeps_exact_ties_out_of_float32_pairs():
    assert paths.TIE_FLOOR > 0
    c = case(tie_fraction=1.0, tie_gap=0.0, params={"tie_layer": 1})
    assert run_case(REGISTRY.get("model.aligned"), c).k3 < 1e-9


# ---------------------------------------------------------------------------------------------
# The planted bugs: invisible where their trigger is absent, caught where it is present
# ---------------------------------------------------------------------------------------------
def k3_pair(name, c):
    return run_case(REGISTRY.get(name), c).k3


def test_late_kv_slots_matter_only_past_their_first_position():
    short = Case(seed=2, seq_lens=(KV_LATE_FROM - 8,), prompt_lens=(7,), logit_scale=4.0)  # last position 31
    assert k3_pair("model.kv_cache_late_fp8", short) == k3_pair("model.aligned", short)
    long = short.replace(seq_lens=(64,), prompt_lens=(16,), logit_scale=8.0)
    assert run_case(REGISTRY.get("model.kv_cache_late_fp8"), long).k3 > DEFAULT_THRESHOLD


def test_truncated_sampling_shows_in_the_exact_kl():
    c = Case(seed=3, seq_lens=(6,), logit_scale=1.0)
    trainer, rollout = run_paths(REGISTRY.get("model.sampling_top_k_default"), c, "cpu")
    assert bool((torch.isfinite(rollout.logprobs).sum(-1) == paths.ENGINE_TOP_K).all())
    assert bool(torch.isfinite(trainer.logprobs).all())  # the trainer scores the full distribution
    ev = run_case(REGISTRY.get("model.sampling_top_k_default"), c)
    assert ev.divergence.kl >= 10 * DEFAULT_THRESHOLD
    assert k3_pair("model.sampling_top_k_default", c.replace(sample_top_k=40)) < 1e-9  # the case sets top-k


def test_temperature_twice_is_invisible_at_temperature_one():
    c = Case(seed=5, seq_lens=(3,), prompt_lens=(2,), logit_scale=2.0)
    assert k3_pair("model.temperature_twice", c) == k3_pair("model.aligned", c)
    assert k3_pair("model.temperature_twice", c.replace(temperature=1.25)) > DEFAULT_THRESHOLD


def test_left_pad_positions_need_left_padding_and_unequal_prompts():
    c = Case(seed=0, seq_lens=(8, 8), prompt_lens=(128, 0), pad_side="left", logit_scale=16.0)
    assert k3_pair("model.left_pad_positions", c) > DEFAULT_THRESHOLD
    assert k3_pair("model.rotary_bf16", c) < 1e-9  # the fixed twin
    for same in (c.replace(pad_side="right"), c.replace(prompt_lens=(64, 64))):
        assert k3_pair("model.left_pad_positions", same) == k3_pair("model.rotary_bf16", same)


# ---------------------------------------------------------------------------------------------
# Campaigns (slow)
# ---------------------------------------------------------------------------------------------
CAUGHT_WITHIN = {"model.left_pad_positions": 150}  # examples a demonstration gets (default 100)


@pytest.mark.slow
@pytest.mark.parametrize("name", DIVERGES)
def test_diverging_model_pair_is_caught_and_shrunk(name, tmp_path):
    cfg = CampaignConfig(pairs=[REGISTRY.get(name)], seed=1, max_examples=CAUGHT_WITHIN.get(name, 100),
                         corpus=tmp_path, write_corpus=False, isolation=False)  # (as isolated: test_fuzz.py)
    (r,) = run_campaign(cfg, NullTracker(), log=lambda m: None).results
    assert r.verdict == "caught", (name, r.verdict, r.max_k3)
    (f,) = r.findings
    assert f.shrink_complete
    c = f.case
    assert c.batch_size <= 8, c.one_line()
    if name == "model.sampling_top_k_default":
        assert f.evaluation.divergence.kl >= 10 * DEFAULT_THRESHOLD  # caught well clear of the line
    if name == "model.temperature_twice":
        assert c.temperature != 1.0
    if name == "model.left_pad_positions":
        assert c.pad_side == "left" and c.batch_size == 2 and len(set(c.prompt_lens)) == 2
    if name == "model.kv_cache_late_fp8":
        assert max(c.total_lens) > KV_LATE_FROM  # some token attends to a late slot
    if name == "model.packing_positions_bug":
        assert c.batch_size >= 2 and len(c.packed_rows()) < c.batch_size  # sequences sharing a row


@pytest.mark.slow
# model.rotary_bf16: bf16 rotary tables round packed and decode rows apart a little, and with top-p on
# both paths a token at the nucleus boundary then goes in or out, moving the kept tokens'
# log-probabilities by its mass (seen: k3 1.3e-6 on a case with top_p 0.967 on an AMD EPYC with
# AVX512, under 1e-6 on the machine the bound was first set on); still ~1000x under the threshold
@pytest.mark.parametrize("name,n,bound", [("model.aligned", 100, 1e-9), ("model.rotary_bf16", 100, 1e-5),
                                          ("model.onnxruntime", 40, 1e-9)])
def test_aligned_model_pair_is_clean_over_sampled_examples(name, n, bound):
    """Cases drawn from the pair's axes (Hypothesis generation only: the campaign's target phase
    spends most of its time hill-climbing on k3 values of ~1e-12, which proves nothing more)."""
    from harness.conformance import sample_cases

    pair = REGISTRY.get(name)
    cases = sample_cases(pair, n, seed=1)
    assert len(cases) >= 0.9 * n
    evs = [run_case(pair, c) for c in cases]
    assert all(not ev.failed for ev in evs), [ev.case.one_line() for ev in evs if ev.failed][:3]
    assert max(ev.k3 for ev in evs) < bound
    assert all(math.isfinite(ev.divergence.kl) and ev.divergence.kl < 1e-5 for ev in evs)


@pytest.mark.slow
def test_compiled_rollout_matches_eager_trainer():
    pair = REGISTRY.get("model.compiled")
    c = Case(seed=5, seq_lens=(4, 6), prompt_lens=(3, 0), pad_side="left", logit_scale=4.0)
    ev = run_case(pair, c)
    assert ev.error is None, ev.error and ev.error["traceback"]
    assert not ev.failed and ev.k3 < 1e-9


@pytest.mark.gpu
def test_model_pairs_run_the_large_config_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the LARGE config runs only with --device cuda")
    c = Case(seed=1, seq_lens=(8, 8, 8, 8), prompt_lens=(4, 0, 8, 2), pad_side="left", logit_scale=4.0)
    assert run_case(REGISTRY.get("model.aligned"), c, "cuda").k3 < 1e-3
    assert run_case(REGISTRY.get("model.bf16_rollout"), c, "cuda").divergence is not None
