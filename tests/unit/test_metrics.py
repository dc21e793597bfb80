import math

import pytest
import torch

from harness.metrics import boundary_tie, compare, routing_flips
from harness.pairs import Outcome, Routing


def lp(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float64))


def test_k3_hand_computed():
    # r = 2: k3 = (2 - 1) - ln 2; r = 1/2: k3 = -1/2 + ln 2; r = 1: 0
    trainer = Outcome(logprobs=lp([[0.5, 0.5], [0.25, 0.75], [0.5, 0.5]]))
    rollout = Outcome(logprobs=lp([[0.25, 0.75], [0.5, 0.5], [0.5, 0.5]]))
    d = compare(trainer, rollout, (3,), torch.tensor([0, 0, 1]))
    assert d.per_token["k3"].tolist() == pytest.approx([1 - math.log(2), -0.5 + math.log(2), 0.0], abs=1e-15)
    assert d.per_token["k3"].dtype.name == "float64"


def test_compare_hand_computed_two_sequences():
    trainer = Outcome(logprobs=lp([[0.5, 0.5], [0.8, 0.2], [0.25, 0.75]]))
    rollout = Outcome(logprobs=lp([[0.25, 0.75], [0.8, 0.2], [0.5, 0.5]]))
    tokens = torch.tensor([0, 0, 1])
    d = compare(trainer, rollout, (2, 1), tokens)
    k3_0 = (2 - 1) - math.log(2)  # r = 0.5 / 0.25
    k3_2 = (1.5 - 1) - math.log(1.5)  # r = 0.75 / 0.5
    assert d.k3_kl == pytest.approx((k3_0 + 0 + k3_2) / 3, abs=1e-15)
    assert d.k3_seq_max == pytest.approx(max(k3_0 / 2, k3_2), abs=1e-15)
    kl0 = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # KL(rollout || trainer), row 0
    kl2 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert d.kl == pytest.approx((kl0 + 0 + kl2) / 3, abs=1e-15)
    assert d.max_abs_dlogp == pytest.approx(math.log(2), abs=1e-15)
    assert d.probs_diff_max == pytest.approx(0.25, abs=1e-15)
    assert d.log_ppl_diff == pytest.approx((math.log(2) / 2 + math.log(1.5)) / 2, abs=1e-15)
    assert d.chi2_token == pytest.approx((4 + 1 + 2.25) / 3 - 1, abs=1e-12)
    assert d.nonfinite_trainer == d.nonfinite_rollout == 0
    assert d.n_tokens == 3
    assert d.entropy == pytest.approx(
        (-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)) - (0.8 * math.log(0.8) + 0.2 * math.log(0.2))
         - 2 * 0.5 * math.log(0.5)) / 3, abs=1e-12)


def test_the_worst_sequences_own_means_and_a_verdict_over_sequences():
    """`k3_expected_seq_max` / `kl_seq_max` are the largest per-sequence means of the per-row expected
    k3 and exact KL; a verdict over sequences judges them, one over the batch the token means: one
    divergent sequence among clean ones fires the first and not the second."""
    from harness.metrics import fired, judged_means

    g = torch.Generator().manual_seed(0)
    r = torch.log_softmax(torch.randn(9, 11, generator=g, dtype=torch.float64), -1)
    t = r.clone()
    t[6:] = torch.log_softmax(r[6:] + 0.05 * torch.randn(3, 11, generator=g, dtype=torch.float64), -1)
    d = compare(Outcome(logprobs=t), Outcome(logprobs=r), (4, 2, 3), torch.zeros(9, dtype=torch.long))
    k3e, kl = d.per_token["k3_expected"], d.per_token["kl"]
    assert d.k3_expected_seq_max == pytest.approx(k3e[6:].mean(), rel=1e-12) and k3e[:6].max() == 0.0
    assert d.kl_seq_max == pytest.approx(kl[6:].mean(), rel=1e-12) and d.worst_sequence == 2
    assert d.k3_expected == pytest.approx(k3e.mean(), rel=1e-12)  # the batch's: a third of the worst sequence's
    line = (d.k3_expected + d.k3_expected_seq_max) / 2
    assert kl.mean() < line and judged_means(d) == (d.k3_expected, d.kl) and fired(d, line) == ""
    d.verdict_over = "sequence"
    assert judged_means(d) == (d.k3_expected_seq_max, d.kl_seq_max) and fired(d, line) == "k3+kl"
    as_dict = {**d.as_dict(), "verdict_over": "sequence"}  # a repro's metrics judge the same way
    assert judged_means(as_dict) == judged_means(d)
    one = compare(Outcome(logprobs=t[6:]), Outcome(logprobs=r[6:]), (3,), torch.zeros(3, dtype=torch.long))
    assert (one.k3_expected_seq_max, one.kl_seq_max) == (one.k3_expected, one.kl)  # one sequence: the batch's
    same = compare(Outcome(logprobs=r), Outcome(logprobs=r), (4, 2, 3), torch.zeros(9, dtype=torch.long))
    assert same.k3_expected_seq_max == same.kl_seq_max == 0.0


