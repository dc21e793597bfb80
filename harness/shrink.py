"""The polish pass: after Hypothesis has shrunk a failure, make it the simplest trigger.

Hypothesis shrinks the choices behind a case; it does not know that a temperature of 1.0 is simpler
than 0.5, nor that sequence 3 can be removed without touching the others (it deletes list elements
it drew, and a batch size drawn as a number is lowered from the end). This pass finishes the job on
the case itself, one knob at a time, keeping a move only when the case still fails with the same
signature:

1. drop one sequence (every other sequence keeps its stream id, so its tensors are unchanged);
2. move one knob to its neutral value (temperature 1.0, top-p 1.0, top-k off, right padding,
   one packed row in the given order, no forced router ties, probe 0, default stream ids; with the pair's axes: logit scale
   at its low bound, the first dtype, the fewest experts and the smallest router top-k);
3. empty one prompt, halve one prompt or response, then drop ..., 8, 4, 2, 1 of their last tokens
   (a bug past a block boundary need not fire at every length above it; the 2^k steps for the
   longest sequence only; every prompt, or response, of one length together, for a bug that needs two
   equal lengths), or give all but one or half of the longest sequence's response tokens
   (all but one of any other's), or one token of any sequence's, to its prompt (the same positions,
   fewer scored tokens; within the axes' prompt lengths); a near-tie case
   becomes one token with every token forced (which tokens are forced is drawn per token);
   the longest sequence's prompt and response, and the batch (its first m sequences), at the sizes
   where engines switch kernels (`_round_sizes`: 1-4, 2^k, multiples of 16 up to 64, and one past
   each), smallest first: a bug past a switch need not fire at every size above it;
4. move a continuous knob halfway to neutral (temperature and top-p toward 1, logit scale toward
   its low bound, the tie gap toward 0): repeated, this bisects to
   the knob value nearest neutral that still fails (a temperature bug shrinks to T = 1.03, not 0.5;
   in a campaign, the value nearest neutral that still fails by `EDGE_MARGIN`: a repro a CPU's last
   bits cannot move under the line);
5. step a discrete knob down (sampling top-k toward 1, router top-k and expert count toward their
   low bounds, the expert count kept above top-k), halfway and by one: a bug from top-k >= 4
   shrinks to top-k = 4;
6. set a free parameter (`Axes.params`) to its strategy's simplest value (what Hypothesis shrinks
   it to: 0.0 for `st.floats(0.0, 0.2)`, the first of `st.sampled_from`), and a numeric one halfway
   there (one of `st.sampled_from`: to the value before it in its list, never to one it cannot draw):
   a uniform case copies its example's parameters, which Hypothesis never shrank.

It repeats until no move is accepted (the result is 1-minimal with respect to
`Case.simpler_neighbours()`) or its evaluation budget or deadline is spent. Each evaluation is one
case through the pair, so the budget is small next to a campaign's.
"""

from __future__ import annotations

import time
import math
from typing import Any, Callable, Iterator

from .case import NEUTRAL, OMITTED_WHEN_NEUTRAL, PENALTIES, Case
from .pairs import SAMPLING_AXES


def neutral_within(axes: Any = None) -> dict[str, Any]:
    """Each knob's neutral value (`case.NEUTRAL`) as the pair's axes allow it: the first pad side
    they draw, sampling knobs clamped into their bounds (temperature and top-p toward 1, sampling
    top-k and min-p toward off: their low bounds, where Hypothesis shrinks them too; penalties toward
    off). A shrunk case stays inside
    the declared axes (a pair that always left-pads is never shown a right-padded repro)."""
    if axes is None:
        return dict(NEUTRAL)
    out = dict(NEUTRAL)
    out["pad_side"] = axes.pad_sides[0]
    for name in SAMPLING_AXES:
        lo, hi = getattr(axes, name)
        out[name] = type(NEUTRAL[name])(min(max(NEUTRAL[name], lo), hi))
    return out


def moves(case: Case, axes: Any = None) -> Iterator[Case]:
    """Simpler neighbours, the biggest simplifications first; with `axes`, only those inside them (a
    pair that declares prompts of 1-16 tokens is never shown a repro without one)."""
    for c in _moves(case, axes):
        if axes is None or within_sizes(c, axes):
            yield c


