"""Module patches: a user's own modules (an engine's MoE kernel) swapped into one path of a real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the HF backend needs transformers: pip install -e '.[hf]'")

import torch  # noqa: E402

from harness.errors import UsageError  # noqa: E402
from targets.hf import FP32, HFModel, Numerics, register_patch  # noqa: E402
from targets.hf.backend import PATCHES, base_model, path_model  # noqa: E402
from targets.hf.configs import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).with_name("plugin_patch.py")


def test_readme_shows_the_patch_plugin_complete():
    assert PLUGIN.read_text().strip() in (ROOT / "README.md").read_text()


def test_a_patch_must_be_registered_before_numerics_name_it_and_names_are_checked():
    with pytest.raises(UsageError, match="not a registered patch.*register_patch"):
        Numerics(patch="never_registered")
    for bad in ("", "none", "has space", "a/b"):
        with pytest.raises(UsageError, match="not a usable patch name"):
            register_patch(bad, lambda m: m)
    with pytest.raises(UsageError, match="must be a function"):
        register_patch("not_callable", 3)

    def first(model):
        return model

    def second(model):
        return model

    try:
        register_patch("test_conflict", first)
        register_patch("test_conflict", first)  # the same function again (a plugin imported twice): fine
        with pytest.raises(UsageError, match="already registered"):
            register_patch("test_conflict", second)
        register_patch("test_lambdas", lambda m: m)
        with pytest.raises(UsageError, match="already registered"):  # two lambdas: two definitions
            register_patch("test_lambdas", lambda m: None)
        assert Numerics(patch="test_conflict").model_key[-1] == "test_conflict"
    finally:
        PATCHES.pop("test_conflict", None)
        PATCHES.pop("test_lambdas", None)


def test_one_plugin_file_imported_under_two_module_names_registers_its_patch_once(tmp_path):
    import importlib.util

    plugin = tmp_path / "engine_plugin.py"
    plugin.write_text("from targets.hf import register_patch\nregister_patch('test_twice', lambda m: None)\n")
    try:
        for name in ("engine_plugin", "harness_plugin_engine_plugin"):  # another plugin imports it by its name
            spec = importlib.util.spec_from_file_location(name, plugin)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
    finally:
        PATCHES.pop("test_twice", None)


def test_the_patch_changes_only_its_own_paths_copy_and_the_routers_stay_hooked():
    seen = []

    def mark(model):
        seen.append(model)
        model.patched_by_test = True

    register_patch("test_mark", mark)
    try:
        spec = HFModel.from_config(TINY["qwen3_moe"], init_seed=5)
        patched = path_model(spec, FP32.replace(patch="test_mark").model_key, "cpu")
        plain = path_model(spec, FP32.model_key, "cpu")
        assert seen == [patched.model] and getattr(patched.model, "patched_by_test", False)
        assert not hasattr(plain.model, "patched_by_test") and not hasattr(base_model(spec), "patched_by_test")
        assert len(patched.gates) == len(plain.gates) == TINY["qwen3_moe"]["num_hidden_layers"]
    finally:
        PATCHES.pop("test_mark", None)


def test_an_engine_kernel_patched_into_the_rollout_is_caught_and_triage_names_the_patch(tmp_path, harness_cli):
    """The README's plugin, in isolated workers (the default): the worker imports the plugin, which
    registers the patches before its pairs name them."""
    code, out, err = harness_cli("fuzz", "patched.*", "--plugin", str(PLUGIN), "--max-examples", "30", "--seed", "1",
                                 "--no-tracking", "--corpus", str(tmp_path / "corpus"), timeout=600)
    assert code == 1, out + err  # a finding (the demonstration's) ...
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("patched.")}
    assert "caught" in lines["patched.bf16_combine"] and "clean" in lines["patched.reference"], out  # ... only
    [repro] = (tmp_path / "corpus" / "patched.bf16_combine").glob("*.json")
    code, out, err = harness_cli("replay", "--plugin", str(PLUGIN), str(repro))
    assert code == 1 and "bit-for-bit yes" in out, out + err
    code, out, err = harness_cli("triage", "--plugin", str(PLUGIN), str(repro), "--no-tracking", "--json",
                                 "--reports", str(tmp_path / "reports"), timeout=600)
    assert code == 0, out + err
    result = json.loads(out[out.index("{"):])
    text = json.dumps(result)
    assert "module patch 'bf16_combine' on the rollout" in text and "mlp.experts" in text, text[:3000]


class _DecodeBatchKernel(torch.nn.Module):
    """An engine's experts whose decode kernel for more than 8 sequences (past its captured batch
    sizes) weights and sums expert outputs in bf16; `decode_batch` is set by the model patch."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.decode_batch = experts, 0

    def forward(self, hidden, top_k_index, top_k_weights):
        if self.decode_batch <= 8:
            return self.inner(hidden, top_k_index, top_k_weights)
        e, out = self.inner, torch.zeros(hidden.shape, dtype=torch.bfloat16)
        for x in top_k_index.unique().tolist():
            tok, rank = torch.where(top_k_index == x)
            gate, up = torch.nn.functional.linear(hidden[tok], e.gate_up_proj[x]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(e.act_fn(gate) * up, e.down_proj[x])
            out.index_add_(0, tok, (y * top_k_weights[tok, rank, None]).bfloat16())
        return out.to(hidden.dtype)


def _decode_batch_kernel(model):
    from targets.hf import current_phase

    kernels = []
    for layer in model.model.layers:
        layer.mlp.experts = _DecodeBatchKernel(layer.mlp.experts)
        kernels.append(layer.mlp.experts)
    forward = model.forward

    def patched(*args, input_ids=None, **kwargs):
        decoding = current_phase() == "decode"  # (one token per sequence; a one-token prefill is not decode)
        for k in kernels:
            k.decode_batch = input_ids.shape[0] if decoding else 0
        return forward(*args, input_ids=input_ids, **kwargs)

    model.forward = patched


def test_a_decode_batch_bug_in_a_real_models_rollout_is_found_at_nine_sequences(tmp_path):
    """The HF pairs' axes reach past decode batch 8 (up to 16 sequences), where engines switch
    kernels; the finding shrinks to the smallest batch that still triggers it."""
    from harness.fuzz import CampaignConfig, run_campaign
    from targets.hf import hf_pair

    register_patch("test_decode_batch", _decode_batch_kernel)
    try:
        pair = hf_pair("user.decode_batch", TINY["qwen3_moe"], FP32, FP32.replace(patch="test_decode_batch"),
                       expected="diverges")
        result = run_campaign(CampaignConfig(pairs=[pair], seed=1, max_examples=100, corpus=tmp_path,
                                             write_corpus=False))
        [finding] = result.findings
        assert finding.evaluation.case.batch_size == 9, finding.evaluation.case.one_line()
    finally:
        PATCHES.pop("test_decode_batch", None)


@pytest.mark.parametrize("body,words", [
    ("    model.model.layers[0].block_sparse_moe.gate = None\n", "raised AttributeError"),
    ("    return {'not': 'a module'}\n", "returned a dict; a patch changes the model in place"),
    # a replacement module that is no transformers model: no get_output_embeddings() to hook
    ("    import torch\n    return torch.nn.Sequential(model.model, model.lm_head)\n",
     "whose get_output_embeddings() gives no LM head module"),
])
def test_a_broken_patch_is_a_pair_that_cannot_run_not_a_finding(tmp_path, body, words):
    from harness.fuzz import CampaignConfig, run_campaign
    from targets.hf import hf_pair

    name = f"test_broken_{len(body)}"
    ns: dict = {}
    exec(f"def broken(model):\n{body}", ns)
    register_patch(name, ns["broken"])
    try:
        pair = hf_pair(f"user.{name}", TINY["qwen3_moe"], FP32, FP32.replace(patch=name), expected="aligned")
        cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=3, corpus=tmp_path / "c")
        [r] = run_campaign(cfg, log=lambda msg: None).results
        assert r.verdict == "CANNOT RUN" and not r.findings, (r.verdict, r.findings)
        assert f"module patch {name!r}" in r.setup_error and words in r.setup_error, r.setup_error
        assert not list((tmp_path / "c").rglob("*.json"))
    finally:
        PATCHES.pop(name, None)