def test_identical_paths_are_exactly_zero():
    x = torch.log_softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(0)), -1)
    d = compare(Outcome(logprobs=x), Outcome(logprobs=x.clone()), (5,), torch.zeros(5, dtype=torch.long))
    assert d.k3_kl == 0.0 and d.kl == 0.0 and d.max_abs_dlogp == 0.0


def test_nonfinite_counts():
    t = lp([[0.5, 0.5], [0.5, 0.5]])
    r = t.clone()
    r[1, 1] = float("nan")
    d = compare(Outcome(logprobs=t), Outcome(logprobs=r), (2,), torch.tensor([0, 0]))
    assert d.nonfinite_rollout == 1 and d.nonfinite_trainer == 0 and d.nonfinite


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ in shape"):
        compare(Outcome(logprobs=lp([[0.5, 0.5]])), Outcome(logprobs=lp([[0.2, 0.3, 0.5]])), (1,),
                torch.tensor([0]))


def test_routing_flips_are_tie_aware():
    scores_t = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.3, 0.3], [0.6, 0.3, 0.1]])
    scores_r = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.3, 0.3], [0.6, 0.1, 0.3]])
    t = {"l0": Routing(experts=torch.tensor([[0, 1], [0, 1], [0, 1]]), scores=scores_t)}
    r = {"l0": Routing(experts=torch.tensor([[1, 0], [0, 2], [0, 2]]), scores=scores_r)}
    flips = routing_flips(t, r)
    # token 0: same set in another order (no flip); token 1: flip at an exact tie; token 2: real flip
    assert flips == {"l0": {"tokens": 3, "tie_flips": 1, "flips": 1}}
    assert boundary_tie(scores_t, 2).tolist() == [False, True, False]
    assert boundary_tie(scores_t, 1).tolist() == [False, False, False]
    assert boundary_tie(torch.tensor([[0.4, 0.3, 0.3]]), 2).tolist() == [True]


# --- precision, -inf semantics, the verdict, token draws ------------------------------------------
import mpmath  # noqa: E402
import numpy as np  # noqa: E402

from harness.case import Case  # noqa: E402
from harness.execute import Symptom, judge  # noqa: E402
from harness.metrics import LOG_ZERO, Divergence, fired, k3_of  # noqa: E402
from harness.sampling import process_logits, sample_rows  # noqa: E402


def test_k3_is_accurate_for_tiny_and_large_log_ratios():
    d = np.concatenate([s * np.logspace(-12, 1, 60) for s in (1.0, -1.0)] + [[0.0, 0.2499, 0.25, -0.25]])
    with mpmath.workdps(40):
        want = np.array([float(mpmath.expm1(mpmath.mpf(x)) - mpmath.mpf(x)) for x in d])
    got = k3_of(d)
    assert np.all(np.abs(got - want) <= 1e-14 * np.abs(want)), np.max(np.abs(got - want) / np.maximum(want, 1e-300))
    assert k3_of(np.array([-np.inf]))[0] == np.inf and np.isnan(k3_of(np.array([np.nan]))).all()
    assert k3_of(np.array([np.inf]))[0] == np.inf  # (r = inf: a sampled token its rollout reports at log 0)


class _Pair:
    name = "unit.pair"


