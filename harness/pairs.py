"""Target pairs: the contract every trainer/rollout pair obeys, and the registry that holds them.

Why this exists
---------------
An RL run computes one policy twice: the rollout engine samples tokens, the trainer recomputes
their log-probabilities for the gradient. A *target pair* packages those two computations of one
op or one model so the harness can feed both the same fuzzed input and compare what comes out.

What a pair is
--------------
A `TargetPair` is declarative data (every field commented below) plus three functions:

    build(case, device)  -> inputs    # every tensor drawn from case.seed (use case.generator(...))
    rollout(inputs)      -> Outcome   # the inference path; runs first
    trainer(inputs)      -> Outcome   # the training path; may take a second argument,
                                      #   trainer(inputs, rollout_outcome), to read the tokens
                                      #   the rollout sampled or replay its routing

Both outcomes hold log-probabilities over a vocabulary, one row per token in *case order*
(sequence 0's tokens first, then sequence 1's, ...) whatever packing or padding the path used
inside. A path that does not end in a distribution (a norm, a rotary embedding, an aggregation)
returns `Outcome(hidden=...)` and the pair declares a `Readout`: a fixed seeded projection to a
vocabulary followed by log-softmax, computed in float64 on both sides, so every pair is judged on
the same k3 scale and the readout adds no divergence of its own.

What is tested
--------------
`harness fuzz` draws cases for the axes a pair declares (`Axes`), runs both paths, and judges the
mean k3 against the threshold. The pair's `expected` verdict says what must happen: an `aligned`
pair must stay under the threshold (a finding is a regression); a `diverges` pair is a
demonstration of a real-world mismatch that must keep being caught. `harness.conformance.check_pair`
checks the contract itself (determinism from the seed, shapes, finite output) in one call.

How to add one
--------------
Write a module with the three functions and call `harness.register(TargetPair(...))` at import
time. Put it in `targets/` (imported automatically), pass it with `--plugin path/to/file.py` or
`--plugin package.module`, or expose the module in the `harness.targets` entry-point group.
Nothing in `harness/` changes. Registration validates eagerly and says how to fix what is wrong.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import inspect
import math
import pkgutil
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from .errors import HarnessError, UsageError

KINDS = ("op", "model")
VERDICTS = ("aligned", "diverges")
VERDICT_OVER = ("batch", "sequence")  # `TargetPair.verdict_over`: what the verdict's means are over
DEVICES = ("cpu", "cuda")
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)*$")
ENTRY_POINT_GROUP = "harness.targets"


def is_glob(name: str) -> bool:
    """A pair name pattern (`fnmatch`: `*`, `?`, `[...]`), not one pair's name."""
    return any(c in name for c in "*?[")


class PairError(HarnessError, ValueError):
    """A target pair breaks the contract. The message says what is wrong and how to fix it."""


# ---------------------------------------------------------------------------------------------
# What a path returns
# ---------------------------------------------------------------------------------------------
@dataclass
class Routing:
    """The experts one router layer chose, with the scores it chose them from."""

    experts: Any  # (T, k) int64: chosen expert ids per token, in case order
    scores: Any = None  # (T, E) the scores top-k ran on, in the path's own precision (tie-aware flips)


@dataclass
class Outcome:
    """What one path produced for one case. Rows are tokens in case order."""

    logprobs: Any = None  # (T, V) log-probabilities over the vocabulary (any float dtype)
    hidden: Any = None  # (T, H) instead of logprobs, for pairs with a Readout
    tokens: Any = None  # (T,) int64 token ids the rollout sampled, where it samples
    routing: dict[str, Routing] = field(default_factory=dict)  # router layer name -> decisions
    intermediates: dict[str, Any] = field(default_factory=dict)  # named tensors, for triage
    # the rollout's logprobs are a recording's per-token values, not its distribution: (T, 2) rows of
    # the two-outcome coarsening (column 0 the sampled token `tokens`, column 1 everything else), on
    # both paths; the verdict then reads the mean k3 of the recorded tokens (there is no expectation
    # over a vocabulary to take) and the coarsened KL
    recorded: bool = False


@dataclass(frozen=True)
class Readout:
    """A fixed seeded head, shared by both paths and computed in float64: RMS-normalise each
    hidden row (a final norm), project (H -> vocab) with a fixed W ~ N(0, 1) (seeded by its shape,
    so one model head serves every case and is drawn once per process), scale by the case's logit_scale,
    log-softmax. Logits have standard deviation `case.logit_scale` (the peakedness axis) whatever
    the magnitude of the hidden states, so relative errors of the paths are what is judged.
    """

    vocab: int = 512  # size of the vocabulary the readout projects to

    def apply(self, hidden: Any, case: Any) -> Any:
        import torch

        h = hidden.to(torch.float64)  # (T, H)
        width = h.shape[-1]
        w = _readout_weight(width, self.vocab, str(h.device))  # (H, V)
        h = h / h.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-300)  # (T, H) unit RMS
        logits = (h @ w) * (case.logit_scale / math.sqrt(width))  # (T, V)
        return torch.log_softmax(logits, dim=-1)


@functools.lru_cache(maxsize=16)
def _readout_weight(width: int, vocab: int, device: str) -> Any:
    import torch

    g = torch.Generator().manual_seed(0x5EED + 7919 * width + vocab)
    return torch.randn(width, vocab, generator=g, dtype=torch.float64).to(device)


# The per-module table's protocol (`harness.triage`): a path that knows which position of which of
# its root module's calls produced each outcome row names them in `Outcome.intermediates[ROW_POSITIONS]`,
# a (T, 3) int64 tensor of (call index, in the order of its root calls in this path's run; batch row;
# position) per row, in case order; triage then files the rows by it, where it would otherwise tie
# each row to a position by correlating its largest values (which a row cut to top-2 does not allow).
ROW_POSITIONS = "row_positions"

# ... and for a root module whose vocabulary-wide output
# is computed at some positions only (an LM head applied to the rows a path scores, not to every
# prompt position): during the call the root module holds, under this attribute name, the (N,) int64
# flattened positions (batch index * seq + position, of the call's (B, S) input) of its output's N
# rows, in order; the output is then (N, V) or (1, N, V).
KEPT_POSITIONS = "harness_kept_positions"


