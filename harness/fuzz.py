"""A fuzz campaign: Hypothesis drives every selected pair, shrinks what diverges, records findings.

Per pair, Hypothesis draws Cases from the pair's axes; each case runs both paths (`execute`),
`hypothesis.target` climbs toward what the verdict reads (`Evaluation.score`), and a case whose
symptom is not `none` fails the property, which Hypothesis then shrinks to a minimal case. Each
distinct failure (by signature) is a `Finding`: the minimal case, its metrics and the environment.
Findings are written to the corpus first, then handed to the tracker, so nothing found depends on a
tracking server.

Settings are our own, never a Hypothesis profile: Hypothesis loads a `ci` profile when CI is set,
which derandomizes and drops the database; a campaign instead always chooses a seed, prints it and
stores it, so a night can be rerun exactly with `--seed`.

Signature (dedup key, within a campaign and across campaigns): sha256 of
`pair | symptom | detail`, where detail is empty for `divergence` and `nonfinite` (one pair, one
numerical mismatch) and `ExceptionType@file:function` of the innermost frame for `error` (one
crash site, one bug), the signal or exit status for `crash` (one way to die, one bug), and empty
for `timeout`. The corpus file of a finding is `corpora/<pair>/<signature[:12]>.json`.

Where cases run: with `CampaignConfig.isolation` (the command line's default) every case runs in a
supervised worker process (`harness.worker`): a hang becomes a `timeout` finding, a dead worker a
`crash` finding, and the campaign goes on with a fresh worker; without it, in this process (for
debugging: a hang then hangs the campaign). `fuzz_pair` itself only calls `evaluate(case)`.

Budget: `budget` is a hard wall for the whole campaign, shared fairly: each pair (each stream) gets
an equal share of what is left when it starts, and the first case of a pair, which pays its cold
start (a worker's imports, a torch.compile of a model: about a minute cold), is not counted against
that share but against what is left for everyone. Op pairs run before model pairs (`run_order`): the
slow starters are deferred, so a cold compile can only shorten the model pairs after it, never skip
the op pairs.

Filling the budget (`fill_budget`, `harness fuzz --budget S` without `--max-examples`): once every
unit has run its `max_examples` (each within its share, as without filling), the time left goes, in
equal shares, to the units that found nothing: each runs further rounds, fresh Hypothesis runs of
`max_examples` from seeds derived from the stream's (`round_seed`), until its share is spent; so a
budget is spent fuzzing, not only capped. Round 0 is exactly the unit's stream; a round that finds
something ends the unit (later rounds would find the same bug again).

Streams: a pair's campaign can be split into `streams` independently seeded Hypothesis streams (each
with its share of `max_examples`), the units that shards and pytest-xdist workers spread; findings
are deduplicated across streams by signature. With one stream (the default) a pair's stream is
exactly the one a campaign has always drawn for it.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .case import Case
from .errors import HarnessError
from .execute import DEFAULT_THRESHOLD, Evaluation, Symptom, mean_text, run_case
from .pairs import TargetPair, lead_of
from .shrink import EDGE_MARGIN
from .worker import DEFAULT_TIMEOUT

Evaluate = Callable[[Case], Evaluation]  # one case of one pair -> its evaluation (never raises for the target)


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
    interrupted: bool = False  # ... it was Ctrl-C / SIGTERM
    path: Path | None = None  # the corpus file
    new: bool = True  # False when the corpus already held this signature
    recurrence: bool = False  # True when the corpus held it as `fixed`
    # what this campaign changed in a repro the corpus already held ("a smaller case", "a worse severe
    # case"; "" when nothing): a file to commit too (pytest copies it to new-repros/)
    updated: str = ""
    cases_to_first: int = 0  # cases the pair's stream had run when this failure was first seen
    seconds_to_first: float = 0.0  # seconds into the pair's stream when it was first seen
    shrink_seconds: float = 0.0  # from the first sighting to the minimal case (Hypothesis + polish)
    polish_evaluations: int = 0  # cases the polish pass (harness.shrink) ran on it
    # what was found (pair, symptom, detail): `signature` until the corpus shows an earlier repro of it
    # that no longer fails, a different bug; `record_finding` then gives this one a signature of its own
    base_signature: str = ""
    deterministic: bool = True  # False when the minimal case, run again, gave other values (see run_campaign)
    stream: tuple[int, int] = (0, 1)  # (the pair's stream that found it, 0-based; of how many streams)
    recorded_by: str = ""  # a case given by hand, not found by a campaign: the command ("harness record")
    # the MLflow regression run that already held it, when the corpus here did not (a CI runner that
    # checks out a corpus its repro was never committed to): not new to the team (`pytest_plugin`)
    known_in_tracking: str = ""
    corpus_status: str = ""  # the status of the repro the corpus already held of it ("" for a new finding)
    # the largest judged mean (`Evaluation.score`) of the failing cases of this signature the campaign
    # ran: how bad it got within the axes (Hypothesis's target climbs it), where the minimal case sits
    # just over the line by construction; what MLflow's severity reads (nan: not a divergence)
    peak: float = math.nan
    # what the simpler neighbours of the minimal case gave when shrinking ran them (`shrink.neighbours_of`;
    # empty when shrinking was cut short): where the failure starts, e.g. one prompt token fewer passes
    neighbours: list = field(default_factory=list)
    # the campaign's worst case of this signature, shrunk keeping its judged mean over a bar far above
    # the minimal case's (`SEVERE_FACTOR`; `corpus.Severe`); None when no case reached SEVERE_FACTOR x
    # the minimal one. A second bug of the pair that the shrinker passed over for a milder one (or the
    # same bug where it is worst): `harness triage --severe` tells which
    severe: Any = None

    @property
    def id(self) -> str:
        return self.signature[:12]

    @property
    def state(self) -> str:
        """What the corpus made of it: "new", "recurrence of a fixed finding" or "already in corpus"."""
        return "new" if self.new else ("recurrence of a fixed finding" if self.recurrence else "already in corpus")

    @property
    def status(self) -> str:
        """Its repro's status: the corpus's where it already held the finding (`wontfix`, `expected`, a
        reopened `open`), else `expected` for a demonstration's divergence and `open` for the rest."""
        if self.corpus_status:
            return self.corpus_status
        if self.expected == "diverges" and self.symptom is Symptom.DIVERGENCE:
            return "expected"
        return "open"

    @property
    def k3(self) -> float:
        return self.evaluation.k3


ZERO_BIN, INF_BIN = -10**6, 10**6  # `PairResult.judged_bins`: cases judged exactly 0, and +inf


@dataclass
class PairResult:
    pair: str
    expected: str
    examples: int = 0
    seconds: float = 0.0
    max_k3: float = 0.0  # the largest sampled tokens' mean k3 (what an RL dashboard logs)
    max_score: float = 0.0  # the largest judged mean (`Evaluation.score`: expected k3 or exact KL)
    threshold: float = 0.0  # the line its cases were judged at (`CampaignConfig.threshold_of`; 0: not run)
    # the rollout's mean entropy (nats) summed over the cases that had metrics, and their count: a
    # near-deterministic model (entropy ~0) hides precision differences (`missed_hint` says so)
    entropy_sum: float = 0.0
    entropy_cases: int = 0
    findings: list[Finding] = field(default_factory=list)
    seed: int = 0
    streams: int = 1  # Hypothesis streams merged into this result
    warmup: float = 0.0  # seconds of the first case (cold start), not counted against the pair's budget share
    # seconds its first case had run when the campaign's budget ended, never having come back (a hang,
    # or a cold start longer than the budget allows); 0 when it came back or never started
    unfinished: float = 0.0
    # where that first case was when stopped, had it run past its per-case timeout (faulthandler's dump)
    unfinished_stack: str = ""
    waited_for: str = ""  # not run: the pair from the same module whose unfinished first case it waited for
    # Hypothesis examples asked for, and how many of them its time share ran out before (0: all ran,
    # or something was found): a pair cut short by the budget is not clean over what was asked
    examples_asked: int = 0
    examples_short: int = 0
    # the pair could not run here: it raised a harness error (`harness.errors.HarnessError`: a
    # checkpoint folder that is gone, a setting it refuses), which says nothing of its paths; the
    # one-paragraph message (`setup_message`). Not a finding: nothing is written or tracked for it.
    setup_error: str = ""
    # what its cases did to the worker's memory: growth past the leak allowance, replacements at the
    # cap (`Worker.memory_seen`, `Executor.memory_note`); "" when nothing was seen
    memory_note: str = ""
    interrupted: bool = False  # Ctrl-C / SIGTERM came while it ran, or before it started
    # the largest sizes its cases reached, each axis on its own: (sequences, a prompt, a response, prompt
    # and response tokens of one case). What a clean verdict covered: a bug past a size switch (a batch
    # bucket, a chunked prefill, a workspace) is found only by cases past it
    largest: tuple[int, int, int, int] = (0, 0, 0, 0)
    # the peak resident memory (MiB) of its worker process while its cases ran (`Worker.peak_seen`: the
    # process's VmHWM, started over for each pair; 0: not isolated): what a machine needs for the pair
    worker_peak_mib: float = 0.0
    # the largest worst-sequence mean (`Divergence.k3_expected_seq_max`, `kl_seq_max`) of its cases judged over
    # the batch: above the line, some sample diverged where the batch mean did not (`missed_hint`, and its pair's line in `run_campaign`)
    max_seq_score: float = 0.0
    # findings left out as the pair's own noise (`FLAKY_RUNS`): each a line saying how often its minimal
    # case failed on the same inputs; not written to the corpus or tracked (they would not replay)
    flaky: list[str] = field(default_factory=list)
    # the case its largest judged mean (`max_score`) came from: how close a clean pair came to the line
    max_case: Any = None
    # the longest sequence of its cases, in positions (prompt + response + the pair's `lead_tokens`):
    # what `size_marks` (a sliding window) are read against
    longest: int = 0
    # cases it had run when its first failure came (0: none yet): its progress lines say that the cases
    # since are shrinking it (and searching for a worse one), not a search that found nothing
    failing_since: int = 0
    # how its cases' judged means were spread: {bin: cases}, bin k holding [10^(k/10), 10^((k+1)/10)),
    # ZERO_BIN the cases judged exactly 0 (`note_score`, `spread_text`): how far apart the paths are,
    # beyond the largest (an accepted gap's line is read off it)
    judged_bins: dict[int, int] = field(default_factory=dict)

    def note_score(self, score: float) -> None:
        """Count a case's judged mean in `judged_bins` (NaN: not counted; +inf: the top bin)."""
        if not score >= 0:
            return
        k = ZERO_BIN if score == 0 else INF_BIN if score == math.inf else math.floor(10 * math.log10(score))
        self.judged_bins[k] = self.judged_bins.get(k, 0) + 1

    def judged_quantile(self, q: float) -> float:
        """An upper bound, within a factor 10^(1/10), of the q-quantile of its cases' judged means (the
        upper edge of the bin it falls in, or the largest judged mean where that is smaller); NaN without cases."""
        n = sum(self.judged_bins.values())
        if not n:
            return math.nan
        seen = 0
        for k in sorted(self.judged_bins):
            seen += self.judged_bins[k]
            if seen >= q * n:
                return 0.0 if k == ZERO_BIN else math.inf if k == INF_BIN else min(10.0 ** ((k + 1) / 10), self.max_score)
        return math.inf

    @property
    def spread_text(self) -> str:
        """'judged: half the cases under 2e-05, 90% under 0.0004' (bins of a tenth of a decade); "" under 10 cases."""
        if sum(self.judged_bins.values()) < 10:
            return ""
        def at(q: float) -> str:  # (a quantile of 0: those cases judged exactly 0, not "under 0")
            v = self.judged_quantile(q)
            return "at 0" if v == 0 else f"under {mean_text(v)}"

        return f"judged: half the cases {at(0.5)}, 90% {at(0.9)}"

    @property
    def p90_text(self) -> str:
        """The 90% quantile of its judged means (`judged_quantile`), for the summary table; '-' under 10 cases."""
        return mean_text(self.judged_quantile(0.9)) if sum(self.judged_bins.values()) >= 10 else "-"

    def note_size(self, case: Case, lead: int = 0) -> None:
        """Count a case the pair ran into `largest` and `longest` (`lead`: the pair's `lead_tokens`)."""
        lens, prompts = case.seq_lens, case.prompt_lens
        p = max(prompts) if prompts else 0
        size = (len(lens), p, max(lens) if lens else 0, sum(lens) + (sum(prompts) if p else 0))
        self.largest = tuple(map(max, self.largest, size))  # type: ignore[assignment]
        if lens:
            self.longest = max(self.longest, max(case.total_lens) + lead)

    def unreached(self, pair: Any) -> str:
        """The pair's `size_marks` its cases' longest sequence never passed (was never longer than:
        'sliding_window 32'), or ""."""
        marks = getattr(pair, "size_marks", None) or {}
        out = [f"{name} {v}" for name, v in sorted(marks.items(), key=lambda kv: kv[1]) if self.longest <= v]
        return ", ".join(out) if self.longest else ""

    @property
    def largest_text(self) -> str:
        """'largest: 32 sequences, prompt 160, response 64, 2310 tokens in a case' (each axis's own maximum)."""
        b, p, r, t = self.largest
        if not b:
            return ""
        return (f"largest: {b} sequence{'s' * (b != 1)}, " + (f"prompt {p}, " if p else "")
                + f"response {r}, {t} tokens in a case" + (" (each the largest of its own axis)" if p else ""))

    @property
    def time_note(self) -> str:
        """"its time share ran out after N of M examples", or "" when it ran them all; for a pair
        that never ran a case of its own, waiting behind another's first case, says that; for one the
        interrupt cut, says how far it got."""
        if self.interrupted:
            return (f"interrupted after {self.examples} case{'s' * (self.examples != 1)}" if self.examples else
                    "the interrupt came before its first case")
        if self.waited_for and not self.examples:
            return f"it waited behind {self.waited_for}'s first case, which never finished: 0 cases of its own"
        return time_note(self.examples_asked, self.examples_short, self.examples)

    @property
    def verdict(self) -> str:
        return pair_verdict(self.expected, [f.symptom.value for f in self.findings], self.examples,
                            bool(self.setup_error), bool(self.unfinished))

    @property
    def rate(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0


SLOW_CASE_SECONDS = 1.0  # `CampaignConfig.slow_case_seconds`


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
    isolation: bool = False  # run cases in a supervised worker process (the command line's default)
    timeout: float = DEFAULT_TIMEOUT  # per-case wall seconds in a worker before the case is a `timeout`
    timeouts: dict[str, float] = field(default_factory=dict)  # pair name -> its own per-case timeout
    thresholds: dict[str, float] = field(default_factory=dict)  # pair name -> its line (`--threshold GLOB=X`)
    plugins: tuple[str, ...] = ()  # plugin specs the workers load (pairs are found by name there)
    streams: int = 1  # independently seeded streams per pair (each runs max_examples / streams cases)
    stream: int | None = None  # run only this stream of each pair (0-based; a pytest item, a CI job)
    # uniform random cases after each Hypothesis example; None: `UNIFORM_PER_EXAMPLE` by the pair's kind
    uniform_per_example: int | None = None
    # with a budget: once every unit has run its max_examples, the time left goes to the units that
    # found nothing as further rounds (see the module note; `profiles.fills_budget` says when it is on)
    fill_budget: bool = False
    # A pair whose cases take at least this many seconds each (after its first) skips Hypothesis's
    # shrinking: its first failure goes straight to the polish pass, whose few dozen moves reach the
    # simplest trigger where Hypothesis's hundreds of small steps cost minutes (reports/scripts/polish_only.py:
    # 92 cases against 464 on a Hypothesis-found model-pair finding, and a smaller case)
    slow_case_seconds: float = SLOW_CASE_SECONDS

    def timeout_for(self, pair: str, own: float | None = None) -> float:
        """The per-case timeout of a pair: the command line's for this pair (`--timeout GLOB=S`), else
        the pair's own (`TargetPair.timeout`: longer for a compiling backend, shorter for one that may
        hang, so its shrink steps cost seconds, not minutes), else the campaign's (`--timeout S`)."""
        if pair in self.timeouts:
            return self.timeouts[pair]
        return own if own else self.timeout

    def threshold_of(self, pair: str) -> float:
        """The line a pair's verdicts are judged at: the command line's for this pair (`--threshold
        GLOB=X`), else the pair's own (`TargetPair.threshold`: an accepted gap), else the campaign's."""
        if pair in self.thresholds:
            return self.thresholds[pair]
        own = next((getattr(p, "threshold", None) for p in self.pairs if p.name == pair), None)
        return own if own else self.threshold

    def own_thresholds(self) -> dict[str, float]:
        """{pair: its line} for the pairs judged at another line than the campaign's."""
        return {p.name: t for p in self.pairs if (t := self.threshold_of(p.name)) != self.threshold}


@dataclass
class CampaignResult:
    seed: int
    config: CampaignConfig
    results: list[PairResult] = field(default_factory=list)
    seconds: float = 0.0
    interrupted: bool = False
    unsaved: list[Finding] = field(default_factory=list)  # findings the corpus could not take (printed as JSON)
    worker_restarts: int = 0  # isolated runs: workers replaced after a timeout, a crash or past their memory cap

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.results for f in r.findings]

    @property
    def examples(self) -> int:
        return sum(r.examples for r in self.results)


