"""`harness.sampling.process_logits`: the nucleus (top-p) filter sorts only the head of each row;
it keeps the tokens its definition keeps over a full sort of the row."""

from __future__ import annotations

import math

import pytest
import torch

from harness.sampling import process_logits


def full_sort_drop(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition over a full sort of each (R, V) row: the softmax's float32 probabilities in
    descending order of the logits, equal logits in ascending token id (a stable sort); a token is
    dropped when the running sum strictly before it reaches top_p."""
    p = torch.softmax(x, dim=-1)
    _, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    c = torch.cumsum(p.gather(-1, idx), dim=-1)
    before = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], dim=-1)
    return torch.zeros_like(x, dtype=torch.bool).scatter(-1, idx, before >= top_p)


@pytest.mark.parametrize("v", [7, 64, 300, 5000])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])  # flat (the head must grow), peaked, one token
def test_nucleus_keeps_the_tokens_of_a_full_sort(v, top_p, scale):
    g = torch.Generator().manual_seed(v + int(1000 * top_p) + int(scale))
    logits = scale * torch.randn(40, v, generator=g)
    lp = process_logits(logits, 1.0, top_p=top_p)
    drop = lp == -math.inf
    assert torch.equal(drop, full_sort_drop(logits, top_p))
    assert (~drop).any(-1).all()  # the most likely token always stays
    # what is kept is the head of the row, its mass reaches top_p, and not without its last token
    p = torch.softmax(logits.double(), -1)
    kept_mass = p.masked_fill(drop, 0).sum(-1)
    last = p.masked_fill(drop, math.inf).amin(-1)
    assert (kept_mass >= top_p - 1e-4).all() and (kept_mass - last < top_p + 1e-4).all()
    assert (logits.masked_fill(drop, math.inf).amin(-1) >= logits.masked_fill(~drop, -math.inf).amax(-1)).all()
    assert torch.allclose(torch.exp(lp).sum(-1), torch.ones(40), atol=1e-5)  # renormalised over the kept


def test_nucleus_after_top_k_and_temperature_on_a_batch_of_any_shape():
    g = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(2, 3, 1000, generator=g)
    lp = process_logits(logits, 0.7, top_k=50, top_p=0.8)
    assert lp.shape == logits.shape
    x = logits / 0.7
    kth = torch.topk(x, 50, dim=-1).values[..., -1:]
    x = x.masked_fill(x < kth, -math.inf).reshape(6, 1000)
    assert torch.equal((lp == -math.inf).reshape(6, 1000), full_sort_drop(x, 0.8))
    assert ((lp > -math.inf).sum(-1) <= 50).all()


def test_rows_that_are_not_distributions_stay_as_they_are():
    x = torch.tensor([[math.nan, 0.0, 1.0], [-math.inf, -math.inf, -math.inf], [0.0, 0.0, 0.0]])
    lp = process_logits(x, 1.0, top_p=0.5)
    assert torch.isnan(lp[0]).all() and torch.isnan(lp[1]).all()  # NaN in, NaN out; no mass at all
    assert (lp[2] > -math.inf).sum() == 2  # three equal tokens: two reach 0.5 (mass before: 0, 1/3, 2/3)
    assert process_logits(torch.zeros(0, 9), 1.0, top_p=0.5).shape == (0, 9)  # an empty batch
    assert process_logits(torch.zeros(2, 0, 9), 1.0, top_k=3, top_p=0.5).shape == (2, 0, 9)


def test_a_real_vocabulary_batch():
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(8, 151936, generator=g)
    lp = process_logits(logits, 1.0, top_p=0.9)
    kept = (lp > -math.inf).sum(-1)
    assert (kept >= 1).all() and (kept < 151936).all()
    assert torch.equal(lp == -math.inf, full_sort_drop(logits, 0.9))


@pytest.mark.parametrize("scale", [1.0, 4.0, 8.0])
def test_a_rows_kept_set_is_its_own_whatever_the_batch_with_bf16_ties(scale):
    """bf16 logits tie often; a rollout filters one row per decode step, a trainer the whole batch:
    each row must keep the same tokens either way (a flat row makes the batch sort a larger head)."""
    g = torch.Generator().manual_seed(int(scale))
    logits = (scale * torch.randn(16, 151936, generator=g)).bfloat16().float()
    logits[3] = (0.05 * torch.randn(151936, generator=g)).bfloat16().float()  # near flat: a large head
    logits[7, :5] = logits[7].max() + 12  # five tokens tied at the top, about 0.2 of the mass each
    for top_p in (0.8, 0.95):
        batch = process_logits(logits, 1.0, top_p=top_p) == -math.inf
        assert torch.equal(batch, full_sort_drop(logits, top_p))
        for r in (0, 3, 7, 11):
            assert torch.equal(process_logits(logits[r:r + 1], 1.0, top_p=top_p)[0] == -math.inf, batch[r]), r
    lp = process_logits(logits[7:8], 1.0, top_p=0.3)[0]
    assert (lp > -math.inf).sum() == 2 and (lp[:2] > -math.inf).all()  # the tied head in token-id order


@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"temperature": -1.0}, {"temperature": math.nan},
                                {"top_p": 0.0}, {"top_p": -0.5}, {"top_p": 1.5}, {"top_p": math.nan}])
def test_settings_that_are_no_distribution_are_refused(kw):
    with pytest.raises(ValueError, match="process_logits: (temperature|top_p) must be"):
        process_logits(torch.zeros(2, 5), **kw)


def min_p_drop(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """min-p as vLLM and Hugging Face define it: a token whose probability is below min_p times the
    row's largest probability is dropped (float64 probabilities, away from the boundary)."""
    p = torch.softmax(x.double(), dim=-1)
    return p < min_p * p.amax(-1, keepdim=True)


@pytest.mark.parametrize("min_p", [0.001, 0.05, 0.3, 0.9])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_min_p_cuts_tokens_below_min_p_times_the_top_probability_after_the_temperature(min_p, temperature):
    g = torch.Generator().manual_seed(int(1000 * min_p) + int(10 * temperature))
    logits = 3.0 * torch.randn(50, 400, generator=g)
    lp = process_logits(logits, temperature, min_p=min_p)
    drop = lp == -math.inf
    ref = min_p_drop(logits / temperature, min_p)
    # (a token within float32 rounding of the boundary may go either way: compared away from it)
    lp64 = torch.log_softmax(logits.double() / temperature, -1)
    far = (lp64 - lp64.amax(-1, keepdim=True) - math.log(min_p)).abs() > 1e-5
    assert far.float().mean() > 0.999 and drop.any() and (~drop).sum() > 50
    assert torch.equal(drop[far], ref[far])
    assert (~drop).any(-1).all()  # the top token always stays
    kept = torch.softmax(logits.double() / temperature, -1).masked_fill(drop, 0.0)
    assert torch.allclose(lp.exp().double(), kept / kept.sum(-1, keepdim=True), atol=1e-6)  # renormalised
    assert torch.equal(process_logits(logits, temperature, min_p=0.0), process_logits(logits, temperature))


def test_min_p_comes_before_top_k_and_top_p_as_in_vllm():
    # probabilities 0.5, 0.3, 0.12, 0.08: min-p 0.2 keeps >= 0.1 (three tokens, renormalised to 0.543,
    # 0.326, 0.130); top-p 0.8 over that keeps two (0.543 + 0.326 >= 0.8). Top-p first (Hugging Face's
    # order) keeps three (0.5 + 0.3 = 0.8 is reached only after the second: the third's "before" is 0.8)
    # and min-p then keeps all three.
    logits = torch.tensor([[0.5, 0.3, 0.12, 0.08]]).log()
    lp = process_logits(logits, 1.0, top_p=0.8, min_p=0.2)[0]
    assert (lp > -math.inf).tolist() == [True, True, False, False]
    assert (process_logits(logits, 1.0, min_p=0.2)[0] > -math.inf).tolist() == [True, True, True, False]
    assert (process_logits(logits, 1.0, top_k=1, min_p=0.2)[0] > -math.inf).tolist() == [True, False, False, False]
    assert (process_logits(logits, 1.0, min_p=1.0)[0] > -math.inf).tolist() == [True, False, False, False]


@pytest.mark.parametrize("min_p", [-0.1, 1.5, math.nan])
def test_a_min_p_outside_0_1_is_refused(min_p):
    with pytest.raises(ValueError, match=r"process_logits: min_p must be in \[0, 1\]"):
        process_logits(torch.zeros(2, 5), min_p=min_p)


def _min_p_pair(buggy: bool):
    """A sampler pair: the trainer scores the case's processed distribution; the rollout samples from
    its own, which (buggy) takes min-p's floor from the raw logits, before the temperature divides them
    (a floor -log(min_p) below the top logit, then scaled: at temperature t it cuts at t * log(min_p))."""
    from harness import Axes, Outcome, TargetPair
    from harness.sampling import sample_rows

    def build(case, device):
        return {"case": case, "logits": case.token_randn(64) * case.logit_scale}

    def trainer(inp):
        c = inp["case"]
        return Outcome(logprobs=process_logits(inp["logits"], c.temperature, c.sample_top_k, c.top_p, c.min_p))

    def rollout(inp):
        c, x = inp["case"], inp["logits"]
        if buggy and c.min_p > 0:
            x = x.masked_fill(x < x.amax(-1, keepdim=True) + math.log(c.min_p), -math.inf)
            lp = process_logits(x, c.temperature, c.sample_top_k, c.top_p)
        else:
            lp = process_logits(x, c.temperature, c.sample_top_k, c.top_p, c.min_p)
        return Outcome(logprobs=lp, tokens=sample_rows(lp, c.token_uniforms("sample")))

    axes = Axes(n_seqs=(1, 4), seq_len=(1, 8), logit_scale=(1.0, 4.0), temperature=(0.5, 2.0), top_p=(0.8, 1.0),
                sample_top_k=(0, 32), min_p=(0.0, 0.3))
    return TargetPair(name=f"test.min_p_{'floor_before_temperature' if buggy else 'exact'}",
                      kind="op", expected="diverges" if buggy else "aligned", build=build, rollout=rollout, trainer=trainer,
                      axes=axes)


def test_a_min_p_bug_is_found_and_shrunk_to_min_p_and_the_temperature_alone():
    from harness.execute import run_case
    from harness.fuzz import CampaignConfig, fuzz_pair, pair_seed

    pair = _min_p_pair(buggy=True)
    cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=60, isolation=False)
    r = fuzz_pair(pair, cfg, seed=pair_seed(1, pair.name), deadline=None)
    assert r.findings, r
    c = r.findings[0].case
    assert c.min_p > 0 and c.temperature != 1.0, c.one_line()
    assert c.n_tokens == 1 and c.top_p == 1.0 and c.sample_top_k == 0, c.one_line()
    assert '"min_p"' in c.key()
    fixed = _min_p_pair(buggy=False)
    seen = []

    def evaluate(case):
        seen.append(case)
        return run_case(fixed, case, "cpu", cfg.threshold)

    clean = fuzz_pair(fixed, CampaignConfig(pairs=[fixed], seed=1, max_examples=60, isolation=False),
                      seed=pair_seed(1, fixed.name), deadline=None, evaluate=evaluate)
    assert not clean.findings and clean.examples >= 60
    # min-p drawn off and on, alone and with the other knobs (top-p too: the order matters there)
    assert any(c.min_p == 0 for c in seen) and any(c.min_p > 0 and c.top_p < 1 for c in seen)
    assert all(0 <= c.min_p <= 0.3 for c in seen)


