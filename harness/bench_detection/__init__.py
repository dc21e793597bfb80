"""`harness bench detection`: how fast the harness finds planted bugs, against uniform random.

For each planted bug class (`planted.py`: a buggy pair and its fixed twin, over the axes a user
of that op would declare) and each seed, side by side in one run:

- harness: a real campaign of the buggy pair (`fuzz_pair`: generation, targeting, shrinking), capped
  at `cap` generated cases. Cases to first finding = distinct cases the pair evaluated up to and
  including the first failing one (recorded by wrapping the pair's `build`, so the count does not
  depend on the campaign engine's internals; the shrinker's cases come after and are not counted).
- random: `strategies.uniform_cases(axes, random.Random(seed))` through `execute.run_case`, the
  first case whose symptom is not `none`, capped at `cap`.
- repro: the campaign's shrunk finding is the simplest trigger when it has the class's expected
  minimal form (one sequence where one suffices, every knob neutral but the trigger) and is
  1-minimal: none of its `Case.simpler_neighbours()` fails with the same symptom.
- twin: a campaign of the fixed twin over `twin_cases` cases must find nothing.

The table goes into the `detection` section of reports/BENCHMARKS.md, the plot to a PNG.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

from ..bench import check_out_file

from .planted import CLASSES, PlantedClass, planted_classes

DEFAULT_PLOT = Path("reports/examples/detection.png")
GOAL_WITHIN = 100  # every class found within this many cases at every seed
GOAL_RATIO = 2.0  # harness median <= this x random median on every class
GOAL_TIE_GAIN = 10.0  # random median / harness median on the tie classes
GOAL_SIMPLEST = 0.9  # share of repros that are the simplest trigger


@dataclass
class Trial:
    """One planted class at one seed."""

    name: str
    seed: int
    harness: int | None = None  # cases to the first failing one (None: none within the cap)
    random: int | None = None  # same for uniform random
    repro: Any = None  # the shrunk Case of the campaign's finding
    symptom: str = ""
    expected_form: bool = False  # the repro has the class's expected minimal form
    one_minimal: bool = False  # no simpler neighbour of the repro fails with the same symptom
    failing_neighbours: list = field(default_factory=list)  # one-line cases of simpler neighbours that fail
    twin_cases: int = 0  # cases the fixed twin's campaign evaluated
    twin_drawn: list = field(default_factory=list, repr=False)  # those cases, in order (what the generator drew)
    twin_findings: int = 0
    seconds: float = 0.0

    @property
    def simplest(self) -> bool:
        return self.expected_form and self.one_minimal


def _record(pair: Any) -> tuple[Any, list]:
    """The pair with a `build` that records each distinct case, in the order first evaluated."""
    order: list = []
    seen: set[str] = set()

    def build(case, device, _build=pair.build):
        key = case.key()
        if key not in seen:
            seen.add(key)
            order.append(case)
        return _build(case, device)

    return dataclasses.replace(pair, build=build), order


def _fails(pair: Any, case: Any, threshold: float) -> Any:
    from ..execute import run_case

    ev = run_case(pair, case, "cpu", threshold)
    return ev.symptom if ev.failed else None


def campaign(pair: Any, seed: int, cases: int, threshold: float) -> tuple[Any, list]:
    """A real campaign of one pair in this process: its result and the distinct cases it evaluated."""
    from ..fuzz import CampaignConfig, fuzz_pair, pair_seed

    recorded, order = _record(pair)
    cfg = CampaignConfig(pairs=[recorded], seed=seed, max_examples=cases, threshold=threshold, write_corpus=False)
    result = fuzz_pair(recorded, cfg, pair_seed(seed, pair.name), deadline=None)
    return result, order


def first_failure(pair: Any, cases: list, threshold: float) -> int | None:
    """1-based index of the first failing case (None when none fails)."""
    for i, case in enumerate(cases, 1):
        if _fails(pair, case, threshold) is not None:
            return i
    return None


def random_baseline(pair: Any, seed: int, cap: int, threshold: float) -> int | None:
    """Cases uniform random over the pair's axes needs to a failing one (None: not within cap)."""
    from ..strategies import uniform_cases

    rng = random.Random(seed)
    for i in range(1, cap + 1):
        if _fails(pair, uniform_cases(pair.axes, rng), threshold) is not None:
            return i
    return None


