"""The Hugging Face backend (targets/hf): the packed-mask trap, the two paths' bookkeeping, the
realistic init, router capture/replay, and detection quality of the built-in pairs.

Skipped with a reason where transformers is not installed (`pip install -e '.[hf]'`).
"""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers", reason="the HF backend needs transformers: pip install -e '.[hf]'")

import torch  # noqa: E402

from harness import REGISTRY, Axes, Case, check_pair  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.execute import run_case  # noqa: E402
from harness.fuzz import CampaignConfig, run_campaign  # noqa: E402
from targets.hf import BF16, FP32, hf_pair  # noqa: E402
from targets.hf.backend import model_from, path_model  # noqa: E402
from targets.hf.builtin import MODELS  # noqa: E402
from targets.hf.paths import CallContext  # noqa: E402

CONFIGS = sorted(MODELS)


def rl_case(seed=3, **kw):
    base = dict(seed=seed, seq_lens=(9, 5, 12), prompt_lens=(4, 0, 7))
    base.update(kw)
    return Case(**base)


def test_registering_the_pairs_does_not_import_transformers():
    code = ("import sys; from harness import REGISTRY; REGISTRY.load_builtins(); "
            "names = [p.name for p in REGISTRY.all() if p.name.startswith('hf.')]; "
            "print(len(names), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) >= 14 and out[1] == "False", out


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_forward_equals_each_sequence_alone_only_with_use_cache_false(config, attention):
    run = path_model(MODELS[config], FP32.replace(attention=attention).model_key, "cpu")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(512, (n,), generator=g) for n in (7, 4, 9)]
    alone = [run(CallContext(), input_ids=s[None], use_cache=False).logits[0] for s in seqs]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    packed = run(CallContext(), input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0]
    trap = run(CallContext(), input_ids=ids, position_ids=pos, attention_mask=None).logits[0]
    ref = torch.cat(alone)
    assert (packed - ref).abs().max() < 1e-4  # float32 noise (different GEMM shapes)
    assert (trap - ref).abs().max() > 0.05  # use_cache left at its default: sequences attend across the packing


@pytest.mark.parametrize("config", CONFIGS)
def test_realistic_init_gives_trained_like_entropy(config):
    ev = run_case(REGISTRY.get(f"hf.{config}.aligned"), rl_case(), keep_outcomes=True)
    assert ev.symptom.value == "none", ev.divergence
    assert 0.8 < ev.divergence.entropy < 3.0, ev.divergence.entropy
    logits_range = ev.rollout.logprobs.max(-1).values - ev.rollout.logprobs.min(-1).values
    assert float(logits_range.mean()) > 15.0  # a trained LM's logit range, not a near-uniform one


@pytest.mark.parametrize("model_type", ["falcon", "gpt_neox"])
def test_realistic_init_finds_embeddings_head_and_norms_by_identity_in_other_families(model_type):
    """Falcon (`word_embeddings`, LayerNorms with biases, a final norm named `ln_f`) and GPT-NeoX
    (`embed_in`, `embed_out`): peaked outputs, biases 0, norm weights as the model initializes them.
    Setting every 1-D parameter without "norm" in its name to 0 had zeroed `ln_f`: uniform output."""
    from targets.hf.backend import base_model

    cfg = dict(model_type=model_type, vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False)
    pair = hf_pair(f"user.{model_type}", cfg, FP32, FP32)
    ev = run_case(pair, rl_case(), keep_outcomes=True)
    assert ev.symptom.value == "none" and ev.divergence.entropy < 0.6 * math.log(256), ev.divergence.entropy
    model = base_model(pair.profiles.model)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert not p.any(), name
        elif p.dim() == 1:
            assert bool((p == 1).all()), name  # LayerNorm weights: transformers' own 1
    assert float(model.get_input_embeddings().weight.std()) == pytest.approx(1.0, rel=0.05)


def test_a_model_that_scales_its_logits_gets_a_head_calibrated_to_peaked_outputs():
    """GraniteMoE divides its logits by `logits_scaling` (and scales embeddings and residuals): drawn
    like the others, its output was near-uniform (5.5 of log V 6.2 nats) and its own bf16 rollout
    demonstration went uncaught. The head is rescaled by a measured, rounded factor."""
    from targets.hf import hf_pairs
    from targets.hf.backend import base_model

    cfg = dict(model_type="granitemoe", vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
               max_position_embeddings=512, tie_word_embeddings=False, embedding_multiplier=12.0, logits_scaling=4.0,
               residual_multiplier=0.22, attention_multiplier=0.0625)
    pairs = {p.name: p for p in hf_pairs("user.granite", cfg)}
    ev = run_case(pairs["user.granite.aligned"], rl_case(), keep_outcomes=True)
    assert ev.symptom.value == "none" and ev.divergence.entropy < 3.0, ev.divergence.entropy
    head = base_model(pairs["user.granite.aligned"].profiles.model).get_output_embeddings().weight
    assert 4.0 < float(head.std()) * math.sqrt(64) < 40.0  # rescaled from 5 by a factor near logits_scaling
    caught = [run_case(pairs["user.granite.bf16_rollout"], rl_case(seed=s)).failed for s in range(6)]
    assert any(caught), caught
    # the weights are a function of (config, seed): not of dropout drawn in the measuring forward, nor
    # of the process's random state, which the calibration leaves as it was
    from targets.hf import HFModel
    from targets.hf.configs import realistic_init

    heads = []
    for state in (0, 1):
        torch.manual_seed(state)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**{**cfg, "attention_dropout": 0.3}))
        before = torch.random.get_rng_state()
        realistic_init(model, 0)
        assert torch.equal(torch.random.get_rng_state(), before) and model.training
        heads.append(model.get_output_embeddings().weight.clone())
    assert torch.equal(heads[0], heads[1])
    # a head tied to the embedding keeps the embedding's scale: peaked output, not near-uniform
    tied = hf_pair("user.granite.tied", HFModel.from_config({**cfg, "tie_word_embeddings": True}), FP32, FP32)
    ev = run_case(tied, rl_case(), keep_outcomes=True)
    assert ev.divergence.entropy < 0.6 * math.log(512), ev.divergence.entropy


@pytest.mark.parametrize("config", ["qwen3", "qwen3_moe"])
def test_a_tied_head_gets_a_model_that_does_not_repeat_its_last_token(config):
    """With the LM head tied to the embedding, the current token's embedding in the residual stream
    scored itself: the model repeated its last token (mean entropy 0.08 nats on a 2-layer Llama, 0.04
    on the tiny Qwen3-MoE) and a bf16 rollout of it was MISSED. The tied matrix is drawn at the head's
    scale and the layers' outputs are raised (by powers of two) until a probe forward stops
    predicting its input token."""
    from targets.hf import HFModel, hf_pairs
    from targets.hf.configs import TINY

    pairs = {p.name.rsplit(".", 1)[-1] if "replay" not in p.name else "replay": p
             for p in hf_pairs(f"user.tied.{config}", HFModel.from_config({**TINY[config], "tie_word_embeddings": True}))}
    case = Case(seed=0, seq_lens=(24, 16, 32), prompt_lens=(8, 4, 16))
    ev = run_case(pairs["aligned"], case, keep_outcomes=True)
    assert ev.symptom.value == "none" and 0.6 < ev.divergence.entropy < 3.0, ev.divergence.entropy
    model = pairs["aligned"].profiles.model
    from targets.hf.backend import base_model

    m = base_model(model)
    assert m.get_output_embeddings().weight is m.get_input_embeddings().weight  # still tied
    if config == "qwen3_moe":  # (the dense config's bf16 rollout sits at the line, tied or not: ~8e-4)
        caught = [run_case(pairs["bf16_rollout"], Case(seed=s, seq_lens=(24, 16, 32), prompt_lens=(8, 4, 16))).failed
                  for s in range(4)]
        assert any(caught), caught


