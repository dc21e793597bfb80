"""Hypothesis strategies that draw Cases, and the near-tie tensor generators pairs build from.

Cases are drawn as a handful of small choices (sizes, layout, sampling knobs, a seed, a gap);
tensors are never drawn element by element: `pair.build` generates them from the case's streams.
So generation is fast and Hypothesis shrinks what matters, the sizes and knobs, toward the simplest
case that still diverges (see `harness.case` for what "simpler" means field by field).

What breaks engines is not what Hypothesis draws by default (it favours small collections and the
bounds of floats), so every axis is drawn on purpose:

- sizes (batch, response and prompt lengths, sampling top-k) from a mixture: uniform over the
  declared range, or a boundary value (the bounds, and every power of two with its neighbours
  2^k - 1, 2^k + 1 inside them: kernels switch there). The batch size is drawn as a number, then
  that many sequences, so a large batch is as likely as a small one.
- peakedness (logit scale) log-uniform over its range; floats uniform (drawn from 24-bit integers,
  not Hypothesis's bound-favouring floats).
- sampling knobs from a mixture of neutral (1.0 / 1.0 / off), near neutral, and far: each shrinks
  toward neutral first (it is the first branch), then toward the simpler end of its range.
- each sequence carries a drawn stream id: removing a sequence leaves the others' tensors alone.
- the seed is drawn last, so the shrinker reaches it after every structural knob.
- `uniform_cases` draws a case uniformly at random over the same axes. Hypothesis's engine starts
  from the simplest case, completes novel prefixes with the simplest choices and mutates what it
  has seen, which finds small triggers fast and large ones slowly (measured: a left-pad mask bug
  took 77 cases where uniform random needed 1), and no strategy shape changes that (a `one_of`
  with a uniform branch got 11-29% of the draws). So a campaign interleaves: every Hypothesis case
  is followed by uniform cases from the stream's own RNG (`harness.fuzz.UNIFORM_PER_EXAMPLE`: three
  for op pairs, whose cases cost about what Hypothesis's engine costs per example, one for model
  pairs; `--uniform-per-example`); a failing uniform
  case is shrunk by the polish pass (`harness.shrink`).

The near-tie gap is drawn as its own value, `gap = mantissa * max_gap * 10**(exponent - 7)`, with
both the mantissa (toward 0.0) and the exponent (toward 1e-7 * max_gap) shrinking toward the exact
tie (with `RoutingAxes(min_gap=g)`: `g + mantissa * (max_gap - g) * ...`, shrinking toward g). Uniform floats on [0, 1e-2] almost never land within bf16 rounding of a score; this draws
gaps log-uniformly over seven decades, so the interesting region is hit often.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from .case import NEUTRAL, PENALTIES, Case
from .pairs import Axes

GAP_DECADES = 7
_U_BITS = 24  # resolution of the uniform draws


def boundary_values(lo: int, hi: int) -> list[int]:
    """The bounds and every 2^k - 1, 2^k, 2^k + 1 inside [lo, hi], ascending."""
    vals = {lo, hi}
    k = 1
    while k <= hi + 1:
        vals.update(v for v in (k - 1, k, k + 1) if lo <= v <= hi)
        k *= 2
    return sorted(vals)


def sizes(lo: int, hi: int) -> st.SearchStrategy[int]:
    """An integer in [lo, hi]: uniform half the time, a boundary value (powers of two) otherwise.
    Shrinks toward lo."""
    if lo == hi:
        return st.just(lo)
    span = hi - lo + 1
    uniform = _uniform_bits().map(lambda u: lo + (u * span >> _U_BITS))
    return st.one_of(uniform, st.sampled_from(boundary_values(lo, hi)))


def _uniform_bits() -> st.SearchStrategy[int]:
    """A uniform integer in [0, 2**24), shrinking toward 0. (Hypothesis draws wide integer ranges
    heavily toward small values, measured: 86% in the lowest 1/16 of [0, 2**24); fixed-size bytes
    are drawn uniformly.)"""
    return st.binary(min_size=_U_BITS // 8, max_size=_U_BITS // 8).map(lambda b: int.from_bytes(b, "big"))


def _packed_size(b: bytes, lo: int, hi: int, bounds: list[int]) -> int:
    """`sizes(lo, hi)` from 4 drawn bytes: byte 0 below 128 picks the uniform draw (bytes 1-3), else
    a boundary value. All-zero bytes (where shrinking goes) give lo."""
    if lo == hi:
        return lo
    u = int.from_bytes(b[1:4], "big")
    if b[0] < 128:
        return lo + (u * (hi - lo + 1) >> _U_BITS)
    return bounds[u % len(bounds)]


def unit_floats() -> st.SearchStrategy[float]:
    """Uniform in [0, 1), shrinking toward 0."""
    return _uniform_bits().map(lambda u: u / 2**_U_BITS)


def uniform_floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    if hi <= lo:
        return st.just(float(lo))
    return unit_floats().map(lambda u: float(lo + (hi - lo) * u))


def log_uniform(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Log-uniform in [lo, hi] (lo > 0), shrinking toward lo."""
    if hi <= lo:
        return st.just(float(lo))
    return unit_floats().map(lambda u: float(min(hi, lo * (hi / lo) ** u)))