class _FusedMoe(torch.nn.Module):
    """Qwen3-MoE's block, the same arithmetic, its router a plain Linear named `router` (as many
    engines have it): no `gate` module for the harness's router hooks."""

    def __init__(self, block):
        super().__init__()
        self.router = torch.nn.Linear(block.gate.hidden_dim, block.gate.num_experts, bias=False)
        self.router.weight = block.gate.weight
        self.k, self.norm, self.experts = block.gate.top_k, block.gate.norm_topk_prob, block.experts

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        top, idx = torch.topk(torch.softmax(self.router(x), dtype=torch.float, dim=-1), self.k, dim=-1)
        if self.norm:
            top = top / top.sum(-1, keepdim=True)
        return self.experts(x, idx, top).reshape(b, s, h)


def test_a_patch_that_hides_the_rollouts_routers_gets_no_one_sided_near_ties(capsys):
    """The near-tie nudge and the tie floor act through the router hooks: with the rollout's routers
    fused away they moved the trainer's router input alone, and an engine with the model's own
    arithmetic was a regression (k3 1.8e-3 at tie_fraction 0.57). Now neither path's input is moved,
    with a warning; router replay, with no rollout experts to replay, cannot run."""
    from harness import Case
    from harness.execute import Symptom, run_case
    from targets.hf import hf_pair

    def fuse(model):
        for layer in model.model.layers:
            layer.mlp = _FusedMoe(layer.mlp)

    register_patch("test_fused_router", fuse)
    try:
        rollout = FP32.replace(patch="test_fused_router")
        pair = hf_pair("user.fused_router", TINY["qwen3_moe"], FP32, rollout, expected="aligned")
        cases = [Case(seed=s, seq_lens=(3, 2), prompt_lens=(2, 1), n_experts=8, top_k=2, tie_fraction=1.0,
                      tie_gap=0.0, params={"tie_layer": s % 2}) for s in range(4)]
        for case in cases:
            ev = run_case(pair, case)
            assert ev.symptom is Symptom.NONE and ev.divergence.k3_expected < 1e-9, (case, ev.headline)
        err = capsys.readouterr().err
        assert err.count("user.fused_router: the trainer's copy of the model has hooked routers at layers.0, "
                         "layers.1 and the rollout's at no layer") == 1, err
        replayed = hf_pair("user.fused_router.replay", TINY["qwen3_moe"], FP32, rollout, expected="aligned",
                           replay=True)
        ev = run_case(replayed, cases[0])
        assert ev.symptom is Symptom.ERROR and ev.setup and "no experts to replay" in ev.error["message"], ev.error
    finally:
        PATCHES.pop("test_fused_router", None)