@pytest.mark.parametrize("name", ["hf.qwen3_moe.aligned", "hf.mixtral.bf16_rollout.replay", "hf.qwen3.eager_vs_sdpa"])
def test_hf_pair_conforms(name):
    check_pair(name, n_cases=2)


def test_rollout_layout_tokens_and_sampling_are_from_the_case():
    pair = REGISTRY.get("hf.qwen3_moe.aligned")
    c = rl_case(temperature=0.8, top_p=0.9, sample_top_k=20)
    inp = pair.build(c, "cpu")
    out = pair.rollout(inp)
    again = pair.rollout(pair.build(c, "cpu"))
    assert torch.equal(out.tokens, again.tokens) and torch.equal(out.logprobs, again.logprobs)
    assert out.logprobs.shape == (c.n_tokens, 512) and out.tokens.shape == (c.n_tokens,)
    kept = torch.isfinite(out.logprobs).sum(-1)
    assert int(kept.max()) <= 20  # top-k 20 (and top-p 0.9) truncate: -inf outside the kept set
    picked = out.logprobs.gather(1, out.tokens[:, None]).squeeze(1)
    assert torch.isfinite(picked).all()  # every token sampled from inside the kept set
    assert set(out.routing) == {"layers.0", "layers.1"}
    assert out.routing["layers.0"].experts.shape == (c.n_tokens, 2)
    assert [len(p) for p in inp.prompts] == [5, 1, 8]  # first token + prompt
    other = pair.rollout(pair.build(c.replace(seed=4), "cpu"))
    assert not torch.equal(out.tokens, other.tokens)


def test_packing_layout_does_not_change_trainer_logprobs():
    pair = REGISTRY.get("hf.qwen3_moe.aligned")
    base = rl_case()
    rollout = pair.rollout(pair.build(base, "cpu"))
    ref = pair.trainer(pair.build(base, "cpu"), rollout).logprobs
    for layout in (dict(row_capacity=19), dict(row_capacity=24, order=(2, 0, 1))):
        c = base.replace(**layout)
        got = pair.trainer(pair.build(c, "cpu"), rollout).logprobs
        assert (got - ref).abs().max() < 1e-4, layout


def test_padding_in_packed_rows_takes_no_position_past_the_longest_sequence(monkeypatch):
    """A packed row's padding is fake sequences of its own: a row that holds one short sequence next
    to a full one must not give its padding positions up to the full row's width (past the model's
    max_position_embeddings when several sequences share a row)."""
    import targets.hf.paths as paths

    pair = REGISTRY.get("hf.qwen3_moe.aligned")
    case = rl_case(row_capacity=32, order=(2, 0, 1))  # rows (19 + 13), (5): 27 positions of padding
    rows = [[case.total_len(j) for j in row] for row in case.packed_rows()]
    width, longest = max(map(sum, rows)), max(map(max, rows)) + 1  # (+1: each sequence's first token)
    assert any(width - sum(r) > longest for r in rows), rows  # a row whose padding is longer than any sequence
    rollout = pair.rollout(pair.build(case, "cpu"))
    seen = []
    real = paths.path_model

    def spying(*a, **kw):
        run = real(*a, **kw)

        def call(ctx, **inputs):
            seen.append(inputs["position_ids"].clone())
            return run(ctx, **inputs)

        return type("Spy", (), {"__call__": staticmethod(call), "gates": run.gates, "model": run.model})()

    monkeypatch.setattr(paths, "path_model", spying)
    pair.trainer(pair.build(case, "cpu"), rollout)
    assert seen and int(seen[-1].max()) < longest, (seen[-1], longest)


def test_router_replay_removes_flips_at_near_ties():
    c = rl_case(tie_fraction=1.0, tie_gap=0.0, params={"tie_layer": 0})
    flips = run_case(REGISTRY.get("hf.qwen3_moe.bf16_rollout"), c)
    replay = run_case(REGISTRY.get("hf.qwen3_moe.bf16_rollout.replay"), c)
    assert flips.divergence.flip_rate + flips.divergence.tie_flip_rate > 0.05, flips.divergence
    assert replay.divergence.flip_rate == 0 and replay.divergence.tie_flip_rate == 0
    assert replay.k3 < flips.k3


def test_bf16_rollout_is_caught_across_cases():
    for name in ("hf.qwen3.bf16_rollout", "hf.qwen3_moe.bf16_rollout", "hf.mixtral.bf16_rollout"):
        k3 = [run_case(REGISTRY.get(name), rl_case(seed=s)).k3 for s in range(6)]
        assert max(k3) > 1e-3, (name, k3)
    aligned = [run_case(REGISTRY.get("hf.qwen3.aligned"), rl_case(seed=s)).k3 for s in range(6)]
    assert max(aligned) < 1e-8


def test_user_pair_from_config_dict_and_profiles_swap():
    cfg = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    pair = hf_pair("user.llama.bf16", cfg, FP32, BF16, expected="diverges")
    assert pair.profiles.rollout["body"] == "bfloat16"
    aligned = pair.profiles.variant(dict(pair.profiles.trainer), dict(pair.profiles.trainer))
    ev = run_case(aligned, rl_case(seed=1))
    assert ev.k3 < 1e-8 and math.isfinite(ev.k3)


def test_axes_past_the_models_positions_are_refused_and_wider_axes_reach_far_positions():
    from targets.hf import hf_pairs
    from targets.hf.pairs import default_axes
    from targets.hf.backend import model_from
    from harness.strategies import uniform_cases

    cfg = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    hand = Axes(n_seqs=(1, 4), seq_len=(1, 48), prompt_len=(0, 48))
    with pytest.raises(UsageError, match=r"reach sequences of 97 tokens .* max_position_embeddings \(64\)"
                                         r".* max_context=63"):
        hf_pair("user.long", cfg, axes=hand)
    # default_axes caps each sequence at the model's positions: long prompts and long responses, not both
    capped = default_axes(model_from(cfg), max_prompt=48, max_response=48)
    assert capped.max_context == 63
    hf_pair("user.long", cfg, axes=capped)
    rng = random.Random(3)
    drawn = [uniform_cases(capped, rng) for _ in range(200)]
    longest = [max(c.prompt_len(j) + n for j, n in enumerate(c.seq_lens)) for c in drawn]
    assert max(longest) == 63 and sum(t == 63 for t in longest) > 20, longest
    assert max(max(c.seq_lens) for c in drawn) >= 40 and max(c.prompt_len(j) for c in drawn
                                                              for j in range(c.batch_size)) >= 40
    wide = default_axes(model_from(cfg), max_prompt=40, max_response=23)  # 1 + 40 + 23 = 64: allowed
    pairs = hf_pairs("user.wide", cfg, axes=wide)
    assert all(p.axes is wide for p in pairs)
    # a case past them (a repro edited by hand) cannot run, saying why; it had run positions up to 601
    ev = run_case(pairs[0], Case(seed=0, seq_lens=(4, 2), prompt_lens=(60, 1)))
    assert ev.setup and "this case has a sequence of 65 tokens" in ev.error["message"], ev.error
    assert not run_case(pairs[0], Case(seed=0, seq_lens=(3, 2), prompt_lens=(60, 1))).failed  # 1 + 60 + 3 = 64