def token_outcome(logp_token: Any, tokens: Any = None, routing: dict | None = None) -> Outcome:
    """The Outcome of a path that reports only its sampled tokens' log-probabilities, as an inference
    engine asked for `logprobs=0` does: (T,) log-probabilities, one per token in case order, as
    (T, 2) two-outcome rows {that token, everything else} (column 1 log(1 - p)) with `recorded=True`.
    The rollout passes its sampled `tokens`; the trainer passes its own log-probabilities at those
    tokens (`full.gather(1, rollout.tokens[:, None])[:, 0]`, a trainer that reads the rollout). The
    verdict then reads the sampled tokens' mean k3 (no expectation over a vocabulary to take: a
    noisier estimate than a full row gives) and the two-outcome KL."""
    import torch

    lp = torch.as_tensor(logp_token).detach().to(torch.float64).reshape(-1)
    rows = torch.stack([lp, torch.log(-torch.expm1(lp.clamp_max(0.0)))], 1)  # (T, 2)
    return Outcome(logprobs=rows, tokens=tokens, routing=routing or {}, recorded=True)


def sampled_tokens_only(pair: "TargetPair", name: str | None = None) -> "TargetPair":
    """`pair` as an engine asked for its sampled tokens' log-probabilities only (`logprobs=0`, as vLLM
    and SGLang report them by default) runs it: its rollout's full rows cut to the sampled tokens'
    (`token_outcome`), and its trainer's to its own log-probabilities at those tokens, so the verdict
    reads what an RL step's k3 reads from such an engine. The pair's paths must return full
    log-probability rows, and its rollout its sampled tokens (a pair with a readout, or whose tokens
    the harness draws, has no sampled token to cut to: a TypeError says so on its first case). Its
    triage profiles, if any, rebuild it the same way. Named `name` (default `<pair>.sampled_only`)."""
    import dataclasses

    base = pair
    new_name = name or f"{pair.name}.sampled_only"

    def cut(o: Any, tokens: Any, role: str, keep_tokens: bool) -> Outcome:
        import torch

        if not isinstance(o, Outcome) or not isinstance(o.logprobs, torch.Tensor) or o.logprobs.dim() != 2:
            raise TypeError(f"{new_name}: sampled_tokens_only needs {base.name}'s {role} to return full (T, V) "
                            "log-probability rows (a path that returns hidden states for a readout, or rows already "
                            "cut to its tokens, has none to cut)")
        if tokens is None:
            raise TypeError(f"{new_name}: sampled_tokens_only needs {base.name}'s rollout to return the tokens it "
                            "sampled (Outcome.tokens): where the harness draws them, there is no engine-sampled token "
                            "to report")
        ids = torch.as_tensor(tokens).reshape(-1).to(device=o.logprobs.device, dtype=torch.int64)
        rows = token_outcome(o.logprobs.gather(1, ids[:, None])[:, 0]).logprobs
        return dataclasses.replace(o, logprobs=rows, recorded=True, tokens=tokens if keep_tokens else None)

    def rollout(inputs: Any) -> Outcome:
        out = base.rollout(inputs)
        return cut(out, getattr(out, "tokens", None), "rollout", True)

    def trainer(inputs: Any, rollout_outcome: Outcome) -> Outcome:
        full = base.trainer(inputs, rollout_outcome) if base.trainer_reads_rollout else base.trainer(inputs)
        return cut(full, rollout_outcome.tokens, "trainer", False)

    profiles = pair.profiles
    if profiles is not None:
        profiles = _SampledOnlyProfiles(profiles, new_name)
    return dataclasses.replace(pair, name=new_name, rollout=rollout, trainer=trainer, profiles=profiles,
                               description=(pair.description + " " if pair.description else "")
                               + "(the rollout reports its sampled tokens' log-probabilities only)")


