"""Conformance check for target pairs: the one line a backend author adds to their own tests.

    def test_my_pair_conforms():
        harness.check_pair(my_pair)          # or check_pair("my.pair") once registered

It draws a few cases from the pair's own axes (seeded, so the check itself is deterministic) and
checks the contract of `harness.pairs`: both paths return an Outcome with one row of
log-probabilities per token in case order over the same vocabulary; running the same case twice
gives bit-for-bit identical outputs (every tensor comes from the case's seed); outputs are finite;
sampled tokens and routing decisions, where present, have the right shapes; rows are normalised
(log-sum-exp within `NORMALISED_TOL` of 0; else a `ConformanceWarning`: raw logits?). Then three metamorphic
checks, on one case each (three or four extra runs of both paths):

- **Permutation.** The case's sequences rotated by one (the last first; each keeps its stream id,
  prompt and packing position) must give each path the same rows, rotated by sequence: row r of
  the permuted case's outcome matches the original outcome's row of the same token (total
  variation distance under `PERMUTE_TV` of the distance between distinct rows, for at least
  `PERMUTE_MATCH` of the rows whose earlier tokens the rollout sampled alike). A path whose rows
  stay put, or come out in another order (rows reversed), breaks "one row per token in case order".
  The check needs per-token inputs that follow the sequences (schema-2 streams: `case.token_randn`,
  `seq_generator`, `prompt_tokens`); when the pair's inputs have per-token tensors and none of
  them follows, it is skipped with a `ConformanceWarning` saying how to draw them. When some follow
  and the rows do not, the violation names the varying inputs that did not follow (one drawn from a
  whole-batch stream looks like rows out of order). Where the rollout returns its sampled tokens,
  the first token of each sequence (same prompt, nothing before it) must come back the same: a
  sampler on one whole-batch stream gets a `ConformanceWarning` (shrinking would change the other
  sequences' tokens).
- **Truncation.** The last token of the longest response (3 tokens or more) removed must leave that
  sequence's other rows as they were: a token's log-probabilities depend on the tokens before it
  only, so a path whose rows are out of order within a sequence shows here. Skipped, like the
  permutation check, when the inputs do not follow.
- **Input dependence.** The same case under another seed must change each path's log-probabilities,
  and a path must not give every token the same row: a path that ignores its input (constant
  log-probabilities, tensors not drawn from the case's seed) is reported. It runs on the case with
  the longest response: a one-token response after a fixed start token is the same under every seed.

The permutation and truncation checks run on cases without forced router ties (a near tie flips on
layout noise in a bf16 router, and every later row of its sequence with it).

It raises `ConformanceError` listing every violation, and returns the cases it checked.
"""

from __future__ import annotations

import warnings
from typing import Any

from .case import NEUTRAL, PENALTIES, Case
from .errors import HarnessError
from .execute import run_paths
from .pairs import REGISTRY, SAMPLING_AXES, TargetPair

PERMUTE_TV = 0.1  # a permuted row matches when its TV distance is under this fraction of distinct rows'
PERMUTE_MATCH = 0.5  # ... for at least this fraction of a path's rows
CANDIDATES = 16  # cases drawn to find one with two or more sequences for the permutation check

# Called with each case before its paths run: a worker that runs a check for `harness check` reports
# progress through it, so the supervisor times every run of a case as a campaign times a case
# (`Worker.check`: a path that hangs is a FAIL, not a check that never ends).
RUN_WATCHERS: list[Any] = []


def _run_paths(pair: TargetPair, case: Case, device: str, reads: set | None = None) -> tuple[Any, Any]:
    """Both paths on the case; with `reads`, the knobs they read go into it (`_Watched`)."""
    for watch in RUN_WATCHERS:
        watch(case)
    if reads is None:
        return run_paths(pair, case, device)
    watched = _Watched.of(case)
    _Watched.reads = reads
    try:
        return run_paths(pair, watched, device)
    finally:
        _Watched.reads = None


# The case fields each fuzzed axis sets: an axis whose fields neither path (nor its readout) reads
# changes nothing the pair computes (`unread_axes`).
AXIS_FIELDS = {"pad_sides": ("pad_side",), "temperature": ("temperature",), "top_p": ("top_p",),
               "sample_top_k": ("sample_top_k",), "min_p": ("min_p",),
               **{name: (name,) for name in PENALTIES}, "logit_scale": ("logit_scale",),
               "packing": ("row_capacity", "order"), "routing.tie_fraction": ("tie_fraction", "tie_gap"),
               "dtypes": ("dtype",), "prompt_len": ("prompt_lens",), "prompt_group": ("prompt_ids",)}