def within_sizes(case: Case, axes: Any) -> bool:
    """Whether a case's batch, response and prompt lengths are inside the axes' lower bounds and
    under their caps (`Axes.max_context`, `max_tokens`)."""
    lo_p = axes.prompt_len[0]
    if not (case.batch_size >= axes.n_seqs[0] and min(case.seq_lens, default=0) >= axes.seq_len[0]
            and (lo_p <= 0 or min(case.prompt_len(j) for j in range(case.batch_size)) >= lo_p)):
        return False
    c, t = getattr(axes, "max_context", None), getattr(axes, "max_tokens", None)
    if c is None and t is None:
        return True
    totals = case.total_lens
    return (c is None or max(totals, default=0) <= c) and (t is None or sum(totals) <= t)


def _moves(case: Case, axes: Any = None) -> Iterator[Case]:
    for i in range(case.batch_size if case.batch_size > 1 else 0):
        yield case.drop_sequence(i)
    neutral_of = neutral_within(axes)
    for name, neutral in neutral_of.items():
        if getattr(case, name) != neutral:
            yield case.replace(**{name: neutral})
    low_scale = axes.logit_scale[0] if axes is not None else None
    if axes is not None:
        if case.logit_scale > low_scale:
            yield case.replace(logit_scale=float(low_scale))
        if case.dtype != axes.dtypes[0]:
            yield case.replace(dtype=axes.dtypes[0])
        r = axes.routing
        if r is not None:
            if case.top_k > r.top_k[0]:
                yield case.replace(top_k=r.top_k[0])
            if case.n_experts > r.n_experts[0] and case.top_k < r.n_experts[0]:
                yield case.replace(n_experts=r.n_experts[0])
    if case.prompt_ids:
        yield case.replace(prompt_ids=())  # every sequence its own prompt: no group
    if case.row_capacity:
        yield case.replace(row_capacity=0)
    if case.order:
        yield case.replace(order=())
    if case.tie_fraction > 0:
        yield case.replace(tie_fraction=0.0)
    low_gap = axes.routing.min_gap if axes is not None and axes.routing is not None else 0.0
    if case.tie_gap > low_gap:
        yield case.replace(tie_gap=float(low_gap))  # the exact tie (or the axes' floor): the simplest gap
    # the n - 2^k steps for the longest sequence only (a position bug lives there): for every sequence,
    # each length's few more moves would make the last, all-rejected round cost too much
    longest = max(range(case.batch_size), key=case.total_len) if case.batch_size else -1
    for group in case.groups:  # (a shared prompt is shortened for its whole group at once)
        p = case.prompt_len(group[0])
        if p:
            for q in _shorter(p, 0, longest in group):
                yield _with(case, group[0], prompt=q)
    for j, n in enumerate(case.seq_lens):
        for m in _shorter(n, 1, j == longest):
            yield _with(case, j, response=m)
    # prompts (responses) of one length shortened together: a bug that needs two sequences of equal
    # lengths (a prefix cache keyed by the prompt's length, a kernel that batches equal lengths) passes
    # at every one-sequence step, and stopped at the lengths it was drawn with
    yield from _equal_lengths(case, longest)
    # the longest sequence's response tokens given to its prompt (same length, fewer scored tokens): a
    # bug past a position fires on its first token there, and shortening alone keeps a long response
    # (970 + 55 tokens, where 1023 + 2 fails too); within the axes' prompt lengths only
    # (every other sequence: all but one of its response tokens); then one token of each sequence's
    # response: a bug whose first failing token needs a clean one before it (its log-probability read
    # at the position before) stops at two scored tokens, where keeping one passes
    max_prompt = axes.prompt_len[1] if axes is not None else 0
    for j in sorted(range(case.batch_size), key=lambda j: j != longest):
        n, p = case.seq_lens[j], case.prompt_len(j)
        if len(case.group_of(j)) > 1:  # its prompt is its group's: unchanged for the others
            continue
        for r in sorted({1, n // 2, n - 1} if j == longest else {1, n - 1}):
            if 1 <= r < n and p + n - r <= max_prompt:
                yield _with(case, j, prompt=p + n - r, response=r)
    # the longest sequence's prompt and response, and the batch size (the first m sequences), at the round
    # sizes where engines switch kernels (block, chunk and bucket sizes: 2^k, multiples of 16 up to 64),
    # smallest first: a bug past such a switch need not fire at every size above it (it depends on the
    # values there), and a drawn 75-token prompt whose one-step neighbours all pass was reported as
    # minimal where 48, the switch, fails too
    if longest >= 0:
        for q in _round_sizes(case.prompt_len(longest), 0):
            yield _with(case, longest, prompt=q)
        for m in _round_sizes(case.seq_lens[longest], 1):
            yield _with(case, longest, response=m)
    for m in _round_sizes(case.batch_size, 1):
        yield case.first_sequences(m)
    if 0 < case.tie_fraction < 1 and case.n_tokens > 1:
        # which tokens are forced comes from their own uniforms: one token, forced, is the simplest
        # near-tie trigger, and shortening alone cannot reach it when the forced token is not the first
        for j in range(case.batch_size):
            yield _with(case, j, response=1).replace(tie_fraction=1.0)
    yield from _halfway(case, "temperature", neutral_of["temperature"], log=True)
    yield from _halfway(case, "top_p", neutral_of["top_p"])
    yield from _halfway(case, "min_p", neutral_of["min_p"])
    for name in PENALTIES:
        yield from _halfway(case, name, neutral_of[name])
    if low_scale is not None:
        yield from _halfway(case, "logit_scale", float(low_scale), log=True)
    yield from _halfway(case, "tie_gap", float(low_gap))
    # discrete knobs step down, halfway then by one: repeated, this bisects to the smallest value
    # that still fails (a bug from top_k >= 4 shrinks to top_k = 4, not to the top_k drawn)
    if case.sample_top_k > 1:  # off (or, axes without it, their low bound) was tried above; the strategy shrinks a k toward its low bound too
        yield from _fewer(case, "sample_top_k", max(1, axes.sample_top_k[0]) if axes is not None else 1)
    if axes is not None and axes.routing is not None:
        r = axes.routing
        yield from _fewer(case, "top_k", r.top_k[0])
        yield from _fewer(case, "n_experts", max(r.n_experts[0], case.top_k + 1))
    # last: the probe and the stream ids, which a pair may never read (a repro should not show them as a
    # trigger), after every size and knob move: new streams are other tensors, and a size move the drawn
    # ones allow (a one-token trigger) may be gone with them
    if case.probe:
        yield case.replace(probe=0)
    if case.seq_ids and not case.prompt_ids:
        yield case.replace(seq_ids=())  # the default streams 0..n-1
    for name, strategy in (getattr(axes, "params", None) or {}).items():
        if name not in case.params:
            continue
        value, simplest = case.params[name], simplest_value(strategy)
        if simplest is _NONE or value == simplest:
            continue
        yield case.replace(params={**case.params, name: simplest})
        choices = listed_values(strategy)
        if choices is not None:  # a listed set (`st.sampled_from`): the value before it in the list, never one it
            # cannot draw (halfway between 0.0 and 0.1 of [0.0, 0.05, 0.1] is 0.05; of a penalty's [1.0, 1.3], none)
            at = [i for i, c in enumerate(choices) if c == value and type(c) is type(value)]
            if at and at[0] > 1 and choices[at[0] - 1] != simplest:
                yield case.replace(params={**case.params, name: choices[at[0] - 1]})
            continue
        numbers = (int, float)
        if isinstance(value, numbers) and isinstance(simplest, numbers) and not isinstance(value, bool):
            mid = (value + simplest) / 2 if isinstance(value, float) or isinstance(simplest, float) \
                else (value + simplest) // 2
            if mid not in (value, simplest) and math.isfinite(mid):
                yield case.replace(params={**case.params, name: type(value)(mid)})


def listed_values(strategy: Any) -> tuple | None:
    """The values of a strategy that draws from a list as given (`st.sampled_from(...)` without a
    `.map` or `.filter`), in its order (the first is its simplest); None for any other."""
    from hypothesis.strategies._internal.strategies import SampledFromStrategy

    inner = getattr(strategy, "wrapped_strategy", strategy)  # (a lazy strategy: what it builds)
    if isinstance(inner, SampledFromStrategy) and not getattr(inner, "_transformations", ()):
        return tuple(inner.elements)
    return None


_NONE = object()
_SIMPLEST: dict[int, tuple[Any, Any]] = {}  # id(strategy) -> (strategy, its simplest value)


def simplest_value(strategy: Any) -> Any:
    """What Hypothesis shrinks a free parameter's strategy to (`hypothesis.find` of anything);
    `_NONE` when it cannot draw one here."""
    hit = _SIMPLEST.get(id(strategy))
    if hit is not None and hit[0] is strategy:
        return hit[1]
    from hypothesis import HealthCheck, Phase, Verbosity, find, settings

    try:
        value = find(strategy, lambda x: True, settings=settings(
            database=None, max_examples=20, phases=(Phase.generate, Phase.shrink), deadline=None,
            suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet))
    except Exception:  # noqa: BLE001 - a strategy that cannot be drawn outside a test, say
        value = _NONE
    _SIMPLEST[id(strategy)] = (strategy, value)
    return value


def _equal_lengths(case: Case, longest: int = -1) -> Iterator[Case]:
    """Every prompt of one length (counting a shared prompt once), then every response of one length,
    shortened together: for each length that two or more hold, to the lengths `_shorter` tries."""
    firsts = [g[0] for g in case.groups]
    for p in sorted({case.prompt_len(j) for j in firsts}, reverse=True):
        same = [j for j in firsts if case.prompt_len(j) == p]
        if p and len(same) > 1:
            for q in _shorter(p, 0, any(longest in case.group_of(j) for j in same)):
                moved = case
                for j in same:
                    moved = _with(moved, j, prompt=q)
                yield moved
    for n in sorted(set(case.seq_lens), reverse=True):
        same = [j for j, m in enumerate(case.seq_lens) if m == n]
        if n > 1 and len(same) > 1:
            for m in _shorter(n, 1, longest in same):
                lens = tuple(m if j in same else k for j, k in enumerate(case.seq_lens))
                yield case._with_lens(lens, case.prompt_lens)


def _shorter(n: int, low: int, steps: bool = True) -> list[int]:
    """Shorter lengths to try for a prompt or response of n, the shortest first: the lowest, half,
    then n - 2^k down to n - 1 (76: 0, 38, 44, 60, 68, 72, 74, 75). A bug past a block boundary
    need not fire at every length above it (it depends on the values there): where half and one
    less both pass, a failing length between them is still reached (76 -> 68 for a bug from
    position 64 that 75 and 38 do not show). Without `steps`: the lowest, half and one less."""
    between = []
    step = 1
    while steps and n - step > max(low, n // 2):
        between.append(n - step)
        step *= 2
    return [m for m in dict.fromkeys((low, n // 2, *reversed(between), n - 1)) if low <= m < n]


def _round_sizes(n: int, low: int) -> list[int]:
    """Sizes below n (and >= low) at which engines commonly switch kernels, smallest first: 1-4,
    powers of two and multiples of 16 up to 64, each with the size one past it (a switch at "more
    than 48" fires at 49). 75: 1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 48, 49, 64, 65."""
    sizes = {1, 2, 3, 4, *range(16, 65, 16)}
    k = 8
    while k < n:
        sizes.add(k)
        k *= 2
    out = sorted({v for s in sizes for v in (s, s + 1)})
    return [v for v in out if low <= v < n]


def _fewer(case: Case, name: str, low: int) -> Iterator[Case]:
    value = getattr(case, name)
    for v in dict.fromkeys(((value + low) // 2, value - 1)):
        if low <= v < value:
            yield case.replace(**{name: v})


def _halfway(case: Case, name: str, neutral: float, log: bool = False) -> Iterator[Case]:
    value = getattr(case, name)
    if value == neutral:
        return
    mid = math.sqrt(value * neutral) if log and neutral > 0 else (value + neutral) / 2
    if abs(mid - neutral) <= 1e-3 * max(abs(neutral), 1e-9) or mid == value:
        return  # close enough to neutral: the full move above was already tried
    yield case.replace(**{name: float(mid)})


def _with(case: Case, j: int, prompt: int | None = None, response: int | None = None) -> Case:
    lens = list(case.seq_lens)
    prompts = list(case.prompt_lens) if case.prompt_lens else [0] * case.batch_size
    if prompt is not None:
        for i in case.group_of(j):  # (a shared prompt: every sequence of its group)
            prompts[i] = prompt
    if response is not None:
        lens[j] = response
    totals = [a + b for a, b in zip(lens, prompts)]
    cap = case.row_capacity if max(totals) <= case.row_capacity < sum(totals) else 0
    return case.replace(seq_lens=tuple(lens), prompt_lens=tuple(prompts) if any(prompts) else (), row_capacity=cap)


EDGE_MARGIN = 1.5  # a knob bisected toward neutral stops where the judged value stays this far over the line

CONTINUOUS = ("logit_scale", "temperature", "top_p", "min_p", "tie_gap", *PENALTIES)


def bisects(case: Case, cand: Case, axes: Any = None) -> bool:
    """Whether `cand` is `case` with one continuous knob moved part of the way toward neutral (a
    halfway step, `_halfway`; not the whole way): what walks a repro to the edge of its failure."""
    a, b = case.to_json(), cand.to_json()
    diff = [k for k in a.keys() | b.keys() if a.get(k) != b.get(k)]
    if len(diff) != 1 or diff[0] not in CONTINUOUS:
        return False
    neutral = neutral_within(axes)
    full = {**{k: neutral[k] for k in ("temperature", "top_p", "min_p", *PENALTIES)},
            "logit_scale": float(axes.logit_scale[0]) if axes is not None else None,
            "tie_gap": float(axes.routing.min_gap) if axes is not None and axes.routing is not None else 0.0}
    return b.get(diff[0], NEUTRAL.get(diff[0], 0.0)) != full[diff[0]]


def polish(case: Case, fails: Callable[[Case], bool], max_evals: int = 200,
           deadline: float | None = None, axes: Any = None,
           strong: Callable[[Case], bool] | None = None) -> tuple[Case, int, bool]:
    """The simplest failing case reachable from `case` by accepted moves.

    `fails(c)` says whether c still fails the same way. Returns (case, evaluations, complete):
    complete is False when the budget or the deadline (time.monotonic()) stopped the pass early.
    `strong(c)` (for a c that fails): whether it fails by a margin (`EDGE_MARGIN` over the line). With
    it, a continuous knob's halfway steps are kept only while the case fails by that margin: bisected
    to the very edge, a repro read k3 0.00100001 against the line 0.001, under it on a CPU whose last
    bits differ (a full move to neutral, and every other move, is kept at any margin).
    """
    evals = 0
    seen: set[str] = {case.key()}
    at, since_accept = 0, 0  # round robin: after an accepted move, go on from the same place
    while True:
        cands = list(moves(case, axes))
        if not cands or since_accept >= len(cands):
            return case, evals, True
        cand = cands[at % len(cands)]
        at, since_accept = at % len(cands) + 1, since_accept + 1
        key = cand.key()
        if key in seen:
            continue
        if evals >= max_evals or (deadline is not None and time.monotonic() > deadline):
            return case, evals, False
        seen.add(key)
        evals += 1
        if fails(cand) and (strong is None or strong(cand) or not bisects(case, cand, axes)):
            case, since_accept = cand, 0
            at -= 1  # the move list of the new case starts over at this position


def describe_change(base: Case, moved: Case) -> str:
    """One simpler neighbour of `base` in words: 'without sequence 3', 'its first 8 of 9 sequences',
    'sequence 0: prompt 48 -> 47', 'sequences 1, 2: response 4 -> 3', 'logit_scale 9.8 -> 1',
    'every prompt its own'."""
    if moved.batch_size < base.batch_size:
        ids = list(base.ids)
        kept = [ids.index(i) for i in moved.ids] if set(moved.ids) <= set(ids) else []
        if kept == list(range(moved.batch_size)) and moved.batch_size < base.batch_size - 1:
            return f"its first {moved.batch_size} of {base.batch_size} sequences"
        dropped = [j for j in range(base.batch_size) if j not in kept]
        if kept and len(dropped) == 1:
            return f"without sequence {dropped[0]}"
        return f"{moved.batch_size} of its {base.batch_size} sequences"
    parts: list[str] = []
    changes: dict[str, list[int]] = {}
    for j in range(base.batch_size):  # (one sequence's prompt and response changes read as one)
        text = ", ".join(f"{what} {a} -> {b}" for what, a, b in (
            ("prompt", base.prompt_len(j), moved.prompt_len(j)), ("response", base.seq_lens[j], moved.seq_lens[j]))
            if a != b)
        if text:
            changes.setdefault(text, []).append(j)
    for text, js in changes.items():
        if text.startswith("prompt") and len(base.group_of(js[0])) == len(js) > 1 and js == base.group_of(js[0]):
            parts.append(f"the prompt of sequences {', '.join(map(str, js))} (shared): {text[len('prompt '):]}")
        else:
            who = f"sequence {js[0]}" if len(js) == 1 else f"sequences {', '.join(map(str, js))}"
            parts.append(f"{who}: {text}")
    a, b = base.to_json(), moved.to_json()
    if base.prompt_ids and not moved.prompt_ids:
        parts.append("every prompt its own")
    elif a.get("prompt_ids") != b.get("prompt_ids"):
        parts.append(f"other prompt streams: prompt ids {_ids(a.get('prompt_ids'))} -> {_ids(b.get('prompt_ids'))}")
    if base.ids != moved.ids:  # (the same sizes and knobs, other tensors: the polish's default-streams move)
        parts.append(f"other random streams: sequence ids {_ids(base.ids)} -> {_ids(moved.ids)}")
    for name in OMITTED_WHEN_NEUTRAL:  # (left out of the JSON when off: compared at their neutral values)
        a.setdefault(name, NEUTRAL[name])
        b.setdefault(name, NEUTRAL[name])
    for name in a:
        if name in ("seq_lens", "prompt_lens", "seq_ids", "prompt_ids", "schema") or a.get(name) == b.get(name):
            continue
        if name == "params":
            for k in sorted(set(a["params"]) | set(b["params"])):
                if a["params"].get(k) != b["params"].get(k):
                    parts.append(f"params.{k} {_short(a['params'].get(k))} -> {_short(b['params'].get(k))}")
        elif name != "row_capacity" or not parts:  # (a packing capacity follows the lengths it no longer fits)
            parts.append(f"{name} {_short(a[name])} -> {_short(b.get(name))}")
    return "; ".join(parts) or "the same case"


def _ids(v: Any) -> str:
    return ", ".join(map(str, v)) if v else "default"


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def neighbours_of(case: Case, axes: Any, result_of: Callable[[Case], tuple[float, str] | None],
                  limit: int = 12) -> list[dict[str, Any]]:
    """What the simpler neighbours shrinking ran around `case` gave: rows of {"change" (in words),
    "judged" (the verdict's value; the largest of the row's cases), "symptom" ("none": they pass),
    "cases"}; `result_of(c)`: (judged, symptom) of a case that was run, None for one that was not.
    Passing moves of one kind (every shorter prompt of a sequence, each sequence dropped, ...) make
    one row, named by the one nearest the case ('sequence 0: prompt 48 -> 47', 21 cases): where the
    failure starts reads off it. The batch first, then lengths, then knobs."""
    import re

    groups: dict[str, list] = {}
    seen: set[str] = {case.key()}
    for m in moves(case, axes):
        key = m.key()
        if key in seen:
            continue
        seen.add(key)
        got = result_of(m)
        if got is None:
            continue
        judged, symptom = got
        change = describe_change(case, m)
        kind = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", change) if symptom == "none" else f"{change}\0{symptom}"
        groups.setdefault(kind, []).append((m.n_tokens + sum(m.prompt_len(j) for j in range(m.batch_size)),
                                            m.batch_size, change, judged, symptom))
    rows = []
    for members in groups.values():
        near = max(members, key=lambda t: (t[1], t[0]))  # the most sequences, then tokens: nearest the case
        vals = [t[3] for t in members if not math.isnan(t[3])]
        rows.append({"change": near[2], "judged": max(vals) if vals else math.nan, "symptom": near[4],
                     "cases": len(members)})

    def kind(row: dict[str, Any]) -> int:  # the batch, then lengths, then knobs
        c = row["change"]
        return 0 if c.startswith(("without", "its first")) or " of its " in c else 1 if (
            " prompt " in c or " response " in c or c.startswith("the prompt")) else 2
    return sorted(rows, key=kind)[:limit]