def run_trial(pc: PlantedClass, seed: int, cap: int, twin_cases: int, threshold: float) -> Trial:
    t0 = time.perf_counter()
    trial = Trial(pc.name, seed)
    result, order = campaign(pc.buggy, seed, cap, threshold)
    findings = [f for f in result.findings if f.symptom.value != "error"] or list(result.findings)
    if findings:
        trial.harness = first_failure(pc.buggy, order, threshold)
        f = min(findings, key=lambda f: (f.case.batch_size, f.case.n_tokens))
        trial.repro, trial.symptom = f.case, f.symptom.value
        trial.expected_form = bool(pc.simplest(f.case))
        for n in f.case.simpler_neighbours():
            s = _fails(pc.buggy, n, threshold)
            if s is not None and s.value == trial.symptom:
                trial.failing_neighbours.append(n.one_line())
        trial.one_minimal = not trial.failing_neighbours
    trial.random = random_baseline(pc.buggy, seed, cap, threshold)
    if twin_cases:
        twin, twin_order = campaign(pc.fixed, seed, twin_cases, threshold)
        trial.twin_cases, trial.twin_findings = len(twin_order), len(twin.findings)
        trial.twin_drawn = twin_order
    trial.seconds = time.perf_counter() - t0
    return trial


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------
def censored_median(values: list[int | None]) -> float:
    """Median where None (not found within the cap) counts as larger than every number."""
    return statistics.median([math.inf if v is None else v for v in values])


def _fmt(v: float | int | None, cap: int) -> str:
    if v is None or v == math.inf:
        return f">{cap}"
    return f"{v:g}"


@dataclass
class ClassSummary:
    pc: PlantedClass
    trials: list[Trial]
    cap: int

    @property
    def harness_median(self) -> float:
        return censored_median([t.harness for t in self.trials])

    @property
    def random_median(self) -> float:
        return censored_median([t.random for t in self.trials])

    def ratio(self) -> str:
        """harness median / random median ('<' or '>' where one side was cut off at the cap)."""
        h, r = self.harness_median, self.random_median
        if h == math.inf and r == math.inf:
            return "-"
        if h == math.inf:
            return f">{self.cap / r:.2g}"
        if r == math.inf:
            return f"<{h / self.cap:.2g}"
        return f"{h / r:.2g}"

    @property
    def found_within_goal(self) -> bool:
        return all(t.harness is not None and t.harness <= GOAL_WITHIN for t in self.trials)

    @property
    def ratio_ok(self) -> bool:
        h, r = self.harness_median, self.random_median
        if self.pc.ties:
            if h == math.inf:
                return False
            return h * GOAL_TIE_GAIN <= (self.cap if r == math.inf else r)  # a miss counts as the cap
        return h <= GOAL_RATIO * r

    @property
    def simplest(self) -> int:
        return sum(t.simplest for t in self.trials)

    @property
    def twin_clean(self) -> bool:
        return all(t.twin_findings == 0 for t in self.trials)


def summarise(trials: list[Trial], classes: list[PlantedClass], cap: int) -> list[ClassSummary]:
    return [ClassSummary(pc, [t for t in trials if t.name == pc.name], cap) for pc in classes]


def table(summaries: list[ClassSummary], cap: int, twin_cases: int) -> list[str]:
    seeds = len(summaries[0].trials) if summaries else 0
    lines = [
        f"| class | trigger | harness cases (per seed) | harness median | random cases (per seed) | random median "
        f"| harness / random | simplest repro | twin clean ({seeds} x {twin_cases} cases) |",
        "|---|---|---|---:|---|---:|---:|---:|---|",
    ]
    for s in summaries:
        per = lambda attr: " / ".join(_fmt(getattr(t, attr), cap) for t in s.trials)  # noqa: E731
        twin = ("not run" if not twin_cases else "yes" if s.twin_clean
                else f"NO ({sum(t.twin_findings for t in s.trials)} findings)")
        lines.append(f"| {s.pc.name}{' (ties)' if s.pc.ties else ''} | {s.pc.trigger} | {per('harness')} "
                     f"| {_fmt(s.harness_median, cap)} | {per('random')} | {_fmt(s.random_median, cap)} "
                     f"| {s.ratio()} | {s.simplest}/{len(s.trials)} | {twin} |")
    return lines