class _SampledOnlyProfiles:
    """A pair's triage profiles, rebuilding each variant as `sampled_tokens_only` made the pair."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner, self._name = inner, name

    def __getattr__(self, key: str) -> Any:
        return getattr(self._inner, key)

    def variant(self, trainer: Mapping[str, str], rollout: Mapping[str, str]) -> "TargetPair":
        return sampled_tokens_only(self._inner.variant(trainer, rollout), self._name)


@dataclass(frozen=True)
class Profiles:
    """The triage protocol for your own pair (`TargetPair.profiles`): what each path runs, component
    by component, and how to rebuild the pair with other settings. `harness triage` swaps one
    differing component at a time (the rollout takes the trainer's setting, and back) and
    delta-debugs the set down to what causes the divergence.

        Profiles(trainer={"kv_cache": "float32", "combine": "float32"},
                 rollout={"kv_cache": "bfloat16", "combine": "float32"},
                 labels={"kv_cache": "KV-cache precision", "combine": "MoE combine precision"},
                 make=lambda t, r: my_pair(name, kv_t=t["kv_cache"], kv_r=r["kv_cache"], ...))

    `make(trainer, rollout)` returns the same pair with its paths running those settings (same
    keys as here); any object with these attributes and a `variant` method works too.
    """

    trainer: Mapping[str, str]  # component -> setting of the trainer path
    rollout: Mapping[str, str]  # component -> setting of the rollout path (the same keys)
    make: Callable[[Mapping[str, str], Mapping[str, str]], "TargetPair"]
    labels: Mapping[str, str] = field(default_factory=dict)  # component -> what a person calls it

    def __post_init__(self) -> None:
        if set(self.trainer) != set(self.rollout):
            raise PairError(f"Profiles: trainer components {sorted(self.trainer)} and rollout components "
                            f"{sorted(self.rollout)} differ; give both paths a setting for every component.")
        if not callable(self.make):
            raise PairError("Profiles: make must be a function (trainer settings, rollout settings) -> TargetPair.")

    def variant(self, trainer: Mapping[str, str], rollout: Mapping[str, str]) -> "TargetPair":
        return self.make(dict(trainer), dict(rollout))


# ---------------------------------------------------------------------------------------------
# What a pair lets the fuzzer vary
# ---------------------------------------------------------------------------------------------
# the sampling knobs an `Axes` bounds, each (low, high), neutral as `case.NEUTRAL` says
SAMPLING_AXES = ("temperature", "top_p", "sample_top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


@dataclass(frozen=True)
class RoutingAxes:
    """Bounds of the near-tie routing axes (only for pairs with a router)."""

    n_experts: tuple[int, int] = (4, 16)  # experts, inclusive range
    top_k: tuple[int, int] = (1, 4)  # experts chosen per token, inclusive (capped at n_experts - 1)
    max_gap: float = 1e-2  # largest boundary gap drawn; 0 is the exact tie
    tie_fraction: tuple[float, float] = (0.0, 1.0)  # fraction of tokens forced to the boundary
    # smallest boundary gap drawn, where gaps shrink to (0: the exact tie). A floor for a router whose
    # two paths compute its scores in different layouts: they flip at an exact tie on float32 rounding,
    # which is not a bug of theirs (1e-5 is the built-in pairs' floor); it also hides what flips below it
    min_gap: float = 0.0


@dataclass(frozen=True)
class Axes:
    """The fuzz axes of a pair and their bounds (inclusive). An axis whose bounds are equal is held
    fixed; each axis has a neutral value that is also what shrinking moves it toward.

    The defaults are what real trigger classes need on a CPU while keeping a case cheap: up to 16
    sequences (kernels switch at batch 8/16), responses up to 64 tokens, logits up to 16x peaked,
    both pad sides. Sampling axes and prompts are off (neutral) unless a pair widens them.
    """

    n_seqs: tuple[int, int] = (1, 16)  # sequences in the batch (neutral: fewer)
    seq_len: tuple[int, int] = (1, 64)  # response (scored) tokens per sequence (neutral: fewer)
    packing: bool = False  # fuzz the trainer's row capacity and packing order (neutral: one row, as given)
    routing: RoutingAxes | None = None  # fuzz near-tie routing; None = no router in this pair
    logit_scale: tuple[float, float] = (1.0, 16.0)  # peakedness, drawn log-uniform (neutral: the low bound)
    dtypes: tuple[str, ...] = ("bfloat16",)  # low-precision dtypes to draw; the first is the simplest
    params: Mapping[str, Any] = field(default_factory=dict)  # name -> Hypothesis strategy (free parameters)
    prompt_len: tuple[int, int] = (0, 0)  # prompt tokens per sequence, prefilled (neutral: fewer; 0 = none)
    pad_sides: tuple[str, ...] = ("right", "left")  # rollout padding sides to draw (neutral: the first)
    temperature: tuple[float, float] = (1.0, 1.0)  # sampling temperature (neutral 1.0)
    top_p: tuple[float, float] = (1.0, 1.0)  # nucleus mass (neutral 1.0 = off)
    sample_top_k: tuple[int, int] = (0, 0)  # sampling top-k (neutral 0 = off)
    min_p: tuple[float, float] = (0.0, 0.0)  # sampling min-p (neutral 0.0 = off)
    # penalties by each row's token history (`harness.sampling.penalize`; the paths must apply them)
    repetition_penalty: tuple[float, float] = (1.0, 1.0)  # neutral 1.0 = off
    presence_penalty: tuple[float, float] = (0.0, 0.0)  # neutral 0.0 = off
    frequency_penalty: tuple[float, float] = (0.0, 0.0)  # neutral 0.0 = off
    # sequences per prompt (a group of samples of one prompt, as GRPO draws them: `case.prompt_ids`);
    # (1, 1) = every sequence its own prompt (neutral)
    prompt_group: tuple[int, int] = (1, 1)
    # Caps on what a case holds (None: none). `max_context`: every sequence's prompt + response tokens
    # (a model's context, less any token the pair adds). A draw over it keeps its prompt and cuts its
    # response to fit (so the longest positions are drawn often), the prompt too where the shortest
    # response does not fit. `max_tokens`: the prompt + response tokens of the whole batch (what a
    # trainer's token-budget micro-batcher holds; the memory of a real-vocabulary case grows with it).
    # A draw over it keeps its first sequences that fit (at least n_seqs' low), then cuts responses,
    # then prompts, from the last sequence back. Shrinking never lengthens a sequence or the batch.
    max_context: int | None = None
    max_tokens: int | None = None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n_seqs": list(self.n_seqs), "seq_len": list(self.seq_len)}
        if self.prompt_len != (0, 0):
            out["prompt_len"] = list(self.prompt_len)
        if self.prompt_group != (1, 1):
            out["prompt_group"] = list(self.prompt_group)
        for name in ("max_context", "max_tokens"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.packing:
            out["packing"] = True
        if len(self.pad_sides) > 1:
            out["pad_sides"] = list(self.pad_sides)
        if self.routing:
            r = self.routing
            out["routing"] = {"n_experts": list(r.n_experts), "top_k": list(r.top_k),
                              "max_gap": r.max_gap, "tie_fraction": list(r.tie_fraction)}
            if r.min_gap:
                out["routing"]["min_gap"] = r.min_gap
        if self.logit_scale[0] != self.logit_scale[1]:
            out["logit_scale"] = list(self.logit_scale)
        for name in SAMPLING_AXES:
            lo, hi = getattr(self, name)
            if lo != hi:
                out[name] = [lo, hi]
        out["dtypes"] = list(self.dtypes)
        if self.params:
            out["params"] = {k: repr(v) for k, v in self.params.items()}
        return out

    def shortest_sequence(self) -> int:
        """The fewest prompt + response tokens a sequence can hold within these axes."""
        return self.prompt_len[0] + self.seq_len[0]

    def _cap_problems(self) -> list[str]:
        out: list[str] = []
        ok = all(isinstance(v, tuple) and len(v) == 2 and all(_int(x) for x in v)
                 for v in (self.n_seqs, self.seq_len, self.prompt_len))
        least = self.shortest_sequence() if ok else 1
        for name, floor, what in (
                ("max_context", least, f"the shortest sequence the axes allow (prompt_len low + seq_len low = {least})"),
                ("max_tokens", least * (self.n_seqs[0] if ok else 1),
                 f"the smallest batch the axes allow (n_seqs low x the shortest sequence = "
                 f"{self.n_seqs[0] if ok else '?'} x {least})")):
            v = getattr(self, name)
            if v is not None and not (_int(v) and v >= floor):
                out.append(f"axes.{name}={v!r} must be None (no cap) or an integer at least {what}: "
                           f"raise it, or lower those low bounds")
        return out

    def problems(self) -> list[str]:
        """Every way these axes break the rules, each with its fix (empty when valid)."""
        from .case import DTYPES, PAD_SIDES, PENALTY_BOUNDS

        out: list[str] = []

        def int_range(name: str, floor: int) -> None:
            v = getattr(self, name)
            if not (isinstance(v, tuple) and len(v) == 2 and all(_int(x) for x in v) and floor <= v[0] <= v[1]):
                out.append(f"axes.{name}={v!r} must be a tuple (low, high) of integers with {floor} <= low <= high")

        def float_range(name: str, low_ok: Callable[[float], bool], high_ok: Callable[[float], bool], rule: str) -> None:
            v = getattr(self, name)
            if not (isinstance(v, tuple) and len(v) == 2 and all(_num(x) for x in v)
                    and low_ok(v[0]) and high_ok(v[1]) and v[0] <= v[1]):
                out.append(f"axes.{name}={v!r} must be a tuple (low, high) of numbers with {rule}")

        int_range("n_seqs", 1)
        int_range("seq_len", 1)
        int_range("prompt_len", 0)
        int_range("prompt_group", 1)
        if (isinstance(self.prompt_group, tuple) and len(self.prompt_group) == 2 and _int(self.prompt_group[1])
                and self.prompt_group[1] > 1 and isinstance(self.prompt_len, tuple) and len(self.prompt_len) == 2
                and self.prompt_len[1] == 0):
            out.append(f"axes.prompt_group={self.prompt_group!r} draws groups of sequences that share a prompt, but "
                       "prompt_len=(0, 0) gives them none to share: widen prompt_len (e.g. prompt_len=(1, 32)) or "
                       "leave prompt_group=(1, 1)")
        int_range("sample_top_k", 0)
        float_range("logit_scale", lambda x: x > 0, math.isfinite, "0 < low <= high < inf")
        float_range("temperature", lambda x: x > 0, math.isfinite, "0 < low <= high < inf (1.0 is neutral)")
        float_range("top_p", lambda x: x > 0, lambda x: x <= 1, "0 < low <= high <= 1 (1.0 is neutral: off)")
        float_range("min_p", lambda x: x >= 0, lambda x: x <= 1, "0 <= low <= high <= 1 (0.0 is neutral: off)")
        float_range("repetition_penalty", lambda x: x > 0, math.isfinite, "0 < low <= high < inf (1.0 is neutral: off)")
        lo, hi = PENALTY_BOUNDS
        for name in ("presence_penalty", "frequency_penalty"):
            float_range(name, lambda x: x >= lo, lambda x: x <= hi,
                        f"{lo:g} <= low <= high <= {hi:g} (0.0 is neutral: off)")
        if not isinstance(self.packing, bool):
            out.append(f"axes.packing={self.packing!r} must be True or False")
        out.extend(self._cap_problems())
        if (not isinstance(self.dtypes, tuple) or not self.dtypes
                or any(not isinstance(d, str) or d not in DTYPES for d in self.dtypes)):
            out.append(f"axes.dtypes={self.dtypes!r} must be a non-empty tuple drawn from {DTYPES}, "
                       "e.g. dtypes=(\"bfloat16\",)")
        if (not isinstance(self.pad_sides, tuple) or not self.pad_sides
                or any(not isinstance(d, str) or d not in PAD_SIDES for d in self.pad_sides)):
            out.append(f"axes.pad_sides={self.pad_sides!r} must be a non-empty tuple drawn from {PAD_SIDES}")
        if not isinstance(self.params, Mapping):
            out.append(f"axes.params={self.params!r} must be a dict of name -> Hypothesis strategy")
        else:
            from hypothesis.strategies import SearchStrategy

            for k, v in self.params.items():
                if not isinstance(k, str) or not k:
                    out.append(f"axes.params key {k!r} must be a non-empty string")
                elif not isinstance(v, SearchStrategy):
                    out.append(f"axes.params[{k!r}]={v!r} is a {type(v).__name__}, not a Hypothesis strategy; "
                               f"write e.g. params={{{k!r}: st.floats(0.5, 2.0)}} with "
                               "`from hypothesis import strategies as st`")
        r = self.routing
        if r is not None:
            if not isinstance(r, RoutingAxes):
                out.append(f"axes.routing must be a harness.RoutingAxes or None, got {type(r).__name__}")
            else:
                ok_e = (isinstance(r.n_experts, tuple) and len(r.n_experts) == 2 and all(_int(x) for x in r.n_experts)
                        and 2 <= r.n_experts[0] <= r.n_experts[1])
                if not ok_e:
                    out.append(f"axes.routing.n_experts={r.n_experts!r} needs integers 2 <= low <= high")
                ok_k = (isinstance(r.top_k, tuple) and len(r.top_k) == 2 and all(_int(x) for x in r.top_k)
                        and 1 <= r.top_k[0] <= r.top_k[1])
                if not ok_k or (ok_e and r.top_k[0] >= r.n_experts[0]):
                    out.append(f"axes.routing.top_k={r.top_k!r} needs integers 1 <= low <= high and low < the fewest "
                               f"experts ({r.n_experts[0] if ok_e else '?'}), so a boundary exists")
                if not (_num(r.max_gap) and 0 <= r.max_gap <= 1.0):
                    out.append(f"axes.routing.max_gap={r.max_gap!r} must lie in [0, 1]")
                elif not (_num(r.min_gap) and 0 <= r.min_gap <= r.max_gap):
                    out.append(f"axes.routing.min_gap={r.min_gap!r} must lie in [0, max_gap={r.max_gap!r}] (the "
                               "smallest boundary gap drawn; 0 reaches the exact tie)")
                tf = r.tie_fraction
                if not (isinstance(tf, tuple) and len(tf) == 2 and all(_num(x) for x in tf) and 0 <= tf[0] <= tf[1] <= 1):
                    out.append(f"axes.routing.tie_fraction={tf!r} must be a tuple (low, high) with 0 <= low <= high <= 1")
        if not out:
            out += self._over_repro_limits()
        return out

    def _over_repro_limits(self) -> list[str]:
        """The largest case these axes allow, against the limits a repro is loaded under
        (`corpus.LIMITS`): a campaign would otherwise draw cases whose repros it then refuses to
        replay (and spend its budget building them)."""
        from .corpus import LIMITS

        out = []
        biggest = {"sequences": self.n_seqs[1], "tokens": self.n_seqs[1] * (self.prompt_len[1] + self.seq_len[1]),
                   "experts": self.routing.n_experts[1] if self.routing is not None else 0}
        how = {"sequences": "n_seqs high", "tokens": "n_seqs high x (prompt_len high + seq_len high)",
               "experts": "routing.n_experts high"}
        for key, n in biggest.items():
            lim = LIMITS[key]
            # (against the default or a raised limit: a limit lowered to refuse large repros must not make
            # the built-in pairs, or anyone's, fail to register; their large repros are refused on load)
            bound = max(lim.default, lim.value())
            if n > bound:
                out.append(f"axes allow cases of {n} {key} ({how[key]}), above the limit of {bound} on a "
                           f"repro's {lim.name}: a finding that large could not be replayed. Lower the bound, or raise "
                           f"the limit with ${lim.env} (in every process that fuzzes or replays it)")
        return out


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


# ---------------------------------------------------------------------------------------------
# The pair
# ---------------------------------------------------------------------------------------------
def lead_of(pair: Any, case: Any) -> int:
    """The tokens `pair` puts before each sequence's prompt in `case` (`TargetPair.lead_tokens_for`,
    else `lead_tokens`): what a position the harness reports counts from."""
    f = getattr(pair, "lead_tokens_for", None)
    return int(f(case)) if f is not None else int(getattr(pair, "lead_tokens", 0) or 0)


def _positive_number(x: Any) -> bool:
    """A real number (int, float, numpy scalar, ...; not a bool) that is finite and > 0."""
    import numbers

    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclass(frozen=True)
class TargetPair:
    name: str  # unique dotted name, e.g. "moe_aggregate.bf16" (family.variant)
    kind: str  # "op" (one operation) or "model" (a whole model)
    expected: str  # "aligned" (must stay under the threshold) or "diverges" (must keep being caught)
    build: Callable[[Any, str], Any]  # (case, device) -> inputs; every tensor from case.seed
    trainer: Callable[..., Outcome]  # (inputs[, rollout_outcome]) -> Outcome: the training path
    rollout: Callable[[Any], Outcome]  # (inputs) -> Outcome: the inference path (runs first)
    axes: Axes = field(default_factory=Axes)  # what the fuzzer may vary, and within which bounds
    readout: Readout | None = None  # required when the paths return hidden states, not logprobs
    devices: tuple[str, ...] = ("cpu", "cuda")  # devices the pair runs on
    description: str = ""  # one line: which real trainer/rollout difference this reproduces
    profiles: Any = None  # optional: numerics profiles of both paths, for triage by swapping
    source: str = ""  # where it was registered from (filled in by the registry)
    timeout: float | None = None  # per-case seconds before a case is a hang; None: the campaign's `--timeout`.
    #   Its own wins over the campaign's either way (a compiling backend that recompiles for new shapes may
    #   need minutes cold; a pair that may hang wants seconds); `--timeout GLOB=S` overrides it
    # The line this pair's verdicts are judged at (judged k3 or exact KL); None: the campaign's `--threshold`.
    #   For paths accepted to differ by a known amount (an int8 rollout against a bf16 trainer): a case
    #   past the accepted gap still fails, one inside it does not. Its own wins over the campaign's
    #   `--threshold X`; `--threshold GLOB=X` overrides it. Where the accepted path can be run as the
    #   trainer (the int8 reference against the engine), an aligned pair at the default line is stricter.
    threshold: float | None = None
    # optional: () -> a fingerprint of the weights the pair runs (a checkpoint folder's contents), kept
    # in its repros; a replay against other weights says so (RL runs overwrite checkpoints)
    weights: Callable[[], str] | None = None
    # What the verdict's means are over: "batch" (every scored token of the case, as an RL step's mean
    # k3) or "sequence" (the worst sequence's own mean: a bug in one sample of a batch, a prefix-cache
    # hit or one request's kernel, is not diluted by the clean ones; `metrics.judged_means`)
    verdict_over: str = "batch"
    # Tokens the pair puts before each sequence's prompt (a first/BOS token: 1 for the Hugging Face
    # pairs), so that the positions the harness reports (`show`, triage) are the sequence's own
    lead_tokens: int = 0
    # Where that depends on the case: its lead tokens for a given case (a recorded rollout scored by
    # `harness score` carries its own prompt, with nothing put before it: 0); None: `lead_tokens`
    lead_tokens_for: Callable[[Any], int] | None = None
    # Sequence lengths (positions, lead tokens included) past which the pair computes otherwise, by
    # name: a sliding window, a KV-cache block, a chunked-prefill size ({"sliding_window": 4096}). A
    # campaign whose cases never pass one says so: nothing past it was tested (`PairResult.unreached`)
    size_marks: Mapping[str, int] = field(default_factory=dict)

    @property
    def trainer_reads_rollout(self) -> bool:
        return _positional_arity(self.trainer) >= 2

    def __post_init__(self) -> None:
        import numbers

        for attr in ("timeout", "threshold"):  # a numpy / Fraction number: a plain float from here on (JSON, MLflow)
            v = getattr(self, attr)
            if isinstance(v, numbers.Real) and not isinstance(v, (bool, float)):
                object.__setattr__(self, attr, float(v))

    def validate(self) -> None:
        where = f"target pair {self.name!r}" + (f" (from {self.source})" if self.source else "")
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise PairError(
                f"{where}: the name must be lower-case dotted words like 'family.variant' "
                f"(letters, digits, underscores); rename it."
            )
        if self.kind not in KINDS:
            raise PairError(f"{where}: kind={self.kind!r} is not one of {KINDS}; set kind='op' or 'model'.")
        if self.expected not in VERDICTS:
            raise PairError(
                f"{where}: expected={self.expected!r} is not one of {VERDICTS}; use 'aligned' for pairs that "
                "must stay equivalent and 'diverges' for demonstrations that must keep being caught."
            )
        for role, fn, want in (("build", self.build, (2,)), ("rollout", self.rollout, (1,)),
                               ("trainer", self.trainer, (1, 2))):
            if not callable(fn):
                raise PairError(f"{where}: {role} must be a function, got {type(fn).__name__}.")
            arity = _positional_arity(fn)
            if arity is not None and arity not in want:
                sig = {"build": "build(case, device)", "rollout": "rollout(inputs)",
                       "trainer": "trainer(inputs) or trainer(inputs, rollout_outcome)"}[role]
                raise PairError(f"{where}: {role} takes {arity} positional argument(s); write it as {sig}.")
        if not isinstance(self.axes, Axes):
            raise PairError(f"{where}: axes must be a harness.Axes, got {type(self.axes).__name__}.")
        problems = self.axes.problems()
        if problems:
            raise PairError(f"{where}: " + "; ".join(problems) + ". Fix the Axes(...) the pair registers with.")
        if not isinstance(self.devices, tuple) or not self.devices or any(d not in DEVICES for d in self.devices):
            raise PairError(f"{where}: devices={self.devices!r} must be a non-empty tuple drawn from {DEVICES}.")
        if self.timeout is not None and not _positive_number(self.timeout):
            raise PairError(f"{where}: timeout={self.timeout!r} must be None or a number of seconds > 0.")
        if self.threshold is not None and not _positive_number(self.threshold):
            raise PairError(f"{where}: threshold={self.threshold!r} must be None (the campaign's --threshold) or a "
                            "finite number > 0: the judged k3 / exact KL above which a case of this pair diverges.")
        if self.verdict_over not in VERDICT_OVER:
            raise PairError(f"{where}: verdict_over={self.verdict_over!r} is not one of {VERDICT_OVER}; 'batch' judges "
                            "the mean over every token of a case, 'sequence' the worst sequence's own mean.")
        if not isinstance(self.lead_tokens, int) or isinstance(self.lead_tokens, bool) or self.lead_tokens < 0:
            raise PairError(f"{where}: lead_tokens={self.lead_tokens!r} must be an integer >= 0 (the tokens the pair "
                            "puts before each sequence's prompt, e.g. 1 for a first/BOS token).")
        if not isinstance(self.size_marks, Mapping) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 1
                for k, v in self.size_marks.items()):
            raise PairError(f"{where}: size_marks={self.size_marks!r} must map names to sequence lengths >= 1 "
                            "(e.g. {'sliding_window': 4096}).")
        if self.readout is not None and not isinstance(self.readout, Readout):
            raise PairError(f"{where}: readout must be a harness.Readout or None.")
        if self.readout is not None and self.readout.vocab < 2:
            raise PairError(f"{where}: readout.vocab must be >= 2.")


@functools.lru_cache(maxsize=1024)
def _positional_arity(fn: Callable) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    n = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty:
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------
# False in a harness worker process: its campaign process has warned already
WARN_BROKEN_ENTRY_POINTS = [True]


class Registry:
    """Name -> TargetPair. Built-ins come from the `targets` package, plugins from files,
    modules and the `harness.targets` entry-point group."""

    def __init__(self) -> None:
        self._pairs: dict[str, TargetPair] = {}
        self._loaded_builtins = False
        # entry point name -> why it did not load: its pairs are missing (named wherever one is asked for),
        # the others run (one broken installed package must not stop every command)
        self.broken_entry_points: dict[str, str] = {}
        self._loading: str = ""
        # (registering module, name) -> pair, for the module being loaded: one module giving two pairs one name
        self._names_loading: dict[tuple[int, str], TargetPair] = {}
        self.plugins: list[str] = []  # plugin specs loaded (load_plugin), in order
        # how the command at hand names its plugin option, for messages (the pytest plugin: --harness-plugin=)
        self.plugin_flag = "--plugin "

    def register(self, pair: TargetPair) -> TargetPair:
        if not isinstance(pair, TargetPair):
            raise PairError(f"register() takes a harness.TargetPair, got {type(pair).__name__}.")
        if not pair.source and self._loading:
            object.__setattr__(pair, "source", self._loading)
        pair.validate()
        old = self._pairs.get(pair.name)
        if self._loading:
            key = (_registering_module(), pair.name)  # a module run twice (imported by two names) is two modules
            twice = self._names_loading.get(key)
            if twice is not None and twice is not pair:
                raise PairError(
                    f"{self._loading} registers two target pairs named {pair.name!r}; the second would silently "
                    "replace the first and its campaigns would never run. Give each pair its own name."
                )
            self._names_loading[key] = pair
        if old is not None and old.source != pair.source:
            raise PairError(
                f"target pair {pair.name!r} from {pair.source or 'unknown'} clashes with the one already "
                f"registered from {old.source or 'unknown'}; give one of them another name."
            )
        self._pairs[pair.name] = pair
        return pair

    def load_builtins(self) -> None:
        if self._loaded_builtins:
            return
        self._loaded_builtins = True
        import targets

        for mod in pkgutil.walk_packages(targets.__path__, prefix="targets."):
            self._import(mod.name, label=mod.name)
        self._load_entry_points()

    def _load_entry_points(self) -> None:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                with self._load(f"entry point {ep.name}"):
                    obj = ep.load()
                    if callable(obj) and not isinstance(obj, type(sys)):
                        for pair in obj() or ():
                            self.register(pair)
            except PairError:
                raise
            except Exception as e:  # its pairs are missing; the built-ins and other packages' pairs still run
                label = f"entry point {ep.name}"
                for name in [n for n, p in self._pairs.items() if p.source == label]:
                    del self._pairs[name]  # (registered before it failed: none of a broken package's pairs run)
                why = (f"the plugin entry point {ep.name!r} ({ep.value}) in group {ENTRY_POINT_GROUP!r} failed to "
                       f"load ({type(e).__name__}: {e}); fix or uninstall the package that provides it")
                self.broken_entry_points[ep.name] = why
                if WARN_BROKEN_ENTRY_POINTS[0]:
                    print(f"warning: {why}. None of its pairs is registered; the others are (a campaign over every "
                          "pair or a glob exits 2, and the corpus test fails its repros).", file=sys.stderr, flush=True)

    def broken_note(self) -> str:
        """A sentence per entry point that failed to load (a pair asked for may be one of its), else ""."""
        return "".join(f" Also, {why}: the pair may be one of its." for why in self.broken_entry_points.values())

    @contextlib.contextmanager
    def _load(self, label: str) -> Iterator[None]:
        """What is registered meanwhile comes from `label`; a load nested in another (a plugin that
        loads a plugin) gives the outer one its state back."""
        saved = self._loading, self._names_loading
        self._loading, self._names_loading = label, {}
        try:
            yield
        finally:
            self._loading, self._names_loading = saved

    def _import(self, module: str, label: str) -> None:
        with self._load(label):
            importlib.import_module(module)

    def load_plugin(self, spec: str) -> None:
        """Import a plugin: a path to a .py file, or a dotted module name."""
        self.load_builtins()
        path = Path(spec)
        try:
            if spec.endswith(".py") or path.exists():
                if path.is_dir():
                    files = sorted(p.name for p in path.glob("*.py"))[:5]
                    raise UsageError(
                        f"plugin {spec!r} is a folder; pass the Python file in it that registers target pairs"
                        + (f" ({', '.join(files)} are there)" if files else " (it holds no .py file)")
                        + ", or a dotted module name importable from this environment (a package: its module)."
                    )
                if not path.is_file():
                    raise UsageError(
                        f"plugin file {spec!r} does not exist; pass the path of a Python file that registers "
                        "target pairs, or a dotted module name importable from this environment."
                    )
                name = "harness_plugin_" + re.sub(r"\W", "_", str(path.resolve()))
                if name in sys.modules:
                    return
                if _module_of_file(path) is not None:  # imported already, by another plugin beside it: its
                    # pairs are registered (running the file again would register them a second time)
                    if spec not in self.plugins:
                        self.plugins.append(spec)
                    return
                # (an explicit source loader: a plugin file whose name does not end in .py loads too; the
                # default finder gives no spec for it, and the import failed with "'NoneType' ... loader")
                mod_spec = importlib.util.spec_from_file_location(
                    name, path, loader=importlib.machinery.SourceFileLoader(name, str(path)))
                module = importlib.util.module_from_spec(mod_spec)
                sys.modules[name] = module
                # its folder importable, as for `python FILE` (a helper module beside it), but after the
                # installed packages, so that a file there never shadows one of them
                folder = str(path.resolve().parent)
                if folder not in sys.path:
                    sys.path.append(folder)
                # a plugin beside it that imports it by its own name (`import tiny_engine`) gets this
                # module, not a second run of the file registering the same pairs again
                alias = path.stem if path.suffix == ".py" and path.stem.isidentifier() else None
                if alias is not None and (alias in sys.modules or not _resolves_to(alias, path)):
                    alias = None
                if alias is not None:
                    sys.modules[alias] = module
                try:
                    with self._load(str(path)):
                        mod_spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(name, None)
                    if alias is not None and sys.modules.get(alias) is module:
                        sys.modules.pop(alias, None)
                    raise
            else:
                self._import(spec, label=spec)
            if spec not in self.plugins:
                self.plugins.append(spec)
        except (UsageError, PairError) as e:
            if spec in str(e):
                raise
            # raised by the plugin's own code while it registered (a checkpoint folder it names is gone):
            # say which plugin, since the pairs it would have registered after it are missing
            wrapped = f"plugin {spec!r} stopped while registering its pairs: {e}"
            try:
                err = type(e)(wrapped)
            except Exception:  # noqa: BLE001 - a subclass of the plugin's own whose __init__ takes other arguments
                err = UsageError(wrapped)
            raise err from None
        except SystemExit as e:  # a script's `sys.exit()` at import: the harness's exit code must not be it
            raise UsageError(
                f"plugin {spec!r} called sys.exit({e.code!r}) while being imported; a plugin module must only "
                "register pairs (keep script code under `if __name__ == \"__main__\":`)."
            ) from None
        except Exception as e:
            is_file = spec.endswith(".py") or path.exists()
            if not is_file and isinstance(e, ModuleNotFoundError) and (e.name == spec or spec.startswith(f"{e.name}.")):
                raise UsageError(
                    f"plugin {spec!r} is neither a file nor an importable module (no module named {e.name!r} in "
                    f"this environment, {sys.executable}); pass the path of a Python file that registers target "
                    "pairs (ending in .py), or install the package that holds the module."
                ) from None
            import shlex

            run = f"python {shlex.quote(spec)}" if is_file else f"python -c 'import {spec}'"
            raise UsageError(
                f"plugin {spec!r} failed to import: {type(e).__name__}: {e}. Run `{run}` to see the full error, "
                "fix it, and try again."
            ) from None

    def get(self, name: str) -> TargetPair:
        self.load_builtins()
        if name not in self._pairs:
            import difflib

            # closest first: difflib's ratio, then the pairs of the same family
            close = difflib.get_close_matches(name, list(self._pairs), n=5, cutoff=0.6)
            close += [n for n in sorted(self._pairs) if n.startswith(name.split(".")[0] + ".") and n not in close]
            close = close[:5]
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise UsageError(
                f"no target pair named {name!r} is registered.{hint} Run `harness list` to see the registered "
                f"pairs; {self.plugins_note()}" + self.broken_note()
            )
        return self._pairs[name]

    def __getitem__(self, name: str) -> TargetPair:
        """`REGISTRY["model.aligned"]`: the same as `get` (a UsageError naming the closest pairs)."""
        return self.get(name)

    def get_loaded(self, name: str) -> TargetPair | None:
        """The pair `name` if it is registered already, else None (loads nothing: no built-ins, no plugin)."""
        return self._pairs.get(name)

    @staticmethod
    def _pairs_of(specs: Iterable[str], pairs: Iterable[TargetPair]) -> list[TargetPair]:
        """The pairs among `pairs` (in their order) that the plugins `specs` registered (their `source`:
        a spec as given, or its path)."""
        sources = {x for spec in specs for x in (spec, str(Path(spec)))}
        return [p for p in pairs if p.source in sources]

    def plugins_note(self) -> str:
        """Where a pair that is not registered could come from: the plugins loaded and what each
        registered (one that registered none is named), else the option that loads one."""
        if not self.plugins:
            return f"a pair from your own file needs `{self.plugin_flag}path/to/file.py`."
        counts = {spec: len(self._pairs_of([spec], self._pairs.values())) for spec in self.plugins}
        empty = [spec for spec, n in counts.items() if not n]
        if empty:
            return (f"plugin {', '.join(map(repr, empty))} loaded but registered no pair: it must call "
                    "harness.register(TargetPair(...)) when imported (not only under `if __name__ == \"__main__\":`"
                    ", nor in a function nobody calls).")
        return ("the plugin(s) loaded register " + ", ".join(f"{n} pair(s) from {spec}" for spec, n in counts.items())
                + f", not this one; another file needs its own `{self.plugin_flag}FILE`.")

    def _close_to_glob(self, pat: str) -> str:
        """' Did you mean 'a.*'?' for a glob with a typo: the registered names close to its literal part,
        as the same glob (family names matched against a family glob); "" when none is close."""
        import difflib

        stem = re.sub(r"[*?\[\]]+.*$", "", pat).rstrip(".")  # ('mine.sofcap*' -> 'mine.sofcap')
        if len(stem) < 3:
            return ""
        tail = pat[len(stem):]
        names = set(self._pairs) | {n.rsplit(".", 1)[0] for n in self._pairs if "." in n}
        close = difflib.get_close_matches(stem, sorted(names), n=3, cutoff=0.7)
        return f" Did you mean {', '.join(repr(c + tail) for c in close)}?" if close else ""

    def select(self, patterns: Iterable[str] = ()) -> list[TargetPair]:
        """Pairs matching any glob pattern (all pairs when none are given), sorted by name."""
        import fnmatch

        self.load_builtins()
        patterns = list(patterns)
        if not patterns:
            return [self._pairs[n] for n in sorted(self._pairs)]
        chosen: dict[str, TargetPair] = {}
        for pat in patterns:
            if is_glob(pat):
                hits = [n for n in self._pairs if fnmatch.fnmatchcase(n, pat)]
                if not hits:
                    raise UsageError(f"no registered pair matches {pat!r}.{self._close_to_glob(pat)} Run `harness "
                                     f"list` to see them; {self.plugins_note()}" + self.broken_note())
                for n in hits:
                    chosen[n] = self._pairs[n]
            else:
                chosen[pat] = self.get(pat)
        return [chosen[n] for n in sorted(chosen)]

    def select_default(self, patterns: Iterable[str] = ()) -> tuple[list[TargetPair], str]:
        """What a campaign runs: the pairs matching `patterns`; with none, the pairs of the plugins given
        (`load_plugin`) when they register any, else every pair. Returns (pairs, a note saying so when the
        plugins' pairs stood in for every pair): a user's nightly with its own plugin runs its own pairs,
        not the built-in demonstrations (whose repros would land in its corpus)."""
        patterns = list(patterns)
        pairs = self.select(patterns)
        if patterns or not self.plugins:
            return pairs, ""
        own = self._pairs_of(self.plugins, pairs)
        if not own:  # (running every built-in pair instead: minutes, and their repros in the user's corpus)
            raise UsageError(f"no pairs named, and {self.plugins_note()} Nothing was run. Name the pairs to run "
                             f"(PAIR or GLOB; '*' for all {len(pairs)} registered, the built-in ones too) once it does.")
        empty = [spec for spec in self.plugins if not self._pairs_of([spec], own)]
        return own, (f"no pairs named: running the {len(own)} pair(s) of {', '.join(self.plugins)} "
                     f"(name pairs, or '*' for all {len(pairs)} registered, to run others)"
                     + (f"; warning: plugin {', '.join(map(repr, empty))} registered no pair of its own (it must "
                        "call harness.register(TargetPair(...)) when imported)" if empty else ""))

    def all(self) -> list[TargetPair]:
        return self.select()

    def __iter__(self) -> Iterator[TargetPair]:
        """Every registered pair (built-ins loaded first), by name."""
        return iter(self.select())

    def __len__(self) -> int:
        self.load_builtins()
        return len(self._pairs)

    def __contains__(self, name: object) -> bool:
        self.load_builtins()
        return name in self._pairs


def _module_of_file(path: Path) -> Any:
    """A module already imported from this file (under any name), or None."""
    target = str(path.resolve())
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and f.endswith(path.name):
            try:
                if str(Path(f).resolve()) == target:
                    return mod
            except OSError:
                continue
    return None


def _resolves_to(name: str, path: Path) -> bool:
    """`import name` would import this file (its folder is on sys.path and nothing earlier has it)."""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    origin = getattr(found, "origin", None)
    try:
        return bool(origin) and Path(origin).resolve() == path.resolve()
    except OSError:
        return False


def _registering_module() -> int:
    """The module calling `register` (the first frame outside the harness), by identity: a plugin
    imported under two names runs as two modules, each registering its pairs once."""
    f = sys._getframe(1)
    while f is not None and (f.f_globals.get("__name__") == "harness"
                             or str(f.f_globals.get("__name__", "")).startswith("harness.")):
        f = f.f_back
    return id(f.f_globals) if f is not None else 0


REGISTRY = Registry()


def register(pair: TargetPair) -> TargetPair:
    """Register a pair in the default registry (call at import time of a targets/plugin module)."""
    return REGISTRY.register(pair)