# the case's helpers that draw from a group's shared prompt stream (`Case.prompt_generator`): a pair that
# fuzzes groups and never calls one gives a group's sequences prompts of their own
SHARED_PROMPT_CALLS = ("prompt_tokens", "prompt_generator")
_WATCHED_FIELDS = frozenset([*(f for fields in AXIS_FIELDS.values() for f in fields), *SHARED_PROMPT_CALLS])


class _ReadParams(dict):
    """A case's params that note which keys were read (`_Watched`)."""

    def __getitem__(self, key: Any) -> Any:
        if _Watched.reads is not None:
            _Watched.reads.add(f"params.{key}")
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if _Watched.reads is not None:
            _Watched.reads.add(f"params.{key}")
        return super().get(key, default)

    def _all(self) -> None:
        if _Watched.reads is not None:
            _Watched.reads.update(f"params.{k}" for k in self)

    def items(self) -> Any:
        self._all()
        return super().items()

    def values(self) -> Any:
        self._all()
        return super().values()

    def __iter__(self) -> Any:
        self._all()
        return super().__iter__()


class _Watched(Case):
    """A case that notes which knob fields are read while `reads` is set (the contract check's runs:
    a helper of the case that reads a knob for the pair counts as the pair reading it)."""

    reads: set | None = None

    @classmethod
    def of(cls, case: Case) -> "_Watched":
        out = cls(**{f: getattr(case, f) for f in case.__dataclass_fields__})
        object.__setattr__(out, "params", _ReadParams(case.params))
        return out

    def __getattribute__(self, name: str) -> Any:
        reads = _Watched.reads
        if reads is not None and name in _WATCHED_FIELDS:
            reads.add(name)
        return object.__getattribute__(self, name)


def unread_axes(pair: TargetPair, reads: set, n_cases: int) -> list[str]:
    """A warning for each axis the pair fuzzes (its bounds allow more than one value) whose case
    fields neither path read over the check's runs: drawing it spends cases on a change the pair
    never sees, and a clean verdict seems to cover it."""
    ax = pair.axes
    fuzzed = {"pad_sides": len(ax.pad_sides) > 1, "packing": ax.packing, "dtypes": len(ax.dtypes) > 1,
              "routing.tie_fraction": ax.routing is not None and ax.routing.tie_fraction[1] > 0,
              "prompt_len": ax.prompt_len[1] > 0, "prompt_group": ax.prompt_group[1] > 1,
              **{k: getattr(ax, k)[0] != getattr(ax, k)[1] for k in (*SAMPLING_AXES, "logit_scale")}}
    fixes = {"pad_sides": f"pad_sides=({ax.pad_sides[0]!r},)", "packing": "packing=False",
             "dtypes": f"dtypes=({ax.dtypes[0]!r},)",
             "routing.tie_fraction": "routing=RoutingAxes(..., tie_fraction=(0.0, 0.0))",
             "prompt_len": "prompt_len=(0, 0)", "prompt_group": "prompt_group=(1, 1)",
             "temperature": "temperature=(1.0, 1.0)", "top_p": "top_p=(1.0, 1.0)",
             "sample_top_k": "sample_top_k=(0, 0)", "min_p": "min_p=(0.0, 0.0)",
             **{name: f"{name}=({NEUTRAL[name]}, {NEUTRAL[name]})" for name in PENALTIES},
             "logit_scale": f"logit_scale=({ax.logit_scale[0]}, {ax.logit_scale[0]})"}
    out = []
    for axis, fields in AXIS_FIELDS.items():
        if fuzzed[axis] and not reads.intersection(fields):
            out.append(f"axes.{axis}: the pair fuzzes it, but neither path read case.{' or case.'.join(fields)} "
                       f"on the {n_cases} case(s) checked: the cases spent on it change nothing the pair computes, "
                       f"and a clean verdict seems to cover what it never ran. Read it (through the case's helpers or "
                       f"the field) or declare Axes({fixes[axis]}).")
    if fuzzed["prompt_group"] and "prompt_ids" in reads and not reads.intersection(SHARED_PROMPT_CALLS):
        out.append(f"axes.prompt_group: the pair fuzzes groups of sequences that share a prompt and reads "
                   f"case.prompt_ids, but neither path drew a prompt from a group's shared stream on the {n_cases} "
                   "case(s) checked (case.prompt_tokens(j, vocab) or case.prompt_generator(j, ...)): a group's "
                   "sequences then get prompts of their own, which is not a group (GRPO samples one prompt n times), "
                   "and a path that reuses a group's prompt (a prefix cache) diverges from one that does not, "
                   "as a false finding of an aligned pair. Draw the prompts with case.prompt_tokens.")
    for key in ax.params:
        if f"params.{key}" not in reads:
            out.append(f"axes.params[{key!r}]: the pair draws it, but neither path read case.params[{key!r}] on the "
                       f"{n_cases} case(s) checked; read it or drop it from params.")
    return out