def message_class(message: Any) -> str:
    """An error message's first line with what varies from case to case taken out (numbers, hex,
    paths): two messages of one class are one bug raised on other inputs."""
    import re

    lines = str(message or "").strip().splitlines()
    first = lines[0] if lines else ""
    first = re.sub(r"(?:[A-Za-z]:)?(?:[\\/][^\s'\"\\/,;:)\]]+){2,}", "<path>", first)
    first = re.sub(r"0x[0-9a-fA-F]+|\b[0-9a-fA-F]{8,}\b|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", "#", first)
    first = re.sub(r"#(?:\s*[,x*]\s*#)+", "#", first)  # a shape or list of any length: (#, #, #) -> (#)
    return re.sub(r"\s+", " ", first)[:200]


def legacy_error_signature(pair: str, error: dict) -> str:
    """An error's signature before the message class was part of it (type and raising frame only):
    what repros written then are named by (`corpus.record_finding` adopts them)."""
    return hashlib.sha256(f"{pair}|error|{error.get('type')}@{error.get('where')}".encode()).hexdigest()


def signature(pair: str, ev: Evaluation) -> str:
    """Findings with the same signature are one bug: shrinking keeps it, the corpus holds one repro.
    An error is its type, the frame that raised it and its message's class (`message_class`): raised
    inside a library (an inference engine's `run`), every error of the pair shares the frame, and
    raised from C++ every error shares the pair's own line; what the message says tells the bugs apart."""
    detail = ""
    if ev.symptom is Symptom.ERROR and ev.error:
        detail = f"{ev.error['type']}@{ev.error['where']}|{message_class(ev.error.get('message'))}"
    elif ev.symptom is Symptom.CRASH and ev.error:
        detail = ev.error["type"]  # the signal (SIGSEGV, SIGABRT, SIGKILL) or exit status
    return hashlib.sha256(f"{pair}|{ev.symptom.value}|{detail}".encode()).hexdigest()


def reproduces_with(evaluate: Callable[[Case], Any], pair: str, base: str) -> Callable[[Case], bool]:
    """`record_finding`'s question, whether a case fails now with the signature `base` (the bug an
    existing repro holds), answered by `evaluate(case)` (an Evaluation; None past a budget). When it
    cannot tell (None, a setup error, a harness error running it), yes: the same bug."""
    def check(case: Case) -> bool:
        try:
            ev = evaluate(case)
        except HarnessError:  # (its worker could not run it: cannot tell)
            return True
        return ev is None or ev.setup or (ev.failed and signature(pair, ev) == base)
    return check


def pair_seed(campaign_seed: int, pair: str) -> int:
    """Each pair's own Hypothesis seed: adding or sharding pairs leaves the others' streams alone."""
    return int.from_bytes(hashlib.sha256(f"{campaign_seed}/{pair}".encode()).digest()[:8], "little") >> 1


def stream_seed(campaign_seed: int, pair: str, stream: int = 0, streams: int = 1) -> int:
    """The Hypothesis seed of one stream of a pair; a one-stream pair keeps its `pair_seed`."""
    if streams <= 1:
        return pair_seed(campaign_seed, pair)
    return pair_seed(campaign_seed, f"{pair}#{stream}/{streams}")


def round_seed(campaign_seed: int, pair: str, stream: int, streams: int, rnd: int) -> int:
    """The Hypothesis seed of round `rnd` of a stream (`fill_budget`); round 0 is the stream's own."""
    if rnd == 0:
        return stream_seed(campaign_seed, pair, stream, streams)
    return pair_seed(campaign_seed, f"{pair}#{stream}/{streams}@{rnd}")


ROUND_MIN_LEFT = 0.5  # seconds of its share a unit must have left to start another round


def stream_examples(max_examples: int, stream: int, streams: int) -> int:
    """Stream `stream`'s share of a pair's max_examples (the shares add up to max_examples; at least
    one each: a stream with none would not run, and Hypothesis refuses max_examples=0)."""
    return max(1, max_examples // streams + (1 if stream < max_examples % streams else 0))


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**32)


# ---------------------------------------------------------------------------------------------
# One pair
# ---------------------------------------------------------------------------------------------
class _Failed(Exception):
    """Raised inside the property so Hypothesis shrinks; one subclass per symptom so Hypothesis
    tracks divergence, non-finite output and crashes as distinct bugs."""

    def __init__(self, ev: Evaluation) -> None:
        super().__init__(f"{ev.symptom.value}: {ev.headline}")
        self.evaluation = ev


class _Diverged(_Failed):
    pass


class _NonFinite(_Failed):
    pass


class _Crashed(_Failed):
    pass


class _TimedOut(_Failed):
    pass


class _WorkerDied(_Failed):
    pass


_RAISE = {Symptom.DIVERGENCE: _Diverged, Symptom.NONFINITE: _NonFinite, Symptom.ERROR: _Crashed,
          Symptom.TIMEOUT: _TimedOut, Symptom.CRASH: _WorkerDied}


# Uniform random cases run after each Hypothesis example, by pair kind. Hypothesis's engine costs
# about as much per example on a CPU (drawing, bookkeeping, mutation) as a whole op case (build,
# both paths, readout, metrics; `harness bench overhead` shows both), so op pairs amortize it over
# three uniform cases; a model case costs 50-250 ms (`harness bench models`), so model pairs keep
# the 1:1 mix that leaves Hypothesis half the cases.
UNIFORM_PER_EXAMPLE = {"op": 3, "model": 1}
MAX_SIGNATURES = 16  # distinct failures one pair's campaign reports (each is shrunk and written)
# A divergence whose campaign reached SEVERE_FACTOR x its minimal case's judged mean has its worst
# case shrunk too, kept over max(SEVERE_FACTOR x the minimal's, the worst's / SEVERE_FACTOR) (`Finding.severe`):
# shrinking keeps the simplest trigger over the line, which is the mildest of several bugs in one pair
# (not for demonstrations, `expected="diverges"`: their bug is known, and the time is the other pairs')
# A finding whose minimal case, run again on the same inputs, comes back otherwise (a pair that is not
# a function of its case: atomics, an unseeded RNG) is run again, this many runs past its first in all;
# where fewer than half of all its runs fail, it is the pair's own run-to-run noise crossing the line,
# not a bug a repro could hold: left out of the corpus and the tracker, and said (`PairResult.flaky`)
FLAKY_RUNS = 5

SEVERE_FACTOR = 5.0
# uniform cases a campaign runs on after a divergence is shrunk, looking for a worse one (within the pair's
# remaining examples and time share): the search itself stops at its first failure
SEVERE_SEARCH_CASES = 300


def pair_verdict(expected: str, symptoms: list[str], cases: int, setup_error: bool = False,
                 unfinished: bool = False) -> str:
    """A pair's verdict from its findings' symptoms (`Symptom` values) and the cases it ran."""
    if setup_error and not symptoms:
        return "CANNOT RUN"
    if unfinished and not symptoms:
        return "UNFINISHED"
    if expected == "aligned":
        return "REGRESSION" if symptoms else ("clean" if cases else "not run")
    if any(s != Symptom.DIVERGENCE.value for s in symptoms):
        return "BROKEN"
    return "caught" if symptoms else ("MISSED" if cases else "not run")