def truncated_sampling(t=40, v=64):
    """A rollout sampling from its top 8 (kept mass Z ~ 0.986) and reporting those log-probs; the
    trainer scores the full distribution. k3 sees (1 - Z)^2 / 2 ~ 1e-4, the exact KL -log Z ~ 0.014."""
    logits = torch.zeros(t, v)
    logits[:, :8] = 6.0
    rollout_lp = process_logits(logits, 1.0, top_k=8)  # (T, V), -inf outside the top 8
    tokens = sample_rows(rollout_lp, torch.rand(t, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    return Outcome(logprobs=torch.log_softmax(logits, -1)), Outcome(logprobs=rollout_lp, tokens=tokens)


def test_verdict_sees_truncated_sampling_through_the_exact_kl():
    trainer, rollout = truncated_sampling()
    ev = judge(_Pair(), Case(seed=0, seq_lens=(40,)), trainer, rollout, threshold=1e-3)
    d = ev.divergence
    z = 8 * math.exp(6) / (8 * math.exp(6) + 56)
    # (fp32 log-probs: d = log z carries ~2e-7 of rounding, so k3 ~ d^2/2 agrees to ~1e-4 only)
    assert d.k3_kl == pytest.approx(z - 1 - math.log(z), rel=1e-4) and d.k3_kl < 1e-3
    assert d.kl == pytest.approx(-math.log(z), rel=1e-4) and d.kl > 10e-3
    assert ev.symptom is Symptom.DIVERGENCE and d.fired == "kl" and not d.nonfinite


def test_fired_names_the_means_above_the_threshold():
    def div(k3, kl, expected=math.nan):
        return Divergence(k3, k3, kl, *([0.0] * 9), 0, 0, 1, k3_expected=expected)

    # without an expected k3 the sampled mean is judged; with one, the expected k3 is
    assert [fired(div(a, b), 1e-3) for a, b in [(2e-3, 0), (0, 2e-3), (2e-3, math.inf), (1e-4, 1e-4),
                                                  (math.nan, 0.0)]] == ["k3", "kl", "k3+kl", "", ""]
    assert [fired(div(a, b, e), 1e-3) for a, b, e in [(2e-3, 1e-4, 1e-4), (1e-4, 1e-4, 2e-3), (math.inf, 0, 1e-4),
                                                       (2e-3, 2e-3, 1e-4)]] == ["", "k3", "k3", "kl"]
    trainer = Outcome(logprobs=lp([[0.5, 0.5]]))
    ev = judge(_Pair(), Case(seed=0, seq_lens=(1,)), trainer, Outcome(logprobs=lp([[0.5, 0.5]]), tokens=torch.tensor([0])))
    assert ev.symptom is Symptom.NONE and ev.divergence.fired == ""


def test_an_unlucky_draw_on_a_small_case_is_not_a_divergence():
    # KL 2.5e-4 at every position; the rollout's rare token (p = 0.01) sampled at both positions gives
    # a mean k3 of ~0.014, 14x the line, from a draw that happens once in 10^4
    trainer = Outcome(logprobs=lp([[0.99 - 0.00158, 0.01 + 0.00158]] * 2))
    rollout = Outcome(logprobs=lp([[0.99, 0.01]] * 2), tokens=torch.tensor([1, 1]))
    ev = judge(_Pair(), Case(seed=0, seq_lens=(2,)), trainer, rollout, threshold=1e-3)
    d = ev.divergence
    assert d.k3_kl > 10e-3 and d.kl < 1e-3
    assert d.k3_expected == pytest.approx(d.kl, rel=1e-9)  # both sides normalised: E[k3] is the KL
    assert ev.symptom is Symptom.NONE and d.fired == ""


def test_reported_log_probs_off_by_their_normaliser_are_a_k3_divergence():
    # the rollout divides its log-probs by the temperature after the log-softmax: the distributions
    # agree once normalised (KL ~0), every reported log-prob does not (what an importance ratio uses)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    trainer = Outcome(logprobs=torch.log_softmax(logits / 2.0, -1))
    rollout = Outcome(logprobs=torch.log_softmax(logits, -1) / 2.0)
    u = torch.rand(6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    d = compare(trainer, rollout, (6,), uniforms=u)
    assert d.kl < 1e-12 and d.k3_expected > 0.01
    offset = (torch.log_softmax(logits / 2.0, -1) - torch.log_softmax(logits, -1) / 2.0)[:, 0]  # per row, constant
    assert d.k3_expected == pytest.approx(float((torch.expm1(offset) - offset).mean()), rel=1e-9)
    assert fired(d, 1e-3) == "k3"


def test_trainer_excluding_a_token_the_rollout_can_produce_is_reported_and_a_divergence_when_sampled():
    # the rollout gives token 2 mass 1e-280 (above e^-650); the trainer gives it -inf
    rollout = torch.tensor([[math.log(0.5), math.log(0.5), -644.7]], dtype=torch.float64)
    trainer = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf]], dtype=torch.float64)
    d = compare(Outcome(logprobs=trainer), Outcome(logprobs=rollout), (1,), torch.tensor([0]))
    assert d.kl == 0.0 and d.kl_excluded > 0 and d.k3_kl == 0.0 and not d.nonfinite  # reported, not +inf
    # ... and the same token sampled: k3 = +inf, still a divergence, not a non-finite value
    ev = judge(_Pair(), Case(seed=0, seq_lens=(1,)), Outcome(logprobs=trainer),
               Outcome(logprobs=rollout, tokens=torch.tensor([2])))
    assert ev.divergence.k3_kl == math.inf and ev.symptom is Symptom.DIVERGENCE and ev.divergence.fired == "k3"
    # mass at or below e^-650 counts as none
    rollout[0, 2] = LOG_ZERO - 1
    assert compare(Outcome(logprobs=trainer), Outcome(logprobs=rollout), (1,), torch.tensor([0])).kl_excluded == 0.0


