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
    assert len(set(case.ids)) == case.batch_size  # distinct streams: identical sequences hide leaks between them
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


def test_near_ties_forced_inside_a_model_by_a_router_hook_match_across_layouts():
    """A router inside a model: its forward pre-hook marks each row from `case.tie_forced(j, n)` for
    the (sequence, position) the path's layout puts there. The trainer's packed forward and the
    rollout's one-position-per-step decode force the same positions to the same gap; fp32 routers on
    both sides then agree, and a bf16 rollout router flips forced positions."""
    case = Case(seed=4, seq_lens=(7, 5, 9), n_experts=8, top_k=2, tie_fraction=0.5, tie_gap=1e-4,
                streams="sequence")
    hidden, experts = 32, 8
    gate = torch.nn.Linear(hidden, experts, bias=False)
    with torch.no_grad():
        gate.weight.copy_(case.randn((experts, hidden), "router") / hidden**0.5)
    h = [case.seq_generator(j, "h") for j in range(case.batch_size)]
    states = [torch.randn(n, hidden, generator=g) for n, g in zip(case.seq_lens, h)]  # (n_j, H) per sequence
    where: list[tuple[int, int]] = []  # (sequence, position) of each row the gate is about to see

    def hook(module, args):
        forced = torch.tensor([bool(case.tie_forced(j, p + 1)[p]) for j, p in where])
        x = near_tie_hidden(args[0].double(), module.weight.T.double(), case, forced=forced)
        return (x.to(module.weight.dtype),)

    gate.register_forward_pre_hook(hook)

    def route(router_dtype):
        g = gate if router_dtype is torch.float32 else gate.to(router_dtype)
        return lambda x: g(x.to(router_dtype)).float()

    # trainer: every position of every sequence packed into one call
    where[:] = [(j, p) for j, n in enumerate(case.seq_lens) for p in range(n)]
    packed = route(torch.float32)(torch.cat(states))
    # rollout: one decode step per position, the sequences still running batched
    steps = {}
    for p in range(max(case.seq_lens)):
        live = [j for j, n in enumerate(case.seq_lens) if p < n]
        where[:] = [(j, p) for j in live]
        for j, row in zip(live, route(torch.float32)(torch.stack([states[j][p] for j in live]))):
            steps[(j, p)] = row
    decoded = torch.stack([steps[(j, p)] for j, n in enumerate(case.seq_lens) for p in range(n)])
    forced = torch.cat([case.tie_forced(j, n) for j, n in enumerate(case.seq_lens)])
    assert forced.any() and not forced.all()
    top_p, top_d = packed.double().topk(3, -1), decoded.double().topk(3, -1)
    gap_p = top_p.values[:, 1] - top_p.values[:, 2]
    assert torch.allclose(gap_p[forced], torch.full_like(gap_p[forced], 1e-4), atol=1e-6)  # (fp32 stored)
    assert torch.equal(top_p.indices[:, :2].sort(-1).values, top_d.indices[:, :2].sort(-1).values)  # fp32: agree
    gate.to(torch.float32)
    where[:] = [(j, p) for j, n in enumerate(case.seq_lens) for p in range(n)]
    low = route(torch.bfloat16)(torch.cat(states))
    gate.to(torch.float32)
    flipped = (low.topk(2, -1).indices.sort(-1).values != top_p.indices[:, :2].sort(-1).values).any(-1)
    assert flipped[forced].float().mean() > 0.3 and not flipped[~forced].any()


def test_a_gap_floor_bounds_the_draws_and_is_where_the_gap_shrinks_to():
    import random

    from hypothesis import find

    from harness.shrink import moves
    from harness.strategies import uniform_cases

    floored = Axes(n_seqs=(1, 3), seq_len=(1, 6),
                   routing=RoutingAxes(n_experts=(4, 6), top_k=(1, 3), max_gap=1e-2, min_gap=1e-5))
    assert find(tie_gaps(1e-2, 1e-5), lambda g: True) == 1e-5
    assert find(tie_gaps(1e-2, 0.0), lambda g: True) == 0.0  # (the default: the exact tie)
    rng = random.Random(0)
    gaps = [uniform_cases(floored, rng, log_gap=log).tie_gap for log in (True, False) for _ in range(300)]
    assert min(gaps) >= 1e-5 and max(gaps) <= 1e-2

    @settings(max_examples=60, deadline=None)
    @given(cases(floored))
    def check(case):
        assert 1e-5 <= case.tie_gap <= 1e-2

    check()
    case = uniform_cases(floored, rng, log_gap=True)
    gaps_tried = {m.tie_gap for m in moves(case, floored)}
    assert 1e-5 in gaps_tried and min(gaps_tried) >= 1e-5  # the floor, never the exact tie below it
    assert floored.describe()["routing"]["min_gap"] == 1e-5
    problems = Axes(routing=RoutingAxes(max_gap=1e-3, min_gap=1e-2)).problems()  # (a pair's validate raises them)
    assert problems == ["axes.routing.min_gap=0.01 must lie in [0, max_gap=0.001] (the smallest boundary gap drawn; "
                        "0 reaches the exact tie)"]


CAPPED = Axes(n_seqs=(2, 8), seq_len=(1, 40), prompt_len=(2, 40), packing=True, prompt_group=(1, 3),
              max_context=48, max_tokens=150)