def rate_text(rate: float) -> str:
    """Cases per second as tables print it: one decimal, two significant digits under 0.1 (a real-vocabulary
    model pair at a case a minute read "0.0")."""
    return f"{rate:.2g}" if 0 < rate < 0.1 else f"{rate:.1f}"


def time_note(asked: int, short: int, cases: int) -> str:
    """Why a pair ran fewer examples than asked: "its time share ran out after N of M examples", or
    "... before its first case finished" when no case came back (an example begun is not a case run);
    "" when it ran them all."""
    if not short:
        return ""
    if not cases:
        return f"its time share ran out before its first case finished: 0 of {asked} examples"
    # (an example's uniform cases, and a case begun when the share ran out, make the two counts differ)
    return f"its time share ran out after {asked - short} of {asked} examples, {cases} case{'s' * (cases != 1)} run"


NOISE_FLOOR = 1e-8  # judged means below this are float rounding (aligned float32 pairs sit near 1e-11)
LOW_ENTROPY = 0.3  # nats: a rollout whose mean entropy stays below this is near-deterministic


NEAR_MISS = 0.1  # a clean pair whose cases reached this fraction of the line names its closest case


def near_miss_line(r: PairResult, threshold: float, plugins: tuple[str, ...] | list[str] = ()) -> str:
    """For a pair with no finding whose cases came within `NEAR_MISS` of the line: its closest case, and
    how to keep it as a repro to look at (recorded under a lower threshold, where it fails); "" else."""
    if r.findings or r.max_case is None or not math.isfinite(r.max_score) or r.max_score < NEAR_MISS * threshold \
            or r.max_score > threshold:
        return ""
    from .corpus import plugin_flags

    lower = 10.0 ** math.floor(math.log10(r.max_score))
    share = r.max_score / threshold
    share_text = f"{share:.0%}" if share < 0.995 or share == 1.0 else f"{share:.1%}" if share < 0.9995 else f"{share:.3%}"
    return (f"closest to the line: judged {mean_text(r.max_score)} ({share_text} of it) on "
            f"{r.max_case.one_line()}; to keep it as a repro to look at (show, triage), record it under a lower line: "
            f"`harness record{plugin_flags(plugins)} {r.pair} --case '{r.max_case.one_line()}' --threshold {lower:g}`")


def missed_hint(r: PairResult, threshold: float, pair: Any = None) -> str:
    """Why a demonstration may have been missed, from the largest judged mean its cases reached: at
    float noise its two paths compute the same thing (a patch that changes nothing it runs, a bug
    whose effect cancels out); over a near-deterministic rollout (mean entropy under LOW_ENTROPY
    nats) a precision difference hardly moves a distribution that is almost one-hot (k3 shrinks with
    the entropy), whatever the number of cases; otherwise more cases or a wider axis may reach it."""
    from .execute import mean_text

    unreached = r.unreached(pair)
    if unreached:  # (a bug past a window its cases never reached: float rounding says nothing of it)
        return (f"max judged {r.max_score:.2g}: its longest sequence, {r.longest} positions, never reached "
                f"{unreached}, where the pair computes otherwise; widen its axes past it (prompt and response "
                "lengths, e.g. targets.hf.default_axes(model, max_prompt=...))")
    if r.max_score < NOISE_FLOOR:
        return (f"max judged {r.max_score:.2g}: its paths agreed to float rounding on every case; check that "
                "the rollout really runs what differs")
    if r.max_seq_score > threshold:
        return (f"max judged {mean_text(r.max_score)} of the line {threshold:g} over a batch, but one sequence's own "
                f"mean reached {mean_text(r.max_seq_score)}: a bug in some samples of a batch, diluted by the others' "
                "tokens? TargetPair(verdict_over='sequence') judges each sequence (README: 'Over the batch, or per "
                "sequence')")
    entropy = r.entropy_sum / r.entropy_cases if r.entropy_cases else math.nan
    if entropy < LOW_ENTROPY:
        return (f"max judged {mean_text(r.max_score)} of the line {threshold:g}, over a near-deterministic rollout "
                f"(mean entropy {entropy:.2g} nats over {r.entropy_cases} case{'s' * (r.entropy_cases != 1)}): a "
                "precision difference hardly moves an almost one-hot distribution, and more cases will not change "
                "that; test a model whose outputs are not (a trained checkpoint; a random model with its LM head "
                "tied to its embedding repeats its last token)")
    vocab = _vocab_of(pair)
    if vocab and entropy > NEAR_UNIFORM * math.log(vocab):
        return (f"max judged {mean_text(r.max_score)} of the line {threshold:g}, over a near-uniform rollout (mean "
                f"entropy {entropy:.3g} nats of at most log {vocab} = {math.log(vocab):.3g}): an untrained model "
                "(transformers' default init in a checkpoint) gives every token about the same probability, so a "
                "precision difference moves almost nothing; test trained weights, or a config-built model with the "
                "harness's realistic init (HFModel.from_config(config), its default)")
    if r.max_score < FAR_UNDER * threshold:
        return (f"max judged {mean_text(r.max_score)}, {threshold / r.max_score:.2g}x under the line {threshold:g} at "
                "its largest: the paths differ (above float rounding), by far too little for more cases of these axes "
                "to bring it over; a difference this small is within the line's tolerance unless what the cases do "
                "not draw amplifies it (trained weights, much longer sequences). `--threshold` lower measures it")
    if getattr(getattr(pair, "profiles", None), "replay", False):  # (an HF pair with router replay)
        return (f"max judged {mean_text(r.max_score)} of the line {threshold:g}, with router replay: the trainer "
                "reuses the rollout's experts, which removes a difference in routing itself; what is left is how the "
                "chosen experts' outputs are computed, weighted and summed. A routing difference (a router's "
                "precision) is demonstrated by the pair without replay. A difference in the experts or their combine "
                "stays small on a config-built model's random weights (a bf16 combine there stays under 6e-5 with "
                "replay, README: 'module patches'): test it against trained weights (your checkpoint), or in "
                "isolation with the op pairs moe_aggregate.*")
    return f"max judged {mean_text(r.max_score)} of the line {threshold:g}: more examples, budget or wider axes?"


NEAR_UNIFORM = 0.9  # a mean entropy above this fraction of log V: the rollout's outputs are nearly uniform
FAR_UNDER = 1e-2  # a largest judged mean under this fraction of the line: no case of these axes is near it


def _vocab_of(pair: Any) -> int | None:
    """The vocabulary of a pair's model, where it has one (an HF pair's)."""
    try:
        model = getattr(getattr(pair, "profiles", None), "model", None)
        return int(model.vocab) if model is not None else None
    except Exception:  # noqa: BLE001 - a checkpoint gone since registration: no hint of this kind
        return None


def uniform_per_example(pair: TargetPair, cfg: CampaignConfig) -> int:
    n = cfg.uniform_per_example
    return UNIFORM_PER_EXAMPLE.get(pair.kind, 1) if n is None else n


_KEYS: dict[int, tuple[Case, Any]] = {}  # id(case) -> (case, its key): a case is keyed ~5 times on its way


def _cache_key(case: Case) -> Any:
    """Equal cases, equal keys: the field values as a tuple (20x cheaper than `case.key()`'s JSON),
    computed once per case object (cases are frozen; the object is kept beside its key, so its id is
    not reused while the entry lives)."""
    hit = _KEYS.get(id(case))
    if hit is not None and hit[0] is case:
        return hit[1]
    try:
        key = tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in vars(case).values())
        hash(key)
    except TypeError:  # an unhashable param value
        key = case.key()
    if len(_KEYS) >= 4096:
        _KEYS.clear()
    _KEYS[id(case)] = (case, key)
    return key


def _size(case: Case) -> tuple:
    return (case.batch_size, case.n_tokens, case.key())