def goals(summaries: list[ClassSummary], twin_cases: int = 1) -> list[str]:
    trials = [t for s in summaries for t in s.trials]
    n_simplest = sum(t.simplest for t in trials)
    missed = [s.pc.name for s in summaries if not s.found_within_goal]
    slow = [f"{s.pc.name} ({s.ratio()})" for s in summaries if not s.pc.ties and not s.ratio_ok]
    ties = [s for s in summaries if s.pc.ties]
    weak_ties = [f"{s.pc.name} ({s.ratio()})" for s in ties if not s.ratio_ok]
    dirty = [s.pc.name for s in summaries if not s.twin_clean]
    share = n_simplest / len(trials) if trials else 0.0

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return [
        f"- every class found within {GOAL_WITHIN} cases at every seed: {mark(not missed)}"
        + (f" (missed: {', '.join(missed)})" if missed else ""),
        f"- harness median <= {GOAL_RATIO:g}x random on every class: {mark(not slow)}"
        + (f" (over: {', '.join(slow)})" if slow else ""),
        f"- tie classes >= {GOAL_TIE_GAIN:g}x fewer cases than random: {mark(not weak_ties)}"
        + (f" (short: {', '.join(weak_ties)})" if weak_ties else ""),
        f"- repros that are the simplest trigger: {n_simplest}/{len(trials)} = {share:.0%} "
        f"(goal >= {GOAL_SIMPLEST:.0%}): {mark(share >= GOAL_SIMPLEST)}",
        f"- fixed twins with 0 findings: {sum(s.twin_clean for s in summaries)}/{len(summaries)}: "
        f"{mark(not dirty)}" + (f" (findings on: {', '.join(dirty)})" if dirty else "")
        if twin_cases else "- fixed twins with 0 findings: not run (--twin-cases 0)",
    ]


def not_simplest(summaries: list[ClassSummary]) -> list[str]:
    out = []
    for s in summaries:
        for t in s.trials:
            if t.repro is None or t.simplest:
                continue
            why = []
            if not t.expected_form:
                why.append(f"not the expected form ({s.pc.simplest_text})")
            if not t.one_minimal:
                why.append(f"a simpler neighbour still fails: {t.failing_neighbours[0]}")
            out.append(f"- {s.pc.name}, seed {t.seed}: `{t.repro.one_line()}`: {'; '.join(why)}")
    return out


DRAW_PROPERTIES: dict[str, Callable[[Any], bool]] = {
    "batch size 1": lambda c: c.batch_size == 1,
    "batch size >= 9": lambda c: c.batch_size >= 9,
    "every response 1 token": lambda c: set(c.seq_lens) == {1},
    "batch >= 2, all responses of one length": lambda c: c.batch_size >= 2 and len(set(c.seq_lens)) == 1,
    "left padding": lambda c: c.pad_side == "left",
    "left padding, unequal lengths": lambda c: c.pad_side == "left" and len(set(c.seq_lens)) > 1,
    "logit scale >= 10": lambda c: c.logit_scale >= 10,
}