def test_a_patch_reads_which_forward_runs_and_a_one_token_prefill_is_not_decode():
    from harness import Case
    from harness.execute import run_paths
    from targets.hf import current_phase, hf_pair

    seen = []

    def watch(model):
        forward = model.forward

        def patched(*args, input_ids=None, **kwargs):
            seen.append((current_phase(), tuple(input_ids.shape)))
            return forward(*args, input_ids=input_ids, **kwargs)

        model.forward = patched

    register_patch("test_phase", watch)
    try:
        pair = hf_pair("user.phase", TINY["qwen3"], FP32.replace(patch="test_phase"), FP32.replace(patch="test_phase"))
        run_paths(pair, Case(seed=1, seq_lens=(3, 2)), "cpu")  # no prompt: a one-token prefill per sequence
        # (the forward that checks, when the path's model is built, that its head may be given cut rows)
        assert seen[:1] == [("check", (1, 6))], seen
        assert seen[1:] == [("prefill", (2, 1)), ("decode", (2, 1)), ("decode", (2, 1)), ("trainer", (1, 7))], seen
        assert current_phase() == ""
    finally:
        PATCHES.pop("test_phase", None)


def test_a_patch_reads_the_cases_sampling_and_a_temperature_applied_twice_is_caught():
    """`current_sampling()` gives a module patch the case's temperature / top-k / top-p during each
    forward: a rollout head that divides its logits by the temperature, which the sampler then
    applies again (temperature twice), diverges at T = 0.7 and is clean at T = 1."""
    from harness import Case
    from harness.execute import run_case
    from targets.hf import current_sampling, hf_pair

    seen = []

    class TwiceHead(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.inner = head

        def forward(self, x):
            s = current_sampling()
            seen.append(s)
            return self.inner(x) / s.temperature

    register_patch("test_temperature_twice", lambda model: setattr(model, "lm_head", TwiceHead(model.lm_head)))
    try:
        pair = hf_pair("user.twice", TINY["qwen3"], FP32, FP32.replace(patch="test_temperature_twice"),
                       expected="diverges")
        hot = run_case(pair, Case(seed=1, seq_lens=(6, 4), prompt_lens=(3, 2), temperature=0.7))
        assert hot.error is None and hot.failed, (hot.error, hot.score)
        assert {(s.temperature, s.top_k, s.top_p) for s in seen} == {(0.7, 0, 1.0), (1.0, 0, 1.0)}  # (and the check's)
        assert path_model(pair.profiles.model, FP32.replace(patch="test_temperature_twice").model_key, "cpu").keeps
        plain = run_case(pair, Case(seed=1, seq_lens=(6, 4), prompt_lens=(3, 2), temperature=1.0))
        assert plain.error is None and not plain.failed, plain.score
        assert current_sampling() is None
    finally:
        PATCHES.pop("test_temperature_twice", None)


def test_a_patch_that_changes_nothing_is_named_and_one_that_changes_anything_is_not(capsys):
    """A typo in what a patch selects (`hasattr(layer.mlp, "expert")`) replaced nothing, and its pair
    was certified aligned without a word."""
    def typo(model):
        for layer in model.model.layers:
            if hasattr(layer.mlp, "expert"):  # (the experts are `experts`)
                layer.mlp = torch.nn.Identity()

    def scale(model):  # an attribute the forward reads
        model.model.layers[0].self_attn.scaling *= 1.0001

    def flag(model):  # a flag on the model object itself
        model.patched_by_test = True

    def hook(model):  # a forward hook that edits the head's logits (a trial's top-p bug was planted so)
        model.get_output_embeddings().register_forward_hook(lambda mod, args, out: out * 1.0001)

    def pre_hook(model):
        model.model.layers[0].mlp.register_forward_pre_hook(lambda mod, args: args)

    def sync(model):  # a correct weight sync: the same values written back (a trial's healthy pair was warned)
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})

    spec = HFModel.from_config(TINY["qwen3_moe"], init_seed=5)
    for name, fn, idle in (("test_typo", typo, True), ("test_scale", scale, False), ("test_flag", flag, False),
                           ("test_hook", hook, False), ("test_pre_hook", pre_hook, False), ("test_sync", sync, False)):
        register_patch(name, fn)
        try:
            capsys.readouterr()
            path_model(spec, FP32.replace(patch=name).model_key, "cpu")
            err = capsys.readouterr().err
            assert (f"module patch {name!r}" in err and "changed nothing the harness can see" in err) == idle, err
        finally:
            PATCHES.pop(name, None)


