"""Hypothesis strategies that draw Cases, and the near-tie tensor generators pairs build from.

Cases are drawn as a handful of small choices (sizes, layout, a seed, a gap); tensors are never
drawn element by element: `pair.build` generates them from `case.seed`. So generation is fast and
Hypothesis shrinks what matters, the sizes and layout, toward the simplest case that still diverges
(see `harness.case` for what "simpler" means field by field).

The near-tie gap is drawn as its own value, `gap = mantissa * max_gap * 10**(exponent - 7)`, with
both the mantissa (toward 0.0) and the exponent (toward 1e-7 * max_gap) shrinking toward the exact
tie. Uniform floats on [0, 1e-2] almost never land within bf16 rounding of a score; this draws
gaps log-uniformly over seven decades, so the interesting region is hit often.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from .case import Case
from .pairs import Axes

GAP_DECADES = 7


def cases(axes: Axes) -> st.SearchStrategy[Case]:
    """A Case within the bounds `axes` declares; fields of axes not fuzzed keep their defaults.

    The fixed-bound strategies are built once per axes, not on every draw: building a bounded
    float strategy costs more than drawing from it.
    """
    r = axes.routing
    seeds = st.integers(0, 2**32 - 1)
    lengths = st.lists(st.integers(*axes.seq_len), min_size=axes.n_seqs[0], max_size=axes.n_seqs[1])
    pad_sides = st.sampled_from(("right", "left"))
    experts = st.integers(*r.n_experts) if r is not None else None
    fractions = st.floats(*r.tie_fraction, allow_nan=False) if r is not None else None
    gaps = tie_gaps(r.max_gap) if r is not None else None
    lo, hi = axes.logit_scale
    scales = st.floats(lo, hi, allow_nan=False) if hi > lo else None
    dtypes = st.sampled_from(axes.dtypes) if len(axes.dtypes) > 1 else None

    @st.composite
    def draw_case(draw: Any) -> Case:
        seed = draw(seeds)  # the draw order is part of what a campaign seed reproduces: keep it
        seq_lens = draw(lengths)
        n = len(seq_lens)
        fields: dict[str, Any] = {"seed": seed, "seq_lens": tuple(seq_lens)}
        fields["probe"] = draw(st.integers(0, n - 1)) if n > 1 else 0

        if axes.packing:
            total, longest = sum(seq_lens), max(seq_lens)
            cut = draw(st.integers(0, total - longest))  # 0 = one row holding everything
            fields["row_capacity"] = total - cut if cut else 0
            order = draw(st.permutations(range(n))) if n > 1 else [0]
            fields["order"] = () if list(order) == list(range(n)) else tuple(order)
            fields["pad_side"] = draw(pad_sides)

        if r is not None:
            n_experts = draw(experts)
            fields["n_experts"] = n_experts
            fields["top_k"] = draw(st.integers(r.top_k[0], min(r.top_k[1], n_experts - 1)))
            fields["tie_fraction"] = draw(fractions)
            fields["tie_gap"] = draw(gaps)

        fields["logit_scale"] = draw(scales) if scales is not None else lo
        fields["dtype"] = draw(dtypes) if dtypes is not None else axes.dtypes[0]
        if axes.params:
            fields["params"] = {k: draw(axes.params[k]) for k in sorted(axes.params)}
        return Case(**fields)

    return draw_case()


def tie_gaps(max_gap: float) -> st.SearchStrategy[float]:
    """Boundary gaps in [0, max_gap], log-uniform over GAP_DECADES decades, shrinking to 0."""
    if max_gap <= 0:
        return st.just(0.0)
    return st.builds(
        lambda m, e: float(m * max_gap * 10.0 ** (e - GAP_DECADES)),
        st.floats(0.0, 1.0, allow_nan=False),
        st.integers(0, GAP_DECADES),
    )


# ---------------------------------------------------------------------------------------------
# Near-tie tensors (called from pair.build, deterministic given the case)
# ---------------------------------------------------------------------------------------------
def forced_tokens(case: Case, n_tokens: int, salt: str = "ties") -> Any:
    """(T,) bool: which tokens the case forces to the top-k boundary (a `tie_fraction` of them)."""
    import torch

    u = torch.rand(n_tokens, generator=case.generator(salt))  # (T,)
    return u < case.tie_fraction


def _boundary_pair(scores: Any, k: int) -> tuple[Any, Any]:
    """Per row, the expert ids at rank k-1 and k (0-based): the last chosen and the first not."""
    import torch

    top = torch.topk(scores, k + 1, dim=-1).indices  # (T, k+1)
    a, b = top[:, k - 1], top[:, k]
    return torch.maximum(a, b), torch.minimum(a, b)  # (winner, runner-up): the winner has the higher id


def near_tie_logits(logits: Any, case: Case, salt: str = "ties") -> Any:
    """Router logits (T, E) with the boundary of forced tokens set to an exact `case.tie_gap`.

    For each forced token the experts at ranks k and k+1 are re-scored so that the one with the
    higher id leads by exactly `tie_gap` (computed in float64, stored in the input dtype). An engine
    whose rounding turns the gap into an exact tie then picks the other expert wherever its top-k
    prefers the lower id on ties, as torch.topk does here: the construction aims at the flip.
    """
    import torch

    out = logits.clone()
    t = forced_tokens(case, logits.shape[0], salt)
    if not bool(t.any()) or case.top_k >= logits.shape[-1]:
        return out
    rows = t.nonzero().squeeze(-1)
    sub = out[rows].to(torch.float64)  # (F, E)
    win, run = _boundary_pair(sub, case.top_k)
    level = torch.maximum(sub.gather(1, win[:, None]), sub.gather(1, run[:, None]))  # (F, 1)
    sub.scatter_(1, win[:, None], level)
    sub.scatter_(1, run[:, None], level - case.tie_gap)
    out[rows] = sub.to(out.dtype)
    return out


def near_tie_hidden(x: Any, w_router: Any, case: Case, salt: str = "ties", rounds: int = 3,
                    aim_rounds: int = 4) -> Any:
    """Hidden states (T, H) nudged so that the router logits x @ w_router (E columns) of forced
    tokens have their top-k boundary at exactly `case.tie_gap` (to float64 precision before x is
    stored in its own dtype).

    The nudge moves x along w[:, a] - w[:, b], the one direction that changes the gap between the
    boundary pair (a, b) and nothing else about them; a few rounds settle which pair sits at the
    boundary. This is the router weight-row construction: the tie survives into the GEMM, so a GEMM
    in `case.dtype` can reorder the pair.

    Then it aims at the flip. Which of the pair leads by the gap is a free choice, so for each forced
    token both routers are evaluated as a rollout would run them (x @ w_router in x's dtype, and
    with x and w_router in `case.dtype`, the GEMM's output rounded too, top-k by torch.topk), and
    where they pick the same experts the other expert of the pair is made to lead instead (up to
    `aim_rounds` times: re-nudging moves x's own rounding). Rounding noise in the GEMM is
    symmetric, so without this about half of the near-tie tokens flip; with it most do.
    """
    import torch

    out = x.clone()
    t = forced_tokens(case, x.shape[0], salt)
    if not bool(t.any()) or case.top_k >= w_router.shape[-1]:
        return out
    rows = t.nonzero().squeeze(-1)
    xs = out[rows].to(torch.float64)  # (F, H)
    w = w_router.to(torch.float64)  # (H, E)

    def set_gap(xs, lead, trail):  # move xs along w[:, lead] - w[:, trail] until lead - trail == gap
        d = (w[:, lead] - w[:, trail]).T  # (F, H)
        logits = xs @ w  # (F, E)
        gap_now = logits.gather(1, lead[:, None]) - logits.gather(1, trail[:, None])  # (F, 1)
        return xs + (case.tie_gap - gap_now) / (d * d).sum(-1, keepdim=True).clamp_min(1e-30) * d

    for _ in range(rounds):
        lead, trail = _boundary_pair(xs @ w, case.top_k)
        xs = set_gap(xs, lead, trail)
    low = getattr(torch, case.dtype)
    if case.tie_gap > 0 and low in (torch.bfloat16, torch.float16):
        hi, lo = _boundary_pair(xs @ w, case.top_k)  # the boundary pair by id; `hi` leads now
        lead, trail = hi, lo
        w_low, w_full = w_router.to(low), w_router.to(out.dtype)
        for _ in range(aim_rounds):
            stored = xs.to(out.dtype)  # (F, H) as the pair will see it
            s_full = stored @ w_full  # (F, E) the full-precision router's scores
            s_low = (stored.to(low) @ w_low).float()  # (F, E) the low-precision router's scores
            k = case.top_k
            same = (torch.sort(s_full.topk(k, -1).indices, -1).values
                    == torch.sort(s_low.topk(k, -1).indices, -1).values).all(-1)  # (F,) no flip yet
            if not bool(same.any()):
                break
            lead, trail = torch.where(same, trail, lead), torch.where(same, lead, trail)
            xs = torch.where(same[:, None], set_gap(xs, lead, trail), xs)
    out[rows] = xs.to(out.dtype)
    return out