def draw_table(summaries: list[ClassSummary]) -> list[str]:
    """What the generator drew: shares of the fixed twins' campaign cases (no failure, so no
    shrinking: generation and targeting only) with each property, in the first and second half of
    each campaign, against uniform random over the same axes (as many cases, same seeds)."""
    from ..strategies import uniform_cases

    first, second, uniform = [], [], []
    repeats = {"first": [], "second": [], "uniform": []}  # per case: same layout as the case before it?

    def layout(c: Any) -> tuple:
        return (c.pad_side, c.seq_lens, c.prompt_lens)

    def repeated(cases: list) -> list[bool]:
        return [False] + [layout(a) == layout(b) for a, b in zip(cases, cases[1:])]

    for s in summaries:
        for t in s.trials:
            drawn = t.twin_drawn
            half = (len(drawn) + 1) // 2
            rng = random.Random(t.seed)
            drawn_uniform = [uniform_cases(s.pc.fixed.axes, rng) for _ in drawn]
            first += drawn[:half]
            second += drawn[half:]
            uniform += drawn_uniform
            rep = repeated(drawn)
            repeats["first"] += rep[:half]
            repeats["second"] += rep[half:]
            repeats["uniform"] += repeated(drawn_uniform)
    if not uniform:
        return []

    def share(cases: list, prop: Callable) -> str:
        return f"{sum(map(prop, cases)) / len(cases):.0%}" if cases else "-"

    def rate(flags: list[bool]) -> str:
        return f"{sum(flags) / len(flags):.0%}" if flags else "-"

    lines = [f"| drawn case | harness, first half ({len(first)} cases) | harness, second half ({len(second)}) "
             f"| uniform random ({len(uniform)}) |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {share(first, p)} | {share(second, p)} | {share(uniform, p)} |"
              for name, p in DRAW_PROPERTIES.items()]
    lines.append(f"| same padding side and lengths as the case before | {rate(repeats['first'])} "
                 f"| {rate(repeats['second'])} | {rate(repeats['uniform'])} |")
    return lines