def test_tied_embeddings_keep_the_body_dtype_when_only_the_head_differs():
    """A tied LM head (tie_word_embeddings: most small real checkpoints) in its own dtype gets its own
    weight copy: the input embedding stays in the body dtype, and a bf16 body with a float32 head runs."""
    cfg = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    for trainer, rollout in ((FP32, FP32.replace(lm_head="bfloat16")), (FP32, BF16.replace(lm_head="float32"))):
        pair = hf_pair("user.tied", cfg, trainer, rollout, expected="diverges")
        ev = run_case(pair, rl_case(seed=2))
        assert ev.error is None and math.isfinite(ev.k3) and ev.k3 > 0, ev.error
        runner = path_model(pair.profiles.model, rollout.model_key, "cpu")
        assert runner.model.get_input_embeddings().weight.dtype == getattr(torch, rollout.body)
        assert runner.head.weight.dtype == getattr(torch, rollout.lm_head)
    same = path_model(pair.profiles.model, FP32.model_key, "cpu").model  # tied and one dtype: still tied
    assert same.get_input_embeddings().weight is same.get_output_embeddings().weight


# MoE model types of transformers, one per router family (see targets.hf.backend.gate_weights)
ROUTER_FAMILIES = ("qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "ernie4_5_moe")
_SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_experts=8, num_local_experts=8,
              n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256, first_k_dense_replace=0,
              shared_expert_intermediate_size=16, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16,
              q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, decoder_sparse_step=1,
              moe_layer_start_index=0, mlp_only_layers=[], tie_word_embeddings=False, norm_topk_prob=False)


def small_moe(model_type: str) -> dict:
    fields = transformers.AutoConfig.for_model(model_type).to_dict()
    return {"model_type": model_type, **{k: v for k, v in _SMALL.items() if k in fields}}


@pytest.mark.parametrize("model_type", ROUTER_FAMILIES)
def test_replay_weights_are_the_routers_own_for_each_router_family(model_type):
    """`gate_weights` gives the weights each family's router gives its own choice (softmax or sigmoid,
    renormalised or not, routed_scaling_factor), so a replayed flip is weighted as the model would."""
    from targets.hf import HFModel
    from targets.hf.backend import base_model, check_gate_weights, gate_weights, router_modules

    [(_, router)] = router_modules(base_model(HFModel.from_config(small_moe(model_type), init_seed=3)))
    x = torch.randn(64, router.weight.shape[-1], generator=torch.Generator().manual_seed(0))
    logits, weights, idx = router(x)
    torch.testing.assert_close(gate_weights(router, logits, idx), weights.float(), rtol=1e-6, atol=1e-7)
    check_gate_weights(router, logits, idx, weights)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3", "glm4_moe"])
def test_replay_at_identical_numerics_is_clean_for_every_router_family(model_type):
    """Replaying the rollout's experts where the trainer chose the same ones changes nothing (a
    recomputed softmax weight on a sigmoid router diverged far above the line before the router's own
    weights stood)."""
    cfg = small_moe(model_type)
    replayed = hf_pair(f"user.{model_type}.replay", cfg, FP32, FP32, replay=True)
    plain = hf_pair(f"user.{model_type}", cfg, FP32, FP32)
    for seed in range(3):
        case = rl_case(seed=seed, tie_fraction=0.5, tie_gap=1e-3)
        ev = run_case(replayed, case)
        assert ev.error is None and ev.k3 < 1e-8, (ev.k3, ev.error)
        assert ev.k3 == run_case(plain, case).k3


def test_replay_on_a_model_whose_routers_are_not_hooked_says_so():
    ev = run_case(hf_pair("user.jetmoe.replay", small_moe("jetmoe"), FP32, BF16, replay=True), rl_case(seed=1))
    assert ev.error is not None and ev.error["type"] == "ReplayError", ev.error
    assert "JetMoeForCausalLM" in ev.error["message"] and "replay=False" in ev.error["message"]


@pytest.mark.parametrize("model_type", ["granitemoe", "gpt_oss"])
def test_topk_routers_outside_mlp_gate_are_hooked(model_type):
    """GraniteMoE's `block_sparse_moe.router` and gpt-oss's `mlp.router` (a router with a bias): found
    by class, so flips are counted, near ties forced and experts replayed (float32 replay: clean)."""
    from targets.hf import HFModel
    from targets.hf.backend import base_model, router_modules

    cfg = {**small_moe(model_type), "num_hidden_layers": 2}
    if model_type == "gpt_oss":
        cfg["sliding_window"] = 16
    assert len(router_modules(base_model(HFModel.from_config(cfg)))) == 2
    eager = FP32.replace(attention="eager")  # gpt-oss has no sdpa attention in transformers 5.24
    case = Case(seed=1, seq_lens=(5, 3), prompt_lens=(2, 0), tie_fraction=0.5, tie_gap=1e-4)
    ev = run_case(hf_pair(f"user.{model_type}.replay", cfg, eager.replace(packing="per_sequence"), eager,
                          replay=True), case)
    assert ev.error is None and ev.k3 < 1e-8 and ev.divergence.flips_per_layer, (ev.k3, ev.error)


def test_tie_nudge_puts_the_boundary_at_the_gap_with_a_router_bias():
    from targets.hf.backend import tie_nudge

    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(16, 32, generator=g, dtype=torch.float64), torch.randn(8, 32, generator=g, dtype=torch.float64),
               torch.randn(8, generator=g, dtype=torch.float64))
    y = tie_nudge(x, w, torch.ones(16, dtype=torch.bool), 1e-4, 2, b)
    top = torch.topk(y @ w.T + b, 3, dim=-1).values
    torch.testing.assert_close(top[:, 1] - top[:, 2], torch.full((16,), 1e-4, dtype=torch.float64), rtol=1e-6, atol=1e-9)


def test_linear_attention_leaks_across_packed_sequences_and_one_sequence_per_row_does_not():
    """Qwen3-Next's linear-attention layers carry state from one packed sequence into the next in
    transformers' forward: the packed trainer diverges on a two-sequence row, not on one sequence or
    with one sequence per row; triage's swap of `packing` finds it."""
    from harness.triage import localize

    cfg = {**small_moe("qwen3_next"), "num_hidden_layers": 4}  # 3 linear-attention layers, then full attention
    packed = hf_pair("user.qwen3_next.aligned", cfg, FP32, FP32)
    alone = hf_pair("user.qwen3_next.per_sequence", cfg, FP32.replace(packing="per_sequence"), FP32)
    one, two = Case(seed=3, seq_lens=(5,), prompt_lens=(2,)), Case(seed=3, seq_lens=(5, 3), prompt_lens=(2, 0))
    assert run_case(packed, one).k3 < 1e-8 and run_case(alone, two).k3 < 1e-8
    ev = run_case(packed, two)
    assert ev.error is None and ev.k3 > 1e-2, (ev.k3, ev.error)
    loc = localize(packed, two, "cpu", 1e-3, ev.k3)
    assert loc is not None and loc.minimal == ["packing"] and loc.explained, loc