def test_an_engines_own_sampler_is_a_component_caught_and_localized():
    """`register_sampler`: an engine's temperature / top-p code in a path. One that scales the
    log-softmax by the temperature (normalised: the same distribution, KL 0; every importance ratio
    off) is caught on its expected k3 and triage's swap of `sampler` finds it; one that keeps one
    nucleus token too few is caught on the KL; a re-implementation of the exact sampler is aligned."""
    import dataclasses
    import math

    from harness.case import Case
    from harness.execute import run_case
    from harness.triage import localize
    from targets.hf import default_axes, hf_pair, register_sampler
    from targets.hf.backend import SAMPLERS, process_logits

    def late_temperature(logits, temperature, top_k, top_p):
        return torch.log_softmax(logits, -1) / temperature

    def nucleus_one_short(logits, temperature, top_k, top_p):
        lp = torch.log_softmax(logits / temperature, -1)
        if top_p < 1.0:
            srt, order = torch.sort(lp, -1, descending=True)
            kept = ((torch.cumsum(srt.exp(), -1) - srt.exp()) < top_p).sum(-1, keepdim=True)  # (N, 1)
            drop = torch.arange(lp.shape[-1]) >= (kept - 1).clamp_min(1)  # the smallest kept token dropped too
            lp = torch.log_softmax(lp.masked_fill(drop.scatter(-1, order, drop), -math.inf), -1)
        return lp

    def engine_exact(logits, temperature, top_k, top_p):
        return process_logits(logits.clone(), temperature, top_k, top_p)

    spec = HFModel.from_config(TINY["qwen3"], init_seed=3)
    axes = dataclasses.replace(default_axes(spec), top_p=(0.5, 1.0))
    try:
        for name, fn in (("test_late_temperature", late_temperature), ("test_nucleus_one_short", nucleus_one_short),
                         ("test_engine_exact", engine_exact)):
            register_sampler(name, fn)
        with pytest.raises(UsageError, match="not a registered sampler"):
            FP32.replace(sampler="test_nope")
        hot = Case(seed=4, seq_lens=(6, 3), prompt_lens=(3, 2), temperature=0.7)
        late = hf_pair("sampled.late_temperature", spec, FP32, FP32.replace(sampler="test_late_temperature"), axes=axes)
        ev = run_case(late, hot)
        assert ev.failed and ev.divergence.fired == "k3" and ev.divergence.kl < 1e-6, ev.divergence
        loc = localize(late, hot, "cpu", 1e-3, ev.score)
        assert loc is not None and loc.minimal == ["sampler"] and loc.explained, loc
        assert "sampler 'test_late_temperature' on the rollout" in late.profiles.labels["sampler"]
        assert not run_case(late, dataclasses.replace(hot, temperature=1.0)).failed  # (T = 1: no bug to see)
        # as an engine that reports its sampled tokens' log-probabilities only: caught on those, and
        # triage's variants are rebuilt the same way (`sampled_tokens_only`)
        from harness import sampled_tokens_only

        only = sampled_tokens_only(late)
        ev = run_case(only, hot)
        assert ev.failed and ev.divergence.rows == "two_outcome", ev.divergence
        loc = localize(only, hot, "cpu", 1e-3, ev.score)
        assert loc is not None and loc.minimal == ["sampler"] and loc.explained, loc
        assert only.profiles.variant(only.profiles.rollout, only.profiles.rollout).name == only.name
        short = hf_pair("sampled.nucleus", spec, FP32, FP32.replace(sampler="test_nucleus_one_short"), axes=axes)
        ev = run_case(short, dataclasses.replace(hot, top_p=0.6, temperature=1.0))
        assert ev.failed and ev.divergence.kl > 1e-3, ev.divergence
        exact = hf_pair("sampled.exact", spec, FP32, FP32.replace(sampler="test_engine_exact"), axes=axes)
        assert not run_case(exact, dataclasses.replace(hot, top_p=0.6)).failed
    finally:
        for name in ("test_late_temperature", "test_nucleus_one_short", "test_engine_exact"):
            SAMPLERS.pop(name, None)


