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