def test_a_bf16_checkpoint_is_held_in_bf16_and_each_path_casts_its_own_copy(tmp_path):
    import copy

    from targets.hf import HFModel
    from targets.hf.backend import base_model

    cfg = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    copy.deepcopy(base_model(HFModel.from_config(cfg))).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    spec = HFModel.from_pretrained(tmp_path / "ckpt")
    base = dict(base_model(spec).named_parameters())
    assert {p.dtype for p in base.values()} == {torch.bfloat16}  # half the host memory of float32
    fp32 = dict(path_model(spec, FP32.model_key, "cpu").model.named_parameters())
    assert all(fp32[n].dtype == torch.float32 and torch.equal(fp32[n], p.float()) for n, p in base.items())
    assert run_case(hf_pair("user.ckpt", str(tmp_path / "ckpt"), FP32, FP32), rl_case(seed=1)).k3 < 1e-8


def test_a_model_without_sdpa_attention_says_which_attention_to_use():
    cfg = dict(model_type="gemma2", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
    ev = run_case(hf_pair("user.gemma2", cfg, FP32, FP32), rl_case(seed=1))
    assert ev.error is not None and ev.error["type"] == "UsageError", ev.error
    assert "attention='sdpa'" in ev.error["message"] and "attention='eager'" in ev.error["message"]
    assert "hf_pairs(prefix, model, base=FP32.replace(attention='eager'))" in ev.error["message"]
    assert "yet.)" in ev.error["message"] or "https://" not in ev.error["message"]  # a whole sentence, no cut URL
    eager = FP32.replace(attention="eager")
    assert run_case(hf_pair("user.gemma2.eager", cfg, eager, eager), rl_case(seed=1)).k3 < 1e-8
    # the standard set on that base: every pair runs, and no eager-vs-sdpa pair (there is no sdpa)
    from targets.hf import hf_pairs

    std = {p.name: p for p in hf_pairs("user.gemma2.std", cfg, base=eager)}
    assert sorted(std) == ["user.gemma2.std.aligned", "user.gemma2.std.bf16_rollout"]
    assert run_case(std["user.gemma2.std.aligned"], rl_case(seed=1)).k3 < 1e-8
    assert run_case(std["user.gemma2.std.bf16_rollout"], rl_case(seed=1)).error is None
    with pytest.raises(UsageError, match="must be a Numerics"):
        hf_pairs("user.gemma2.bad", cfg, base="eager")


def test_a_config_its_own_model_cannot_run_is_a_pair_that_cannot_run_not_a_regression(tmp_path):
    """DeepSeek-V3 with n_group=3 over 8 experts raises inside the router's view on every case: the
    model's own forward fails, so the pair cannot run (a setup error), nothing goes to the corpus."""
    cfg = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8,
               num_experts_per_tok=2, n_group=3, topk_group=1, first_k_dense_replace=0, max_position_embeddings=256,
               q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
               tie_word_embeddings=False)
    pair = hf_pair("user.ds_bad_groups", cfg, FP32, FP32)
    ev = run_case(pair, rl_case(seed=1))
    assert ev.setup and "fails its own plain forward" in ev.error["message"], ev.error
    result = run_campaign(CampaignConfig(pairs=[pair], seed=1, max_examples=5, corpus=tmp_path))
    assert not list(tmp_path.rglob("*.json"))
    assert "fails its own plain forward" in result.results[0].setup_error and not result.results[0].findings


def test_an_encoder_is_a_pair_that_cannot_run_not_a_regression(tmp_path):
    """transformers builds BERT as a causal LM (BertLMHeadModel) whose tokens attend to later ones: every
    case would diverge by construction. The base model's causality probe says so (a setup error); the
    same config as a decoder (is_decoder=True) runs, aligned."""
    cfg = dict(model_type="bert", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, max_position_embeddings=256)
    pair = hf_pair("user.bert_encoder", cfg, FP32, FP32)
    ev = run_case(pair, rl_case(seed=1))
    assert ev.setup and "is not a causal language model" in ev.error["message"], ev.error
    assert "is_decoder=True" in ev.error["message"]
    result = run_campaign(CampaignConfig(pairs=[pair], seed=1, max_examples=5, corpus=tmp_path))
    assert not list(tmp_path.rglob("*.json"))
    assert "not a causal language model" in result.results[0].setup_error and not result.results[0].findings
    decoder = hf_pair("user.bert_decoder", {**cfg, "is_decoder": True}, FP32, FP32)
    ev = run_case(decoder, rl_case(seed=1))
    assert not ev.setup, ev.error


def test_a_config_transformers_refuses_to_build_is_a_pair_that_cannot_run_naming_the_reason(tmp_path):
    """transformers validates a config when it is built (in the worker, at the first case, so that
    listing pairs imports no transformers): heads that do not divide the hidden size were a
    regression of every aligned pair, with the reason only in the repro's traceback."""
    cfg = dict(model_type="llama", vocab_size=256, hidden_size=66, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2)
    pair = hf_pair("user.llama_bad_heads", cfg, FP32, FP32)
    result = run_campaign(CampaignConfig(pairs=[pair], seed=1, max_examples=5, corpus=tmp_path))
    (r,) = result.results
    assert r.verdict == "CANNOT RUN" and not r.findings and not list(tmp_path.rglob("*.json"))
    assert "cannot be built by transformers" in r.setup_error and "not a multiple" in r.setup_error, r.setup_error


def test_a_config_built_sigmoid_router_has_a_selection_bias_a_rollout_without_it_diverges():
    """realistic_init draws DeepSeek-V3's `e_score_correction_bias` (a buffer the model starts at 0,
    non-zero in every trained checkpoint): at 0, a rollout whose weight sync drops it selected
    exactly the trainer's experts and such a bug could never be caught on a config-built model."""
    from targets.hf import HFModel, register_patch
    from targets.hf.backend import base_model, router_modules

    cfg = {**small_moe("deepseek_v3"), "num_hidden_layers": 2}
    spec = HFModel.from_config(cfg, init_seed=4)
    biases = [r.e_score_correction_bias for _, r in router_modules(base_model(spec))]
    assert len(biases) == 2 and all(0.03 < float(b.std()) < 0.3 for b in biases), biases

    def drop_bias(model):  # (a weight sync that leaves the buffer out: the engine's stays at 0)
        for module in model.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.zero_()

    register_patch("test.drop_selection_bias", drop_bias)
    pair = hf_pair("user.dsv3.no_bias", spec, FP32, FP32.replace(patch="test.drop_selection_bias"), expected="diverges")
    judged = [run_case(pair, rl_case(seed=seed)).k3 for seed in range(3)]
    assert max(judged) > 1e-2, judged
    assert run_case(hf_pair("user.dsv3.aligned", spec, FP32, FP32), rl_case(seed=0)).k3 < 1e-8
    # triage names the router's choice (its experts), not the weights that follow from it
    from harness.corpus import Repro
    from harness.triage import triage

    from harness.pairs import Registry

    own = Registry()
    own.register(pair)
    repro = Repro(path=None, id="nb", pair=pair.name, symptom="divergence", signature="", status="expected",
                  threshold=1e-3, case=rl_case(seed=0), metrics={}, error=None, environment={}, loader={}, found={})
    t = triage(repro, registry=own)
    assert t.first_module == "model.layers.0.mlp.gate[2]", (t.first_module, [(m.name, m.error) for m in t.modules][:12])