def test_penalties_follow_vllms_definition_over_each_rows_history():
    """Row t of a sequence reads its prompt and its response before t: the repetition penalty divides
    a positive logit of a token seen there (multiplies a negative one), the frequency penalty subtracts
    per occurrence in the response, the presence penalty once; then the temperature."""
    from harness.sampling import history, penalize

    g = torch.Generator().manual_seed(3)
    prompt, response, v = torch.tensor([1, 2, 2]), torch.tensor([5, 1, 5, 7, 5]), 9
    logits = torch.randn(len(response), v, generator=g)
    seen, counts = history(prompt, response, v)
    x = penalize(logits, seen, counts, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25)
    for t in range(len(response)):
        before = response[:t].tolist()
        for tok in range(v):
            ref = float(logits[t, tok])
            if tok in prompt.tolist() or tok in before:
                ref = ref / 1.3 if ref > 0 else ref * 1.3
            ref -= 0.25 * before.count(tok) + (0.4 if tok in before else 0.0)
            assert math.isclose(float(x[t, tok]), ref, rel_tol=1e-6, abs_tol=1e-6), (t, tok)
    lp = process_logits(logits, 0.7, seen=seen, counts=counts, repetition_penalty=1.3, presence_penalty=0.4,
                        frequency_penalty=0.25)
    assert torch.allclose(lp, torch.log_softmax(x / 0.7, -1), atol=1e-6)
    # a chunk of rows reads what the whole does there; neutral penalties need no history
    s2, c2 = history(prompt, response, v, first=2, last=4)
    assert torch.equal(s2, seen[2:4]) and torch.equal(c2, counts[2:4])
    assert torch.equal(process_logits(logits, 0.7, repetition_penalty=1.0), process_logits(logits, 0.7))
    with pytest.raises(ValueError, match="penalties need each row's token history"):
        process_logits(logits, 1.0, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number > 0"):
        process_logits(logits, 1.0, seen=seen, counts=counts, repetition_penalty=0.0)