def plot(summaries: list[ClassSummary], cap: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [s.pc.name for s in summaries]
    y = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 2.0), layout="constrained")
    for off, attr, label, color in ((-0.18, "harness", "harness (campaign)", "tab:blue"),
                                    (0.18, "random", "uniform random", "tab:orange")):
        med = [min(censored_median([getattr(t, attr) for t in s.trials]), cap * 1.5) for s in summaries]
        ax.barh([i + off for i in y], [m - 0.7 for m in med], left=0.7, height=0.34, color=color, alpha=0.55,
                label=f"{label}, median")
        for i, s in enumerate(summaries):
            xs = [getattr(t, attr) for t in s.trials]
            ax.scatter([cap * 1.5 if v is None else v for v in xs], [i + off] * len(xs), color=color, s=14,
                       marker="o", zorder=3)
    ax.axvline(cap, color="grey", ls="--", lw=1, label=f"cap {cap} (dots right of it: not found)")
    ax.axvline(GOAL_WITHIN, color="green", ls=":", lw=1, label=f"goal: within {GOAL_WITHIN}")
    ax.set_xscale("log")
    ax.set_xlim(0.7, cap * 2)
    ax.set_yticks(y, [n + (" (ties)" if s.pc.ties else "") for n, s in zip(names, summaries)])
    ax.invert_yaxis()
    ax.set_xlabel("cases to the first finding (log; dots: seeds)")
    ax.set_title("Planted bugs: cases to first finding, harness vs uniform random")
    fig.legend(loc="outside lower center", ncol=2, fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
def detection(names: tuple[str, ...] = (), seeds: int = 3, cap: int = 300, twin_cases: int = 100,
              out: Path = Path("reports/BENCHMARKS.md"), plot_path: Path | None = DEFAULT_PLOT,
              threshold: float | None = None, log: Callable[[str], None] = lambda msg: None) -> list[ClassSummary]:
    """Run the detection benchmark, write its section (and the plot); returns the per-class summaries."""
    from ..bench import machine, write_section
    from ..env import threads_as
    from ..execute import DEFAULT_THRESHOLD

    threshold = DEFAULT_THRESHOLD if threshold is None else threshold
    classes = planted_classes(names)
    t0 = time.perf_counter()
    trials = []
    with threads_as(1):
        for pc in classes:
            for seed in range(1, seeds + 1):
                t = run_trial(pc, seed, cap, twin_cases, threshold)
                trials.append(t)
                log(f"  {pc.name} seed {seed}: harness {_fmt(t.harness, cap)}, random {_fmt(t.random, cap)}, "
                    f"simplest {t.simplest}, twin findings {t.twin_findings} ({t.seconds:.1f}s)")
        summaries = summarise(trials, classes, cap)
        info = machine()
    wall = time.perf_counter() - t0
    command = ["harness bench detection", f"--seeds {seeds}", f"--cap {cap}", f"--twin-cases {twin_cases}",
               *names]
    body = [
        "## Detection: planted bugs, harness vs uniform random",
        "",
        f"Command: `{' '.join(command)}` ({info}; {wall:.0f} s). Threshold {threshold:g}.",
        f"{len(classes)} planted bug classes (`harness/bench_detection/planted.py`, never registered), each a buggy",
        "op pair and its fixed twin over the axes a user of that op would declare (`Axes()` defaults plus",
        "what the op needs). Per class and seed (1..N): *harness* = cases a real campaign (`fuzz_pair`)",
        "evaluated up to and including its first failing case; *random* = the same for",
        f"`uniform_cases(axes, random.Random(seed))`; both capped at {cap} (`>{cap}`: not found). Medians",
        "count a miss as larger than any number. *simplest repro* = the shrunk finding has the class's",
        "expected minimal form and no simpler neighbour (`Case.simpler_neighbours()`) still fails.",
        f"Goals: every class within {GOAL_WITHIN} cases at every seed; harness median <= {GOAL_RATIO:g}x random;",
        f">= {GOAL_TIE_GAIN:g}x fewer on the tie classes; >= {GOAL_SIMPLEST:.0%} of repros simplest; twins clean.",
        "",
        *table(summaries, cap, twin_cases),
        "",
        "Goals:",
        *goals(summaries, twin_cases),
    ]
    odd = not_simplest(summaries)
    if odd:
        body += ["", "Repros that are not the simplest trigger:", *odd]
    draws = draw_table(summaries)
    if draws:
        body += ["", "What the generator drew: the fixed twins' campaigns (nothing fails, so no shrinking; every",
                 "class declares the default batch, length, padding and logit-scale axes), first and second half",
                 "of each campaign (Hypothesis's target phase starts at half of max_examples), against",
                 "`uniform_cases` over the same axes:", "", *draws]
    if plot_path is not None:
        p = plot(summaries, cap, plot_path)
        body += ["", f"Plot: `{p}`.", "", f"![detection]({_relative(p, out)})"]
    write_section(out, "detection", "\n".join(body))
    return summaries


def _relative(p: Path, out: Path) -> str:
    import os

    try:
        return os.path.relpath(Path(p).resolve(), Path(out).resolve().parent)
    except ValueError:
        return str(p)


@click.command("detection", help="Cases to the first finding of planted bugs, harness vs uniform random, "
               f"3 seeds, into reports/BENCHMARKS.md. Classes: {', '.join(CLASSES)}.")
@click.argument("names", nargs=-1, metavar="[CLASS ...]")
@click.option("--seeds", type=click.IntRange(1), default=3, show_default=True, help="Seeds 1..N per class.")
@click.option("--cap", type=click.IntRange(1), default=300, show_default=True,
              help="Cases each side may try before a class counts as not found.")
@click.option("--twin-cases", type=click.IntRange(0), default=100, show_default=True,
              help="Cases of each fixed twin's campaign per seed (0: skip the twins).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("reports/BENCHMARKS.md"), show_default=True,
              callback=check_out_file)
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=DEFAULT_PLOT, show_default=True)
def detection_command(names: tuple[str, ...], seeds: int, cap: int, twin_cases: int, out: Path,
                      plot_path: Path) -> None:
    summaries = detection(names, seeds, cap, twin_cases, out, plot_path,
                          log=lambda msg: click.echo(msg, err=True))
    click.echo("\n".join(table(summaries, cap, twin_cases) + [""] + goals(summaries, twin_cases)))
    click.echo(f"\nwritten to {out}" + (f" and {plot_path}" if plot_path else ""))