def test_mass_on_a_token_the_trainer_excludes_does_not_offset_a_truncation_elsewhere():
    """The rollout drops the trainer's tail (a truncation bug: KL -log(kept mass), 14x the line) and
    also keeps one token the trainer cuts. Over the tokens the trainer keeps, the rollout is
    renormalised: the KL is that of the truncation, not a partial sum pulled below zero by the
    excluded token's mass (which read -0.035 and hid the bug)."""
    v = 40
    g = torch.Generator().manual_seed(11)
    trainer = torch.log_softmax(torch.randn(1, v, generator=g, dtype=torch.float64) * 2, -1)
    trainer[0, v - 1] = -math.inf  # the trainer cuts the last token
    trainer = trainer - torch.logsumexp(trainer, -1, keepdim=True)
    order = torch.argsort(trainer[0, : v - 1])  # ascending
    p_t = trainer[0].exp()
    tail = order[torch.cumsum(p_t[order], 0) <= 0.014]  # the smallest tokens up to 1.4% of the mass
    kept_mass = 1.0 - float(p_t[tail].sum())
    q = p_t.clone()
    q[tail] = 0.0
    q = q / q.sum() * 0.95
    q[v - 1] = 0.05  # the rollout keeps the token the trainer cut
    rollout = q.log()[None]
    d = compare(Outcome(logprobs=trainer), Outcome(logprobs=rollout), (1,), torch.tensor([0]))
    assert d.kl == pytest.approx(-math.log(kept_mass), rel=1e-9) and d.kl > 0.01
    assert d.kl_excluded == pytest.approx(0.05, rel=1e-9)
    assert fired(d, 1e-3) == "kl"
    # all of the rollout's mass on tokens the trainer cuts: no common support, +inf
    only = torch.full((1, v), -math.inf, dtype=torch.float64)
    only[0, v - 1] = 0.0
    d = compare(Outcome(logprobs=trainer), Outcome(logprobs=only), (1,), torch.tensor([0]))
    assert d.kl == math.inf and d.kl_excluded == 1.0


@pytest.mark.parametrize("floor", [-math.inf, -700.0, -651.0])
def test_a_trainer_row_at_log_zero_where_the_rollout_has_mass_is_infinite_kl(floor):
    """A probability at or below e^-650 is 0, whether the trainer writes -inf or a finite -700 (a
    masked fill with a large negative number, as engines do): such tokens are excluded on both
    counts. A row with every token there had KL -inf when finite (the normaliser's log 0 entered the
    KL with the wrong sign, under the threshold: a missed divergence); it is +inf, as for -inf."""
    v = 30
    g = torch.Generator().manual_seed(4)
    rollout = torch.log_softmax(torch.randn(3, v, generator=g, dtype=torch.float64) * 2, -1)
    trainer = rollout.clone()
    trainer[1] = floor  # the trainer gives this position nothing
    trainer[2, :10] = floor  # ... and these tokens nothing
    d = compare(Outcome(logprobs=trainer), Outcome(logprobs=rollout), (3,), torch.tensor([0, 0, 20]))
    kept = float(rollout[2, 10:].exp().sum())
    assert d.per_token["kl"][1] == math.inf and d.per_token["kl"][0] == 0.0
    assert d.per_token["kl"][2] == pytest.approx(-math.log(kept) + math.log(float(rollout[2, 10:].exp().sum())),
                                                 abs=1e-12)  # renormalised over the kept tokens: the same shape
    assert d.kl_excluded == pytest.approx((1.0 + 1.0 - kept) / 3, rel=1e-12)
    assert d.kl == math.inf and fired(d, 1e-3)
    assert d.nonfinite_trainer == 0  # log 0 is not a non-finite value