def test_a_sampler_gets_the_cases_min_p_where_it_takes_one_and_one_that_cannot_is_refused_not_run():
    """min-p reaches a registered sampler as `min_p=` where it has that parameter (or **kwargs); one
    of four arguments runs cases of min-p 0 and refuses the others with a setup error that says what
    to add; the exact sampler cuts by min-p, so an engine that ignores it is caught."""
    import dataclasses

    from harness.case import Case
    from harness.execute import Symptom, run_case
    from targets.hf import default_axes, hf_pair, register_sampler
    from targets.hf.backend import SAMPLER_KEYWORDS, SAMPLERS, process_logits

    def four_args(logits, temperature, top_k, top_p):
        return process_logits(logits.clone(), temperature, top_k, top_p)

    def with_min_p(logits, temperature, top_k, top_p, min_p=0.0):
        return process_logits(logits.clone(), temperature, top_k, top_p, min_p)

    def ignores_min_p(logits, temperature, top_k, top_p, **kwargs):
        return process_logits(logits.clone(), temperature, top_k, top_p)

    spec = HFModel.from_config(TINY["qwen3"], init_seed=3)
    axes = dataclasses.replace(default_axes(spec), min_p=(0.0, 0.3))
    names = ("test_four_args", "test_with_min_p", "test_ignores_min_p")
    try:
        for name, fn in zip(names, (four_args, with_min_p, ignores_min_p)):
            register_sampler(name, fn)
        assert [SAMPLER_KEYWORDS[n] for n in names] == [frozenset(), frozenset({"min_p"}), None]
        case = Case(seed=4, seq_lens=(6, 3), prompt_lens=(3, 2), temperature=0.8, min_p=0.2)
        pairs = {n: hf_pair(f"sampled.{n}", spec, FP32, FP32.replace(sampler=n), axes=axes) for n in names}
        assert not run_case(pairs["test_with_min_p"], case).failed
        ev = run_case(pairs["test_four_args"], case)
        assert ev.symptom == Symptom.ERROR and ev.setup and "takes no min_p" in ev.error["message"], ev.error
        assert "add a `min_p=...` parameter" in ev.error["message"]
        assert not run_case(pairs["test_four_args"], case.replace(min_p=0.0)).failed
        ev = run_case(pairs["test_ignores_min_p"], case)  # samples tokens the trainer's min-p cuts
        assert ev.failed and ev.divergence.kl_excluded > 0, ev.divergence
    finally:
        for name in names:
            SAMPLERS.pop(name, None)
            SAMPLER_KEYWORDS.pop(name, None)