@pytest.mark.parametrize("groups", [1, 2])
def test_near_ties_sit_at_a_sigmoid_routers_own_selection_boundary(groups):
    """DeepSeek-V3 / GLM-4.5 routers rank experts by sigmoid(logit) + a selection bias, within the
    groups they keep: a nudge to +gap / -gap puts the pair's higher / lower expert into the router's
    own choice (a nudge on raw logits missed the boundary once the bias is not 0)."""
    from targets.hf import HFModel
    from targets.hf.backend import base_model, boundary_gap, router_modules, selection_scores, tie_nudge

    cfg = {**small_moe("deepseek_v3"), "n_group": groups, "topk_group": 1}
    [(_, router)] = router_modules(base_model(HFModel.from_config(cfg, init_seed=groups)))
    g = torch.Generator().manual_seed(7)
    bias = 0.3 * torch.randn(router.e_score_correction_bias.shape, generator=g)
    own = router.e_score_correction_bias.clone()  # (the shared model's own, drawn by realistic_init)
    router.e_score_correction_bias.copy_(bias)
    try:
        x = torch.randn(64, router.weight.shape[-1], generator=g)
        k, every = int(router.top_k), torch.ones(64, dtype=torch.bool)
        for gap in (1e-4, -1e-4):
            y = tie_nudge(x.double(), router.weight, every, gap, k, router=router)
            at = (boundary_gap(y, router.weight, k, router=router) - abs(gap)).abs() < 1e-9  # on the boundary
            # every row with one group; with two, a row whose move changes the kept group may not be
            assert int(at.sum()) == 64 if groups == 1 else int(at.sum()) >= 56, int(at.sum())
            top = torch.topk(selection_scores(router, y @ router.weight.double().T), k + 1).indices[at]
            first, second = top[:, k - 1], top[:, k]  # the k-th and (k+1)-th by selection score
            assert bool((first > second).all() if gap > 0 else (first < second).all())  # who leads: the gap's sign
            chosen = router(y.float())[2][at]  # the router's own experts, (rows, k)
            assert bool((chosen == first[:, None]).any(-1).all()) and not bool((chosen == second[:, None]).any(-1).any())
    finally:
        router.e_score_correction_bias.copy_(own)


def test_a_natural_router_near_tie_is_not_decided_by_layout_noise(monkeypatch):
    """A case a campaign found: float32 eager vs sdpa, no forced ties, one position whose natural
    top-k boundary gap (~1e-7) is under the paths' layout noise; its expert flipped and the case
    read k3 0.13 (on the machine that found it: whether noise of that size flips it depends on the
    CPU's kernels). Natural gaps under TIE_FLOOR are raised to it as forced ties are: clean, and the
    rollout says where it raised one; without the floor nothing is raised (a flip, where this
    machine's noise makes one, reads k3 0.13 there)."""
    from targets.hf import paths

    case = Case(seed=1680253565, seq_lens=(5,), prompt_lens=(6,), seq_ids=(26800,), params={"tie_layer": 1})
    pair = REGISTRY.get("hf.qwen3_moe.eager_vs_sdpa")
    ev = run_case(pair, case, keep_outcomes=True)
    assert ev.k3 < 1e-8 and not any(v["flips"] for v in ev.divergence.flips_per_layer.values()), ev.divergence
    raised = ev.rollout.intermediates["tie_floor_at"]
    assert sum(len(v) for v in raised.values()) >= 1, raised  # the natural gap was under the floor
    make = paths.make_inputs

    def without_floor(*args, **kwargs):
        inp = make(*args, **kwargs)
        inp.tie_floor = False
        return inp

    monkeypatch.setattr(paths, "make_inputs", without_floor)
    ev = run_case(pair, case, keep_outcomes=True)
    assert not any(len(v) for v in ev.rollout.intermediates["tie_floor_at"].values())
    if not any(v["flips"] for v in ev.divergence.flips_per_layer.values()):
        assert ev.k3 < 1e-8, ev.divergence  # no flip: the paths agree as with the floor


def test_replay_refuses_a_router_whose_weights_it_cannot_recompute():
    from targets.hf.backend import ReplayError, check_gate_weights

    class Odd(torch.nn.Module):  # weights = the top-k softmax squared: no family gate_weights knows
        top_k = 2

    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    w, idx = torch.softmax(logits, -1).topk(2)
    with pytest.raises(ReplayError, match="Odd.*replay=False"):
        check_gate_weights(Odd(), logits, idx, w * w)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf.qwen3.bf16_rollout", "hf.qwen3_moe.bf16_rollout", "hf.mixtral.bf16_rollout",
                                  "hf.qwen3_moe.packed_cache_trap"])
def test_demonstration_caught_and_shrunk(name, tmp_path):
    cfg = CampaignConfig(pairs=[REGISTRY.get(name)], seed=1, max_examples=100, corpus=tmp_path, write_corpus=False,
                         isolation=False)  # (this process has the model loaded; as isolated: test_fuzz.py)
    (r,) = run_campaign(cfg, log=lambda m: None).results
    assert r.verdict == "caught", (name, r.verdict, r.max_k3)
    (f,) = r.findings
    assert f.case.n_tokens <= 16, f.case.one_line()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf.qwen3_moe.aligned", "hf.qwen3.eager_vs_sdpa"])
def test_aligned_clean(name, tmp_path):
    cfg = CampaignConfig(pairs=[REGISTRY.get(name)], seed=1, max_examples=60, corpus=tmp_path, write_corpus=False,
                         isolation=False)  # (this process has the model loaded; as isolated: test_fuzz.py)
    (r,) = run_campaign(cfg, log=lambda m: None).results
    assert r.verdict == "clean", (name, r.verdict, r.max_k3, [(f.symptom, f.case.one_line(), f.evaluation.error) for f in r.findings])