def test_a_token_the_rollout_gives_no_mass_is_a_nonfinite_rollout():
    lr = torch.tensor([[0.0, -math.inf]])
    d = compare(Outcome(logprobs=lr.clone()), Outcome(logprobs=lr), (1,), torch.tensor([1]))
    assert d.nonfinite_rollout == 1 and d.nonfinite_trainer == 0 and d.nonfinite


def test_truncated_rows_alike_on_both_sides_are_clean():
    lr = process_logits(3 * torch.randn(6, 300, generator=torch.Generator().manual_seed(0)), 0.8, top_k=20, top_p=0.9)
    d = compare(Outcome(logprobs=lr.clone()), Outcome(logprobs=lr), (6,), uniforms=torch.linspace(0, 0.99, 6,
                                                                                                  dtype=torch.float64))
    assert d.kl == 0.0 and d.k3_kl == 0.0 and not d.nonfinite and math.isfinite(d.entropy)


def seq_case(lens, **kw):
    return Case(seed=7, seq_lens=lens, **kw)


def test_per_sequence_draws_replay_and_survive_dropping_a_sequence():
    case = seq_case((5, 3, 4))
    lr = torch.log_softmax(torch.randn(12, 50, generator=torch.Generator().manual_seed(1)), -1)
    d = compare(Outcome(logprobs=lr.clone()), Outcome(logprobs=lr), case.seq_lens, case=case)
    assert (d.per_token["token"] == sample_rows(lr, case.token_uniforms("tokens")).numpy()).all()
    smaller = case.drop_sequence(0)  # sequences 1 and 2 keep their streams
    d2 = compare(Outcome(logprobs=lr[5:].clone()), Outcome(logprobs=lr[5:]), smaller.seq_lens, case=smaller)
    assert (d2.per_token["token"] == d.per_token["token"][5:]).all()


def test_upgraded_schema_1_cases_keep_the_multinomial_draw():
    case = seq_case((6, 4), streams="single")
    lr = torch.log_softmax(torch.randn(10, 30, generator=torch.Generator().manual_seed(2)), -1)
    d = compare(Outcome(logprobs=lr.clone()), Outcome(logprobs=lr), case.seq_lens, case=case)
    want = torch.multinomial(torch.exp(lr.double()), 1, generator=case.generator("tokens")).squeeze(-1)
    assert (d.per_token["token"] == want.numpy()).all()


def test_values_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(3)
    x = 3 * torch.randn(3, 151936, generator=g)
    lt, lr = torch.log_softmax(x + 1e-3 * torch.randn(x.shape, generator=g), -1), torch.log_softmax(x, -1)
    before = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(compare(Outcome(logprobs=lt), Outcome(logprobs=lr), (3,), torch.tensor([0, 1, 2])))
    finally:
        torch.set_num_threads(before)
    assert runs[0].as_dict() == runs[1].as_dict()
    assert (runs[0].per_token["kl"] == runs[1].per_token["kl"]).all()


@pytest.mark.parametrize("bad", [-1, 8])
def test_a_token_id_outside_the_vocabulary_is_an_error_not_a_wrapped_index(bad):
    """Returned tokens are read by index on the CPU: -1 must not quietly mean the last token."""
    lp = torch.log_softmax(torch.randn(3, 8, dtype=torch.float64), -1)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 8\)"):
        compare(Outcome(logprobs=lp), Outcome(logprobs=lp.clone()), (3,), tokens=torch.tensor([0, bad, 2]))


def test_gathered_tokens_are_the_same_whatever_the_dtype_and_device_path():
    """The CPU index path (float32/float64) and the tensor path (bfloat16) read the same values."""
    g = torch.Generator().manual_seed(3)
    lp = torch.log_softmax(torch.randn(6, 32, generator=g), -1).bfloat16()
    tokens = torch.randint(0, 32, (6,), generator=g)
    a = compare(Outcome(logprobs=lp), Outcome(logprobs=lp.float() + 1e-3), (2, 4), tokens=tokens)
    b = compare(Outcome(logprobs=lp.float()), Outcome(logprobs=lp.float() + 1e-3), (2, 4), tokens=tokens)
    assert np.array_equal(a.per_token["logp_trainer"], b.per_token["logp_trainer"])
    assert np.array_equal(a.per_token["token"], tokens.numpy()) and a.k3_kl == b.k3_kl