def fuzz_pair(pair: TargetPair, cfg: CampaignConfig, seed: int, deadline: float | None,
              progress: Callable[[PairResult, bool], None] | None = None, evaluate: Evaluate | None = None,
              max_examples: int | None = None, wall: float | None = None,
              polish_evals: int = 150) -> PairResult:
    """Fuzz one pair until max_examples or the deadline (time.monotonic()); shrink what fails.

    `evaluate(case)` runs one case (default: in this process); it may raise `worker.OutOfTime`
    when the campaign's hard wall (`wall`) came while the case ran. The first case's time is added
    to the deadline (a cold start is not the pair's share), never past `wall`.
    """
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings, target
    from hypothesis import seed as hseed

    from .strategies import cases, uniform_cases
    from .worker import OutOfTime

    threshold = cfg.threshold_of(pair.name)
    if evaluate is None:
        def evaluate(case: Case) -> Evaluation:
            return run_case(pair, case, cfg.device, threshold)
    result = PairResult(pair.name, pair.expected, seed=seed, threshold=threshold)
    limit = {"deadline": deadline}
    # case key -> the evaluation of a failing case, or just the k3 of a passing one (a long nightly
    # evaluates tens of thousands of cases; Hypothesis only needs their verdicts back on a replay)
    cache: dict[Any, Evaluation | float] = {}
    smallest: dict[str, Evaluation] = {}  # signature -> smallest failing evaluation seen so far
    peak: dict[str, float] = {}  # signature -> the largest judged mean of its failing cases (`Finding.peak`)
    peak_case: dict[str, Evaluation] = {}  # signature -> the evaluation that gave it
    first_seen: dict[str, tuple[int, float]] = {}  # signature -> (cases run, seconds) at its first sighting
    cut = {"shrink": False}
    start = time.monotonic()
    last_report = [start]
    floor = threshold * 1e-3
    # Every Hypothesis case is followed by `uniform_per_example` uniform random cases over the same
    # axes (see `strategies`): Hypothesis finds small and near-tie triggers, uniform draws find large ones.
    n_uniform = uniform_per_example(pair, cfg)
    uniform_rng = random.Random(seed ^ 0x5DEECE66D) if n_uniform > 0 else None
    hit: dict[str, Evaluation] = {}
    timing = [0.0, 0]  # seconds and count of the cases evaluated after the first (`slow`)
    # for the margin rule in `prop`: signature -> the cache key of its first failing Hypothesis case, and the
    # smallest size among the failing cases Hypothesis was given; case key -> whether it was given as failing
    first_failure: dict[str, Any] = {}
    smallest_taken: dict[str, tuple] = {}
    steps: dict[Any, bool] = {}

    def slow() -> bool:
        """Whether a case of this pair costs `cfg.slow_case_seconds` or more on average, over the cases
        after its first (whose cold start says nothing of it: not slow until one more has run)."""
        return bool(timing[1]) and timing[0] / timing[1] >= cfg.slow_case_seconds

    def run(case: Case) -> Evaluation | float:
        key = _cache_key(case)
        ev = cache.get(key)
        if ev is not None:
            return ev
        if _SIGNALLED[0]:  # an interrupt whose KeyboardInterrupt Python swallowed (raised inside a
            raise KeyboardInterrupt  # weakref or __del__ callback, say): delivered here, between cases
        began = time.monotonic()
        if limit["deadline"] is not None and began > limit["deadline"]:
            raise _OutOfTime  # a BaseException: Hypothesis lets it through instead of shrinking it
        try:
            ev = evaluate(case)
        except OutOfTime:
            raise _OutOfTime from None
        if ev.setup or (result.examples == 0 and breaks_contract(ev)):
            raise _Setup(ev)
        if result.examples:  # (after the cold start: what a case costs, for `slow`; as the process that ran it
            # timed it: waiting here may include cases handed ahead of it)
            timing[0] += ev.seconds if ev.seconds is not None else time.monotonic() - began
            timing[1] += 1
        if result.examples == 0:  # the cold start: charged to everyone's remaining time, not this share
            result.warmup = time.monotonic() - began
            if limit["deadline"] is not None:
                limit["deadline"] += result.warmup
                if wall is not None:
                    limit["deadline"] = min(limit["deadline"], wall)
        cache[key] = ev if ev.failed else ev.score
        result.examples += 1
        result.note_size(case, lead_of(pair, case))
        if not math.isnan(ev.k3):  # (inf: a sampled token the trainer excludes, the largest there is)
            result.max_k3 = max(result.max_k3, ev.k3)
        if not math.isnan(ev.score):
            result.note_score(ev.score)
            if ev.score > result.max_score or result.max_case is None:
                result.max_case = case
            result.max_score = max(result.max_score, ev.score)
            d = ev.divergence
            if d is not None and d.verdict_over == "batch" and d.k3_expected_seq_max == d.k3_expected_seq_max:
                result.max_seq_score = max(result.max_seq_score, d.k3_expected_seq_max, d.kl_seq_max)
        if ev.divergence is not None and math.isfinite(ev.divergence.entropy):
            result.entropy_sum += ev.divergence.entropy
            result.entropy_cases += 1
        if ev.failed:
            sig = signature(pair.name, ev)
            first_seen.setdefault(sig, (result.examples, time.monotonic() - start))
            result.failing_since = result.failing_since or result.examples
            if not math.isnan(ev.score):
                if ev.score > peak.get(sig, -math.inf):
                    peak_case[sig] = ev
                peak[sig] = max(peak.get(sig, ev.score), ev.score)
            if sig not in smallest or _size(case) <= _size(smallest[sig].case):
                smallest[sig] = ev
        now = time.monotonic()
        if progress is not None and now - last_report[0] > 2.0:
            last_report[0] = now
            result.seconds = now - start
            progress(result, False)
        return ev

    # Isolated, with a core to spare (`Executor.hand_ahead`), each example is handed to the worker
    # as soon as Hypothesis has drawn it, with its uniform cases queued behind it, before the
    # previous example's uniform cases are collected: the worker's queue never runs dry while this
    # process collects results, targets and draws (the worker computes while this process draws).
    # Cases run in the same order either way, so a campaign finds the same things; a failure stops
    # Hypothesis at the case where it occurs (the cases queued behind it are computed and never
    # counted, as in-process they never run).
    prefetch = getattr(evaluate, "prefetch", None)
    pending: list[Case] = []

    def take_pending() -> None:
        while pending:
            ev_u = run(pending.pop(0))
            if isinstance(ev_u, Evaluation) and ev_u.failed:
                pending.clear()
                hit["ev"] = ev_u
                raise _UniformHit  # a BaseException: Hypothesis stops; the polish pass shrinks it

    def hand_ahead(queue: list[Case]) -> int:
        """Hand these cases to the worker in order, up to the first it does not take (a pair's first
        case: the worker is not warm; a full queue); how many it took (a case already evaluated needs
        no handing). The others run when asked for."""
        if prefetch is None or (limit["deadline"] is not None and time.monotonic() >= limit["deadline"]):
            return 0
        n = 0
        while n < len(queue) and (_cache_key(queue[n]) in cache or prefetch(queue[n])):
            n += 1
        return n

    def prop(case: Case) -> None:
        # this example's uniform cases are drawn before it runs (from its params), so that they can
        # be queued behind it; none once something has failed (Hypothesis is shrinking it)
        calls[0] += 1
        if smallest and slow():  # Hypothesis is shrinking a failure of a slow pair: the polish pass takes over
            hit["ev"] = next(iter(smallest.values()))
            raise _UniformHit
        after = [uniform_cases(pair.axes, uniform_rng, params=case.params, log_gap=True)
                 for _ in range(n_uniform)] if uniform_rng is not None and not smallest else []
        handed = hand_ahead([case, *after]) if pending or after else 0
        take_pending()
        ev = run(case)
        score = ev if isinstance(ev, float) else ev.score
        if math.isfinite(score) and score > floor:
            # Climb toward what the verdict reads (the expected k3 or the exact KL, the larger: the
            # sampled tokens' k3 adds the draw's noise on small cases), but only where the score says
            # something: below 1/1000 of the threshold every case is rounding noise (seen: 18k calls
            # for 146 distinct cases of an aligned fp32 model), and a flat score makes Hypothesis's
            # target phase draw nothing but minimal cases (measured: batch 1 in 98% of the second
            # half of a campaign).
            target(score, label="score")
        if isinstance(ev, Evaluation) and ev.failed:
            if slow():  # no Hypothesis shrinking: the polish pass shrinks it (`CampaignConfig.slow_case_seconds`)
                pending.clear()
                hit["ev"] = ev
                raise _UniformHit
            key = _cache_key(case)
            sig = signature(pair.name, ev)
            size = (case.batch_size, case.n_tokens, sum(case.prompt_lens))
            first = first_failure.setdefault(sig, key)
            taken = steps.get(key)
            if taken is None:
                # Over the line by less than the margin: a finding when it is the first of its kind, and a step
                # Hypothesis's shrinker may take when it makes the case smaller, but not one that only moves a
                # knob (it walked a repro's logit scale to k3 0.00100001 against the line 0.001, which another
                # CPU's last bits read clean). Decided once per case: a replay of it is judged the same way.
                taken = steps[key] = (ev.symptom is not Symptom.DIVERGENCE or ev.score >= EDGE_MARGIN * threshold
                                      or first == key
                                      or size < smallest_taken.get(sig, size))
            if not taken:
                pending.extend(after)
                return
            smallest_taken[sig] = min(smallest_taken.get(sig, size), size)
            raise _RAISE[ev.symptom](ev)
        pending.extend(after)
        rest = after[max(0, handed - 1):]  # those not handed yet (all of them when the case was not)
        if rest and hand_ahead(rest) < len(rest):
            take_pending()  # run them now; else they run in the worker and the next example collects them

    asked = max_examples if max_examples is not None else cfg.max_examples
    calls = [0]  # Hypothesis examples run
    test = settings(
        max_examples=asked,
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
        take_pending()  # the last example's uniform case
    except _Failed as e:
        failures.append(e.evaluation)
    except BaseExceptionGroup as group:  # several distinct bugs
        matched, rest = group.split((_Failed, _UniformHit))
        if rest is not None:
            raise rest
        failures.extend(e.evaluation for e in _leaves(matched) if isinstance(e, _Failed))
    except _UniformHit:
        pass  # kept in `smallest`; polished below
    except _Setup as e:
        result.setup_error = setup_message(e.evaluation)
        cut["shrink"] = True  # what was found before it is kept at its smallest so far
    except _OutOfTime:
        cut["shrink"] = bool(smallest)  # what was found is kept at its smallest so far
        if not smallest:
            result.examples_asked, result.examples_short = asked, max(0, asked - calls[0])
    except KeyboardInterrupt:
        result.seconds, result.interrupted = time.monotonic() - start, True
        result.findings = [_seen(_finding(pair, ev, result, complete=False, peak=peak), first_seen, start)
                           for ev in smallest.values()]
        raise _Interrupted(result) from None
    by_sig: dict[str, Evaluation] = {}
    for ev in failures:
        by_sig[signature(pair.name, ev)] = ev
    for sig, ev in smallest.items():  # a failure Hypothesis did not report (a uniform case, or a
        by_sig.setdefault(sig, ev)  # cut-short run) is kept at its smallest

    def seek_severe(ev: Evaluation) -> None:
        """Uniform cases after a divergence is shrunk, while its pair's examples (with their uniform cases)
        and time share last, at most SEVERE_SEARCH_CASES: the search stopped at its first failure, so a
        worse second bug may not have been drawn yet. All of them run (`run` keeps the worst case of each
        signature): stopping at the first case SEVERE_FACTOR x worse kept the first bug at peaked logits
        where a second one, worse still, came later."""
        n = SEVERE_SEARCH_CASES
        if asked:
            n = min(n, max(0, asked - calls[0]) * (1 + n_uniform))
        rng = random.Random(seed ^ 0x5E7E7E)
        for _ in range(n):
            if limit["deadline"] is not None and time.monotonic() > limit["deadline"]:
                return
            try:
                run(uniform_cases(pair.axes, rng, params=ev.case.params, log_gap=True))
            except _OutOfTime:
                return

    findings = []
    queue = list(by_sig.items())
    severe = None
    while queue:
        sig, ev = queue.pop(0)
        evals = 0
        if not cut["shrink"] and polish_evals > 0:
            try:
                ev, evals, complete = _polish(pair, ev, sig, run, limit["deadline"], polish_evals, threshold)
                if (complete and pair.expected != "diverges" and ev.symptom is Symptom.DIVERGENCE
                        and math.isfinite(ev.score)):  # (inf: a sampled token the trainer excludes, the worst there is)
                    seek_severe(ev)  # (a finding stops the search: look on for a worse case)
                    top = peak.get(sig, math.nan)
                    if sig in peak_case and top >= SEVERE_FACTOR * max(ev.score, threshold):
                        severe = _severe(pair, ev, sig, peak_case[sig], top, run, limit["deadline"], polish_evals,
                                         threshold)
            except _Setup as e:  # it stopped running while a finding was shrunk: kept at its smallest so far
                result.setup_error = setup_message(e.evaluation)
                cut["shrink"], evals, ev, complete = True, 0, smallest.get(sig, ev), False
            except KeyboardInterrupt:
                result.seconds, result.interrupted = time.monotonic() - start, True
                result.findings = [_seen(_finding(pair, e, result, complete=False, peak=peak), first_seen, start)
                                   for e in by_sig.values()]
                raise _Interrupted(result) from None
            if not complete and limit["deadline"] is not None and time.monotonic() > limit["deadline"]:
                cut["shrink"] = True
        f = _finding(pair, ev, result, complete=not cut["shrink"], peak=peak)
        f.severe, severe = severe, None
        if evals and f.shrink_complete:
            f.neighbours = _neighbours(pair, ev.case, cache)
        f.cases_to_first, f.seconds_to_first = first_seen.get(sig, (result.examples, 0.0))
        f.shrink_seconds = max(0.0, time.monotonic() - start - f.seconds_to_first)
        f.polish_evaluations = evals
        findings.append(f)
        # another failure first seen while polishing (a NaN on the way to the smallest error, say) is a
        # finding too, polished in its turn
        queue += [(s, e) for s, e in smallest.items() if s not in by_sig and len(by_sig) < MAX_SIGNATURES]
        by_sig.update(queue)
    result.seconds = time.monotonic() - start
    result.findings = findings
    if progress is not None:
        progress(result, True)
    return result


def _polish(pair: TargetPair, ev: Evaluation, sig: str, run: Callable[[Case], Any], deadline: float | None,
            max_evals: int, threshold: float, bar: float | None = None) -> tuple[Evaluation, int, bool]:
    """The polish pass (`harness.shrink`) on one finding: its simplest trigger, same signature, its
    continuous knobs bisected only as far as it fails by `shrink.EDGE_MARGIN` over `threshold`.
    With `bar`, a smaller case counts only when its judged mean stays at or over it (`_severe`)."""
    from .shrink import polish

    out_of_time: dict[str, Any] = {"hit": False, "setup": None}

    def fails(case: Case) -> bool:
        if out_of_time["hit"]:
            return False
        try:
            got = run(case)
        except _OutOfTime:
            out_of_time["hit"] = True
            return False
        except _Setup as e:  # the pair stopped running: stop here, and say so (below)
            out_of_time["hit"], out_of_time["setup"] = True, e
            return False
        return (isinstance(got, Evaluation) and got.failed and signature(pair.name, got) == sig
                and (bar is None or got.score >= bar))

    def strong(case: Case) -> bool:  # (run again: from the cache) fails by the margin, or not as a divergence
        got = run(case)
        return isinstance(got, Evaluation) and (got.symptom is not Symptom.DIVERGENCE
                                                or got.score >= EDGE_MARGIN * threshold)

    case, evals, complete = polish(ev.case, fails, max_evals=max_evals, deadline=deadline, axes=pair.axes,
                                   strong=strong if bar is None else None)
    if out_of_time["setup"] is not None:
        raise out_of_time["setup"]
    got = run(case) if not out_of_time["hit"] else ev
    best = got if isinstance(got, Evaluation) and got.failed else ev
    return best, evals, complete and not out_of_time["hit"]


def _severe(pair: TargetPair, ev: Evaluation, sig: str, worst: Evaluation, peak: float,
            run: Callable[[Case], Any], deadline: float | None, max_evals: int, threshold: float) -> Any:
    """The campaign's worst evaluation of a divergence (judged `peak`), shrunk by the polish pass keeping
    the same signature and a judged mean over the bar (max(SEVERE_FACTOR x the minimal case's, peak /
    SEVERE_FACTOR)); None when it shrinks to the minimal case itself."""
    bar = max(SEVERE_FACTOR * max(ev.score, threshold), peak / SEVERE_FACTOR)
    got, _, complete = _polish(pair, worst, sig, run, deadline, max_evals, threshold, bar=bar)
    if got.case == ev.case or not got.score >= bar:
        return None
    from .corpus import Severe

    # (its shrinking may have run a case worse than the peak it started from)
    return Severe(got.case, got.score, got.headline, bar, max(peak, got.score), complete)


def _neighbours(pair: TargetPair, case: Case, cache: dict) -> list[dict[str, Any]]:
    """The minimal case's simpler neighbours as shrinking ran them (from the campaign's cache of
    verdicts: nothing is run again)."""
    from .shrink import neighbours_of

    def result_of(c: Case) -> tuple[float, str] | None:
        got = cache.get(_cache_key(c))
        if got is None:
            return None
        return (got, "none") if isinstance(got, float) else (got.score, got.symptom.value)

    return neighbours_of(case, pair.axes, result_of)


def _leaves(group: BaseExceptionGroup):
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


def _seen(f: Finding, first_seen: dict[str, tuple[int, float]], start: float) -> Finding:
    """A finding an interrupt cut short: when it was first seen, and shrinking's time since, as the
    finished ones say it (not 'after 0 cases, 0.0 s')."""
    f.interrupted = True
    f.cases_to_first, f.seconds_to_first = first_seen.get(f.signature, (f.examples, 0.0))
    f.shrink_seconds = max(0.0, time.monotonic() - start - f.seconds_to_first)
    return f


def _finding(pair: TargetPair, ev: Evaluation, result: PairResult, complete: bool,
             peak: dict[str, float] | None = None) -> Finding:
    sig = signature(pair.name, ev)
    return Finding(pair=pair.name, expected=pair.expected, symptom=ev.symptom, signature=sig, base_signature=sig,
                   case=ev.case, evaluation=ev, examples=result.examples, shrink_complete=complete,
                   peak=(peak or {}).get(sig, math.nan))


class _Setup(BaseException):
    """The pair raised a harness error on a case (it cannot run here). A BaseException, so
    Hypothesis lets it through instead of shrinking it."""

    def __init__(self, ev: Evaluation) -> None:
        super().__init__(ev.pair)
        self.evaluation = ev


_SETUP_TAIL = " That is the pair's own"


def setup_headline(message: str) -> str:
    """The first sentence of a `setup_message` (what the pair raised), for a table's findings column."""
    return message.split(_SETUP_TAIL)[0]


def setup_reason(pair: str, message: str) -> str:
    """A `setup_message` without its pair's name: what pairs failing for one reason share."""
    head = f"{pair} cannot run here: "
    return message[len(head):] if message.startswith(head) else message


def _setup_said(said: dict[str, str], pair: str, label: str, message: str) -> str:
    """A progress line's setup error: its headline the first time, then which unit raised it first
    (a checkpoint that does not load makes every pair of the model say the same paragraph)."""
    first = said.setdefault(setup_reason(pair, message), label)
    return setup_headline(message) if first == label else f"the same error as {first}"


def breaks_contract(ev: Evaluation) -> bool:
    """The case failed the harness's check of what a path returned. On a pair's first case (the
    simplest a campaign draws) it is the pair's own adapter that is wrong, not a divergence: the
    pair cannot run (a campaign recorded it as an open regression, which the corpus tests then
    expected to fail, green, forever). On a later case it is a finding like any error: an engine
    that returns a wrong shape for some batches only."""
    from .execute import CONTRACT_CHECKS

    err = ev.error or {}
    return ev.symptom is Symptom.ERROR and err.get("where") in CONTRACT_CHECKS


def setup_message(ev: Evaluation) -> str:
    """What to say of a pair that raised a harness error on a case (`Evaluation.setup`), or broke the
    contract on its first case (`breaks_contract`)."""
    err = ev.error or {}
    lines = str(err.get("message", "")).strip().splitlines()
    first = lines[0].rstrip() if lines else ""
    if not ev.setup and breaks_contract(ev):
        return (f"{ev.pair} cannot run here: its first case, the simplest, raised {err.get('type', 'Error')}: "
                f"{first}{'' if first.endswith('.') else '.'}" + _SETUP_TAIL + " code's fault: what its paths "
                "return breaks the harness's contract on the simplest case, so no case can be judged; it is not a "
                "divergence of its paths, and nothing was recorded for it; fix the pair's paths as the message says "
                "and run it again.")
    return (f"{ev.pair} cannot run here: its case raised {err.get('type', 'HarnessError')}: "
            f"{first} (at {err.get('where', '?')})." + _SETUP_TAIL + " setup (a harness "
            "error: a checkpoint that is gone, a setting it refuses), not a divergence of its paths, so nothing was "
            "recorded for it; fix what the message names and run it again (if it refuses only some cases, narrow its "
            "axes so that they are never drawn).")


class _OutOfTime(BaseException):
    """The pair's share of the budget is spent."""


class _UniformHit(BaseException):
    """A uniform random case failed: the Hypothesis run stops, the polish pass shrinks the case."""


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


@dataclass(frozen=True)
class Unit:
    """One stream of one pair: what a campaign, a shard or a pytest item runs."""

    pair: TargetPair
    stream: int = 0  # 0-based
    streams: int = 1  # streams the pair is split into

    @property
    def label(self) -> str:
        return self.pair.name if self.streams == 1 else f"{self.pair.name}#{self.stream}"


def campaign_units(pairs: list[TargetPair], streams: int = 1, shard: tuple[int, int] | None = None,
                   stream: int | None = None) -> list[Unit]:
    """The units of a campaign in (pair name, stream) order; shard i/N takes unit j when j mod N = i - 1.

    With one stream per pair this is exactly `shard_pairs`. More streams give shards (and pytest-xdist
    workers) more units than there are pairs, so they scale past the number of pairs and past one
    dominant model pair; `stream` keeps only that stream of each pair.
    """
    if not (isinstance(streams, int) and streams >= 1):
        raise ValueError(f"streams={streams!r} must be an integer >= 1")
    units = [Unit(p, k, streams) for p in sorted(pairs, key=lambda p: p.name) for k in range(streams)
             if stream is None or k == stream]
    if shard is None:
        return units
    i, n = shard
    if not (isinstance(i, int) and isinstance(n, int) and 1 <= i <= n):
        raise ValueError(f"shard {shard!r} must be (i, N) with 1 <= i <= N")
    return [u for j, u in enumerate(units) if j % n == i - 1]


def unit_pairs(units: list[Unit]) -> list[TargetPair]:
    """The pairs the units name, each once, in the units' order."""
    return list({u.pair.name: u.pair for u in units}.values())


def run_order(units: list[Unit]) -> list[Unit]:
    """The order a campaign runs its units in: op pairs, then model pairs (slow to start: imports,
    exports, compiles), each by name. Shards are cut by name first (`campaign_units`), so every
    shard's share of the pairs is the same whatever the order."""
    return sorted(units, key=lambda u: (u.pair.kind == "model", u.pair.name, u.stream))


class Deferred(BaseException):
    """A pair's first case was still running when its share of the budget ended (a cold start: a
    model's imports, export or compilation). Its worker is parked and goes on with it in the
    background, the campaign goes on with a fresh worker, and the pair comes back at the end of the
    queue, where that first case's result is waiting. A BaseException, so Hypothesis lets it through."""


class Executor:
    """Where a campaign's cases run: supervised worker processes (isolation), or this process.

    One executor may serve several campaigns with the same device and plugins (a pytest session's
    items): its worker is reused, so only the first pays the start. Up to `MAX_PARKED` more workers
    are parked at a time, each finishing a slow first case (see `Deferred`) on another core; pairs
    registered from the same module as a parked one wait for it (they would pay the same imports),
    then run in its worker. A pair's first case in a worker may take `COLD_START_TIMEOUT` seconds (or
    the pair's timeout if longer) before it counts as a hang: a cold compile is not one.
    """

    MAX_PARKED = 2
    DEFER_AFTER = 5.0  # a first case is deferred only once it has run this long (and past its share)
    COLD_START_TIMEOUT = 300.0
    COLD_AFTER_HANG = 30.0  # a cold case's allowance once the pair's first case hung through COLD_START_TIMEOUT
    PREFETCH_DEPTH = 8  # cases a campaign may hand the worker ahead of asking for them
    UNFINISHED_AFTER = 1.0  # seconds a first case must have run to be UNFINISHED at the budget's end

    def __init__(self, cfg: CampaignConfig) -> None:
        self.cfg = cfg
        self.worker: Any = None  # the worker new cases go to
        self.warm: set[str] = set()  # pairs the current worker has run a case of
        self.parked: dict[str, tuple[str, Any]] = {}  # pair name -> (its source, the worker finishing its first case)
        # results collected on the way to another case (a parked first case, cases handed ahead) and not
        # yet asked for; at most PREFETCH_DEPTH are left behind by a uniform failure, until close()
        self.done: dict[tuple[str, Any], Evaluation] = {}
        self._restarts = 0  # of workers already closed
        self.hand_ahead = spare_core_per_worker()
        self._warm_key: tuple[int, int] = (0, -1)  # (worker, its restarts) the warm set is about
        self.first_sent: dict[str, float] = {}  # pair -> when its first case (cold) was sent to a worker
        self.cold_seconds: dict[str, float] = {}  # pair -> how long its first case in a worker process took
        # pairs whose first case timed out before any case of theirs came back: their later cold cases get
        # the timeout plus COLD_AFTER_HANG (`allowance`)
        self.cold_hung: set[str] = set()
        # pair -> seconds its first case had run when the campaign's wall stopped it (it never finished:
        # a hang, or a cold start longer than the budget allows)
        self.unfinished: dict[str, float] = {}
        self.waited: dict[str, str] = {}  # pair -> the pair whose unfinished first case it waited behind
        self.unfinished_stack: dict[str, str] = {}  # pair -> its unfinished first case's stacks (if read)
        self._memory_retired: list[dict] = []  # `Worker.memory_seen` of workers already closed (`memory_note`)
        self._peaks_retired: list[dict] = []  # ... and their `Worker.peak_seen` (`worker_peak`)

    @staticmethod
    def source(pair: TargetPair) -> str:
        return pair.source or pair.name

    @property
    def parked_sources(self) -> set[str]:
        return {src for src, _ in self.parked.values()}

    def _current(self) -> Any:
        if self.worker is None:
            from .worker import Worker

            self.worker = Worker(self.cfg.device, self.cfg.plugins, self.cfg.timeout)
            self.worker.start()  # imports in the background while Hypothesis gets ready
            self.warm = set()
        return self.worker

    def prepare(self, wall: float | None) -> None:
        """Start the worker and wait until it has imported the engine (not charged to any pair's share)."""
        if self.cfg.isolation:
            from .worker import OutOfTime

            worker = self._current()
            try:
                if not worker.ready:
                    worker.ready = worker._wait_ready(wall)
            except OutOfTime:
                pass

    def warm_up(self, pair: TargetPair, cfg: CampaignConfig | None = None) -> float:
        """Run one case of a pair that is cold in the worker (the first its axes give, seeded), so that
        its imports and model build come before a budget starts: pytest's budget is per pair, and a
        model pair's cold start had taken a whole stream's share of it (UNFINISHED). What it gives is
        not kept (the campaign draws its own cases, and meets a failure again); a case that hangs is
        stopped at the cold-start allowance, as any first case. Seconds it took (0: warm already, or
        in-process, where a first case's time is never charged to the budget's wall)."""
        cfg = cfg or self.cfg
        if not cfg.isolation or pair.name in self._warm(self._current()):
            return 0.0
        from .conformance import sample_cases
        from .worker import OutOfTime

        t = time.monotonic()
        try:
            self.evaluator(pair, None, cfg)(sample_cases(pair, 1)[0])
        except (OutOfTime, HarnessError):  # (its campaign says what stops it)
            pass
        return time.monotonic() - t

    def _warm(self, worker: Any) -> set[str]:
        """The pairs that have run a case in this worker's current process: a worker replaced after a
        crash or timeout is a new process, cold again (imports, compilation)."""
        key = (id(worker), worker.restarts)
        if key != self._warm_key:
            self.warm, self._warm_key = set(), key
        return self.warm

    def _retire(self, worker: Any) -> None:
        self._restarts += worker.restarts
        self._memory_retired.append(worker.memory_seen)
        worker.settle_peak()
        self._peaks_retired.append(worker.peak_seen)
        worker.close()

    def memory_note(self, pair: str) -> str:
        """What the pair's cases did to its workers' memory, over every worker of this executor: the
        largest growth, the replacements added up ("" if nothing was seen)."""
        from .worker import memory_note

        live = [w.memory_seen for w in (self.worker, *(w for _, w in self.parked.values())) if w is not None]
        seen = [m[pair] for m in (*self._memory_retired, *live) if pair in m]
        return memory_note(max(g for g, _ in seen), sum(n for _, n in seen)) if seen else ""

    def worker_peak(self, pair: str) -> float:
        """The peak resident memory (MiB) of a worker while this pair's cases ran (0: never read)."""
        workers = [w for w in (self.worker, *(w for _, w in self.parked.values())) if w is not None]
        for w in workers:
            w.settle_peak()
        return max((m[pair] for m in (*self._peaks_retired, *(w.peak_seen for w in workers)) if pair in m),
                   default=0.0)

    def _resume(self, source: str) -> None:
        """Make the parked worker of this source (the one furthest along) the current one."""
        name = next(n for n, (src, _) in self.parked.items() if src == source)
        _, parked = self.parked.pop(name)
        if self.worker is not None:
            self._retire(self.worker)
        self.worker, self.warm = parked, set()

    def evaluator(self, pair: TargetPair, wall: float | None, cfg: CampaignConfig | None = None,
                  share: float | None = None, may_defer: bool = False) -> Evaluate:
        """`evaluate(case)` for one pair. With `may_defer`, a first case of the pair still running
        at `share` (time.monotonic()) and after `DEFER_AFTER` seconds raises `Deferred`."""
        cfg = cfg or self.cfg
        line = cfg.threshold_of(pair.name)
        if not cfg.isolation:
            return lambda case: run_case(pair, case, cfg.device, line)
        timeout, source = cfg.timeout_for(pair.name, getattr(pair, "timeout", None)), self.source(pair)

        def collected(worker: Any, name: str, ev: Evaluation) -> Evaluation:
            sent = self.first_sent.pop(name, None)
            if sent is not None and ev.symptom is not Symptom.TIMEOUT:
                self.cold_seconds[name] = time.monotonic() - sent
            elif sent is not None and name not in self.cold_seconds:  # its cold case hung, none ever came back
                self.cold_hung.add(name)
            if ev.symptom not in (Symptom.CRASH, Symptom.TIMEOUT):  # (else the process is gone)
                self._warm(worker).add(name)
            return ev

        def allowance(cold: bool) -> float:
            """A case's timeout: a cold case (the pair's first in this worker process) also gets its
            imports and compilation; in a process replaced after a crash or timeout, twice what its
            first case took before, else up to COLD_START_TIMEOUT, or COLD_AFTER_HANG once its first
            case hung through that."""
            if not cold:
                return timeout
            if pair.name in self.cold_seconds:
                return timeout + 2 * self.cold_seconds[pair.name]
            if pair.name in self.cold_hung:
                # it hung through a whole cold allowance already: another one per shrink step, in each
                # replacement worker, cost an always-hanging pair 300 s a step (hours of a nightly); a
                # bounded one still covers a cold start (imports, a model's load) longer than the timeout
                # of a pair that hangs on some inputs only, whose shrinking would otherwise take any cold
                # case for a hang
                return timeout + self.COLD_AFTER_HANG
            return max(timeout, self.COLD_START_TIMEOUT)

        def evaluate(case: Case) -> Evaluation:
            from .worker import OutOfTime

            done = self.done.pop((pair.name, _cache_key(case)), None)
            if done is not None:
                return done
            if source in self.parked_sources:
                self._resume(source)
            worker = self._current()
            key = _cache_key(case)
            waiting = pair.name  # whose case the worker is running
            try:
                while worker.inflight is not None:  # cases handed ahead (or a parked first case): collect in order
                    other, sent = worker.inflight[0], worker.inflight[1]
                    waiting = other.name
                    ev = collected(worker, other.name, worker.collect(wall))
                    if other.name == pair.name and _cache_key(sent) == key:
                        return ev
                    self.done[(other.name, _cache_key(sent))] = ev  # (a timeout or crash also empties the queue)
                waiting = pair.name
                worker.replace_if_due()  # (grown past its memory cap: a fresh, cold process from this case on)
                cold = pair.name not in self._warm(worker)
                if cold:
                    self.first_sent.setdefault(pair.name, time.monotonic())
                worker.submit(pair, case, line, allowance(cold), wall, cold_extra=allowance(cold) - timeout)
                if may_defer and share is not None and cold and len(self.parked) < self.MAX_PARKED:
                    ev = worker.collect(wall, until=max(share, time.monotonic() + self.DEFER_AFTER))
                    if ev is None:
                        self.parked[pair.name], self.worker = (source, worker), None
                        raise Deferred
                else:
                    ev = worker.collect(wall)
            except OutOfTime as e:
                ran = time.monotonic() - self.first_sent.pop(waiting, time.monotonic())
                if ran >= self.UNFINISHED_AFTER:  # a first case that never came back (one sent as the budget
                    self.unfinished[waiting] = ran  # ended has said nothing yet: its pair is "not run")
                    if e.stack:
                        self.unfinished_stack[waiting] = e.stack
                    if waiting != pair.name:
                        self.waited[pair.name] = waiting
                raise
            return collected(worker, pair.name, ev)

        def prefetch(case: Case) -> bool:
            """Hand a case to the warm worker without waiting (behind at most `PREFETCH_DEPTH - 1`
            others); `evaluate(case)` collects it."""
            if not self.hand_ahead or source in self.parked_sources:
                return False
            worker = self._current()
            if pair.name not in self._warm(worker):
                return False
            if len(worker.queue) >= self.PREFETCH_DEPTH or not worker.ready or not worker.alive() or worker.replace_due:
                return False
            if any(q[0].name != pair.name for q in worker.queue):
                return False  # a parked first case of another pair is still running
            worker.submit(pair, case, line, timeout, wall)
            return True

        evaluate.prefetch = prefetch  # type: ignore[attr-defined]
        return evaluate

    @property
    def restarts(self) -> int:
        return self._restarts + (self.worker.restarts if self.worker is not None else 0)

    def close(self) -> None:
        for w in (self.worker, *(w for _, w in self.parked.values())):
            if w is not None:
                self._retire(w)
        self.worker, self.parked, self.done = None, {}, {}


def cores_and_campaigns() -> tuple[int, int]:
    """The cores this process may run on, and the campaigns running at once on them (pytest-xdist
    workers: `PYTEST_XDIST_WORKER_COUNT`; 1 otherwise)."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        campaigns = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    except ValueError:
        campaigns = 1
    return cores, campaigns


def spare_core_per_worker() -> bool:
    """Whether this machine has a core for each campaign's worker besides the campaign itself: two per
    campaign running at once. Handing cases ahead lets the worker compute while the campaign draws,
    which pays only with a core to spare; without one the campaign and its worker compete for a core
    with the other campaigns' processes."""
    cores, campaigns = cores_and_campaigns()
    return cores >= 2 * campaigns


def share_threads_among_campaigns(isolated: bool = True) -> int | None:
    """Give torch its share of the cores: cores // campaigns threads (pytest-xdist workers: several
    campaigns at once), less one where that leaves two or more and cases run in a worker process beside
    the campaign (`isolated`), which draws, shrinks and judges while its worker computes; at least 1.
    Unless the thread count was chosen (`OMP_NUM_THREADS`, `MKL_NUM_THREADS`) or is already within the
    share. torch's default, a thread per core in every process, oversubscribed the machine:
    `pytest --harness-fuzz -n 2` on 2 cores outside this repository (whose tests/conftest.py sets one
    thread) ran 271 cases in 15.2 s against 11.0 s with one thread each
    (`reports/scripts/xdist_threads.py`), and a lone `harness fuzz` of a model pair on a 2-core machine
    loaded by other work ran many times slower on 2 threads than on 1 (its OpenMP threads spin-wait for
    the core the campaign holds). Returns the count set, or None. A repro records the count it ran
    with and replays with it (`environment.torch_threads`)."""
    import os

    cores, campaigns = cores_and_campaigns()
    if any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
        return None
    import torch

    each = cores // campaigns
    share = max(1, each - (1 if isolated and each >= 2 else 0))
    if torch.get_num_threads() <= share:
        return None
    torch.set_num_threads(share)
    return share


_SIGNALLED = [False]  # an interrupt came during this campaign (set by `_Signals._handle`)


# Functions an exception raised in is printed ("Exception ignored in ...", with its traceback) and
# dropped: a signal landing there must not raise (Hypothesis's gc callback measures collections)
_DROPPING = frozenset({"gc_callback", "__del__"})


class _Signals:
    """SIGTERM (what CI timeouts and Slurm send) handled like Ctrl-C, and neither of them lands in the
    middle of writing a finding: inside `critical()` an interrupt waits until the write is done."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self.saved: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        import signal
        import threading

        _SIGNALLED[0] = False
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal

        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        _SIGNALLED[0] = False  # (delivered by now; a later campaign in this process starts without it)

    def _handle(self, signum: int, frame: Any) -> None:
        _SIGNALLED[0] = True  # (checked between cases too: Python drops an exception raised here when the
        if self.depth:  # signal lands inside a weakref callback or __del__, and the campaign would go on)
            self.pending = True
            return
        f = frame
        while f is not None:  # inside a callback whose exceptions Python prints and drops (a gc callback,
            if f.f_code.co_name in _DROPPING:  # a __del__): the flag alone stops the campaign at the next case
                return
            f = f.f_back
        raise KeyboardInterrupt

    def critical(self) -> "_Critical":
        return _Critical(self)


class _Critical:
    def __init__(self, signals: _Signals) -> None:
        self.signals = signals

    def __enter__(self) -> None:
        self.signals.depth += 1

    def __exit__(self, *exc: Any) -> None:
        self.signals.depth -= 1
        if not self.signals.depth and self.signals.pending and exc[0] is None:
            self.signals.pending = False
            raise KeyboardInterrupt


def _merge(into: PairResult, r: PairResult, rounds: bool = False) -> list[Finding]:
    """Add another stream's (or, `rounds`, another round's) result to a pair's; returns the findings
    whose signature is new here."""
    if rounds:  # a round's findings were first seen this far into the unit, which ran this many cases in all
        for f in r.findings:
            f.cases_to_first += into.examples
            f.seconds_to_first += into.seconds
            f.examples += into.examples
    into.examples += r.examples
    into.seconds += r.seconds
    into.max_k3 = max(into.max_k3, r.max_k3)
    if r.max_case is not None and (r.max_score > into.max_score or into.max_case is None):
        into.max_case = r.max_case
    into.max_score = max(into.max_score, r.max_score)
    into.threshold = into.threshold or r.threshold
    for k, n in r.judged_bins.items():
        into.judged_bins[k] = into.judged_bins.get(k, 0) + n
    into.largest = tuple(max(a, b) for a, b in zip(into.largest, r.largest))  # type: ignore[assignment]
    into.longest = max(into.longest, r.longest)
    into.worker_peak_mib = max(into.worker_peak_mib, r.worker_peak_mib)
    into.max_seq_score = max(into.max_seq_score, r.max_seq_score)
    into.entropy_sum += r.entropy_sum
    into.entropy_cases += r.entropy_cases
    into.setup_error = into.setup_error or r.setup_error
    into.memory_note = into.memory_note or r.memory_note
    into.interrupted = into.interrupted or r.interrupted
    into.flaky += [x for x in r.flaky if x not in into.flaky]
    if not rounds:  # (a further round ends when its share does, by design: not a pair cut short)
        into.streams += r.streams
        into.warmup += r.warmup
        into.examples_asked += r.examples_asked
        into.examples_short += r.examples_short
    known = {f.signature: i for i, f in enumerate(into.findings)}
    fresh = [f for f in r.findings if f.signature not in known]
    for f in r.findings:
        i = known.get(f.signature)
        if i is not None and f.new and not into.findings[i].new and f.path == into.findings[i].path:
            # two streams found one signature (pytest-xdist items, each writing as it finds): the one that
            # wrote the corpus file stands for it, so the summary's case is the file's
            into.findings[i] = f
        if i is not None and f.severe is not None and (into.findings[i].severe is None
                                                       or f.severe.judged > into.findings[i].severe.judged):
            into.findings[i].severe = f.severe  # (the worst any stream saw, as the corpus file keeps it)
    into.findings.extend(fresh)
    return fresh


def warm_hypothesis() -> None:
    """Hypothesis's one-off scan of the process's local modules for constants (it draws them now and
    then), done before a campaign's clock starts. Left to the first draw, it took the first pair's
    time share: 0.4-1.1 s in a folder without Hypothesis's cache of them (`.hypothesis/constants/`: a
    fresh CI checkout, pytest's tmp dirs), 0.03-0.14 s with it (`reports/scripts/hypothesis_scan.py`),
    more under pytest, whose test modules are local too; a 2 s campaign's first pair ran no case ("not
    run"). The same modules are loaded either way, so the constants, and the draws, are the same.
    (Hypothesis's internals: without them, nothing.)"""
    try:
        from hypothesis.internal.conjecture.providers import _get_local_constants
    except ImportError:
        return
    try:
        _get_local_constants()
    except Exception:  # noqa: BLE001 - a changed internal: the first draw pays it, as before
        pass


def own_lines(cfg: CampaignConfig, pairs: Any) -> str:
    """` (own lines: a 0.01, b 0.003)` for the pairs judged at another line than the campaign's; "" else."""
    names = {getattr(p, "name", p) for p in pairs}
    own = {n: t for n, t in cfg.own_thresholds().items() if n in names}
    return f" (own lines: {', '.join(f'{n} {t:g}' for n, t in sorted(own.items()))})" if own else ""


def run_campaign(cfg: CampaignConfig, tracker: Any = None, log: Callable[[str], None] | None = None,
                 on_finding: Callable[[Finding], None] | None = None, executor: Executor | None = None,
                 on_progress: Callable[[Any, PairResult], None] | None = None) -> CampaignResult:
    """Fuzz every pair of the config; write each finding to the corpus, then to the tracker.

    A finding the corpus cannot take (disk full, read-only folder) is printed in full as JSON on
    stderr (the repro file it would have been) and kept in `CampaignResult.unsaved`; the campaign goes on.
    `on_progress(unit, result so far)` is called every few seconds of a unit's campaign (what a
    pytest item leaves for its session's summary, should it be interrupted).
    """
    from . import corpus as corpus_mod
    from .tracking import NullTracker

    tracker = tracker or NullTracker()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    seed = cfg.seed if cfg.seed is not None else fresh_seed()
    cfg.seed = seed
    result = CampaignResult(seed=seed, config=cfg)
    units = run_order(campaign_units(cfg.pairs, cfg.streams, cfg.shard, cfg.stream))
    pairs = unit_pairs(units)
    log(f"campaign seed {seed} (rerun exactly with --seed {seed}); {len(pairs)} pair(s), device {cfg.device}, "
        f"threshold {cfg.threshold:g}" + own_lines(cfg, pairs) + (f", {cfg.streams} streams per pair" if cfg.streams > 1 else "")
        + (f", shard {cfg.shard[0]}/{cfg.shard[1]}" if cfg.shard else "")
        + ("" if cfg.isolation else ", in-process (no isolation)"))
    tracker.campaign_started(cfg, seed, pairs)
    warm_hypothesis()
    start = time.monotonic()
    end = start + cfg.budget if cfg.budget is not None else None
    own_executor = executor is None
    executor = executor or Executor(cfg)
    restarts_before = executor.restarts
    signals = _Signals()
    by_pair: dict[str, PairResult] = {}

    def eta(unit: Any, r: PairResult) -> str:
        """How long the unit's examples would still take at its rate so far, where that is over a minute
        and no budget bounds it (a slow model pair given --max-examples alone)."""
        if end is not None or cfg.fill_budget or r.rate <= 0 or not cfg.max_examples or r.examples < 8:
            return ""  # (the first cases' rate is the cold start's)
        cases = examples_of(unit) * (1 + uniform_per_example(unit.pair, cfg))  # (each example's uniform cases too)
        left = max(0, cases - r.examples) / r.rate
        return (f"; about {left / 60:.0f} min more for its {examples_of(unit)} examples at this rate "
                "(--budget bounds it)") if left > 60 else ""

    def progress_of(unit: Any, before: tuple[PairResult, ...] = ()) -> Callable[[PairResult, bool], None]:
        """A unit's progress lines; `before`: its earlier runs (a round's), counted in what `on_progress` gets."""
        def progress(r: PairResult, done: bool) -> None:
            if not done:  # (the unit's label: a pair's streams count their cases apart)
                so_far = PairResult(r.pair, r.expected)  # (with its earlier rounds': the counts never go back)
                for b in (*before, r):
                    so_far.examples += b.examples
                    so_far.seconds += b.seconds
                    so_far.max_score, so_far.max_k3 = max(so_far.max_score, b.max_score), max(so_far.max_k3, b.max_k3)
                shown = so_far if unit.streams == 1 else r  # (a pair's streams count their cases apart)
                log(f"  {unit.label}: {shown.examples} cases, {rate_text(r.rate)}/s, max judged {shown.max_score:.3g} "
                    f"(sampled k3 {shown.max_k3:.3g})"
                    + (f"; shrinking the failure found after {r.failing_since} cases, then looking for a worse case "
                       "(smaller cases that still fail are kept; the budget bounds it)" if r.failing_since else eta(unit, r)))
                if on_progress is not None:
                    on_progress(unit, so_far)
        return progress

    def run_again(f: Finding, case: Case) -> Evaluation | None:
        """One more evaluation of a case of the finding's pair, after the search (the corpus check, the
        determinism check); None past the budget's wall, or when the target raised KeyboardInterrupt
        (inside a finding's critical section a Ctrl-C waits, so the target raised it)."""
        from .worker import OutOfTime

        if end is not None and time.monotonic() >= end:
            return None
        pair = next(p for p in pairs if p.name == f.pair)
        try:
            ev = executor.evaluator(pair, end, cfg)(case)
        except (OutOfTime, KeyboardInterrupt):
            return None
        return None if ev.setup else ev  # (it cannot run now: that tells nothing of the finding)

    def reproduces(f: Finding) -> Callable[[Case], bool]:
        """Whether a case fails now as the finding does (an existing repro of its signature: the same
        bug, or one that is gone)."""
        return reproduces_with(lambda case: run_again(f, case), f.pair, f.base_signature or f.signature)

    def check_determinism(f: Finding) -> bool:
        """Run the minimal case once more: a pair that gives other values on the same case (the global
        RNG, uninitialised memory, a race) makes a repro that will not replay; say so now, and in it.
        Where that run came back clean, run it until `FLAKY_RUNS` runs past the first: True when fewer
        than half of all its runs failed (the pair's noise crossing the line: `PairResult.flaky`)."""
        from .corpus import metrics_json

        if f.symptom not in (Symptom.DIVERGENCE, Symptom.NONFINITE):
            return False
        again = run_again(f, f.case)
        if again is None or (again.symptom is f.symptom and metrics_json(again) == metrics_json(f.evaluation)):
            return False
        f.deterministic = False
        first, then = f.evaluation.score, again.score
        runs = [f.evaluation, again]
        if not again.failed:  # (a failure that does not come back: how often does it?)
            for _ in range(FLAKY_RUNS - 1):
                more = run_again(f, f.case)
                if more is None:
                    break
                runs.append(more)
        failed = sum(1 for ev in runs if ev.symptom is f.symptom)
        scores = [ev.score for ev in runs if ev.divergence is not None and not math.isnan(ev.score)]
        spread = (f"{min(scores):.3g} to {max(scores):.3g}" if scores else "no metrics")
        rel = (abs(first - then) / max(abs(first), abs(then)) if math.isfinite(first) and math.isfinite(then)
               and max(abs(first), abs(then)) > 0 else math.nan)
        said = (f"the minimal case gave {f.evaluation.headline}, then "
                + ("clean" if not again.failed else again.symptom.value) + f" {again.headline} on the same inputs"
                + (f" (judged {first:.6g} then {then:.6g}, a relative difference of {rel:.2g})" if not math.isnan(rel)
                   else ""))
        if 2 * failed < len(runs):
            log(f"warning: {f.pair} is not deterministic given its case, and its run-to-run noise alone crosses the "
                f"line: {said}; it failed in {failed} of {len(runs)} runs of those inputs (judged {spread}). Not "
                "recorded as a regression: no repro of it would replay. Make the rollout deterministic "
                "(`harness check` names the cause), or judge the pair on a threshold above its noise; a rerun "
                "with the same --seed may search other cases (its draws follow the noisy values).")
            return True
        log(f"warning: {f.pair} is not deterministic given its case: {said}" + (
            f"; it failed in {failed} of {len(runs)} runs (judged {spread})" if len(runs) > 2 else "")
            + " (a global RNG, uninitialised memory, a race?). Its repro will not replay bit for bit; `harness check` "
            "names the cause, and a rerun with the same --seed may search other cases.")
        return False

    def record(f: Finding) -> None:
        with signals.critical():  # (Ctrl-C waits until the finding is on disk)
            if f.shrink_complete and check_determinism(f):  # (a campaign cut short has no time for it)
                holder = by_pair.get(f.pair)
                if holder is not None and f in holder.findings:  # noise, not a finding: said, never recorded
                    holder.findings.remove(f)
                    holder.flaky.append(f"{f.symptom.value} {f.evaluation.headline} in {f.case.one_line(brief=True)}, "
                                        "not reproducible (the pair's noise)")
                return
            if cfg.write_corpus:
                try:
                    corpus_mod.record_finding(f, cfg.corpus, cfg.threshold_of(f.pair), seed, cfg.device, log=log,
                                              reproduces=reproduces(f))
                except Exception as e:  # noqa: BLE001 - a full disk, or a bug writing it: the finding is printed
                    _unsaved(f, e, cfg, seed, log)
                    result.unsaved.append(f)
            tracker.finding(f)
        if on_finding:
            on_finding(f)

    def add(r: PairResult, unit: Any, rounds: bool = False) -> list[Finding]:
        for f in r.findings:  # (which stream found it: its repro says, beside the campaign seed)
            f.stream = (unit.stream, unit.streams)
        if r.pair not in by_pair:
            by_pair[r.pair] = r
            result.results.append(r)
            return list(r.findings)
        return _merge(by_pair[r.pair], r, rounds=rounds)

    setup_said: dict[str, str] = {}  # a setup error's text (pair name left out) -> the first unit that raised it

    def examples_of(unit: Any) -> int:
        return stream_examples(cfg.max_examples, unit.stream, unit.streams)

    def run_rounds(unit: Any, deadline: float) -> PairResult:
        """`fill_budget`: rounds 1, 2, ... of a unit until its deadline or a finding, as one result."""
        r = PairResult(unit.pair.name, unit.pair.expected)
        evaluate = executor.evaluator(unit.pair, end, cfg, deadline, False)
        rnd = 1
        while not r.findings and not r.setup_error and time.monotonic() < deadline - ROUND_MIN_LEFT:
            more = fuzz_pair(unit.pair, cfg, round_seed(seed, unit.pair.name, unit.stream, unit.streams, rnd),
                             deadline, progress_of(unit, tuple(x for x in (by_pair.get(unit.pair.name), r) if x)),
                             evaluate=evaluate, max_examples=examples_of(unit), wall=end)
            if not more.examples:
                r.setup_error = r.setup_error or more.setup_error  # (its first case could not run: say so)
                break
            _merge(r, more, rounds=True)
            rnd += 1
        return r

    fill: deque = deque()  # clean units, which take the time left once every unit has run
    queue = deque(units)
    try:
        with signals:
            executor.prepare(end)
            while queue:
                unit = queue.popleft()
                pair, source, parked = unit.pair, executor.source(unit.pair), executor.parked_sources
                if source in parked and any(executor.source(u.pair) not in parked for u in queue):
                    queue.append(unit)  # a first case from its module still runs in the background: later
                    continue
                deadline = None
                if end is not None:
                    now = time.monotonic()
                    if now >= end:  # the budget's wall: the units left do not start (each start costs a
                        # Hypothesis setup, and thousands of streams would run far past it); each is "not run"
                        hung = next((r.pair for r in result.results if r.unfinished), "")  # (what took the time)
                        for u in [unit, *queue]:
                            add(PairResult(pair=u.pair.name, expected=u.pair.expected,
                                           seed=stream_seed(seed, u.pair.name, u.stream, u.streams),
                                           waited_for=hung if hung != u.pair.name else "",
                                           # every example it was to run is one the budget cut: its pair
                                           # is not clean over what was asked (`time_note`)
                                           examples_asked=examples_of(u), examples_short=examples_of(u)), u)
                        log(f"  the budget ended before {unit.label}"
                            + (f" and {len(queue)} more unit(s)" if queue else "") + " started: not run"
                            + (f" (they waited behind {hung}'s first case, which never finished)" if hung else ""))
                        queue.clear()
                        break
                    deadline = now + max(0.0, end - now) / (len(queue) + 1)
                may_defer = any(executor.source(u.pair) not in parked and executor.source(u.pair) != source
                                for u in queue)
                evaluate = executor.evaluator(pair, end, cfg, deadline, may_defer)
                try:
                    r = fuzz_pair(pair, cfg, stream_seed(seed, pair.name, unit.stream, unit.streams), deadline,
                                  progress_of(unit), evaluate=evaluate, max_examples=examples_of(unit), wall=end)
                except Deferred:
                    log(f"  {unit.label}: first case still running at the end of its share (a cold start?): "
                        "deferred, it goes on in the background")
                    queue.append(unit)
                    continue
                except _Interrupted as stop:
                    for f in add(stop.result, unit):
                        record(f)
                    raise KeyboardInterrupt from None
                if not r.examples:  # a first case the budget's end stopped, or one it waited behind
                    r.unfinished = executor.unfinished.get(pair.name, 0.0)
                    r.unfinished_stack = executor.unfinished_stack.get(pair.name, "")
                    r.waited_for = executor.waited.get(pair.name, "")
                for f in add(r, unit):
                    record(f)
                if cfg.fill_budget and r.examples and not by_pair[pair.name].findings \
                        and not by_pair[pair.name].setup_error:  # (another stream's finding or setup error counts)
                    fill.append(unit)
                said = r.verdict
                if said == "MISSED" and (unit in fill or unit.streams > 1):  # the pair's verdict comes at the end
                    said = "not caught yet" + (" (more rounds follow if time is left)" if unit in fill else
                                               " (by this stream)")
                elif said == "clean" and unit in fill:  # (a later round may still find something)
                    said = "clean so far (more rounds follow if time is left)"
                log(f"  {unit.label}: {said} ({r.examples} cases in {r.seconds:.1f}s, max judged {r.max_score:.3g}"
                    + (f"; {r.spread_text}" if r.spread_text and not r.findings else "")
                    + (f"; {r.largest_text}" if r.largest_text and not r.findings else "")
                    + (f"; its longest sequence, {r.longest} positions, never reached {r.unreached(pair)}: nothing past "
                       "it was tested" if r.unreached(pair) and not r.findings else "")
                    + (f"; one sequence's own mean reached {r.max_seq_score:.3g}, over the line: judged over the batch"
                       if r.max_seq_score > cfg.threshold_of(r.pair) and not r.findings else "")
                    + (f", first case {r.warmup:.1f}s" if r.warmup > 5 else "")
                    + (f", {len(r.findings)} finding(s)" if r.findings else "")
                    + (f"; {r.time_note}" if r.time_note else "") + ")"
                    + (f": {_setup_said(setup_said, unit.pair.name, unit.label, r.setup_error)}" if r.setup_error else ""))
                if r.unfinished or r.waited_for:
                    log(f"  {unit.label}: {unfinished_note(r, cfg.timeout_for(pair.name, getattr(pair, 'timeout', None)))}")
                near = near_miss_line(r, cfg.threshold_of(r.pair), cfg.plugins)
                if near:
                    log(f"  {unit.label}: {near}")
            # Filling, once every unit has run its examples: the time left goes to the clean units, in
            # equal shares, as further rounds (not before: a quick op pair that filled its first share
            # would take the time a slow model pair after it needs for its first cases)
            while fill and end is not None and end - time.monotonic() > ROUND_MIN_LEFT * (len(fill) + 1):
                unit = fill.popleft()
                if by_pair[unit.pair.name].setup_error:  # (a round of another stream found it cannot run)
                    continue
                now = time.monotonic()
                try:
                    r = run_rounds(unit, now + max(0.0, end - now) / (len(fill) + 1))
                except Deferred:
                    continue
                except _Interrupted as stop:
                    for f in add(stop.result, unit, rounds=True):
                        record(f)
                    raise KeyboardInterrupt from None
                for f in add(r, unit, rounds=True):
                    record(f)
                if r.examples:
                    log(f"  {unit.label}: {r.examples} more cases in {r.seconds:.1f}s of the time left"
                        + (f", {len(r.findings)} finding(s): now {by_pair[unit.pair.name].verdict}" if r.findings
                           else ""))
            if fill:  # (their lines said "more rounds follow if time is left": say that none did)
                log(f"  no time was left for more rounds of {', '.join(u.label for u in fill)}: "
                    "their verdicts stand on the cases above")
    except KeyboardInterrupt:
        result.interrupted = True
        for u in queue:  # the units it came before: each pair asked for has its row ("not run", or cut short)
            add(PairResult(pair=u.pair.name, expected=u.pair.expected,
                           seed=stream_seed(seed, u.pair.name, u.stream, u.streams), interrupted=True), u)
    finally:
        result.results.sort(key=lambda r: r.pair)
        for r in result.results:
            r.memory_note = executor.memory_note(r.pair) if cfg.isolation else ""
            r.worker_peak_mib = executor.worker_peak(r.pair) if cfg.isolation else 0.0
        result.worker_restarts = executor.restarts - restarts_before
        if own_executor:
            executor.close()
        result.seconds = time.monotonic() - start
        tracker.campaign_finished(result)
    return result


def stack_where(stack: str, frames: int = 4) -> str:
    """The innermost frames of the thread a faulthandler dump was written from (the worker's main
    thread: where its case was), innermost first, on one line."""
    blocks = stack.split("\n\n")
    block = next((b for b in blocks if b.lstrip().startswith("Current thread")), blocks[0] if blocks else "")
    lines = [ln.strip() for ln in block.splitlines()[1:] if ln.strip().startswith("File ")]
    return " <- ".join(lines[:frames]) + (" <- ..." if len(lines) > frames else "") if lines else stack.strip()[:300]


def unfinished_note(r: PairResult, timeout: float, budget_flag: str = "--budget") -> str:
    """Why a pair has no result: its first case never came back before the budget ended, or it waited
    behind another pair's that did not (pairs of one module share a worker: the same imports)."""
    if r.unfinished:
        return (f"its first case was still running after {r.unfinished:.0f} s when the budget ended (per-case "
                f"timeout {timeout:g} s; a first case may take up to {Executor.COLD_START_TIMEOUT:g} s for imports and "
                f"compilation): a hang, or a cold start longer than the budget allows. Without {budget_flag} it "
                "becomes a timeout finding once past that; or give the pair more budget"
                + (f". It had run past its per-case timeout; where it was when stopped: {stack_where(r.unfinished_stack)}"
                   if r.unfinished_stack else ""))
    if r.waited_for:
        return (f"not run: it waited for the first case of {r.waited_for} (same module, same worker), which never "
                "finished before the budget ended")
    return ""


def _unsaved(f: Finding, err: Exception, cfg: CampaignConfig, seed: int, log: Callable[[str], None]) -> None:
    """A finding the corpus could not take: say why, and print it in full so it is not lost."""
    from .corpus import finding_to_repro

    target = f.path or Path(cfg.corpus) / f.pair / f"{f.id}.json"
    f.path = None
    if isinstance(err, OSError):
        why = (f"{err.strerror or err} (errno {err.errno}). Free space or make the corpus folder writable (or pass "
               "`harness fuzz --corpus DIR`, `pytest --harness-corpus DIR`)")
    else:  # not the disk: a bug of the harness writing the file (please report it, with this message)
        why = (f"{type(err).__name__}: {err} (an error of the harness writing the file, not of the disk: please report "
               f"it, with the existing {target} if there is one)")
    log(f"error: could not write finding {f.id} ({f.pair}, {f.symptom.value}) to {target}: {why}; the campaign goes "
        f"on (`harness fuzz` exits 3 at the end, which outranks 1: a finding is not on disk; under pytest its item "
        f"fails). The finding follows on "
        f"one line as JSON: save that line as {target} to replay it.")
    try:
        data = finding_to_repro(f, cfg.threshold_of(f.pair), seed, cfg.device).to_json()
    except Exception as e:  # noqa: BLE001 - what can still be said: the case and the verdict
        data = {"pair": f.pair, "symptom": f.symptom.value, "case": f.case.to_json(),
                "error_making_the_repro": f"{type(e).__name__}: {e}"}
    print(json.dumps(data, default=str), file=sys.stderr, flush=True)


NOT_HERE = "not caught by this shard's streams"


def caught_elsewhere_maybe(r: PairResult, cfg: CampaignConfig) -> bool:
    """A demonstration none of this shard's streams caught, whose other streams run on other shards:
    not MISSED here (another shard may have caught it; `harness report` judges a night's shards
    together)."""
    return (r.verdict == "MISSED" and cfg.shard is not None and cfg.shard[1] > 1 and cfg.streams > 1
            and r.streams < cfg.streams)


def expected_text(expected: str, line: float | None, campaign_line: float | None) -> str:
    """'aligned', or 'aligned (line 0.02)' for a pair judged at another line than the campaign's (its
    own `TargetPair(threshold=)`, or `--threshold GLOB=K3`): the table's values read against it."""
    if line and campaign_line and line != campaign_line:
        return f"{expected} (line {line:g})"
    return expected


def summary_table(result: CampaignResult) -> str:
    """One row per pair; *max judged* is the largest mean the verdict read (expected k3 or exact KL),
    *max sampled k3* the largest sampled tokens' mean k3. A pair that cannot run points to the error
    line `harness fuzz` prints after the table (`setup_error`, said there once)."""
    from .pairs import REGISTRY

    rows = [("pair", "expected", "verdict", "cases", "cases/s", "judged p90", "max judged", "max sampled k3",
             "findings")]
    for r in result.results:
        pair = REGISTRY.get_loaded(r.pair)
        reach = r.unreached(pair) if pair is not None and not r.findings and r.examples else ""
        verdict = (f"{NOT_HERE} ({r.streams} of {result.config.streams})"
                   if result.config is not None and caught_elsewhere_maybe(r, result.config) else r.verdict) \
            + (f" ({r.time_note})" if r.time_note and not r.findings else "")
        expected = expected_text(r.expected, r.threshold, result.config.threshold if result.config else None)
        if r.setup_error and not r.findings:  # (what it raised: once, in the error line after the table)
            rows.append((r.pair, expected, verdict, str(r.examples), rate_text(r.rate), "-", "-", "-",
                         "cannot run here: see the error below"))
            continue
        rows.append((r.pair, expected, verdict, str(r.examples), rate_text(r.rate), r.p90_text, f"{r.max_score:.3g}",
                     f"{r.max_k3:.3g}",
                     ", ".join(f"{f.symptom.value} {f.evaluation.headline} (found after {f.cases_to_first} cases, "
                               f"{f.seconds_to_first:.1f}s; "
                               + (f"shrunk in {f.shrink_seconds:.1f}s" if f.shrink_complete else
                                  f"shrinking cut short{' by the interrupt' if f.interrupted else ''} after "
                                  f"{f.shrink_seconds:.1f}s") + f") -> {f.path or '-'}"
                               + (" (not deterministic: will not replay bit for bit)" if not f.deterministic else "")
                               for f in r.findings) + ("; " if r.findings and r.memory_note else "")
                     + r.memory_note + ("; " if (r.findings or r.memory_note) and r.flaky else "")
                     + "; ".join(f"noise: {x}" for x in r.flaky[:2])
                     + ("; " if (r.memory_note or r.flaky) and reach else "")
                     + (f"never reached {reach}: nothing past it tested" if reach else "") or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return "\n".join(lines)