def test_a_group_limited_routers_kept_groups_are_not_decided_by_layout_noise(monkeypatch):
    """DeepSeek-V3's router keeps `topk_group` of `n_group` groups by their two best selection scores
    (sigmoid + a checkpoint's nonzero bias): a near tie between the last kept and the first dropped
    group flipped experts in an aligned float32 eager-vs-sdpa pair (KL 0.14, a campaign found it in 23
    cases). Such gaps are raised to TIE_FLOOR, the higher group leading, and float32 noise then keeps
    the same groups; the aligned pair stays clean on forced near ties."""
    from targets.hf import HFModel
    from targets.hf.backend import TIE_FLOOR, _group_boundary, base_model, group_gap, group_nudge, router_modules

    cfg = {**small_moe("deepseek_v3"), "n_routed_experts": 64, "num_experts_per_tok": 8, "n_group": 8,
           "topk_group": 4, "num_hidden_layers": 2, "vocab_size": 512, "routed_scaling_factor": 2.5,
           "norm_topk_prob": True, "hidden_size": 256}
    spec = HFModel.from_config(cfg, init_seed=91)
    routers = router_modules(base_model(spec))
    g = torch.Generator().manual_seed(5)
    own = [router.e_score_correction_bias.clone() for _, router in routers]
    for _, router in routers:
        router.e_score_correction_bias.copy_(0.1 * torch.randn(router.e_score_correction_bias.shape, generator=g))
    try:
        _, router = routers[0]
        x = torch.randn(256, router.weight.shape[-1], generator=g, dtype=torch.float64)
        every = torch.ones(256, dtype=torch.bool)
        y = group_nudge(x, router.weight, every, TIE_FLOOR, router=router)
        at = (group_gap(y, router.weight, router=router) - TIE_FLOOR).abs() < 1e-3 * TIE_FLOOR
        assert int(at.sum()) >= 240, int(at.sum())
        logits = y @ router.weight.double().T
        gs, win, run, _ = _group_boundary(router, logits)
        assert bool((gs.gather(1, win[:, None]) > gs.gather(1, run[:, None]))[at].all())  # the higher group leads
        noisy = y + 1e-7 * torch.randn(y.shape, generator=g, dtype=torch.float64)  # float32 layout noise
        kept = [gs.topk(2, -1).indices.sort(-1).values for gs, *_ in
                (_group_boundary(router, z @ router.weight.double().T) for z in (y, noisy))]
        assert torch.equal(kept[0][at], kept[1][at])
        # a forced nudge that ends at the kink where the kept groups change (as its Newton steps do on
        # a checkpoint's router: seen on a DeepSeek-V3 config with a nonzero bias), made certain here
        import targets.hf.backend as backend

        nudge = backend.tie_nudge

        def nudge_to_the_kink(x, w, forced, gap, k, bias=None, rounds=None, router=None, **kw):
            y = nudge(x, w, forced, gap, k, bias, rounds=rounds, router=router, **kw)
            return group_nudge(y, w, forced, 1e-9, bias, router=router) if backend._groups(router) != (1, 1) else y

        monkeypatch.setattr(backend, "tie_nudge", nudge_to_the_kink)
        pair = hf_pair("user.dsv3_groups.eager_vs_sdpa", spec, FP32.replace(attention="eager"), FP32)
        for seed in range(4):
            ev = run_case(pair, rl_case(seed=seed, tie_fraction=0.7, tie_gap=0.0, params={"tie_layer": seed % 2}))
            assert ev.error is None and ev.k3 < 1e-8 and ev.divergence.kl < 1e-8, (seed, ev.divergence)
    finally:
        for (_, router), bias in zip(routers, own):
            router.e_score_correction_bias.copy_(bias)


def test_a_mistyped_model_type_makes_the_pair_unable_to_run_not_a_regression():
    """A config dict's typo shows at its first case: a UsageError (CANNOT RUN, exit 2), not an
    `error` finding of an aligned pair that a nightly would carry as a known regression."""
    from harness.execute import Symptom
    from targets.hf.configs import TINY

    fields = {**TINY["qwen3_moe"], "model_type": "qwen3_mo"}
    pair = hf_pair("typo.aligned", fields)  # registration imports no transformers: nothing checked yet
    ev = run_case(pair, Case(seed=1, seq_lens=(2,)))
    assert ev.symptom == Symptom.ERROR and ev.setup, ev.error
    assert "config model_type 'qwen3_mo' is not a model type transformers" in ev.error["message"]
    assert "did you mean 'qwen3_moe'" in ev.error["message"]
    # a config key that is a near-miss of a field (transformers would keep it unused and build with the
    # default: 8 experts, not the 6 meant) is the same kind of error, naming the field
    mix = {k: v for k, v in TINY["mixtral"].items() if k != "num_local_experts"}
    ev = run_case(hf_pair("typo.key", {**mix, "num_local_expert": 6}), Case(seed=1, seq_lens=(2,)))
    assert ev.symptom == Symptom.ERROR and ev.setup, ev.error
    assert "config key 'num_local_expert' is not a field of transformers' 'mixtral' config (did you mean " \
           "'num_local_experts'?)" in ev.error["message"] and "num_local_experts=8" in ev.error["message"]
    # an unknown model_type reads as dense (nothing of experts known): that type is the error, not "no experts"
    with pytest.raises(UsageError, match="config model_type 'mixtrall' is not a model type"):
        hf_pair("typo.dense", {**mix, "model_type": "mixtrall"}, FP32, FP32.replace(router="bfloat16"))


def test_the_trainer_raises_to_the_tie_floor_where_the_rollout_did_not_where_its_own_gap_says():
    """A natural boundary gap within layout noise of the floor: 0.989e-5 in the rollout (raised, the
    higher expert leading) and 1.037e-5 in the packed trainer (left, the lower leading). Each path
    deciding from its own gap, the aligned float32 pair flipped expert 0 for 4 (k3 0.031); the trainer
    now raises exactly the positions the rollout raised."""
    from targets.hf.configs import TINY

    pair = hf_pair("user.floor_straddle", TINY["qwen3_moe"], FP32, FP32)
    case = Case(seed=3616330962, seq_lens=(1, 1, 1, 10), prompt_lens=(0, 0, 11, 10),
                seq_ids=(65005, 4887, 49332, 35118), pad_side="left", n_experts=8, top_k=2,
                temperature=0.9312812859439159, params={"tie_layer": 0})
    ev = run_case(pair, case)
    assert ev.k3 < 1e-9 and ev.divergence.flip_rate == 0 == ev.divergence.tie_flip_rate, (ev.headline, ev.divergence)


def test_the_head_computes_only_the_rows_each_path_scores():
    """The rollout's LM head runs where it samples: each prompt's last position in the prefill ((B, 1),
    as in each decode step), as engines do. The trainer's runs at every position of its packed
    forward (head_rows "all", the default: a head kernel that changes with the row count is tested),
    or at the response-scoring positions only ((1, T), head_rows "scored": no (positions, V) logits
    for long prompts); the values are alike (float32 noise of another GEMM shape apart), and a model
    that bypasses its output-embeddings module still gets its rows picked."""
    from targets.hf.backend import as_rollout, current_phase
    from targets.hf.paths import make_inputs, rollout, trainer

    cfg = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
               num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)
    scored = FP32.replace(head_rows="scored")
    pair = hf_pair("user.rows", cfg, scored, FP32)
    case = rl_case(seed=5, seq_lens=(3, 6, 2), prompt_lens=(20, 0, 11))
    run = path_model(pair.profiles.model, FP32.model_key, "cpu")
    seen = []
    spy = run.head.register_forward_hook(lambda m, args, out: seen.append((current_phase(), tuple(args[0].shape[:-1]))))
    try:
        inp = make_inputs(case, pair.profiles.model, "cpu")
        ro = rollout(inp, as_rollout(FP32))
        cut = trainer(inp, ro, scored)
        whole = trainer(inp, ro, FP32)
    finally:
        spy.remove()
    seen = [s for s in seen if s[0] != "check"]
    rows = case.packed_rows()
    width = max(sum(1 + case.prompt_len(j) + case.seq_lens[j] for j in row) for row in rows)
    assert seen[0] == ("prefill", (3, 1)) and set(seen[1:-2]) == {("decode", (3, 1))}, seen
    assert seen[-2:] == [("trainer", (1, case.n_tokens)), ("trainer", (len(rows), width))], seen
    # the same trainer with the head's row cut taken out (a model whose forward bypasses its
    # output-embeddings module): every position computed, the rows picked from them
    hooks = run.head._forward_pre_hooks
    key = next(k for k, h in hooks.items() if getattr(h, "__func__", None) is type(run)._keep_rows)
    hook = hooks.pop(key)
    try:
        bypassed = trainer(inp, ro, scored)
    finally:
        hooks[key] = hook
        hooks.move_to_end(key, last=False)
    assert cut.logprobs.shape == whole.logprobs.shape == bypassed.logprobs.shape == (case.n_tokens, 256)
    assert (cut.logprobs - whole.logprobs).abs().max() < 1e-5 and torch.equal(whole.logprobs, bypassed.logprobs)
    ev = run_case(pair, case)
    assert ev.error is None and not ev.failed and ev.k3 < 1e-9, (ev.error, ev.k3)
    assert pair.profiles.trainer["head_rows"] == "scored" and pair.profiles.rollout["head_rows"] == "scored"
    assert hf_pair("user.rows2", cfg).profiles.trainer["head_rows"] == "all"  # (the default)