def test_verdict_mean_is_the_mean_that_fired():
    # an exact KL over the line on a case whose few sampled tokens give a tiny k3: the KL is shown
    from harness.execute import headline
    from harness.metrics import judged_k3, verdict_mean
    from harness.mlflow_tracking.payload import severity

    m = {"k3_kl": 4.5e-6, "k3_expected": 5.2e-7, "kl": 3.0e-3, "fired": "kl"}
    assert verdict_mean(m) == ("kl", 3.0e-3) and headline(m, None) == "kl=0.003"
    assert severity("divergence", verdict_mean(m)[1], 1e-3) == "low"
    # both fired: the larger; neither: the judged k3 (expected, else sampled; +inf when sampled is)
    assert verdict_mean({**m, "k3_expected": 0.2, "fired": "k3+kl"}) == ("k3", 0.2)
    assert verdict_mean({**m, "kl": 0.5, "k3_expected": 0.2, "fired": "k3+kl"}) == ("kl", 0.5)
    assert verdict_mean({"k3_kl": 1e-9, "k3_expected": 2e-9, "kl": 2e-9, "fired": ""}) == ("k3", 2e-9)
    # a case that no longer fires, beside a repro recorded firing on the KL: its KL, not its k3
    now = {"k3_kl": 5.3e-14, "k3_expected": 4e-14, "kl": 2e-10, "fired": ""}
    assert headline(now, None) == "k3=4e-14" and headline(now, None, like=m) == "kl=2e-10"
    assert headline(now, None, like={**m, "fired": "k3"}) == "k3=4e-14"
    assert judged_k3(float("nan"), 0.01) == 0.01 and judged_k3(1e-3, float("inf")) == float("inf")
    assert severity("divergence", float("inf"), 1e-3) == "high"
    err = {"type": "ValueError", "message": "trainer logprobs have shape (0, 64), expected (1, vocab)\nmore"}
    assert headline(None, err) == "ValueError: trainer logprobs have shape (0, 64), expected (1, vocab)"
    long = {"type": "timeout", "message": "the case ran longer than " + "the per-case timeout " * 12 + "`pytest --harness"}
    cut = headline(None, long)
    assert cut.endswith(" the ...") and len(cut) < 220  # cut at a word, not in the middle of one
    assert headline({**m, "nonfinite_trainer": 3, "nonfinite_rollout": 0}, None) == "NaN/inf from the trainer 3 token(s)"


def test_a_finding_fired_by_one_excluded_draw_says_so_with_the_exact_means():
    from harness.execute import headline

    m = {"k3_kl": math.inf, "k3_expected": 3.6e-4, "kl": 2e-4, "kl_excluded": 0.038, "fired": "k3",
         "nonfinite_trainer": 0, "nonfinite_rollout": 0}
    assert headline(m, None) == ("k3=inf (a sampled token the trainer excludes: rollout mass there 0.038; "
                                 "expected k3 0.00036 over the tokens the trainer keeps, kl 0.0002)")
    assert headline({**m, "k3_kl": 0.01, "k3_expected": 0.002}, None) == "k3=0.002"


def test_a_rollout_that_samples_a_token_it_reports_at_log_zero_is_a_divergence_not_nonfinite():
    """A sampler that draws from another distribution than it reports (top-k applied to the reported
    log-probs, not to the draw): its token's own log-prob is -inf, log 0. That is k3 = inf, a
    divergence saying so, not 'NaN/inf from the rollout' (a BROKEN demonstration)."""
    from harness.execute import headline

    trainer = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]], dtype=torch.float64)
    rollout = torch.tensor([[0.0, -math.inf, -math.inf]], dtype=torch.float64)  # reported: top-1
    ev = judge(_Pair(), Case(seed=0, seq_lens=(1,)), Outcome(logprobs=trainer),
               Outcome(logprobs=rollout, tokens=torch.tensor([2])))  # ... but it drew token 2
    d = ev.divergence
    assert d.nonfinite_rollout == 0 and d.k3_kl == math.inf and ev.symptom is Symptom.DIVERGENCE, d
    assert "the rollout sampled a token its own reported distribution gives probability 0" in headline(d, None)