def test_penalties_read_each_rows_history_on_both_paths_and_a_sampler_that_drops_them_is_caught():
    """Repetition, presence and frequency penalties: the rollout's decode steps and the trainer's packed
    rows read the same history (prompt, then the response so far), so an aligned pair stays aligned
    with them on; an engine whose sampler drops the presence penalty is caught, and a campaign shrinks
    it to a case with the presence penalty on and the rest neutral."""
    import dataclasses

    from harness.case import Case
    from harness.execute import run_case
    from harness.fuzz import CampaignConfig, fuzz_pair, pair_seed
    from targets.hf import default_axes, hf_pair, register_sampler
    from targets.hf.backend import SAMPLER_KEYWORDS, SAMPLERS, process_logits

    def no_presence(logits, temperature, top_k, top_p, **kw):
        return process_logits(logits.clone(), temperature, top_k, top_p, **{**kw, "presence_penalty": 0.0})

    spec = HFModel.from_config(TINY["qwen3"], init_seed=3)
    axes = dataclasses.replace(default_axes(spec), n_seqs=(1, 3), seq_len=(1, 8), repetition_penalty=(1.0, 1.5),
                               presence_penalty=(0.0, 2.0), frequency_penalty=(0.0, 1.0))
    try:
        register_sampler("test_no_presence", no_presence)
        # (a presence penalty moves only the mass of tokens already sampled: a small one reads a small k3)
        case = Case(seed=4, seq_lens=(9, 5), prompt_lens=(3, 2), temperature=0.9, repetition_penalty=1.3,
                    presence_penalty=1.5, frequency_penalty=0.4)
        aligned = hf_pair("pen.aligned", spec, FP32, FP32, axes=axes)
        ev = run_case(aligned, case)
        assert not ev.failed and ev.score < 1e-9, ev.divergence
        buggy = hf_pair("pen.no_presence", spec, FP32, FP32.replace(sampler="test_no_presence"), axes=axes)
        assert run_case(buggy, case).failed
        assert not run_case(buggy, case.replace(presence_penalty=0.0)).failed
        cfg = CampaignConfig(pairs=[buggy], seed=1, max_examples=30, isolation=False)
        [f] = fuzz_pair(buggy, cfg, seed=pair_seed(1, buggy.name), deadline=None).findings
        c = f.case
        assert c.presence_penalty > 0 and c.repetition_penalty == 1.0 and c.frequency_penalty == 0.0, c.one_line()
        assert c.batch_size == 1 and c.n_tokens <= 3, c.one_line()  # (a repeat needs a token before it)
    finally:
        SAMPLERS.pop("test_no_presence", None)
        SAMPLER_KEYWORDS.pop("test_no_presence", None)