def test_a_checkpoint_folder_that_is_not_there_makes_pairs_that_cannot_run(tmp_path, capsys, monkeypatch):
    """A plugin naming a checkpoint that is gone (a nightly whose mount is missing) registers its
    pairs, each case of which cannot run and says why (a setup error: CANNOT RUN, nothing recorded),
    so the plugin's other pairs still run; it had stopped the plugin at import."""
    from targets.hf import hf_pairs

    gone = tmp_path / "step-100"
    from targets.hf.pairs import default_axes

    wide = default_axes(gone, max_prompt=96, max_response=64)  # (a plugin widening its pairs' axes)
    assert wide.prompt_len == (0, 96) and wide.routing is None
    pairs = hf_pairs("user.gone", str(gone), axes=wide) + [hf_pair("user.gone_one", gone, expected="diverges")]
    assert [p.name for p in pairs] == ["user.gone.aligned", "user.gone.bf16_rollout", "user.gone.bf16_rollout.replay",
                                       "user.gone.eager_vs_sdpa", "user.gone_one"]
    assert [p.expected for p in pairs] == ["aligned", "diverges", "diverges", "aligned", "diverges"]
    assert pairs[0].axes is wide  # (its axes as given: `harness list` shows them)
    err = capsys.readouterr().err
    assert err.count("is not a checkpoint directory") == 1, err  # once per folder
    for p in pairs:
        ev = run_case(p, Case(seed=0, seq_lens=(1,)))
        assert ev.setup and "is not a checkpoint directory" in ev.error["message"], ev.error
    assert "cannot run: no checkpoint at" in pairs[-1].description
    # `harness score --pair` on one says why it cannot run (it had said "only Hugging Face pairs")
    from harness.errors import UsageError
    from harness.score import resolve_scorer

    monkeypatch.setattr(REGISTRY, "get", {pairs[0].name: pairs[0]}.__getitem__)  # (as a plugin registers it)
    with pytest.raises(UsageError, match="cannot score here: .*is not a checkpoint directory"):
        resolve_scorer(None, pairs[0].name, False)


def test_a_forward_that_reshapes_the_head_output_to_every_position_keeps_them_all(capsys):
    """Code after the head that reshapes its output to (B, S, V) (a model's own, or a module patch's)
    cannot take the rows cut: the path's model is checked once when built, and such a path computes
    every position, its rows picked after; the pair runs as before, with no error of its own."""
    from targets.hf import register_patch
    from targets.hf.backend import PATCHES

    def reshaping(model):
        forward = model.forward

        def patched(*args, input_ids=None, **kwargs):
            out = forward(*args, input_ids=input_ids, **kwargs)
            out.logits = out.logits.reshape(input_ids.shape[0], input_ids.shape[1], -1)  # (fails on cut rows)
            return out

        model.forward = patched

    register_patch("test_reshaping_forward", reshaping)
    try:
        cfg = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
        patched = FP32.replace(patch="test_reshaping_forward")
        pair = hf_pair("user.reshaping", cfg, FP32, patched)
        ev = run_case(pair, rl_case(seed=1))
        assert ev.error is None and not ev.failed and ev.k3 < 1e-9, (ev.error, ev.k3)
        assert not path_model(pair.profiles.model, patched.model_key, "cpu").keeps
        assert "cannot be given only the rows read" in capsys.readouterr().err  # (said, once, when built)
        assert path_model(pair.profiles.model, FP32.model_key, "cpu").keeps
    finally:
        PATCHES.pop("test_reshaping_forward", None)