def test_a_row_with_excluded_tokens_leaves_its_chunk_neighbours_values_unchanged():
    """Excluded tokens are masked out in place over the whole chunk that holds one: the other rows'
    values must stay those they have alone (a row's value depends on no other row)."""
    from harness.metrics import row_stats

    g = torch.Generator().manual_seed(8)
    x = 3 * torch.randn(6, 200, generator=g, dtype=torch.float64)
    lr = torch.log_softmax(x, -1)
    lt = torch.log_softmax(x + 0.05 * torch.randn(6, 200, generator=g, dtype=torch.float64), -1)
    lt[1, :50] = -math.inf  # the trainer cuts these tokens
    lt[4, 100:] = -1e4  # ... and these, with a finite fill
    lt[2, :20], lr[2, :20] = -math.inf, -math.inf  # both cut alike: no excluded mass
    together = row_stats(lt, lr)
    assert together["excluded"][1] > 0 and together["excluded"][4] > 0 and together["excluded"][2] == 0
    for r in range(6):
        alone = row_stats(lt[r:r + 1], lr[r:r + 1])
        for key in ("kl", "entropy", "excluded", "k3"):
            assert together[key][r] == alone[key][0], (r, key)


def test_the_exact_kl_and_expected_k3_are_never_negative_on_near_equal_rows():
    """Two fp32 log-softmaxes of logits that differ in their last bits: the float64 normalisers leave
    ~1e-14 of either sign, which a triage table showed as a KL of -2e-14; a KL is >= 0."""
    import torch

    from harness.metrics import compare
    from harness.pairs import Outcome

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 1000, generator=g, dtype=torch.float64) * 3  # (a float64 readout's rows)
    lt = torch.log_softmax(logits, -1)
    lr = torch.log_softmax(logits * (1 + 1e-15), -1)
    div = compare(Outcome(logprobs=lt), Outcome(logprobs=lr), (64,), uniforms=torch.rand(64, generator=g,
                                                                                         dtype=torch.float64))
    assert (div.per_token["kl"] >= 0).all() and div.kl >= 0 and div.kl < 1e-12
    assert (div.per_token["k3_expected"] >= 0).all()  # (the expected k3 too: -2.9e-18 was seen)
    with_inf = lt.clone()
    with_inf[:, :10] = -float("inf")  # the non-plain path (a trainer that truncates)
    div = compare(Outcome(logprobs=with_inf), Outcome(logprobs=lr), (64,), tokens=torch.full((64,), 500))
    assert (div.per_token["kl"] >= 0).all()


def test_a_top_k_boundary_swap_gives_a_kl_of_about_the_excluded_mass_and_show_says_why():
    """Both paths cut to the top 4; a near-tied 4th/5th pair ranks the other way on the rollout: each
    keeps a token the other cuts. The KL over the trainer's tokens comes out about the rollout's mass
    on the token the trainer cuts, with a tiny expected k3 (a trial read it as the excluded mass being
    judged); `boundary_swap_note` names the pattern, and not that of a plain divergence."""
    import torch

    from harness.execute import boundary_swap_note
    from harness.metrics import compare
    from harness.pairs import Outcome

    logits = torch.tensor([[4.0, 3.0, 2.5, 2.0, 1.9999, -1.0, -2.0, -3.0]], dtype=torch.float64)
    trainer, rollout = logits.clone(), logits.clone()
    rollout[0, 3], rollout[0, 4] = 1.9999, 2.0  # the near tie at the boundary, ranked the other way

    def cut(x):
        return torch.log_softmax(x.masked_fill(x < x.topk(4, -1).values[..., -1:], -math.inf), -1)

    div = compare(Outcome(logprobs=cut(trainer)), Outcome(logprobs=cut(rollout)), (1,), tokens=torch.tensor([0]))
    assert div.kl_excluded > 0.01 and 1 / 3 < div.kl / div.kl_excluded < 3 and div.k3_expected < div.kl / 10
    assert boundary_swap_note(div.as_dict()).startswith("truncation boundary: the rollout keeps tokens the trainer cuts")
    assert boundary_swap_note({"kl": 0.01, "kl_excluded": 0.0, "k3_expected": 0.01}) == ""
    assert boundary_swap_note({"kl": 0.01, "kl_excluded": 0.0101, "k3_expected": 0.005}) == ""  # (a real gap too)