def _check_capped(case):
    totals = [case.prompt_len(j) + n for j, n in enumerate(case.seq_lens)]
    assert max(totals) <= 48 and sum(totals) <= 150, (totals, case)
    assert case.batch_size >= 2 and min(case.seq_lens) >= 1 and min(case.prompt_len(j) for j in range(case.batch_size)) >= 2
    for group in case.groups:  # a shared prompt has one length
        assert len({case.prompt_len(j) for j in group}) == 1, case
    assert case.row_capacity == 0 or max(totals) <= case.row_capacity < sum(totals), case
    assert len(case.ids) == case.batch_size and 0 <= case.probe < case.batch_size
    assert Case.from_json(case.to_json()) == case
    return totals


@settings(max_examples=150, deadline=None)
@given(cases(CAPPED))
def test_capped_cases_stay_under_their_caps(case):
    _check_capped(case)


def test_uniform_capped_cases_stay_under_their_caps_and_reach_them():
    import random

    from harness.strategies import uniform_cases

    rng = random.Random(5)
    drawn = [_check_capped(uniform_cases(CAPPED, rng)) for _ in range(400)]
    # a sequence over the context cap is cut to it (the last positions are drawn often), and a batch over
    # the token cap keeps the sequences that fit: both caps are reached, and long responses still occur
    assert sum(max(t) == 48 for t in drawn) > 100
    assert sum(sum(t) >= 140 for t in drawn) > 20
    # half the batches over max_tokens keep their sequences, shorter: large batches are drawn too
    assert sum(len(t) >= 6 and sum(t) >= 120 for t in drawn) > 20
    c = uniform_cases(CAPPED, random.Random(7))
    assert max(c.seq_lens) <= 46


def test_caps_cut_responses_first_then_prompts_and_keep_the_first_sequences():
    from harness.strategies import fit_caps

    ax = Axes(n_seqs=(1, 8), seq_len=(2, 100), prompt_len=(1, 100), max_context=50, max_tokens=120)
    lens, prompts = [40, 30, 45, 60], [30, 10, 49, 5]
    keep = fit_caps(lens, prompts, ax)
    # context: 30 + 40 -> response 20; 49 + 45 -> response 2 (its least), then prompt 48; 5 + 60 -> response 45
    # tokens: 50 + 40 + 50 + 50 = 190 over 120: the last two sequences go (three would hold 140)
    assert (keep, lens[:keep], prompts[:keep]) == (2, [20, 30], [30, 10])
    lens, prompts = [40, 40, 40], [40, 40, 40]
    ax = Axes(n_seqs=(3, 8), seq_len=(2, 100), prompt_len=(1, 100), max_tokens=60)
    assert fit_caps(lens, prompts, ax) == 3 and sum(lens) + sum(prompts) == 60
    assert lens == [2, 2, 2] and prompts == [40, 13, 1]  # 126 after the responses: 39, then 27 off the prompts
    # keep_batch: every sequence kept, the lengths above the shortest scaled down together
    lens, prompts = [40, 30, 45, 60], [30, 10, 49, 5]
    ax = Axes(n_seqs=(1, 8), seq_len=(2, 100), prompt_len=(1, 100), max_tokens=120)
    assert fit_caps(lens, prompts, ax, keep_batch=True) == 4 and sum(lens) + sum(prompts) <= 120
    assert min(lens) >= 2 and min(prompts) >= 1 and sum(lens) + sum(prompts) >= 110, (lens, prompts)
    assert lens[3] > lens[1] and prompts[2] > prompts[3]  # (the order of the lengths is kept)
    # shared prompts (each sequence names the sequence whose prompt it shares) are cut for their group
    lens, prompts = [2, 2, 2], [40, 40, 40]
    ax = Axes(n_seqs=(1, 8), seq_len=(2, 100), prompt_len=(1, 100), max_tokens=60)
    assert fit_caps(lens, prompts, ax, groups=[0, 0, 0]) == 3 and prompts == [18, 18, 18]


def test_caps_below_what_the_axes_allow_are_refused_with_the_fix():
    bad = Axes(n_seqs=(4, 8), seq_len=(3, 9), prompt_len=(5, 9), max_context=7, max_tokens=20)
    text = " ".join(bad.problems())
    assert "axes.max_context=7" in text and "prompt_len low + seq_len low = 8" in text
    assert "axes.max_tokens=20" in text and "4 x 8" in text
    assert Axes(n_seqs=(4, 8), seq_len=(3, 9), prompt_len=(5, 9), max_context=8, max_tokens=32).problems() == []
    assert Axes(max_context=12).describe()["max_context"] == 12 and "max_tokens" not in Axes().describe()


def test_shrinking_never_leaves_the_caps():
    from harness.shrink import moves, within_sizes

    ax = Axes(n_seqs=(1, 8), seq_len=(1, 40), prompt_len=(0, 40), max_context=30, max_tokens=80)
    case = Case(seed=1, seq_lens=(5, 3, 12), prompt_lens=(25, 25, 8), prompt_ids=(0, 0, 2), seq_ids=(0, 1, 2))
    out = list(moves(case, ax))
    assert within_sizes(case, ax) and len(out) > 10 and all(within_sizes(c, ax) for c in out)
    assert not within_sizes(case.replace(seq_lens=(6, 3, 12)), ax)  # 31 tokens in sequence 0
    assert not within_sizes(case.replace(seq_lens=(5, 3, 14), prompt_lens=(25, 25, 9)), ax)  # 81 in the batch
