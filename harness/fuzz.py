"""A fuzz campaign: Hypothesis drives every selected pair, shrinks what diverges, records findings.

Per pair, Hypothesis draws Cases from the pair's axes; each case runs both paths (`execute`),
`hypothesis.target` climbs toward large k3, and a case whose symptom is not `none` fails the
property, which Hypothesis then shrinks to a minimal case. Each distinct failure (by signature) is
a `Finding`: the minimal case, its metrics and the environment. Findings are written to the corpus
first, then handed to the tracker, so nothing found depends on a tracking server.

Settings are our own, never a Hypothesis profile: Hypothesis loads a `ci` profile when CI is set,
which derandomizes and drops the database; a campaign instead always chooses a seed, prints it and
stores it, so a night can be rerun exactly with `--seed`.

Signature (dedup key, within a campaign and across campaigns): sha256 of
`pair | symptom | detail`, where detail is empty for `divergence` and `nonfinite` (one pair, one
numerical mismatch) and `ExceptionType@file:function` of the innermost frame for `error` (one
crash site, one bug). The corpus file of a finding is `corpora/<pair>/<signature[:12]>.json`.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .case import Case
from .execute import DEFAULT_THRESHOLD, Evaluation, Symptom, run_case
from .pairs import TargetPair


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
@dataclass
class Finding:
    pair: str
    expected: str  # the pair's expected verdict
    symptom: Symptom
    signature: str
    case: Case  # the minimal case
    evaluation: Evaluation  # the minimal case's evaluation (metrics, per-token table)
    examples: int  # cases this pair had run when the campaign ended
    shrink_complete: bool = True  # False when the budget or Ctrl-C cut shrinking short
    path: Path | None = None  # the corpus file
    new: bool = True  # False when the corpus already held this signature
    recurrence: bool = False  # True when the corpus held it as `fixed`

    @property
    def id(self) -> str:
        return self.signature[:12]

    @property
    def status(self) -> str:
        if self.expected == "diverges" and self.symptom is Symptom.DIVERGENCE:
            return "expected"
        return "open"

    @property
    def k3(self) -> float:
        return self.evaluation.k3


@dataclass
class PairResult:
    pair: str
    expected: str
    examples: int = 0
    seconds: float = 0.0
    max_k3: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    seed: int = 0

    @property
    def verdict(self) -> str:
        diverged = any(f.symptom is Symptom.DIVERGENCE for f in self.findings)
        broken = any(f.symptom is not Symptom.DIVERGENCE for f in self.findings)
        if self.expected == "aligned":
            return "REGRESSION" if self.findings else ("clean" if self.examples else "not run")
        if broken:
            return "BROKEN"
        return "caught" if diverged else ("MISSED" if self.examples else "not run")

    @property
    def rate(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0


@dataclass
class CampaignConfig:
    pairs: list[TargetPair]
    seed: int | None = None  # None: a fresh seed, printed and stored
    max_examples: int = 100  # per pair
    budget: float | None = None  # wall seconds for the whole campaign (split over the pairs)
    threshold: float = DEFAULT_THRESHOLD
    device: str = "cpu"
    corpus: Path = Path("corpora")
    shard: tuple[int, int] | None = None  # (i, N), 1-based: this job's share of pair x seed
    write_corpus: bool = True
    profile: str | None = None  # the named profile the settings came from (stored with the campaign run)


@dataclass
class CampaignResult:
    seed: int
    config: CampaignConfig
    results: list[PairResult] = field(default_factory=list)
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.results for f in r.findings]

    @property
    def examples(self) -> int:
        return sum(r.examples for r in self.results)


def signature(pair: str, ev: Evaluation) -> str:
    detail = ""
    if ev.symptom is Symptom.ERROR and ev.error:
        detail = f"{ev.error['type']}@{ev.error['where']}"
    return hashlib.sha256(f"{pair}|{ev.symptom.value}|{detail}".encode()).hexdigest()


def pair_seed(campaign_seed: int, pair: str) -> int:
    """Each pair's own Hypothesis seed: adding or sharding pairs leaves the others' streams alone."""
    return int.from_bytes(hashlib.sha256(f"{campaign_seed}/{pair}".encode()).digest()[:8], "little") >> 1


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**32)


# ---------------------------------------------------------------------------------------------
# One pair
# ---------------------------------------------------------------------------------------------
class _Failed(Exception):
    """Raised inside the property so Hypothesis shrinks; one subclass per symptom so Hypothesis
    tracks divergence, non-finite output and crashes as distinct bugs."""

    def __init__(self, ev: Evaluation) -> None:
        super().__init__(f"{ev.symptom.value}: k3={ev.k3:.6g}")
        self.evaluation = ev


class _Diverged(_Failed):
    pass


class _NonFinite(_Failed):
    pass


class _Crashed(_Failed):
    pass


_RAISE = {Symptom.DIVERGENCE: _Diverged, Symptom.NONFINITE: _NonFinite, Symptom.ERROR: _Crashed}


def _size(case: Case) -> tuple:
    return (case.batch_size, case.n_tokens, case.key())


def fuzz_pair(pair: TargetPair, cfg: CampaignConfig, seed: int, deadline: float | None,
              progress: Callable[[PairResult, bool], None] | None = None) -> PairResult:
    """Fuzz one pair until max_examples or the deadline (time.monotonic()); shrink what fails."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings, target
    from hypothesis import seed as hseed

    from .strategies import cases

    result = PairResult(pair.name, pair.expected, seed=seed)
    # case key -> the evaluation of a failing case, or just the k3 of a passing one (a long nightly
    # evaluates tens of thousands of cases; Hypothesis only needs their verdicts back on a replay)
    cache: dict[str, Evaluation | float] = {}
    smallest: dict[str, Evaluation] = {}  # signature -> smallest failing evaluation seen so far
    cut = {"shrink": False}
    start = time.monotonic()
    last_report = [start]

    def prop(case: Case) -> None:
        key = case.key()
        ev = cache.get(key)
        if ev is None:
            if deadline is not None and time.monotonic() > deadline:
                raise _OutOfTime  # a BaseException: Hypothesis lets it through instead of shrinking it
            ev = run_case(pair, case, cfg.device, cfg.threshold)
            cache[key] = ev if ev.failed else ev.k3
            result.examples += 1
            if math.isfinite(ev.k3):
                result.max_k3 = max(result.max_k3, ev.k3)
            now = time.monotonic()
            if progress is not None and now - last_report[0] > 2.0:
                last_report[0] = now
                result.seconds = now - start
                progress(result, False)
        k3 = ev if isinstance(ev, float) else ev.k3
        if math.isfinite(k3):
            # Climb toward large k3, but not through rounding noise: below 1/1000 of the threshold
            # every case scores the same, so Hypothesis's optimiser stops instead of hill-climbing
            # on 1e-11 differences (seen: 18k calls for 146 distinct cases of an aligned fp32 model).
            target(max(k3, cfg.threshold * 1e-3), label="k3")
        if isinstance(ev, Evaluation) and ev.failed:
            sig = signature(pair.name, ev)
            if sig not in smallest or _size(case) <= _size(smallest[sig].case):
                smallest[sig] = ev
            raise _RAISE[ev.symptom](ev)

    test = settings(
        max_examples=cfg.max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        phases=(Phase.generate, Phase.target, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=True,
        verbosity=Verbosity.quiet,
        print_blob=False,
    )(hseed(seed)(given(cases(pair.axes))(prop)))

    failures: list[Evaluation] = []
    try:
        test()
    except _Failed as e:
        failures.append(e.evaluation)
    except BaseExceptionGroup as group:  # several distinct bugs
        matched, rest = group.split(_Failed)
        if rest is not None:
            raise rest
        failures.extend(e.evaluation for e in _leaves(matched))
    except _OutOfTime:
        cut["shrink"] = bool(smallest)  # what was found is kept at its smallest so far
    except KeyboardInterrupt:
        result.seconds = time.monotonic() - start
        result.findings = [_finding(pair, ev, result, complete=False) for ev in smallest.values()]
        raise _Interrupted(result) from None
    result.seconds = time.monotonic() - start
    by_sig: dict[str, Evaluation] = {}
    for ev in failures:
        by_sig[signature(pair.name, ev)] = ev
    for sig, ev in smallest.items():  # a failure Hypothesis did not report (it never drops one, but
        by_sig.setdefault(sig, ev)  # a cut-short run may) is kept at its smallest
    result.findings = [_finding(pair, ev, result, complete=not cut["shrink"]) for ev in by_sig.values()]
    if progress is not None:
        progress(result, True)
    return result


def _leaves(group: BaseExceptionGroup):
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


def _finding(pair: TargetPair, ev: Evaluation, result: PairResult, complete: bool) -> Finding:
    return Finding(pair=pair.name, expected=pair.expected, symptom=ev.symptom,
                   signature=signature(pair.name, ev), case=ev.case, evaluation=ev,
                   examples=result.examples, shrink_complete=complete)


class _OutOfTime(BaseException):
    """The pair's share of the budget is spent."""


class _Interrupted(Exception):
    def __init__(self, result: PairResult) -> None:
        self.result = result


# ---------------------------------------------------------------------------------------------
# The campaign
# ---------------------------------------------------------------------------------------------
def shard_pairs(pairs: list[TargetPair], shard: tuple[int, int] | None) -> list[TargetPair]:
    """This shard's pairs: pair j (0-based, in name order) goes to shard (j mod N) + 1.

    What one unsharded campaign with seed S covers is the set of (pair, pair_seed(S, pair)) streams:
    one Hypothesis stream per selected pair, its cases fixed by its own seed (never by the other
    pairs). The pair x seed space of a campaign therefore has one seed per pair, and sharding it
    is sharding the pairs: shards 1..N of one seed run disjoint sets of pairs whose union is the
    selection, each stream started exactly as the unsharded run starts it (with the same
    max_examples, the same cases; with a time budget, each pair gets more of it). Shards beyond
    the number of pairs are empty; to put more machines on fewer pairs give them different seeds.
    """
    if shard is None:
        return pairs
    i, n = shard
    if not (isinstance(i, int) and isinstance(n, int) and 1 <= i <= n):
        raise ValueError(f"shard {shard!r} must be (i, N) with 1 <= i <= N")
    ordered = sorted(pairs, key=lambda p: p.name)
    return [p for j, p in enumerate(ordered) if j % n == i - 1]


def run_campaign(cfg: CampaignConfig, tracker: Any = None, log: Callable[[str], None] | None = None,
                 on_finding: Callable[[Finding], None] | None = None) -> CampaignResult:
    """Fuzz every pair of the config; write each finding to the corpus, then to the tracker."""
    from . import corpus as corpus_mod
    from .tracking import NullTracker

    tracker = tracker or NullTracker()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    seed = cfg.seed if cfg.seed is not None else fresh_seed()
    cfg.seed = seed
    result = CampaignResult(seed=seed, config=cfg)
    pairs = shard_pairs(cfg.pairs, cfg.shard)
    log(f"campaign seed {seed} (rerun exactly with --seed {seed}); {len(pairs)} pair(s), device {cfg.device}, "
        f"threshold {cfg.threshold:g}" + (f", shard {cfg.shard[0]}/{cfg.shard[1]}" if cfg.shard else ""))
    tracker.campaign_started(cfg, seed, pairs)
    start = time.monotonic()
    end = start + cfg.budget if cfg.budget is not None else None

    def progress(r: PairResult, done: bool) -> None:
        if not done:
            log(f"  {r.pair}: {r.examples} cases, {r.rate:.1f}/s, max k3 {r.max_k3:.3g}")

    def record(f: Finding) -> None:
        if cfg.write_corpus:
            corpus_mod.record_finding(f, cfg.corpus, cfg.threshold, seed, cfg.device)
        tracker.finding(f)
        if on_finding:
            on_finding(f)

    try:
        for n, pair in enumerate(pairs):
            deadline = None
            if end is not None:
                now = time.monotonic()
                deadline = now + max(0.0, end - now) / (len(pairs) - n)
            try:
                r = fuzz_pair(pair, cfg, pair_seed(seed, pair.name), deadline, progress)
            except _Interrupted as stop:
                result.results.append(stop.result)
                for f in stop.result.findings:
                    record(f)
                raise KeyboardInterrupt from None
            result.results.append(r)
            for f in r.findings:
                record(f)
            log(f"  {pair.name}: {r.verdict} ({r.examples} cases in {r.seconds:.1f}s, max k3 {r.max_k3:.3g}"
                + (f", {len(r.findings)} finding(s)" if r.findings else "") + ")")
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        result.seconds = time.monotonic() - start
        tracker.campaign_finished(result)
    return result


def summary_table(result: CampaignResult) -> str:
    rows = [("pair", "expected", "verdict", "cases", "cases/s", "max k3", "findings")]
    for r in result.results:
        rows.append((r.pair, r.expected, r.verdict, str(r.examples), f"{r.rate:.1f}", f"{r.max_k3:.3g}",
                     ", ".join(f"{f.symptom.value} k3={f.k3:.3g} -> {f.path or '-'}" for f in r.findings) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return "\n".join(lines)