def test_an_engine_that_reports_raw_log_probs_is_a_component_caught_and_localized():
    """`Numerics(logprobs="raw")`: the rollout draws from its processed distribution and reports the raw
    one's log-probs (vLLM's default logprobs_mode). Against a trainer that scores the processed one it
    is caught at T 0.7 and triage names `logprobs`; at T 1 without cut or penalty the two are one; a
    trainer that scores raw too is aligned with it at any setting."""
    from harness.case import Case
    from harness.execute import run_case
    from harness.triage import localize
    from targets.hf import hf_pair

    spec = HFModel.from_config(TINY["qwen3"], init_seed=3)
    raw = FP32.replace(logprobs="raw")
    with pytest.raises(UsageError, match="Numerics.logprobs='rare' is not one of"):
        FP32.replace(logprobs="rare")
    pair = hf_pair("lp.raw_rollout", spec, FP32, raw)
    hot = Case(seed=4, seq_lens=(6, 3), prompt_lens=(3, 2), temperature=0.7)
    ev = run_case(pair, hot)
    assert ev.failed, ev.divergence
    loc = localize(pair, hot, "cpu", 1e-3, ev.score)
    assert loc is not None and loc.minimal == ["logprobs"] and loc.explained, loc
    assert not run_case(pair, hot.replace(temperature=1.0)).failed
    both = hf_pair("lp.raw_both", spec, raw, raw)
    assert run_case(both, hot).score < 1e-9


def test_a_weight_sync_is_a_patch_its_bugs_are_caught_and_the_module_named(capsys):
    """`tests/hf/plugin_sync.py`: the trainer's weights through an engine's layout and back. The
    correct round trip is aligned to float rounding (and not warned about as a patch that changed
    nothing); k and v fused in the wrong order in one layer, an expert left uncopied and a router cast
    to bf16 each fail within three cases; triage names the attention of the layer the swap is in."""
    from harness import REGISTRY, Case
    from harness.corpus import Repro
    from harness.execute import run_case
    from harness.triage import triage

    REGISTRY.load_plugin(str(Path(__file__).parent / "plugin_sync.py"))
    cases = [Case(seed=s, seq_lens=(9, 5, 12), prompt_lens=(4, 0, 7)) for s in range(3)]
    scores = {name: [run_case(REGISTRY.get(name), c).score for c in cases]
              for name in ("sync.aligned", "sync.kv_swap", "sync.stale_expert", "sync.router_bf16")}
    assert max(scores.pop("sync.aligned")) < 1e-9 and "changed nothing" not in capsys.readouterr().err
    assert all(max(v) > 1e-3 for v in scores.values()), scores
    repro = Repro(path=None, id="kv", pair="sync.kv_swap", symptom="divergence", signature="", status="expected",
                  threshold=1e-3, case=cases[0], metrics={}, error=None, environment={}, loader={}, found={})
    t = triage(repro)
    assert t.first_module and t.first_module.startswith("model.layers.1.self_attn."), t.first_module
    # the module whose output came just before it agrees: the note says where to look between them
    assert any(n.startswith(f"per-module table: {t.first_module} is where the divergence starts, and ")
               and "no module wraps" in n for n in t.notes), t.notes
