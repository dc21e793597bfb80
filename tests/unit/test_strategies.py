import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import Axes, Case, RoutingAxes
from harness.strategies import cases, near_tie_hidden, near_tie_logits, tie_gaps

AXES = Axes(n_seqs=(2, 5), seq_len=(3, 9), packing=True,
            routing=RoutingAxes(n_experts=(4, 6), top_k=(1, 3), max_gap=1e-3),
            logit_scale=(0.5, 2.0), dtypes=("bfloat16", "float16"), params={"shards": st.integers(1, 4)})


@settings(max_examples=60, deadline=None)
@given(cases(AXES))
def test_cases_stay_within_the_declared_axes(case):
    assert 2 <= case.batch_size <= 5 and all(3 <= n <= 9 for n in case.seq_lens)
    assert 4 <= case.n_experts <= 6 and 1 <= case.top_k <= 3
    assert 0.0 <= case.tie_gap <= 1e-3 and 0.0 <= case.tie_fraction <= 1.0
    assert 0.5 <= case.logit_scale <= 2.0 and case.dtype in ("bfloat16", "float16")
    assert 1 <= case.params["shards"] <= 4
    assert Case.from_json(case.to_json()) == case


def test_fixed_axes_keep_defaults():
    @settings(max_examples=10, deadline=None)
    @given(cases(Axes(n_seqs=(1, 1), seq_len=(4, 4), logit_scale=(1.0, 1.0), pad_sides=("right",))))
    def check(case):
        assert case.seq_lens == (4,) and case.row_capacity == 0 and case.order == ()
        assert case.tie_fraction == 0.0 and case.dtype == "bfloat16" and case.logit_scale == 1.0

    check()


def test_gap_shrinks_to_the_exact_tie():
    from hypothesis import find

    assert find(tie_gaps(1e-2), lambda g: True) == 0.0
    # the smallest non-zero gap the strategy keeps is far below bf16 rounding
    assert find(tie_gaps(1e-2), lambda g: g > 0) < 1e-8


def test_near_tie_logits_set_the_boundary_gap_exactly():
    case = Case(seed=1, seq_lens=(64,), n_experts=8, top_k=2, tie_fraction=1.0, tie_gap=2**-20)
    logits = near_tie_logits(torch.randn(64, 8, generator=case.generator("x"), dtype=torch.float64), case)
    top = logits.topk(3, -1)
    assert torch.all(top.values[:, 1] - top.values[:, 2] == 2**-20)
    # the expert just inside the boundary has the higher id: ties broken toward the lower id flip it
    assert torch.all(top.indices[:, 1] > top.indices[:, 2])


def test_near_tie_hidden_puts_router_logits_at_the_boundary():
    case = Case(seed=2, seq_lens=(32,), n_experts=8, top_k=2, tie_fraction=1.0, tie_gap=1e-4)
    w = torch.randn(16, 8, generator=case.generator("w"), dtype=torch.float64)
    x = near_tie_hidden(torch.randn(32, 16, generator=case.generator("x"), dtype=torch.float64), w, case)
    top = (x @ w).topk(3, -1).values
    assert torch.allclose(top[:, 1] - top[:, 2], torch.full((32,), 1e-4, dtype=torch.float64), atol=1e-9)


def test_fraction_zero_changes_nothing():
    case = Case(seed=2, seq_lens=(8,), n_experts=4, tie_fraction=0.0, tie_gap=0.0)
    x = torch.randn(8, 4)
    assert torch.equal(near_tie_logits(x, case), x)


def test_near_tie_hidden_aims_at_the_flip():
    from harness.bench_ops import flip_rate

    case = Case(seed=3, seq_lens=(512,), n_experts=8, top_k=2, tie_fraction=1.0, tie_gap=1e-5)
    w = case.randn((32, 8), "router") / 32**0.5
    x = case.randn((512, 32), "hidden")
    assert flip_rate(x, w, 2) < 0.02  # random inputs: rare
    assert flip_rate(near_tie_hidden(x, w, case), w, 2) > 0.95  # near ties, aimed: almost all


def test_neartie_benchmark_writes_its_section(tmp_path):
    from harness.bench_ops import neartie

    out = tmp_path / "B.md"
    text = neartie(tokens=256, trials=1, shapes=((8, 2),), gaps=(1e-5,), out=out)
    assert "| 8 | 2 | 1e-05 |" in text and "<!-- bench:neartie -->" in out.read_text()


def test_generator_draws_large_batches_boundaries_and_peaked_logits():
    import collections

    from harness.strategies import boundary_values

    assert boundary_values(1, 16) == [1, 2, 3, 4, 5, 7, 8, 9, 15, 16]
    got = []

    @settings(max_examples=400, deadline=None, database=None, derandomize=True)
    @given(cases(Axes(temperature=(0.5, 2.0), top_p=(0.5, 1.0), sample_top_k=(0, 64))))
    def collect(case):
        got.append(case)

    collect()
    batch = collections.Counter(c.batch_size for c in got)
    assert batch[1] / len(got) < 0.25  # Hypothesis's own lists give batch 1 about 42% of the time
    assert sum(v for k, v in batch.items() if k >= 9) / len(got) > 0.25
    assert sum(c.logit_scale > 8 for c in got) / len(got) > 0.1  # log-uniform, not stuck on the bound
    assert 0.15 < sum(c.temperature == 1.0 for c in got) / len(got) < 0.6  # neutral, near and far
    assert sum(c.pad_side == "left" for c in got) / len(got) > 0.3


def test_sampling_knobs_shrink_to_neutral_not_to_their_lower_bound():
    from hypothesis import find

    from harness.strategies import structured_cases

    case = find(structured_cases(Axes(temperature=(0.5, 2.0), top_p=(0.5, 1.0), sample_top_k=(0, 64))),
                lambda c: c.temperature > 1.02)
    assert 1.02 < case.temperature < 1.1  # the near-neutral branch, not 0.5 or 2.0
    assert case.top_p == 1.0 and case.sample_top_k == 0 and case.batch_size == 1
