"""A recording's two-outcome rows: (T, 2), never (T, V), with the same metrics as the (T, V) spread.

`harness score` judges a recorded rollout by the two-outcome coarsening {sampled token, everything
else} of each row. Spread over a (T, V) float64 tensor on each side (what it was), a 1,000-token
recording at V = 151936 held 2.4 GB before the metrics started; the rows are now (T, 2), and the
metrics' row sums see the same two terms (the other V - 2 were exact zeros), so every value is the
same bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("transformers", reason="recorded rollouts are scored by the HF backend: pip install -e '.[hf]'")

import torch  # noqa: E402

from harness import REGISTRY, Case  # noqa: E402
from harness.execute import run_case  # noqa: E402
from harness.metrics import compare  # noqa: E402
from harness.pairs import Outcome  # noqa: E402
from harness.score import parse_sample, sample_case  # noqa: E402
from targets.hf.paths import records, two_outcome  # noqa: E402


def spread(lp: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The (T, V) form the rows had: lp at the token, log(1 - p) at the next id, -inf elsewhere."""
    rows = torch.full((len(lp), vocab), -math.inf, dtype=torch.float64)
    ar = torch.arange(len(lp))
    rows[ar, tokens] = lp
    rows[ar, (tokens + 1) % vocab] = torch.log(-torch.expm1(lp.clamp_max(0.0)))
    return rows


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("seed", range(4))
def test_two_outcome_rows_give_the_spread_rows_metrics_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    seq_lens = (17, 5, 30)
    n, vocab = sum(seq_lens), 997
    tokens = torch.randint(0, vocab, (n,), generator=g)
    # recorded and trainer log-probabilities: typical, near 0 (p ~ 1), exactly 0 (p = 1: log(1 - p) = -inf),
    # and far below (p ~ e^-40)
    lr = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    lr[::7] = -1e-9
    lr[3] = 0.0
    lr[4] = -40.0
    lt = lr + torch.randn(n, generator=g, dtype=torch.float64) * 0.05
    lt = lt.clamp_max(0.0)
    lt[3] = 0.0
    wide = compare(Outcome(logprobs=spread(lt, tokens, vocab)), Outcome(logprobs=spread(lr, tokens, vocab)),
                   seq_lens, tokens)
    narrow = compare(Outcome(logprobs=two_outcome(lt)), Outcome(logprobs=two_outcome(lr)), seq_lens,
                     torch.zeros(n, dtype=torch.int64))
    for key, v in wide.as_dict().items():
        assert same(float(v), float(narrow.as_dict()[key])), (key, v, narrow.as_dict()[key])
    for key in ("k3", "kl", "logp_trainer", "logp_rollout"):
        np.testing.assert_array_equal(wide.per_token[key], narrow.per_token[key])
    assert wide.kl > 0 and wide.k3_kl > 0  # (a comparison that saw nothing would pass the equalities too)


def test_a_scored_recording_keeps_two_columns_per_token_and_shows_its_own_token_ids():
    pair = REGISTRY.get("hf.qwen3_moe.aligned")
    inp = pair.build(Case(seed=3, seq_lens=(9,), prompt_lens=(4,)), "cpu")
    rec = records(inp, pair.rollout(inp))[0]
    vocab = pair.profiles.model.vocab
    s = parse_sample(1, rec, vocab, pair.profiles.model.moe())
    case, _ = sample_case(s, {}, {})
    ev = run_case(pair, case, "cpu", keep_outcomes=True)
    assert ev.divergence is not None, ev.error
    assert tuple(ev.trainer.logprobs.shape) == (9, 2) and tuple(ev.rollout.logprobs.shape) == (9, 2)
    assert ev.divergence.per_token["token"].tolist() == rec["response_ids"]
    # the trainer scored the recorded tokens (its own rollout, float32 on both sides: the same values)
    np.testing.assert_allclose(ev.divergence.per_token["logp_trainer"], rec["rollout_logprobs"], rtol=0, atol=1e-5)
    assert ev.divergence.k3_kl < 1e-8


def test_a_recorded_rollout_with_full_rows_is_refused_with_the_shape_it_needs():
    pair = REGISTRY.get("hf.qwen3_moe.aligned")
    case = Case(seed=0, seq_lens=(3,), prompt_lens=(2,))
    from harness.execute import finalize

    rollout = Outcome(logprobs=torch.zeros(3, 10), tokens=torch.zeros(3, dtype=torch.int64), recorded=True)
    with pytest.raises(ValueError, match=r"\(3, 2\) two-outcome rows"):
        finalize(pair, case, rollout, "rollout")