class ConformanceError(AssertionError):
    pass


class ConformanceWarning(UserWarning):
    """A check that could not run for this pair, and what the pair would need for it."""


def sample_cases(pair: TargetPair, n: int, seed: int = 0) -> list[Case]:
    """n distinct cases from the pair's axes, the same ones every time for the same seed."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hseed

    from .strategies import cases

    out: list[Case] = []

    @settings(max_examples=n, database=None, derandomize=False, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @hseed(seed)
    @given(cases(pair.axes))
    def collect(case: Case) -> None:
        if case not in out:
            out.append(case)

    collect()
    return out


def rotated_case(case: Case) -> tuple[Case, list[int], list[int]] | None:
    """The case with its sequences rotated by one (the last first; each keeps its stream id, prompt
    and place in the trainer's packing), for every row of it the row of the same token in `case`,
    and for every sequence of it the sequence of `case`. None when there is nothing to permute or
    the case draws from one whole-batch stream (schema 1). A rotation, not a reversal: rows
    reversed as a whole look like reversed sequences when their lengths are equal. Sequences that
    share a prompt (`case.groups`) move as one block, in their order: the first sample of a prompt
    stays first (a rollout's prefix cache is filled by it, and a bug of its hits is order-bound, not
    a row-order fault); a case that is one group has nothing to permute."""
    b = case.batch_size
    if b < 2 or getattr(case, "streams", "single") != "sequence":
        return None
    groups = case.groups if hasattr(case, "groups") else [[j] for j in range(b)]
    if len(groups) < 2:
        return None
    # position i of the new case holds sequence perm[i] of the old (the last group first)
    perm = [j for g in [groups[-1], *groups[:-1]] for j in g]
    inv = {old: new for new, old in enumerate(perm)}
    new = case.replace(seq_lens=tuple(case.seq_lens[p] for p in perm),
                       prompt_lens=tuple(case.prompt_lens[p] for p in perm) if case.prompt_lens else (),
                       seq_ids=tuple(case.ids[p] for p in perm),
                       prompt_ids=tuple(case.prompt_ids[p] for p in perm) if getattr(case, "prompt_ids", ()) else (),
                       order=tuple(inv[o] for o in case.packing_order), probe=inv[case.probe])
    offsets = case.offsets
    return new, [offsets[p] + t for p in perm for t in range(case.seq_lens[p])], perm


def _walk(obj: Any, depth: int = 0) -> list[Any]:
    """Tensors and lists of tensors inside a pair's inputs (dicts, lists, dataclasses), in order."""
    return [t for _, t in _walk_named(obj)]


def _walk_named(obj: Any, name: str = "inputs", depth: int = 0) -> list[tuple[str, Any]]:
    """`_walk` with where each was found (`inputs['h']`, `inputs.ids[0]`), for messages."""
    import dataclasses

    import torch

    if isinstance(obj, torch.Tensor):
        return [(name, obj)]
    if depth > 3 or isinstance(obj, torch.nn.Module):
        return []
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        return [(name, list(obj))]
    if isinstance(obj, dict):
        items = [(f"{name}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(f"{name}[{i}]", v) for i, v in enumerate(obj)]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f"{name}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    else:
        return []
    return [t for key, item in items for t in _walk_named(item, key, depth + 1)]


def truncated_case(case: Case) -> tuple[Case, list[int], list[int]] | None:
    """The case with the last token of its longest response (at least 3 tokens) removed, for every
    row of it the row of the same token in `case`, and the rows of the shortened sequence."""
    if getattr(case, "streams", "single") != "sequence":
        return None
    j = max(range(case.batch_size), key=lambda i: case.seq_lens[i])
    n = case.seq_lens[j]
    if n < 3:
        return None
    new = case.replace(seq_lens=case.seq_lens[:j] + (n - 1,) + case.seq_lens[j + 1:])
    drop = case.offsets[j] + n - 1
    return new, [r for r in range(case.n_tokens) if r != drop], list(range(new.offsets[j], new.offsets[j] + n - 1))


def inputs_follow(pair: TargetPair, case: Case, derived: Case, src: list[int], seqs: list[int],
                  device: str) -> bool | None:
    """Whether the pair's inputs follow a rearrangement of the case: a per-token (T, ...) tensor that
    varies over its rows and comes back as its rows `src`, or a per-sequence list of tensors that
    comes back as its items `seqs`. True if one does, False if some vary and none does, None if the
    inputs have neither."""
    return _input_report(pair, case, derived, src, seqs, device)[0]


def _input_report(pair: TargetPair, case: Case, derived: Case, src: list[int], seqs: list[int],
                  device: str) -> tuple[bool | None, list[str]]:
    """`inputs_follow`, and the varying per-token or per-sequence inputs that did not follow (by
    where they sit in the inputs, with their shape): a pair may draw one input per sequence and
    another from a whole-batch stream, or lay one out in packing order (which stays put, rightly)."""
    import torch

    with torch.inference_mode():
        a, b = _walk_named(pair.build(case, device)), _walk_named(pair.build(derived, device))
    if len(a) != len(b):
        return None, []
    n, batch = case.n_tokens, case.batch_size
    seen, follows, stray = False, False, []
    for (name, x), (_, y) in zip(a, b):
        if isinstance(x, list) and isinstance(y, list) and len(x) == batch and len(y) == len(seqs):
            if any(x[i].shape != x[0].shape or not torch.equal(x[i], x[0]) for i in range(batch)):
                seen = True
                if all(_same_or_prefix(y[i], x[p]) for i, p in enumerate(seqs)):
                    follows = True
                else:
                    stray.append(f"{name} (a list of {batch} per-sequence tensors)")
        elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() >= 1 and n > 1 \
                and x.shape[0] == n and y.shape[0] == len(src) and x.shape[1:] == y.shape[1:] \
                and not bool((x == x[:1]).all()):
            seen = True
            if torch.equal(y.cpu(), x.cpu()[torch.tensor(src)]):
                follows = True
            else:
                stray.append(f"{name} {tuple(x.shape)}")
    return (True if follows else False if seen else None), stray


def tokens_follow(derived: Case, src: list[int], tokens: Any, tokens2: Any) -> bool | None:
    """Whether the rollout's sampled tokens follow a rotation of the sequences: the first response
    token of each sequence (sampled in the same context in both runs: its own prompt, nothing before
    it) is the same token. False when two or more and more than half of them changed (one draw
    that falls on a cumulative-probability boundary may flip on layout noise; a whole-batch stream
    changes almost all). None without tokens to compare."""
    import torch

    if tokens is None or tokens2 is None:
        return None
    a, b = torch.as_tensor(tokens).cpu().reshape(-1), torch.as_tensor(tokens2).cpu().reshape(-1)
    if a.numel() != len(src) or b.numel() != len(src):
        return None
    firsts = [off for off, m in zip(derived.offsets, derived.seq_lens) if m]
    if len(firsts) < 2:
        return None
    differ = sum(int(a[src[r]]) != int(b[r]) for r in firsts)
    return not (differ >= 2 and 2 * differ > len(firsts))


def _same_or_prefix(y: Any, x: Any) -> bool:
    """y equals x, or its first rows (a shortened sequence's tensor drawn row by row)."""
    import torch

    return y.dim() == x.dim() and y.shape[1:] == x.shape[1:] and y.shape[0] <= x.shape[0] \
        and torch.equal(y, x[:y.shape[0]])


_TV_CHUNK = 1 << 22  # float64 elements per operand a TV chunk holds (32 MiB: a real vocabulary's rows in bounded memory)


def _row_chunks(n: int, v: int) -> list[slice]:
    """Slices of n rows of V entries, each chunk holding at most `_TV_CHUNK` elements (at least one row)."""
    step = max(1, _TV_CHUNK // max(v, 1))
    return [slice(k, k + step) for k in range(0, n, step)]


def _probs(x: Any) -> Any:
    import torch

    return torch.nan_to_num(x.detach().to(torch.float64).cpu().exp(), nan=0.0)


def _tv_rows(a: Any, b: Any) -> Any:
    """Total variation distance between matching rows of two (n, V) log-probability tensors, in
    chunks of rows (memory a small multiple of `_TV_CHUNK` whatever n and V)."""
    import torch

    out = [0.5 * (_probs(a[c]) - _probs(b[c])).abs().sum(-1) for c in _row_chunks(a.shape[0], a.shape[-1])]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _distinct_scale(lp: Any) -> float:
    """The median TV distance between distinct rows of one outcome (every pair of its first 64 rows),
    the probabilities made once and the pairs taken in chunks (2016 pairs of 151936-token rows held
    at once were 12 GB)."""
    import torch

    n = min(64, lp.shape[0])
    if n < 2:
        return 0.0
    p = _probs(lp[:n])  # (n, V)
    i, j = torch.triu_indices(n, n, 1)
    tv = torch.cat([0.5 * (p[i[c]] - p[j[c]]).abs().sum(-1) for c in _row_chunks(len(i), p.shape[-1])])
    return float(tv.median())


def _follows(orig: Any, new: Any, src: list[int], judged: list[int] | None = None) -> bool | None:
    """Whether `new`'s rows (those in `judged`, default all) are `orig`'s rows `src` (TV distance
    under PERMUTE_TV x the distance between distinct rows, for at least PERMUTE_MATCH of them).
    None when `orig` has no distinct rows to tell apart."""
    import torch

    scale = _distinct_scale(orig)
    if scale <= 0:
        return None
    rows = torch.tensor(judged if judged is not None else list(range(len(src))))
    want = orig.detach().cpu()[torch.tensor(src)[rows]].to(new.device)
    tv = _tv_rows(new[rows.to(new.device)], want)
    return float((tv <= PERMUTE_TV * scale).double().mean()) >= PERMUTE_MATCH


def _same_context(derived: Case, src: list[int], tokens: Any, tokens2: Any, rows: list[int]) -> list[int]:
    """The rows among `rows` whose earlier response tokens the rollout sampled alike in both runs (a
    sampled token that flips on layout noise changes every row after it in its sequence)."""
    import torch

    if tokens is None or tokens2 is None:
        return rows
    a = torch.as_tensor(tokens).cpu()[torch.tensor(src)]
    b = torch.as_tensor(tokens2).cpu()
    if a.shape != b.shape:
        return rows
    ok = []
    for off, n in zip(derived.offsets, derived.seq_lens):
        for r in range(off, off + n):
            ok.append(r)
            if not bool(a[r] == b[r]):
                break  # this row still shares its context; the rows after it do not
    keep = set(ok)
    return [r for r in rows if r in keep]


def _relation(pair: TargetPair, case: Case, trainer: Any, rollout: Any, device: str, check: str, what: str,
              derived: Case, src: list[int], seqs: list[int], judged: list[int] | None, rule: str) -> list[str]:
    """Run the derived case; a path whose rows do not come back as `src` breaks `rule`."""
    t2, r2 = _run_paths(pair, derived, device)
    judged = _same_context(derived, src, rollout.tokens, r2.tokens,
                           judged if judged is not None else list(range(len(src))))
    follows = {role: _follows(a.logprobs, b.logprobs, src, judged) if judged else None for role, a, b in
               (("trainer", trainer, t2), ("rollout", rollout, r2))}
    judged_roles = {role: f for role, f in follows.items() if f is not None}
    inp, stray = _input_report(pair, case, derived, src, seqs, device)
    if check == "permutation" and tokens_follow(derived, src, rollout.tokens, r2.tokens) is False:
        warnings.warn(ConformanceWarning(
            f"{pair.name}: on {case.one_line()} with {what} the rollout's sampled tokens did not follow their "
            "sequences (the first token of each sequence, sampled from the same prompt, changed), so the rollout "
            "samples from a whole-batch stream: removing or reordering a sequence changes the other sequences' "
            "tokens, and a shrunk repro is no longer the case that failed. Sample sequence j from its own stream "
            "(case.seq_generator(j, \"sample\"), or case.token_uniforms(\"sample\") by inverse CDF)."), stacklevel=6)
    if inp is False or (inp is None and judged_roles and not any(judged_roles.values())):
        why = ("the pair's per-token inputs did not follow, so its tensors come from whole-batch streams" if inp is False
               else "neither path's rows followed and the pair's inputs hold no per-token tensor to tell why: either "
                    "its tensors come from whole-batch streams, or both paths return rows out of case order ("
                    + ROW_ORDER + ")")
        warnings.warn(ConformanceWarning(
            f"{pair.name}: the {check} check was skipped: on {case.one_line()} with {what} {why}. "
            f"{'Draw' if inp is False else 'If the former, draw'} them per sequence (case.token_randn, "
            "case.seq_generator(j, ...), case.prompt_tokens(j, ...)) so that reordering, shortening or removing a "
            "sequence leaves the other tokens' tensors unchanged, as shrinking assumes."), stacklevel=6)
        return []
    hint = ""
    if stray:
        hint = (f" (or an input is drawn from a whole-batch stream: {', '.join(stray[:4])} did not follow the "
                "rearrangement while another input did; draw every per-token input per sequence, with "
                "case.token_randn or case.seq_generator(j, ...), unless it is laid out in packing order)")
    return [f"case {case.one_line()} with {what}: the {role}'s rows did not follow (fewer than "
            f"{PERMUTE_MATCH:.0%} of them match the original row of the same token); {rule}{hint}"
            for role, f in judged_roles.items() if not f]


ROW_ORDER = ("a path must return one row per token in case order (sequence 0's tokens first, then sequence "
             "1's, ...) whatever order it computes them in")


def check_permutation(pair: TargetPair, case: Case, trainer: Any, rollout: Any, device: str) -> list[str]:
    """Rotating the case's sequences must rotate both outcomes' rows by sequence."""
    got = rotated_case(case)
    if got is None:
        return []
    derived, src, seqs = got
    return _relation(pair, case, trainer, rollout, device, "permutation", "its sequences rotated (the last first)",
                     derived, src, seqs, None, ROW_ORDER)


def check_truncation(pair: TargetPair, case: Case, trainer: Any, rollout: Any, device: str) -> list[str]:
    """Removing the last token of a sequence must leave that sequence's other rows as they were."""
    got = truncated_case(case)
    if got is None:
        return []
    derived, src, judged = got
    return _relation(pair, case, trainer, rollout, device, "truncation",
                     "the last token of its longest sequence removed",
                     derived, src, list(range(case.batch_size)), judged,
                     "a token's row must depend only on the tokens before it and sit at its own position "
                     "within its sequence (" + ROW_ORDER + ")")


def check_input_dependence(pair: TargetPair, case: Case, trainer: Any, rollout: Any, device: str) -> list[str]:
    """Problems of a path whose output ignores its input: the same rows under another seed, or one
    row for every token."""
    import torch

    other = case.replace(seed=(case.seed + 1) % 2**63)
    t2, r2 = _run_paths(pair, other, device)
    out = []
    for role, a, b in (("trainer", trainer, t2), ("rollout", rollout, r2)):
        lp = a.logprobs
        if lp.shape == b.logprobs.shape and torch.equal(lp, b.logprobs):
            out.append(f"case {case.one_line()}: the {role} gives the same log-probabilities under seed {case.seed} "
                       f"and seed {other.seed}: its output ignores its input; compute it from the tensors build "
                       "draws from the case's seed")
        elif lp.shape[0] >= 2 and torch.equal(lp, lp[:1].expand_as(lp)):
            out.append(f"case {case.one_line()}: the {role} returns the same row for all {lp.shape[0]} tokens: its "
                       "output ignores its input")
    return out


def check_pair(pair: TargetPair | str, n_cases: int = 8, device: str = "cpu", seed: int = 0) -> list[Case]:
    """Check a pair (or a registered pair's name) against the contract of `harness.pairs`: `n_cases`
    cases drawn from its axes (Hypothesis, seeded by `seed`, so the check is deterministic), each run
    twice on `device`, then the metamorphic checks of this module's docstring (permutation,
    truncation, input dependence). Raises `ConformanceError` listing every violation (with the line
    of the pair's code that raised, if one did); warns `ConformanceWarning` for a check it had to
    skip. Returns the cases it checked."""
    import torch

    if isinstance(pair, str):
        pair = REGISTRY.get(pair)
    pair.validate()
    problems: list[str] = []
    checked = sample_cases(pair, n_cases, seed)
    kept: dict[str, tuple[Case, tuple[Any, Any]]] = {}  # the metamorphic checks' cases -> their outcomes
    unnormalised: set[str] = set()
    reads: set[str] = set()  # the knob fields the paths read (`unread_axes`)
    for case in checked:
        where = f"case {case.one_line()}"
        try:
            t1, r1 = _run_paths(pair, case, device, reads)
            t2, r2 = _run_paths(pair, case, device)
        except HarnessError:  # its own setup (a checkpoint without weights): it cannot run, no contract to judge
            raise
        except Exception as e:
            problems.append(f"{where}: the pair raised {_raised(e)}")
            continue
        keep_outcomes(kept, case, (t1, r1))
        if t1.logprobs.shape != r1.logprobs.shape:
            problems.append(f"{where}: trainer logprobs {tuple(t1.logprobs.shape)} and rollout logprobs "
                            f"{tuple(r1.logprobs.shape)} differ in shape; both must be (tokens, vocab)")
        for role, a, b in (("trainer", t1, t2), ("rollout", r1, r2)):
            same = (torch.equal(a.logprobs, b.logprobs) if a.logprobs.shape != b.logprobs.shape or not a.logprobs.is_floating_point()
                    else bool(torch.isclose(a.logprobs, b.logprobs, rtol=0, atol=0, equal_nan=True).all()))
            if not same:  # (NaN in the same places is the same output: reported below, not as nondeterminism)
                problems.append(f"{where}: {role} is not deterministic: two runs of the same case differ. Draw every "
                                "tensor from case.generator(...) and avoid nondeterministic kernels")
            if bool(torch.isnan(a.logprobs).any() or torch.isposinf(a.logprobs).any()):
                problems.append(f"{where}: {role} logprobs contain NaN or +inf (-inf is allowed for masked tokens)")
            for name, rt in a.routing.items():
                ex = torch.as_tensor(rt.experts)
                if ex.dim() != 2 or ex.shape[0] != case.n_tokens:
                    problems.append(f"{where}: {role} routing[{name!r}].experts has shape {tuple(ex.shape)}, "
                                    f"expected ({case.n_tokens}, top_k)")
        for role, out in (("rollout", r1), ("trainer", t1)):
            if out.tokens is not None:
                tok = torch.as_tensor(out.tokens).reshape(-1)  # ((T,) or (T, 1): run_paths checked the shape)
                recorded = getattr(r1, "recorded", False)  # (two-outcome rows: ids of the model's vocabulary)
                if len(tok) and (int(tok.min()) < 0 or (not recorded and int(tok.max()) >= out.logprobs.shape[-1])):
                    problems.append(f"{where}: {role} tokens must be ids in [0, {out.logprobs.shape[-1]}) (the vocabulary "
                                    f"of its logprobs); got ids from {int(tok.min())} to {int(tok.max())}")
                elif role == "rollout" and r2.tokens is not None and not torch.equal(
                        tok, torch.as_tensor(r2.tokens).reshape(-1)):
                    problems.append(f"{where}: rollout sampled different tokens on two runs; sample with a "
                                    "generator seeded from the case")
            if role not in unnormalised and not _check_normalised(pair, case, role, out):
                unnormalised.add(role)  # (warned once per path)
    if not problems:
        problems += _metamorphic(pair, checked, kept, device, seed)
        for note in unread_axes(pair, reads, len(checked)):
            warnings.warn(note, ConformanceWarning, stacklevel=2)
    if problems:
        said = _grouped(problems, [f"case {c.one_line()}" for c in checked])
        raise ConformanceError(f"target pair {pair.name!r} breaks the contract:\n  - " + "\n  - ".join(said))
    return checked


NORMALISED_TOL = 0.05  # |log-sum-exp| of a row above this: not log-probabilities (bf16 rounding is ~1e-3)


def _check_normalised(pair: TargetPair, case: Case, role: str, out: Any) -> bool:
    """Warn when a path's rows are not log-probabilities of distributions (a path returning raw logits,
    or a log-softmax over part of the vocabulary): the exact KL normalises each side, but the sampled
    tokens' k3 reads the values as they are, so the verdict would judge the offset. A warning, not a
    violation: a demonstration pair may get the normaliser wrong on purpose."""
    import torch

    lp = out.logprobs.detach()
    lse = torch.cat([torch.logsumexp(lp[c].to(torch.float64).cpu(), -1) for c in _row_chunks(len(lp), lp.shape[-1])]) \
        if len(lp) else torch.zeros(0)
    lse = lse[torch.isfinite(lse)]  # (a row with every entry masked has none to sum)
    ok = not len(lse) or float(lse.abs().max()) <= NORMALISED_TOL
    if not ok:
        warnings.warn(ConformanceWarning(
            f"{pair.name}: on {case.one_line()} the {role}'s rows are not normalised: their log-sum-exp lies in "
            f"[{float(lse.min()):.3g}, {float(lse.max()):.3g}], not 0. A path returns log-probabilities (each row sums "
            "to 1 over the vocabulary): raw logits? apply log_softmax. The exact KL normalises each side, but the "
            "sampled tokens' k3 reads the values as they are."), stacklevel=3)
    return ok


def _grouped(problems: list[str], wheres: list[str]) -> list[str]:
    """The same violation on several cases once, on its first case, with how many more (a patch that
    raises past some size listed seven cases of ~600 characters each). `wheres`: each case's prefix."""
    first: dict[str, int] = {}
    more: dict[int, int] = {}
    out: list[str] = []
    for p in problems:
        w = max((w for w in wheres if p.startswith(w + ": ")), key=len, default=None)
        key = p[len(w) + 2:] if w is not None else p
        if key in first:
            more[first[key]] = more.get(first[key], 0) + 1
            continue
        first[key] = len(out)
        out.append(p)
    return [p + (f" (and on {more[i]} more case(s))" if more.get(i) else "") for i, p in enumerate(out)]


def _raised(e: BaseException) -> str:
    """An exception with where it was raised: the innermost frame of the pair's own code (outside the
    harness, the standard library and installed packages), else the innermost one, so a bare
    `IndexError: tuple index out of range` points at a line."""
    import traceback
    from pathlib import Path

    import site
    import sysconfig

    frames = traceback.extract_tb(e.__traceback__)
    here = Path(__file__).resolve().parent
    libs = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "purelib", "platlib")}
    libs |= {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}

    def theirs(f: Any) -> bool:
        if f.filename.startswith("<"):  # <frozen ...>, <string>: no file of theirs
            return False
        path = Path(f.filename).resolve()
        return not path.is_relative_to(here) and not any(path.is_relative_to(lib) for lib in libs) \
            and "site-packages" not in path.parts and "dist-packages" not in path.parts

    at = ([f for f in frames if theirs(f)] or frames)[-1:]
    where = f" (at {at[0].filename}:{at[0].lineno}, in {at[0].name})" if at else ""
    return f"{type(e).__name__}: {e}{where}"


def keep_outcomes(kept: dict, case: Case, outcomes: tuple[Any, Any]) -> None:
    """Keep the outcomes of the cases the metamorphic checks start from (the first case, the first
    with two or more sequences, the one with the longest response so far), and only those."""
    cases = [c for c, _ in kept.values()]
    first_multi = _pick_multi(cases)
    longest = max(cases, key=lambda c: max(c.seq_lens), default=None)
    wanted = not cases or (case.batch_size >= 2 and (first_multi is None or (
        len(set(first_multi.seq_lens)) == 1 and len(set(case.seq_lens)) > 1))) \
        or max(case.seq_lens) > max(longest.seq_lens)
    if not wanted:
        return
    if longest is not None and max(case.seq_lens) > max(longest.seq_lens) and longest is not cases[0] \
            and longest is not first_multi:
        del kept[longest.key()]
    kept[case.key()] = (case, outcomes)


def _pick_multi(cases: list[Case]) -> Case | None:
    """The first case with two or more sequences, one with unequal lengths when there is one."""
    multi = [c for c in cases if c.batch_size >= 2]
    return next((c for c in multi if len(set(c.seq_lens)) > 1), multi[0] if multi else None)


def _metamorphic(pair: TargetPair, checked: list[Case], kept: dict, device: str, seed: int) -> list[str]:
    """The input-dependence check on the case with the longest response (the first case when every
    response is one token), the permutation check on the first case with
    two or more sequences (drawn anew when none of the checked cases has them), the truncation check
    on the case with the longest response."""
    first = checked[0] if checked else None
    multi = _pick_multi(checked)
    if multi is None and pair.axes.n_seqs[1] >= 2:
        multi = _pick_multi(sample_cases(pair, CANDIDATES, seed + 1))
    longest = max(checked, key=lambda c: max(c.seq_lens), default=None)
    # Without forced router ties: a near tie flips on layout noise (a bf16 router), which changes every
    # later row of its sequence; that is not what reordering or shortening the batch is about.
    multi, longest = (c.replace(tie_fraction=0.0, tie_gap=0.0) if c is not None and c.tie_fraction > 0 else c
                      for c in (multi, longest))
    problems: list[str] = []

    def _outcomes(case: Case) -> tuple[Any, Any]:
        return kept[case.key()][1] if case.key() in kept else _run_paths(pair, case, device)  # tie-free: anew

    # input dependence on the longest response: a model whose sequences start from a fixed token
    # gives a one-token, prompt-free case the same row under every seed, rightly
    dep = longest if longest is not None and max(longest.seq_lens) >= 2 else first
    try:
        if dep is not None:
            problems += check_input_dependence(pair, dep, *_outcomes(dep), device)
        if multi is not None:
            problems += check_permutation(pair, multi, *_outcomes(multi), device)
        if longest is not None and max(longest.seq_lens) >= 3:
            problems += check_truncation(pair, longest, *_outcomes(longest), device)
    except Warning:
        raise  # a ConformanceWarning turned into an error by the caller's warning filter
    except Exception as e:  # noqa: BLE001 - a raise on a derived case is a violation like any other
        problems.append(f"the pair raised {_raised(e)} on a derived case (another seed, sequences "
                        f"rotated, or a token removed)")
    return problems


def check_verdict(pair: TargetPair, n_cases: int, device: str) -> tuple[str, str, list[str]]:
    """`check_pair` as `harness check` reports it: (verdict, text, warnings), the verdict PASS (text:
    the cases checked), FAIL (text: the violations, or what the check raised outside the runs it
    catches) or CANNOT (the pair's own setup raised a harness error: a checkpoint folder that is gone;
    it says nothing of its paths), with the `ConformanceWarning`s it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConformanceWarning)
        try:
            verdict = ("PASS", str(len(check_pair(pair, n_cases=n_cases, device=device))))
        except ConformanceError as e:
            verdict = ("FAIL", str(e))
        except HarnessError as e:
            verdict = ("CANNOT", str(e))
        except Exception as e:  # noqa: BLE001 - drawing its cases, say: a FAIL that says what, not a traceback
            verdict = ("FAIL", f"the check raised {type(e).__name__}: {e}")
    return (*verdict, [str(w.message) for w in caught if issubclass(w.category, ConformanceWarning)])