def test_a_trainer_head_kernel_that_changes_with_the_row_count_is_tested_with_every_position():
    """A trainer's head that takes another code path above 64 rows (a chunked large-batch kernel, here
    one that rounds its logits to bf16): with head_rows "all" (the default) the packed forward's every
    position reaches it and the case diverges; with "scored" the head sees only the scored rows and
    the same case is clean: the choice is the pair's to make, and its profile names it."""
    from targets.hf import register_patch
    from targets.hf.backend import PATCHES

    class RowCountHead(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.inner = head

        def forward(self, x):
            y = self.inner(x)
            return y.bfloat16().float() * self.scale if x.shape[:-1].numel() > self.rows else y

    def patch(rows, scale):
        def apply(model):
            model.lm_head = RowCountHead(model.lm_head)
            model.lm_head.rows, model.lm_head.scale = rows, scale
        return apply

    register_patch("test_row_count_head", patch(64, 1.05))
    register_patch("test_row_count_head4", patch(4, 1.5))
    try:
        cfg = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
        case = rl_case(seed=2, seq_lens=(6, 5), prompt_lens=(40, 30))  # 83 positions, 11 of them scored
        trainer = FP32.replace(patch="test_row_count_head")
        every = run_case(hf_pair("user.rowcount", cfg, trainer, FP32, expected="diverges"), case)
        scored = run_case(hf_pair("user.rowcount_scored", cfg, trainer.replace(head_rows="scored"), FP32,
                                  expected="diverges"), case)
        assert every.error is None and every.failed, (every.error, every.score)
        assert scored.error is None and not scored.failed and scored.k3 < 1e-9, (scored.error, scored.k3)
        # the rollout's head sees a row per sequence: with one sequence a kernel above 4 rows never runs
        # there (the check when its model is built compares shapes, not values: such a kernel keeps its cut)
        rollout = FP32.replace(patch="test_row_count_head4")
        one = run_case(hf_pair("user.rowcount_rollout", cfg, FP32, rollout), rl_case(seed=2, seq_lens=(5,),
                                                                                      prompt_lens=(4,)))
        assert one.error is None and not one.failed and one.k3 < 1e-9, (one.error, one.k3)
        assert path_model(model_from(cfg), rollout.model_key, "cpu").keeps
    finally:
        PATCHES.pop("test_row_count_head", None)
        PATCHES.pop("test_row_count_head4", None)


def test_a_head_a_patch_wrapped_runs_in_its_own_dtype():
    """A module patch that wraps the LM head in a module of its own (no `weight` attribute) on a path
    whose head dtype differs from its body's: the cast goes by the dtype's name, not the module's
    weight (an AttributeError inside the harness had been recorded as the engine's error)."""
    from targets.hf import register_patch
    from targets.hf.backend import PATCHES

    class SoftCap(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.inner = head

        def forward(self, x):
            return 30.0 * torch.tanh(self.inner(x) / 30.0)

    register_patch("test_wrapped_head", lambda model: setattr(model, "lm_head", SoftCap(model.lm_head)))
    try:
        cfg = dict(model_type="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
        rollout = FP32.replace(lm_head="bfloat16", patch="test_wrapped_head")
        ev = run_case(hf_pair("user.wrapped_head", cfg, FP32, rollout, expected="diverges"), rl_case(seed=1))
        assert ev.error is None and math.isfinite(ev.k3) and ev.k3 > 0, ev.error
        assert path_model(model_from(cfg), rollout.model_key, "cpu").keeps
    finally:
        PATCHES.pop("test_wrapped_head", None)


def test_config_mistakes_named_at_registration(tmp_path):
    """A top-k over as many experts as there are was blamed on Axes the user never wrote; a config.json
    given for its folder warned 'until it is there' of a file that is there: both are said now."""
    from targets.hf import HFModel
    from targets.hf.backend import base_model
    from targets.hf.configs import TINY

    cfg = {**TINY["qwen3_moe"], "num_experts_per_tok": TINY["qwen3_moe"]["num_experts"]}
    with pytest.raises(UsageError, match=rf"num_experts_per_tok={cfg['num_experts']} of its {cfg['num_experts']} "
                                         "experts.*fix the config"):
        hf_pair("user.topk_all", cfg, FP32, FP32)
    ckpt = tmp_path / "ckpt"
    base_model(HFModel.from_config(TINY["qwen3"], init_seed=5)).save_pretrained(ckpt)
    with pytest.raises(UsageError, match="is a file of a checkpoint; pass its folder"):
        hf_pair("user.config_json", str(ckpt / "config.json"), FP32, FP32)


def test_a_checkpoint_whose_tensors_do_not_fit_its_config_names_them(tmp_path):
    """A trial's OLMoE checkpoint with num_experts removed from config.json (16 saved, the default 64
    built): the message was transformers' 'You set ignore_mismatched_sizes to False, thus raising an
    error', whose 'above report' its logging level hides."""
    import json

    from harness.errors import UsageError
    from targets.hf import HFModel
    from targets.hf.backend import base_model

    spec = HFModel.from_config({**small_moe("olmoe"), "num_experts": 16}, init_seed=1)
    base_model(spec).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["num_experts"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match=r"its tensors do not fit the model its config.json describes \(model\.layers\.0\."
                                         r"\S+: checkpoint \[16, .*\] vs model \[64, ") as e:
        base_model(HFModel.from_pretrained(tmp_path))
    assert "a config field missing or wrong" in str(e.value)
    assert transformers.logging.get_verbosity() == transformers.logging.ERROR  # (put back as it was)


def test_a_rollout_with_slightly_other_weights_meets_forced_ties_where_the_trainer_does():
    """A rollout running weights 1e-3 off the trainer's (a weight sync one step stale), with router
    replay: forced near ties must not amplify that. Each path's tie nudge moved a row between the two
    experts its own router ranked k-th and (k+1)-th, and where ranks were close the two paths chose
    different pairs and moved the router input far apart (here seeds 4 and 5 read 0.0099 and 0.0154
    forced, 1e-4 plain: reports/scripts/forced_ties_stale.py); the trainer now follows the rollout's pairs."""
    from targets.hf import register_patch
    from targets.hf.configs import TINY

    def stale(model):
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * p.abs().mean() * torch.sign(torch.randn(p.shape, generator=g)))

    register_patch("test_stale_step", stale)
    pair = hf_pair("user.stale.replay", TINY["qwen3_moe"], FP32, FP32.replace(patch="test_stale_step"), replay=True)
    forced, plain = [], []
    for s in range(6):  # (before: seeds 4 and 5 read 0.0099 and 0.0154 forced, 0.0001 plain)
        case = rl_case(seed=s, n_experts=8, top_k=2, params={"tie_layer": 0})
        forced.append(run_case(pair, case.replace(tie_fraction=1.0, tie_gap=0.0)).divergence.k3_expected)
        plain.append(run_case(pair, case).divergence.k3_expected)
    assert max(plain) < 1e-3, plain  # (the bug itself: far under the line on these cases)
    assert max(f / p for f, p in zip(forced, plain)) < 3, (forced, plain)


def test_a_sliding_window_the_cases_never_pass_is_said_and_positions_count_the_first_token(tmp_path, harness_cli):
    """A trial's window bug (sliding_window 32) was MISSED with "its paths agreed to float rounding ...
    check that the rollout really runs what differs": no case was longer than 29 positions. An HF pair
    names its config's window (`size_marks`) and its first token (`lead_tokens`): the campaign says a
    window its cases never passed, and show and triage count positions as the model ran them."""
    from harness.fuzz import PairResult, missed_hint
    from targets.hf import default_axes
    from targets.hf.pairs import size_marks_of

    mistral = dict(model_type="mistral", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, sliding_window=64)
    pair = hf_pair("swa.window_far", mistral, FP32, FP32, axes=default_axes(mistral))
    assert pair.lead_tokens == 1 and pair.size_marks == {"sliding_window": 64}
    assert size_marks_of(model_from(dict(mistral, model_type="qwen2", use_sliding_window=False))) == {}
    lines: list[str] = []
    res = run_campaign(CampaignConfig(pairs=[pair], seed=1, max_examples=3, write_corpus=False, isolation=False),
                       log=lines.append)
    [r] = res.results
    assert 1 < r.longest <= 64 and r.unreached(pair) == "sliding_window 64", r.longest
    assert any(f"its longest sequence, {r.longest} positions, never reached sliding_window 64: nothing past it "
               "was tested" in line for line in lines), lines
    from harness import REGISTRY
    from harness.fuzz import summary_table

    REGISTRY._pairs[pair.name] = pair  # (the final table reads the pair's marks from the registry)
    try:
        assert "never reached sliding_window 64: nothing past it tested" in summary_table(res), summary_table(res)
    finally:
        REGISTRY._pairs.pop(pair.name, None)
    # a mark of one's own kernel beside the config's (a split-KV decode's chunk), kept by triage's rebuilds
    own = hf_pair("swa.splitkv", mistral, FP32, FP32, axes=default_axes(mistral), size_marks={"splitkv_chunk": 48})
    assert own.size_marks == {"sliding_window": 64, "splitkv_chunk": 48}
    assert own.profiles.variant(own.profiles.trainer, own.profiles.rollout).size_marks == own.size_marks
    # a pair's own line and timeout (an accepted gap's), kept by triage's rebuilds and by a checkpoint gone
    import numpy as np

    lined = hf_pair("swa.lined", mistral, FP32, BF16, expected="aligned", threshold=np.float32(0.02), timeout=90)
    assert lined.threshold == pytest.approx(0.02) and type(lined.threshold) is float and lined.timeout == 90.0
    variant = lined.profiles.variant(lined.profiles.trainer, lined.profiles.trainer)
    assert (variant.threshold, variant.timeout) == (lined.threshold, 90.0)
    gone = hf_pair("swa.gone", "/nonexistent/ckpt", threshold=0.05)
    assert gone.threshold == 0.05 and "cannot run" in gone.description
    missed = PairResult(pair.name, "diverges", examples=3, longest=r.longest)
    assert missed_hint(missed, 1e-3, pair).startswith(f"max judged 0: its longest sequence, {r.longest} positions, "
                                                      "never reached sliding_window 64")
    # show and triage: a case past a window of 8, counted with the pair's first token
    from harness.triage import first_over_line

    near = hf_pair("swa.window_near", dict(mistral, sliding_window=8), FP32, BF16, expected="diverges")
    case = Case(seed=3, seq_lens=(2,), prompt_lens=(6,))
    ev = run_case(near, case)
    line = first_over_line(ev.divergence, case, 0.0, near.lead_tokens)
    assert "after a 6-token prompt (offset 6), position 7 of its sequence (1 token(s) the pair puts before each" in line