def temperatures(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Neutral 1.0 (when in range), near it (within 10%), or anywhere log-uniform."""
    if hi <= lo:
        return st.just(float(lo))
    branches = [st.just(1.0)] if lo <= 1.0 <= hi else []
    near_lo, near_hi = max(lo, 0.9), min(hi, 1.1)
    if near_lo < near_hi:
        branches.append(uniform_floats(near_lo, near_hi))
    branches.append(log_uniform(lo, hi))
    return st.one_of(*branches)


def top_ps(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Neutral 1.0 (off, when in range), near it (>= 0.9), or anywhere in range."""
    if hi <= lo:
        return st.just(float(lo))
    branches = [st.just(1.0)] if hi >= 1.0 else []
    if max(lo, 0.9) < hi:
        branches.append(uniform_floats(max(lo, 0.9), hi).map(lambda p: 1.0 - (1.0 - p)))
    branches.append(uniform_floats(lo, hi).map(lambda p: max(p, 1e-6)))
    return st.one_of(*branches)


def off_or_uniform(lo: float, hi: float, neutral: float) -> st.SearchStrategy[float]:
    """The neutral value (off, when in range) or a value in range, its bounds included: min-p, the
    penalties."""
    if hi <= lo:
        return st.just(float(lo))
    branches = [st.just(float(neutral))] if lo <= neutral <= hi else []
    branches.append(uniform_floats(lo, hi))
    return st.one_of(*branches)


def sample_top_ks(lo: int, hi: int) -> st.SearchStrategy[int]:
    """0 (off, when in range) or a size in range (boundary values included)."""
    if hi <= lo:
        return st.just(lo)
    branches = [st.just(0)] if lo == 0 else []
    branches.append(sizes(max(lo, 1), hi))
    return st.one_of(*branches)


def cases(axes: Axes) -> st.SearchStrategy[Case]:
    """A Case within the bounds `axes` declares; axes not fuzzed keep their neutral values.

    The fixed-bound strategies are built once per axes, not on every draw: building a bounded
    strategy costs more than drawing from it.
    """
    r = axes.routing
    seeds = st.binary(min_size=4, max_size=4).map(lambda b: int.from_bytes(b, "big"))
    batch = sizes(*axes.n_seqs)
    has_prompts = axes.prompt_len != (0, 0)
    resp_bounds, prompt_bounds = boundary_values(*axes.seq_len), boundary_values(*axes.prompt_len)
    # one choice per sequence (response size, prompt size, stream id packed in fixed-size bytes):
    # a Hypothesis draw costs ~0.1 ms, and a 16-sequence case made of 4 draws per sequence spent more
    # time drawing than running an op pair; deleting a sequence is still deleting one choice
    seq_bytes = st.binary(min_size=10 if has_prompts else 6, max_size=10 if has_prompts else 6)
    pad_sides = st.sampled_from(axes.pad_sides) if len(axes.pad_sides) > 1 else None
    experts = st.integers(*r.n_experts) if r is not None else None
    fractions = uniform_floats(*r.tie_fraction) if r is not None else None
    gaps = tie_gaps(r.max_gap, r.min_gap) if r is not None else None
    lo, hi = axes.logit_scale
    scales = log_uniform(lo, hi) if hi > lo else None
    temps = temperatures(*axes.temperature) if axes.temperature[0] != axes.temperature[1] else None
    tops = top_ps(*axes.top_p) if axes.top_p[0] != axes.top_p[1] else None
    topks = sample_top_ks(*axes.sample_top_k) if axes.sample_top_k[0] != axes.sample_top_k[1] else None
    minps = off_or_uniform(*axes.min_p, 0.0) if axes.min_p[0] != axes.min_p[1] else None
    pens = {name: off_or_uniform(*getattr(axes, name), NEUTRAL[name]) for name in PENALTIES
            if getattr(axes, name)[0] != getattr(axes, name)[1]}
    dtypes = st.sampled_from(axes.dtypes) if len(axes.dtypes) > 1 else None
    group_sizes = st.integers(*axes.prompt_group) if axes.prompt_group[1] > 1 else None
    capped = axes.max_context is not None or axes.max_tokens is not None

    @st.composite
    def draw_case(draw: Any) -> Case:
        # the draw order is part of what a campaign seed reproduces; the seed comes last on purpose
        n = draw(batch)
        seq_lens, prompt_lens, seq_ids = [], [], []
        for _ in range(n):
            b = draw(seq_bytes)
            seq_lens.append(_packed_size(b[0:4], *axes.seq_len, resp_bounds))
            if has_prompts:
                prompt_lens.append(_packed_size(b[6:10], *axes.prompt_len, prompt_bounds))
            seq_ids.append(int.from_bytes(b[4:6], "big"))
        if capped:  # (a batch over max_tokens keeps its first sequences, or, drawn, all of them shorter)
            keep_batch = draw(st.booleans()) if axes.max_tokens is not None else False
            n = fit_caps(seq_lens, prompt_lens, axes, keep_batch=keep_batch)
            del seq_lens[n:], prompt_lens[n:], seq_ids[n:]
        fields: dict[str, Any] = {"seq_lens": tuple(seq_lens)}
        if has_prompts and any(prompt_lens):
            fields["prompt_lens"] = tuple(prompt_lens)
        seq_ids = distinct_ids(seq_ids)
        fields["seq_ids"] = () if seq_ids == list(range(n)) else tuple(seq_ids)
        fields["probe"] = draw(st.integers(0, n - 1)) if n > 1 else 0

        if axes.packing:
            totals = [a + (prompt_lens[j] if prompt_lens else 0) for j, a in enumerate(seq_lens)]
            total, longest = sum(totals), max(totals)
            cut = draw(st.integers(0, total - longest))  # 0 = one row holding everything
            fields["row_capacity"] = total - cut if cut else 0
            order = draw(st.permutations(range(n))) if n > 1 else [0]
            fields["order"] = () if list(order) == list(range(n)) else tuple(order)
        fields["pad_side"] = draw(pad_sides) if pad_sides is not None else axes.pad_sides[0]

        if r is not None:
            n_experts = draw(experts)
            fields["n_experts"] = n_experts
            fields["top_k"] = draw(st.integers(r.top_k[0], min(r.top_k[1], n_experts - 1)))
            fields["tie_fraction"] = draw(fractions)
            fields["tie_gap"] = draw(gaps)

        fields["logit_scale"] = draw(scales) if scales is not None else lo
        fields["temperature"] = draw(temps) if temps is not None else float(axes.temperature[0])
        fields["top_p"] = draw(tops) if tops is not None else float(axes.top_p[0])
        fields["sample_top_k"] = draw(topks) if topks is not None else axes.sample_top_k[0]
        # (drawn only where the axis is fuzzed: pairs without it draw the cases they drew before it existed)
        fields["min_p"] = draw(minps) if minps is not None else float(axes.min_p[0])
        for name in PENALTIES:  # (the same: drawn only where fuzzed)
            fields[name] = draw(pens[name]) if name in pens else float(getattr(axes, name)[0])
        fields["dtype"] = draw(dtypes) if dtypes is not None else axes.dtypes[0]
        if axes.params:
            fields["params"] = {k: draw(axes.params[k]) for k in sorted(axes.params)}
        if group_sizes is not None:  # (drawn only where the axis is on: other pairs draw what they drew)
            _group(fields, draw(group_sizes), interleaved=draw(st.booleans()), axes=axes)
        fields["seed"] = draw(seeds)
        return Case(**fields)

    return draw_case()


def fit_caps(seq_lens: list[int], prompt_lens: list[int], axes: Any, groups: list[int] | None = None,
             keep_batch: bool = False) -> int:
    """Fit drawn sequences to the axes' caps, in place; returns how many of them the case keeps.

    `Axes.max_context`: a sequence over it keeps its prompt and has its response cut to fit (at
    least the axes' shortest response), then its prompt. `Axes.max_tokens`: the first sequences
    that fit are kept (at least n_seqs' low; never with `groups`), then responses are cut, then
    prompts, from the last sequence back. With `keep_batch` (half of the draws: long sequences
    would otherwise crowd out large batches), every sequence the cap can hold at its shortest is
    kept and their lengths above the shortest are scaled down together to fit. `prompt_lens` may be empty (no prompts). `groups`: for
    each sequence, the index of the sequence whose prompt it shares (a cut prompt is cut for each
    sequence of its group). Both caps stay reachable: `Axes.problems` refuses a cap below the
    shortest sequence (batch) the axes allow.
    """
    n = len(seq_lens)
    s_lo, p_lo = axes.seq_len[0], axes.prompt_len[0]
    prompts = prompt_lens if prompt_lens else [0] * n
    owner = groups if groups is not None else list(range(n))

    def set_prompt(j: int, value: int) -> None:
        for i in range(n):
            if owner[i] == owner[j]:
                prompts[i] = value

    c = axes.max_context
    if c is not None:
        for j in range(n):
            if prompts[j] + seq_lens[j] > c:
                seq_lens[j] = max(s_lo, c - prompts[j])
                if prompts[j] + seq_lens[j] > c:
                    set_prompt(j, c - seq_lens[j])
    t = axes.max_tokens
    keep = n
    if t is not None:
        total = sum(seq_lens) + sum(prompts)
        least = s_lo + p_lo  # (a sequence at its shortest)
        if groups is None and keep_batch and total > t:
            keep = max(min(n, axes.n_seqs[0]), min(n, t // max(least, 1)))
            room = sum(seq_lens[:keep]) + sum(prompts[:keep]) - keep * least  # tokens above the shortest
            f = min(1.0, max(0, t - keep * least) / room) if room > 0 else 0.0
            for j in range(keep):
                seq_lens[j] = s_lo + int((seq_lens[j] - s_lo) * f)
                prompts[j] = p_lo + int((prompts[j] - p_lo) * f)
            total = sum(seq_lens[:keep]) + sum(prompts[:keep])
        elif groups is None:
            while keep > axes.n_seqs[0] and total > t:
                keep -= 1
                total -= seq_lens[keep] + prompts[keep]
        for j in reversed(range(keep)):  # responses, then prompts, from the last sequence back
            if total <= t:
                break
            cut = min(total - t, seq_lens[j] - s_lo)
            seq_lens[j] -= cut
            total -= cut
        for j in reversed(range(keep)):
            if total <= t:
                break
            members = sum(1 for i in range(keep) if owner[i] == owner[j])
            cut = min(-(-(total - t) // members), prompts[j] - p_lo)
            if cut > 0:
                set_prompt(j, prompts[j] - cut)
                total -= cut * members
    if prompt_lens:
        prompt_lens[:] = prompts
    return keep


def _group(fields: dict[str, Any], size: int, interleaved: bool = False, axes: Any = None) -> None:
    """Sequences in groups of `size` share the prompt of their group's first sequence
    (`Case.prompt_ids`: its stream id; its prompt length): consecutive (A A B B), or `interleaved`
    (A B A B: requests of several prompts arriving in turn at an engine's prefix cache); size 1
    leaves every prompt its own. Where a shared prompt made a sequence longer than the axes' caps
    allow (`Axes.max_context`, `max_tokens`), responses are cut, then shared prompts (for their whole
    group). A row capacity drawn before is raised to the longest sequence where a shared prompt made
    one longer (one row when that holds everything)."""
    if size <= 1:
        return
    n = len(fields["seq_lens"])
    ids = fields.get("seq_ids") or tuple(range(n))
    n_groups = -(-n // size)
    firsts = [j % n_groups if interleaved else size * (j // size) for j in range(n)]
    pids = tuple(ids[f] for f in firsts)
    if pids == tuple(ids):
        return
    fields["prompt_ids"] = pids
    prompts = fields.get("prompt_lens") or ()
    if prompts:
        fields["prompt_lens"] = prompts = tuple(prompts[f] for f in firsts)
        if axes is not None and (axes.max_context is not None or axes.max_tokens is not None):
            lens, shared = list(fields["seq_lens"]), list(prompts)
            fit_caps(lens, shared, axes, groups=firsts)
            prompts = tuple(shared)
            fields["seq_lens"], fields["prompt_lens"] = tuple(lens), prompts
    cap = fields.get("row_capacity", 0)
    if cap:
        totals = [a + (prompts[j] if prompts else 0) for j, a in enumerate(fields["seq_lens"])]
        cap = max(cap, max(totals))
        fields["row_capacity"] = cap if cap < sum(totals) else 0


def structured_cases(axes: Axes) -> st.SearchStrategy[Case]:
    """The same as `cases` (the name says which half of a campaign's draws it makes)."""
    return cases(axes)


def distinct_ids(ids: list[int]) -> list[int]:
    """Stream ids made distinct in order (a repeat moves up to the next free id, mod 2^16). Two
    sequences with one id draw the same tokens, and identical sequences hide what leaks between
    them (a packed attention mask that lets one attend to the other scores them alike); Hypothesis
    shrinks raw ids toward all-zero, which this turns into 0, 1, 2, ... (the default)."""
    used: set[int] = set()
    out = []
    for i in ids:
        while i in used:
            i = (i + 1) % 2**16
        used.add(i)
        out.append(i)
    return out


def uniform_cases(axes: Axes, rng: Any, params: dict | None = None, log_gap: bool = False) -> Case:
    """One case drawn uniformly at random over the same axes (the baseline a fuzzer must beat, and
    half of a campaign's draws): every size uniform over its range, every float uniform, no
    boundary or neutral preference. `rng` is a `random.Random`; `params` the free parameters (the
    pair's own strategies cannot be drawn from outside Hypothesis). `log_gap` draws the near-tie gap
    log-uniformly over the same decades as `tie_gaps` (a campaign's interleaved cases do: a uniform
    gap on [0, 1e-2] is almost never within float rounding of a tie)."""
    r = axes.routing
    n = rng.randint(*axes.n_seqs)
    seq_lens = tuple(rng.randint(*axes.seq_len) for _ in range(n))
    fields: dict[str, Any] = {"seed": rng.randrange(2**32), "seq_lens": seq_lens,
                              "seq_ids": tuple(distinct_ids([rng.randrange(2**16) for _ in range(n)]))}
    if axes.prompt_len != (0, 0):
        prompts = tuple(rng.randint(*axes.prompt_len) for _ in range(n))
        fields["prompt_lens"] = prompts if any(prompts) else ()
    if axes.max_context is not None or axes.max_tokens is not None:
        lens, shared = list(seq_lens), list(fields.get("prompt_lens") or ())
        n = fit_caps(lens, shared, axes, keep_batch=axes.max_tokens is not None and rng.random() < 0.5)
        fields["seq_lens"], fields["seq_ids"] = tuple(lens[:n]), fields["seq_ids"][:n]
        if shared:
            fields["prompt_lens"] = tuple(shared[:n]) if any(shared[:n]) else ()
        seq_lens = fields["seq_lens"]
    fields["probe"] = rng.randrange(n)
    if axes.packing:
        totals = [a + (fields.get("prompt_lens") or (0,) * n)[j] for j, a in enumerate(seq_lens)]
        cut = rng.randint(0, sum(totals) - max(totals))
        fields["row_capacity"] = sum(totals) - cut if cut else 0
        order = list(range(n))
        rng.shuffle(order)
        fields["order"] = tuple(order)
    fields["pad_side"] = rng.choice(axes.pad_sides)
    if r is not None:
        fields["n_experts"] = rng.randint(*r.n_experts)
        fields["top_k"] = rng.randint(r.top_k[0], min(r.top_k[1], fields["n_experts"] - 1))
        fields["tie_fraction"] = rng.uniform(*r.tie_fraction)
        if log_gap:  # (min_gap 0: exactly the values drawn before it existed)
            fields["tie_gap"] = r.min_gap + (r.max_gap - r.min_gap) * 10.0 ** rng.uniform(-GAP_DECADES, 0.0)
        else:
            fields["tie_gap"] = rng.uniform(r.min_gap, r.max_gap)
    fields["logit_scale"] = rng.uniform(*axes.logit_scale)
    fields["temperature"] = rng.uniform(*axes.temperature)
    fields["top_p"] = max(1e-6, rng.uniform(*axes.top_p))
    fields["sample_top_k"] = rng.randint(*axes.sample_top_k)
    fields["min_p"] = rng.uniform(*axes.min_p) if axes.min_p[0] != axes.min_p[1] else float(axes.min_p[0])
    for name in PENALTIES:
        lo, hi = getattr(axes, name)
        fields[name] = rng.uniform(lo, hi) if lo != hi else float(lo)
    fields["dtype"] = rng.choice(axes.dtypes)
    if params:
        fields["params"] = dict(params)
    if axes.prompt_group[1] > 1:  # (drawn only where the axis is on: other pairs draw what they drew)
        _group(fields, rng.randint(*axes.prompt_group), interleaved=rng.random() < 0.5, axes=axes)
    return Case(**fields)


def tie_gaps(max_gap: float, min_gap: float = 0.0) -> st.SearchStrategy[float]:
    """Boundary gaps in [min_gap, max_gap], min_gap + a log-uniform part over GAP_DECADES decades,
    shrinking to min_gap (0: the exact tie)."""
    if max_gap <= min_gap:
        return st.just(float(min_gap))
    return st.builds(
        lambda m, e: min_gap + float(m * (max_gap - min_gap) * 10.0 ** (e - GAP_DECADES)),
        unit_floats(),
        st.integers(0, GAP_DECADES),
    )


# ---------------------------------------------------------------------------------------------
# Near-tie tensors (called from pair.build, deterministic given the case)
# ---------------------------------------------------------------------------------------------
def forced_tokens(case: Case, n_tokens: int, salt: str = "ties") -> Any:
    """(T,) bool: which tokens the case forces to the top-k boundary (a `tie_fraction` of them).

    For the case's own tokens (n_tokens == case.n_tokens) each sequence decides from its own stream,
    so dropping a sequence keeps the others' forced tokens; other lengths use one stream."""
    import torch

    if n_tokens == case.n_tokens and case.streams == "sequence":
        return case.token_uniforms(salt) < case.tie_fraction  # (T,)
    u = torch.rand(n_tokens, generator=case.generator(salt))  # (T,)
    return u < case.tie_fraction


def _forced_rows(forced: Any, n: int) -> Any:
    import torch

    t = torch.as_tensor(forced).cpu()
    if t.dtype != torch.bool or t.shape != (n,):
        raise ValueError(f"forced must be a ({n},) bool tensor, one flag per row; got {t.dtype} {tuple(t.shape)}")
    return t


def _boundary_pair(scores: Any, k: int) -> tuple[Any, Any]:
    """Per row, the expert ids at rank k-1 and k (0-based): the last chosen and the first not."""
    import torch

    top = torch.topk(scores, k + 1, dim=-1).indices  # (T, k+1)
    a, b = top[:, k - 1], top[:, k]
    return torch.maximum(a, b), torch.minimum(a, b)  # (winner, runner-up): the winner has the higher id


def near_tie_logits(logits: Any, case: Case, salt: str = "ties", forced: Any = None) -> Any:
    """Router logits (T, E) with the boundary of forced tokens set to an exact `case.tie_gap`.

    `forced` ((T,) bool) says which rows to force when the rows are not the case's tokens in case
    order (a router inside a model: see `Case.tie_forced`); by default `forced_tokens(case, T)`.

    For each forced token the experts at ranks k and k+1 are re-scored so that the one with the
    higher id leads by exactly `tie_gap` (computed in float64, stored in the input dtype). An engine
    whose rounding turns the gap into an exact tie then picks the other expert wherever its top-k
    prefers the lower id on ties, as torch.topk does here: the construction aims at the flip.
    """
    import torch

    out = logits.clone()
    t = forced_tokens(case, logits.shape[0], salt) if forced is None else _forced_rows(forced, logits.shape[0])
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
                    aim_rounds: int | None = None, forced: Any = None) -> Any:
    """Hidden states (T, H) nudged so that the router logits x @ w_router (E columns) of forced
    tokens have their top-k boundary at exactly `case.tie_gap` (to float64 precision before x is
    stored in its own dtype).

    `forced` ((T,) bool) picks the rows when they are not the case's tokens in case order: in a
    forward pre-hook on a router inside a model, the rows are whatever the path's layout puts there
    (packed sequences, a decode step's batch), so the hook marks each row from `case.tie_forced(j,
    n)[p]` for the sequence j and position p it holds. Each row's nudge depends on that row alone, so
    a position gets the same boundary gap in the trainer's packed forward and in the rollout's
    decode step. By default `forced_tokens(case, T)`.

    `aim_rounds` (below) defaults to 4, and to 0 with `forced`: inside a model each path nudges its
    own hidden states, which differ in their last bits, so aiming could make each path lead with
    the other expert: a flip no rounding of the router caused. Without aiming the higher expert
    id leads in both, and only a router that rounds the gap away flips.

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
    t = forced_tokens(case, x.shape[0], salt) if forced is None else _forced_rows(forced, x.shape[0])
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
    if aim_rounds is None:
        aim_rounds = 4 if forced is None else 0
    if case.tie_gap > 0 and low in (torch.bfloat16, torch.float16) and aim_rounds > 0:
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
