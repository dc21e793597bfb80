"""The command line: `harness list | fuzz | replay | show | bench ...` (also `python -m harness`).

Exit codes: 0 nothing found (or a replay no longer diverges), 1 finding(s) (or a replay still
diverges), 2 usage or input error (a one-paragraph message, no traceback; `replay DIR`: some
repros skipped), 3 a finding could not be written to the corpus (printed as JSON instead), 125 a
repro that cannot be evaluated during a `git bisect run` (so bisect skips the commit), 130
interrupted by Ctrl-C or SIGTERM (every finding already made is on disk). README has the table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import click

from .clitypes import FiniteFloat
from .errors import CannotEvaluate, HarnessError, UsageError

MAX_STREAMS = 1024  # streams per pair: far past any machine's workers; a typo of 10000 would only start and stop

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_SKIP, EXIT_INTERRUPTED = 0, 1, 2, 125, 130
EXIT_UNSAVED = 3  # fuzz: a finding could not be written to the corpus (it was printed as JSON on stderr)
MAX_UNIFORM_PER_EXAMPLE = 1000  # (the uniform cases of an example are drawn before any deadline check)


POSITIVE = FiniteFloat(0, min_open=True)  # a float > 0 that is also finite


def plugin_option(fn: Callable) -> Callable:
    return click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE",
                        help="Load target pairs from a Python file or an importable module (repeatable).")(fn)


def load_plugins(plugins: tuple[str, ...]) -> None:
    from .pairs import REGISTRY

    REGISTRY.load_builtins()
    for spec in plugins:
        REGISTRY.load_plugin(spec)


def echo_err(msg: str) -> None:
    click.echo(msg, err=True)


class LazyGroup(click.Group):
    """A click group whose subcommands live in other modules, imported only when used.

    `lazy` maps a command name to "module:attribute". Commands whose module is not part of this
    installation are left out of the listing; one whose module fails to import says so when run.
    """

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def _available(self, name: str) -> bool:
        import importlib.util

        module = self.lazy[name].split(":")[0]
        return importlib.util.find_spec(module) is not None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | {n for n in self.lazy if self._available(n)})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy and name not in self.commands and self._available(name):
            import importlib

            module, attr = self.lazy[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)


# Subcommands defined beside the stage they belong to (name -> "module:attribute").
LAZY_COMMANDS = {
    "regressions": "harness.cli_tracking:regressions",
    "sync": "harness.cli_tracking:sync",
    "triage": "harness.triage:triage_command",
    "report": "harness.report:report_command",
    "score": "harness.score:score_command",
    "gpucheck": "harness.gpucheck:gpucheck_command",
    "rerecord": "harness.rerecord:rerecord_command",
    "shrink": "harness.reshrink:shrink_command",
}
LAZY_BENCHMARKS = {
    "overhead": "harness.bench:overhead_command",
    "xdist": "harness.bench:xdist_command",
    "neartie": "harness.bench_ops:neartie_command",
    "ops": "harness.bench_ops:ops_command",
    "models": "harness.bench_models:models_command",
    "tracking": "harness.cli_tracking:bench_tracking_command",
    "detection": "harness.bench_detection:detection_command",
    "metrics": "harness.bench_metrics:metrics_command",
}


@click.group(cls=LazyGroup, lazy=LAZY_COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trainer-rollout-harness", message="harness %(version)s")
def cli() -> None:
    """Differential fuzzing of trainer vs rollout numerics: find, shrink, record and replay
    divergences above a k3 threshold."""


# ---------------------------------------------------------------------------------------------
@cli.command("check")
@click.argument("pair_names", nargs=-1, required=True)
@click.option("--cases", type=click.IntRange(1), default=8, show_default=True,
              help="Cases drawn from each pair's axes (seeded: the check is deterministic).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--timeout", "timeouts", multiple=True, metavar="SECONDS|GLOB=SECONDS",
              help="Wall seconds one run of a case's paths may take before the pair FAILs as hung [default: 60, "
              "or the pair's own TargetPair(timeout=); the first run may take 300 for imports]; GLOB=SECONDS for the "
              "matching pairs (as `harness fuzz --timeout`).")
@click.option("--no-isolation", is_flag=True, help="Check in this process instead of a supervised worker (for "
              "debugging: no timeouts, and a crash of a target ends the check).")
@plugin_option
def check_command(pair_names: tuple[str, ...], cases: int, device: str, timeouts: tuple[str, ...],
                  no_isolation: bool, plugins: tuple[str, ...]) -> None:
    """Check pairs against the contract before fuzzing them (`harness.check_pair`): each case run twice
    (determinism), shapes, rows in case order, a row depending only on the tokens before it, input
    dependence. Each pair is checked in a worker process, every run of a case's paths under the
    per-case timeout (a hang or a crash is a FAIL). Exit 1 when a pair breaks it (each violation
    named), 2 for bad input."""
    from .env import resolve_device
    from .errors import HarnessError
    from .pairs import REGISTRY

    if not no_isolation:
        from .worker import start_fork_server

        start_fork_server()
    try:
        load_plugins(plugins)
        pairs = REGISTRY.select(pair_names)
        dev = resolve_device(device)
        default_timeout, per_pair = parse_timeouts(timeouts, pairs)
    except HarnessError as e:
        echo_err(f"error: {e}")
        sys.exit(EXIT_USAGE)
    from .fuzz import CampaignConfig

    limits = CampaignConfig(pairs=pairs, timeout=default_timeout, timeouts=per_pair)
    failed, cannot, done = [], [], set()
    worker = None
    if not no_isolation:
        from .worker import Worker

        worker = Worker(device=dev, plugins=plugins)
    try:
        for pair in pairs:
            if dev not in pair.devices:
                click.echo(f"{pair.name}: skipped (runs on {', '.join(pair.devices)}, not {dev})")
                done.add(pair.name)
                continue
            timeout = limits.timeout_for(pair.name, pair.timeout)
            echo_err(f"checking {pair.name} ({cases} cases"  # (a model pair's cases take seconds: say what runs)
                     + (", after the worker process's imports" if worker is not None and not done else "") + ") ...")
            verdict, text, warned = _check_one(pair, cases, dev, worker, timeout)
            done.add(pair.name)
            if verdict == "PASS":
                click.echo(f"{pair.name}: PASS ({text} cases)")
            elif verdict == "CANNOT":
                cannot.append(pair.name)
                click.echo(f"{pair.name}: CANNOT RUN here: {text}")
            else:
                failed.append(pair.name)
                click.echo(f"{pair.name}: FAIL\n{text}")
            for w in warned:
                echo_err(f"warning: {pair.name}: {w}")
    except KeyboardInterrupt:
        left = [p.name for p in pairs if p.name not in done]
        echo_err(f"interrupted: {len(left)} pair(s) not checked: {', '.join(left)}"
                 + (f"; {len(failed)} broke the contract: {', '.join(failed)}" if failed else ""))
        sys.exit(130)
    finally:
        if worker is not None:
            worker.close()
    if failed:
        echo_err(f"{len(failed)} pair(s) break the contract: {', '.join(failed)}; fix them before fuzzing (a broken "
                 "pair's findings say nothing of its paths).")
    sys.exit(EXIT_FOUND if failed else EXIT_USAGE if cannot else EXIT_OK)


CHECK_PROGRESS_SECONDS = 20.0  # `harness check` says how far a pair's check got at most this often


def _check_one(pair: Any, cases: int, dev: str, worker: Any, timeout: float) -> tuple[str, str, list[str]]:
    """(verdict, text, warnings) of one pair's contract check: in `worker` (timed, see `Worker.check`),
    or in this process without one. A hang or a crash of a run is a FAIL that says where it was."""
    if worker is None:
        from .conformance import check_verdict

        return check_verdict(pair, cases, dev)
    from .fuzz import Executor, stack_where

    cold = max(timeout, Executor.COLD_START_TIMEOUT)
    said = [0.0]

    def progress(runs: int, seconds: float) -> None:  # (a real-vocabulary pair's check takes minutes)
        if seconds - said[0] >= CHECK_PROGRESS_SECONDS:
            said[0] = seconds
            echo_err(f"  {pair.name}: {runs} run(s) of its paths in {seconds:.0f} s (each case runs twice, then "
                     "derived cases: other inputs, the sequences permuted, a response truncated)")

    verdict, text, warned, stack = worker.check(pair, cases, timeout, cold, progress)
    if verdict == "TIMEOUT":
        first = not text
        text = (f"  {text or 'before its first case'}: "
                + (f"the pair did not load and run its first case within {cold:g} s (imports, compilation and the "
                   "first run)" if first else f"a run of the case's paths (build, rollout, trainer) did not return "
                   f"within {timeout:g} s")
                + f": a hang? If the pair is just slow, raise it: `harness check --timeout '{pair.name}=SECONDS'` (or "
                f"TargetPair(timeout=SECONDS)). Where it was: {stack_where(stack) if stack else '(no stack written)'}")
        verdict = "FAIL"
    elif verdict == "CRASH":
        text = (f"  {text}: a run of the case's paths killed the process (a segfault or abort in a kernel, the "
                f"OOM killer, an exit)" + (f". Where it was: {stack_where(stack)}" if stack.strip() else ""))
        verdict = "FAIL"
    return verdict, text, warned


# ---------------------------------------------------------------------------------------------
@cli.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the registry as JSON.")
@plugin_option
def list_cmd(as_json: bool, plugins: tuple[str, ...]) -> None:
    """List the registered target pairs."""
    from .execute import DEFAULT_THRESHOLD
    from .pairs import REGISTRY

    load_plugins(plugins)
    pairs = REGISTRY.all()
    if as_json:
        click.echo(json.dumps([
            {"name": p.name, "kind": p.kind, "expected": p.expected, "verdict_over": p.verdict_over,
             "devices": list(p.devices), "threshold": p.threshold, "timeout": p.timeout,
             "axes": p.axes.describe(), "readout": p.readout.vocab if p.readout else None,
             "description": p.description, "source": p.source}
            for p in pairs], indent=2))
        return
    rows = [("pair", "kind", "expected", "devices", "axes")]
    for p in pairs:
        axes = p.axes.describe()
        ax = ", ".join(k for k in axes if k not in ("dtypes",))
        # (a model pair runs the precisions its paths name, not the case's dtype, unless it draws several)
        if p.kind != "model" or len(axes["dtypes"]) > 1:
            ax += f"; dtypes {'/'.join(axes['dtypes'])}"
        # (the verdict's means; a line of the pair's own, which `--threshold` leaves as it is)
        notes = (["per sequence"] if p.verdict_over == "sequence" else []) + (
            [f"own line {p.threshold:g}"] if p.threshold is not None else [])
        expected = p.expected + (f" ({', '.join(notes)})" if notes else "")
        rows.append((p.name, p.kind, expected, ",".join(p.devices), ax))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    own = sum(p.threshold is not None for p in pairs)
    click.echo(f"\n{len(pairs)} pair(s)"
               + (f"; {own} judged at a line of their own (TargetPair(threshold=)), the rest at the campaign's "
                  f"--threshold (default {DEFAULT_THRESHOLD:g})" if own else "")
               + ". `harness list --json` shows bounds and descriptions."
               + ("" if plugins else " Pairs of your own file are listed with `--plugin path/to/file.py` (or MODULE)."))


# ---------------------------------------------------------------------------------------------
def parse_shard(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise UsageError(f"--shard {value!r} must look like i/N, e.g. 1/4 (the first of four shards).") from None
    if n < 1:
        raise UsageError(f"--shard {value!r}: N = {n} shards; the number of shards must be at least 1 (i/N: job i of N, "
                         "counting from 1).")
    if not 1 <= i <= n:
        raise UsageError(f"--shard {value!r}: i = {i} must lie between 1 and N = {n} (job i of N, counting from 1; "
                         "N at least 1).")
    return i, n


@cli.command()
@click.argument("pair_names", nargs=-1, metavar="[PAIR|GLOB]...")
@click.option("--pairs", "pair_options", multiple=True, metavar="PAIR|GLOB",
              help="A pair or glob to fuzz, as the arguments (repeatable; `gpucheck`'s spelling).")
@click.option("--max-examples", type=click.IntRange(1), default=None,
              help="Hypothesis examples per pair (before shrinking); each is followed by uniform random cases "
              "(--uniform-per-example), so a pair runs about 4x this many cases on op pairs, 2x on model pairs  "
              "[default: 100, or the profile's]")
@click.option("--budget", type=POSITIVE, default=None,
              help="Wall seconds for the whole campaign, split over the pairs (shrinking included). Without "
              "--max-examples or --profile the budget is filled: once every pair has run its examples, the "
              "time left goes to the pairs that found nothing, as further freshly seeded rounds.")
@click.option("--seed", type=click.IntRange(0), default=None, help="Campaign seed (default: fresh, printed).")
@click.option("--threshold", "thresholds", multiple=True, metavar="K3|GLOB=K3",
              help="The line a case's judged k3 (expected k3) or exact KL must stay under (default 0.001). "
              "GLOB=K3: the matching pairs' own line (repeatable), over a pair's own TargetPair(threshold=...), "
              "which a plain K3 leaves as it is.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--corpus", "corpus_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("corpora"), show_default=True, help="Where repros are written.")
@click.option("--shard", default=None, metavar="i/N", help="Fuzz only this shard's share of the pairs.")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, "
              "else sqlite:///<abs>/reports/mlflow.db).")
@click.option("--no-tracking", is_flag=True, help="Do not log to MLflow (the corpus is still written).")
@click.option("--profile", default=None, type=click.Choice(["dev", "ci", "nightly"]),
              help="Named settings (harness/profiles.py) for what is not given explicitly: cases and seconds "
              "per pair, seed policy (nightly: seed derived from $HARNESS_RUN_ID or $GITHUB_RUN_ID).")
@click.option("--timeout", "timeouts", multiple=True, metavar="SECONDS|GLOB=SECONDS",
              help="Per-case wall seconds before a case is a `timeout` finding [default: 60; a pair registered "
              "with its own TargetPair(timeout=) keeps that]; GLOB=SECONDS sets it for the matching pairs, their "
              "own included (repeatable).")
@click.option("--no-isolation", is_flag=True, help="Run cases in this process instead of a supervised worker "
              "(for debugging: no timeouts, and a crash of a target ends the campaign).")
@click.option("--streams", type=click.IntRange(1, MAX_STREAMS), default=1, show_default=True,
              help="Independently seeded streams per pair (each runs its share of the cases); --shard spreads them.")
@click.option("--uniform-per-example", type=click.IntRange(0, MAX_UNIFORM_PER_EXAMPLE), default=None,
              help="Uniform random cases run after each Hypothesis example [default: 3 for op pairs, 1 for model "
              "pairs]; 0 leaves the search to Hypothesis alone.")
@plugin_option
def fuzz(pair_names: tuple[str, ...], pair_options: tuple[str, ...], max_examples: int | None, budget: float | None,
         seed: int | None,
         thresholds: tuple[str, ...], device: str, corpus_dir: Path, shard: str | None, tracking_uri: str | None,
         no_tracking: bool, profile: str | None, timeouts: tuple[str, ...], no_isolation: bool, streams: int,
         uniform_per_example: int | None, plugins: tuple[str, ...]) -> None:
    """Fuzz pairs (none named: the pairs of the --plugin files given, else every registered pair); shrink and
    record what diverges."""
    from .env import resolve_device
    from .fuzz import NOT_HERE, CampaignConfig, caught_elsewhere_maybe, run_campaign, setup_reason, summary_table
    from .pairs import REGISTRY, is_glob
    from .corpus import replay_command_for, shrink_command_for
    from .tracking import make_tracker

    terminate_like_ctrl_c()
    from .corpus import check_limits

    check_limits()  # a mistyped HARNESS_MAX_* stops here, not at the first corpus file it refuses
    from .worker import memory_limits, start_fork_server

    memory_limits()  # ... and a mistyped HARNESS_WORKER_*_MB, not in the middle of the campaign
    if not no_isolation:
        start_fork_server()  # (its imports run beside the target modules' below)
    load_plugins(plugins)
    dev = resolve_device(device)
    pair_names = (*pair_names, *pair_options)
    chosen, note = REGISTRY.select_default(pair_names)
    if note:
        echo_err(note)
    pairs = [p for p in chosen if dev in p.devices]
    if not pairs:
        raise UsageError(f"none of the selected pairs runs on {dev}; run `harness list` to see their devices.")
    from .fuzz import campaign_units
    from .profiles import campaign_settings

    n_units = len(campaign_units(pairs, streams, parse_shard(shard)))
    if not n_units:  # a shard the split left empty (more CI jobs than pairs x streams): nothing to run, not an error
        i, n = parse_shard(shard)
        click.echo(f"shard {i}/{n} got no pair of this selection ({len(pairs)} pair(s) x {streams} stream(s) for {n} "
                   "shards): nothing to run here, exit 0")
        return
    s = campaign_settings(profile, max(1, -(-n_units // streams)), max_examples, budget, seed)
    default_timeout, per_pair = parse_timeouts(timeouts, pairs)
    threshold, own_lines = parse_thresholds(thresholds, pairs)
    from .profiles import shard_seed_warning

    if shard_seed_warning(parse_shard(shard), s.seed):
        echo_err(shard_seed_warning(parse_shard(shard), s.seed))
    if profile:
        echo_err(f"profile {profile}: {s.max_examples} examples per pair"
                 + (" per round, rounds until the budget" if s.fill_budget else "") + f", budget {s.budget}s, {s.origin}")
    cfg = CampaignConfig(pairs=pairs, seed=s.seed, max_examples=s.max_examples, budget=s.budget,
                         threshold=threshold, thresholds=own_lines, device=dev, corpus=corpus_dir,
                         shard=parse_shard(shard), profile=profile, isolation=not no_isolation,
                         timeout=default_timeout, timeouts=per_pair,
                         plugins=tuple(plugins), streams=streams, uniform_per_example=uniform_per_example,
                         fill_budget=s.fill_budget)
    from .corpus import new_corpus_note

    corpus_note = new_corpus_note(corpus_dir)
    if corpus_note:
        echo_err(corpus_note)
    tracker = make_tracker(tracking_uri, enabled=not no_tracking, log=echo_err, night=s.night)

    def announce(f: Any) -> None:
        state = f.state
        notes = ("" if f.shrink_complete else
                 f" (shrinking cut short by the {'interrupt' if getattr(f, 'interrupted', False) else 'budget'}" +
                 (f": `{shrink_command_for(f.pair, f.path, tracking_uri, tracking=not no_tracking)}` goes on)"
                  if f.path and f.new else ")")) + \
            ("" if f.deterministic else " (not deterministic: may not replay)")
        echo_err(f"  finding [{f.status}, {state}] {f.pair}: {f.symptom.value}, {f.evaluation.headline}, minimal case "
                 f"{f.case.one_line()}{notes}\n    replay: "
                 + (replay_command_for(f.pair, f.path) if f.path else "(not written: saved as JSON on stderr above)"))
        sev = getattr(f, "severe", None)
        if sev:
            times = ("a sampled token one path gives probability 0" if sev.peak == float("inf") else
                     f"{sev.peak / max(f.evaluation.score, 1e-300):.0f}x this one")
            echo_err(f"    severe: its cases reached {sev.peak:.3g}, {times}; its worst, shrunk keeping {sev.keeping}: {sev.case.one_line()} "
                     f"({sev.headline}): most often this bug where it is worst, a second one where triage names "
                     "another component or module"
                     + (": `" + replay_command_for(f.pair, f.path).replace("harness replay", "harness triage --severe", 1)
                        + "`" if f.path else ""))

    from .fuzz import share_threads_among_campaigns

    threads = share_threads_among_campaigns(isolated=not no_isolation)
    if threads is not None:  # (said: a repro records it, and a user comparing cases/s should know)
        echo_err(f"torch threads per case: {threads} (one core left for the campaign beside its worker process; "
                 "OMP_NUM_THREADS=N chooses)")
    result = run_campaign(cfg, tracker=tracker, on_finding=announce)
    click.echo(summary_table(result))
    n = len(result.findings)
    click.echo(f"\n{result.examples} cases in {result.seconds:.1f}s, {n} finding(s); seed {result.seed}.")
    peaks = sorted(((r.worker_peak_mib, r.pair) for r in result.results if r.worker_peak_mib), reverse=True)
    if peaks:  # (what sizing a machine for these pairs needs; the campaign process itself holds no model)
        click.echo("worker memory (peak resident while a pair's cases ran): "
                   + ", ".join(f"{p} {m:.0f} MiB" for m, p in peaks[:4]) + (f", ... ({len(peaks)} pairs)"
                                                                             if len(peaks) > 4 else ""))
    elsewhere = [r.pair for r in result.results if caught_elsewhere_maybe(r, cfg)]  # other streams: other shards'
    if elsewhere:
        click.echo(f"{NOT_HERE} ({cfg.shard[0]}/{cfg.shard[1]}): {', '.join(elsewhere)}; the other "
                   "shards run the rest of each pair's streams, so a demonstration is missed only if no shard caught "
                   "it (compare their summaries)")
    missed = [r.pair for r in result.results if r.verdict == "MISSED" and r.pair not in elsewhere]
    if missed:
        from .fuzz import missed_hint

        hints = "; ".join(f"{r.pair} ({missed_hint(r, cfg.threshold_of(r.pair), REGISTRY.get_loaded(r.pair))})"
                          for r in result.results if r.pair in missed)
        click.echo(f"missed demonstration(s): {len(missed)} of {sum(r.expected == 'diverges' for r in result.results)}"
                   f" not caught: {hints}")
        click.echo(f"warning: demonstration pair(s) not caught: {hints}", err=True)
    unfinished = [r.pair for r in result.results if r.verdict == "UNFINISHED"]
    if unfinished:
        click.echo(f"unfinished: {', '.join(unfinished)}: a first case never came back before the budget ended (a hang, "
                   "or a cold start longer than the budget allows; see the lines above); exit 1 as for a finding")
    cannot = [r for r in result.results if r.verdict == "CANNOT RUN"]
    reasons: dict[str, list[str]] = {}  # (pairs of one broken checkpoint: one paragraph, naming them all)
    for r in cannot:
        reasons.setdefault(setup_reason(r.pair, r.setup_error), []).append(r.pair)
    for why, names in reasons.items():
        click.echo(f"error: {names[0]} cannot run here: {why}" if len(names) == 1 else
                   f"error: {len(names)} pairs cannot run here ({', '.join(names)}), each for the same reason: {why}",
                   err=True)
    # a campaign over every pair, or a glob, that a broken plugin package left pairs out of: as a pair
    # that cannot run, not a pass (pairs named one by one ran as asked: the warning above said it)
    every = not pair_names or any(is_glob(p) for p in pair_names)
    broken = list(REGISTRY.broken_entry_points.values()) if every else []
    for why in broken:
        click.echo(f"error: {why}; none of its pairs was fuzzed.", err=True)
    cannot = cannot + broken
    if result.unsaved:
        click.echo(f"error: {len(result.unsaved)} finding(s) could not be written to {corpus_dir} (each was printed "
                   f"as JSON on stderr): {', '.join(f.id for f in result.unsaved)}.", err=True)
    if result.interrupted:
        click.echo("interrupted: the findings above are on disk." if not result.unsaved else "interrupted.", err=True)
    if result.unsaved:
        sys.exit(EXIT_UNSAVED)
    if result.interrupted:
        sys.exit(EXIT_INTERRUPTED)
    if not n and not unfinished and not cannot and not result.examples and result.results:
        click.echo(f"error: no case ran: the campaign ended before any pair's first case came back (budget "
                   f"{cfg.budget}s for {len(result.results)} pair(s)); give it more time (--budget) or fewer pairs. "
                   "Nothing was tested, so this is not a pass.", err=True)
        sys.exit(EXIT_USAGE)
    if cannot and not n and not unfinished:  # (a finding outranks it: it is on disk, to triage)
        sys.exit(EXIT_USAGE)
    sys.exit(EXIT_FOUND if n or unfinished else EXIT_OK)


def terminate_like_ctrl_c() -> None:
    """SIGTERM (CI timeouts, Slurm, `kill`) ends a campaign as Ctrl-C does: findings on disk, exit 130."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def parse_timeouts(values: tuple[str, ...] | list[str], pairs: list, option: str = "--timeout",
                   require_match: bool = True) -> tuple[float, dict[str, float]]:
    """`--timeout 30` (every pair) and `--timeout 'model.*=300'` (the matching pairs)."""
    from .worker import DEFAULT_TIMEOUT

    return parse_per_pair(values, pairs, option, DEFAULT_TIMEOUT, "SECONDS", ("30", "model.*=300"), require_match)


def parse_thresholds(values: tuple[str, ...] | list[str], pairs: list, option: str = "--threshold",
                     require_match: bool = True) -> tuple[float, dict[str, float]]:
    """`--threshold 0.002` (every pair without a line of its own) and `--threshold 'quant.*=0.01'`
    (the matching pairs, whatever their own line)."""
    from .execute import DEFAULT_THRESHOLD

    return parse_per_pair(values, pairs, option, DEFAULT_THRESHOLD, "K3", ("0.002", "quant.*=0.01"), require_match)


def _replay_lines(values: tuple[str, ...], pair_names: list[str]) -> Callable[[str], float | None]:
    """`replay --threshold`: the line a repro of each pair is judged at (None: the one it was recorded at)."""
    from types import SimpleNamespace

    default, per_pair = parse_thresholds(values, [SimpleNamespace(name=n) for n in sorted(set(pair_names))])
    plain = any("=" not in str(v) for v in values)  # (a K3 for every repro; else only the GLOBs' pairs move)
    return lambda name: per_pair.get(name, default if plain else None)


def parse_per_pair(values: tuple[str, ...] | list[str], pairs: list, option: str, default: float, unit: str,
                   examples: tuple[str, str], require_match: bool = True) -> tuple[float, dict[str, float]]:
    """`OPTION X` (the default) and `OPTION 'GLOB=X'` (the matching pairs), X a finite number > 0."""
    import fnmatch

    per_pair: dict[str, float] = {}
    for v in values:
        glob, _, text = str(v).rpartition("=")
        try:
            t = float(text)
        except ValueError:
            t = float("nan")
        if not (t > 0 and t != float("inf")):
            raise UsageError(f"{option} {v!r}: {text!r} is not a finite number > 0; write {option} {unit} or {option} "
                             f"'GLOB={unit}' with {unit} > 0, e.g. {option} {examples[0]} or {option} '{examples[1]}'.")
        if not glob and "=" in str(v):  # `=30`: a GLOB left out (a shell variable that was empty?)
            raise UsageError(f"{option} {v!r} has an empty GLOB before '='; write {option} {text} for every pair, or "
                             f"{option} 'GLOB={text}' for the pairs GLOB matches.")
        if not glob:
            default = t
            continue
        hits = [p.name for p in pairs if fnmatch.fnmatchcase(p.name, glob)]
        if not hits and require_match:
            raise UsageError(f"{option} {v!r}: no selected pair matches {glob!r}, so it would change nothing; run "
                             "`harness list` to see the pairs (with the plugin option for a plugin's), then fix the "
                             "GLOB or select the pairs it names.")
        per_pair.update((h, t) for h in hits)
    return default, per_pair


# ---------------------------------------------------------------------------------------------
def in_bisect() -> bool:
    """True while a `git bisect` is in progress in the repository of the working directory."""
    try:
        path = subprocess.run(["git", "rev-parse", "--git-path", "BISECT_START"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(path) and Path(path).exists()


@cli.command()
@click.argument("files", nargs=-1, type=click.Path(path_type=Path))
@click.option("--run-id", default=None, help="Fetch the repro from this MLflow regression run instead.")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI for --run-id.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--threshold", "thresholds", multiple=True, metavar="K3|GLOB=K3",
              help="Judge at this line instead of the one each repro was recorded at; GLOB=K3 for the repros of the "
                   "matching pairs (repeatable, as `harness fuzz --threshold`).")
@click.option("--bisect/--no-bisect", "bisect", default=None,
              help="Exit 125 when a repro cannot be evaluated (default: only during a git bisect).")
@click.option("--timeout", type=POSITIVE, default=None,
              help="Per-case timeout in seconds for crash and timeout repros (replayed in a worker process; "
                   "default: the timeout the repro was found under, else 60).")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@plugin_option
def replay(files: tuple[Path, ...], run_id: str | None, tracking_uri: str | None, device: str,
           thresholds: tuple[str, ...], bisect: bool | None, timeout: float | None, as_json: bool,
           plugins: tuple[str, ...]) -> None:
    """Replay repro files (or folders of them): exit 1 if any still diverges, 0 if none does.

    A file that does not load (damaged, out of bounds) or whose pair cannot be loaded here is skipped
    with its reason and the rest are replayed; the exit is then 2 (125 under --bisect) unless one
    still diverges. A repro recorded from a plugin file inside this repository loads that file.
    A crash or timeout repro runs in a worker process: one that still crashes or hangs exits 1."""
    from .corpus import (CLOSE_FLAGS_HINT, Skipped, _display, load_many_tolerant, load_plugin_for, missing_repro,
                         replay as do_replay, severe_note)
    from .env import machine_differences, resolve_device
    from .execute import headline
    from .metrics import verdict_mean

    bisect = in_bisect() if bisect is None else bisect
    cannot = EXIT_SKIP if bisect else EXIT_USAGE
    try:
        if not files and not run_id:
            raise UsageError("replay needs at least one repro FILE (or folder), or --run-id ID.")
        missing = [str(f) for f in files if not Path(f).exists()]
        repros, skipped = load_many_tolerant(f for f in files if Path(f).exists())
        skipped = [Skipped(Path(m), missing_repro(Path(m))) for m in missing] + skipped
        if run_id:
            from .tracking import fetch_repro

            repros.append(fetch_repro(run_id, tracking_uri))
        if not repros and not skipped:
            raise UsageError(f"no repro files found in {', '.join(map(str, files))}.")
        try:
            load_plugins(plugins)
        except UsageError as e:
            raise CannotEvaluate(str(e)) from None
        dev = resolve_device(device)
        line_of = _replay_lines(thresholds, [r.pair for r in repros])
    except HarnessError as e:
        echo_err(f"error: {e}")
        sys.exit(cannot)
    results = []
    for r in repros:
        threshold = line_of(r.pair)
        why = load_plugin_for(r)
        if why is not None:
            skipped.append(Skipped(r.path, f"repro {r.path or r.id} cannot be replayed here: {why}."))
            continue
        try:
            results.append(do_replay(r, dev, threshold, timeout=timeout, plugins=plugins, warn=as_json))
        except HarnessError as e:
            skipped.append(Skipped(r.path, str(e)))
    if len(skipped) == 1 and not results:  # one repro asked for, and it cannot be replayed
        echo_err(f"error: {skipped[0].reason}")
    else:
        for s in skipped:
            echo_err(f"skipped {s.path}: {s.reason}")
    out = []
    for res in results:
        r, ev = res.repro, res.evaluation
        verdict = ev.symptom.value if ev.failed else "clean"
        rec_k3 = r.metrics.get("k3_kl")
        elsewhere = machine_differences(r.environment, dev)
        beyond = res.beyond_noise() if elsewhere else {}
        threshold = line_of(r.pair)
        moved = threshold is not None and threshold != r.threshold  # (--threshold: only the line moved, not the paths)
        now_fixed = res.compared and not res.bit_for_bit and not ev.failed and r.status == "open" \
            and not res.nondeterministic and not moved  # (an open repro of a fixed bug: its metrics moved as a fix moves them)
        line = (f"{r.path or r.id}: pair {r.pair} [{r.status}] recorded {r.symptom} {headline(r.metrics, r.error)} "
                f"-> now {verdict} {ev.headline_like(r.metrics)}"
                + (f" (judged at --threshold {threshold:g}; recorded at {r.threshold:g}: a verdict that differs from the "
                   "recorded one says where the line is, not that the paths changed)" if moved else "")
                + "; bit-for-bit "
                + (f"no: it no longer fails (fixed? once it is: `{r.close_command(given_flags=_plugin_flags(r, plugins))}`"
                   f", {CLOSE_FLAGS_HINT})" if now_fixed else
                   "yes" if res.compared and res.bit_for_bit else "no" if res.compared else
                   ("not compared (its case was edited since it was recorded: the recorded metrics are another "
                    "case's; " + (f"`harness rerecord{_plugin_flags(r, plugins)} "
                                  f"{_display(r.path) if r.path else 'FILE'}` records this case's)" if ev.failed else
                                  "this case passes, which rerecord refuses (a repro holds a failure): restore its "
                                  "case from git)")) if r.case_edited else
                   "not compared (a fixed repro that replays clean: its recorded metrics are the bug's)"))
        if not res.bit_for_bit and not now_fixed:
            line += " (" + ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in
                                     ((k, *v) for k, v in list(res.mismatches.items())[:4])) + ")"
            if res.nondeterministic:  # no replay reproduces its metrics: only its failure is compared
                failure = res.failure_mismatches()
                line += ("\n  recorded as not deterministic (its pair gave other values on this case when it was "
                         "found): its metrics were one draw; " + (
                             "it fails the way it was recorded" if not failure else
                             "this draw came back clean" if not ev.failed else
                             "it now fails another way (" + ", ".join(sorted(failure)) + ")"))
            elif elsewhere:
                line += ("\n  recorded on another machine or software (" + "; ".join(elsewhere) + "): " + (
                    "last-bit differences are expected there, and these are within them" if not beyond else
                    "these differ beyond last bits (" + ", ".join(sorted(beyond)[:4]) + "): a change to look at"))
        if not r.metrics and not r.error and ev.failed and r.path:  # (cut from the file, or never written)
            line += (f"\n  the file holds no recorded metrics, so nothing replays bit for bit against them: "
                     f"`harness rerecord --accept-changes{_plugin_flags(r, plugins)} {_display(r.path)}` records this "
                     "case's")
        if res.weights:
            line += f"\n  warning: {res.weights}"
        if r.status == "fixed" and ev.failed:  # (as the corpus test says it: a regression, not a known bug)
            line += "\n  this repro was closed as fixed and fails again: the bug is back (the corpus test fails on it)"
        severe = _severe_still(r, dev) if now_fixed else None
        if severe is not None:
            line += f"\n  but {severe_note(severe)}"
        recorded_pkg = r.loader.get("package") if r.loader.get("kind") == "entry_point" else None
        if recorded_pkg:
            from .corpus import entry_point_package

            now_pkg = entry_point_package(r.loader.get("name", ""))
            if now_pkg and now_pkg != recorded_pkg:  # (its pair's code changed since: a change to look at)
                line += f"\n  note: its pair's package was {recorded_pkg} when recorded, {now_pkg} now"
        if ev.error:
            line += f"\n  {ev.error['type']}: {ev.error['message']}"
        d = ev.divergence
        now = {**(d.as_dict() if d is not None else {}), "fired": getattr(d, "fired", "")}
        out.append({"file": str(r.path) if r.path else None, "id": r.id, "pair": r.pair, "status": r.status,
                    "recorded_symptom": r.symptom, "symptom": ev.symptom.value,
                    # the mean the verdict read (`fired` says which crossed the line), then the sampled k3
                    "verdict_mean": list(verdict_mean(now)) if d is not None else None,
                    "recorded_verdict_mean": list(verdict_mean(r.metrics)) if r.metrics else None,
                    "fired": now["fired"], "k3_expected": now.get("k3_expected"), "kl": now.get("kl"),
                    "k3": ev.k3, "recorded_k3": rec_k3, "bit_for_bit": res.bit_for_bit if res.compared else None,
                    "case_edited": r.case_edited, "weights_changed": bool(res.weights),
                    "recorded_elsewhere": elsewhere, "beyond_noise": sorted(beyond) if elsewhere else None,
                    "nondeterministic": res.nondeterministic,
                    "severe_still_fails": None if severe is None else f"{severe.symptom.value} {severe.headline}",
                    "mismatches": {k: [str(a), str(b)] for k, (a, b) in res.mismatches.items()}})
        if not as_json:
            click.echo(line)
    if as_json:
        out += [{"file": str(s.path) if s.path else None, "skipped": s.reason} for s in skipped]
        from .corpus import encode_tree

        # (strict JSON: an infinite k3, a sampled token the trainer excludes, is the string "inf", as in
        # repro files and `harness score`'s summary, not a bare Infinity that JSON parsers refuse)
        click.echo(json.dumps(encode_tree(out), indent=2, default=str, allow_nan=False))
    if skipped and not as_json and (results or len(skipped) > 1):
        echo_err(f"{len(skipped)} repro(s) skipped, {len(results)} replayed.")
    if any(res.diverges for res in results):
        sys.exit(EXIT_FOUND)
    sys.exit(cannot if skipped else EXIT_OK)


def _plugin_flags(repro: Any, plugins: tuple[str, ...] = ()) -> str:
    """The --plugin flags a printed command needs: the ones this command was given, as the user typed
    them (a repro found in another checkout records that one's path), else the repro's own."""
    from .corpus import plugin_flags

    return plugin_flags(plugins or ([repro.plugin_spec()] if repro.plugin_spec() else []))


def _severe_still(repro: Any, device: str) -> Any:
    """A repro's severe case run now, when it still fails (else None, also when it cannot run here)."""
    from .corpus import replay_severe

    try:
        ev = replay_severe(repro, device)
    except HarnessError:
        return None
    return ev if ev is not None and ev.failed else None


def _fmt(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def parse_case(text: str) -> Any:
    """A case from the command line: a JSON object, a `.json` file holding a case or a repro (its
    `case`), or the one-line form the harness prints (`seed=3 seq_lens=[1, 1] prompt_lens=[4, 4]
    pad_side='left'`; each value a Python literal, read with `ast.literal_eval`: nothing is executed)."""
    import ast
    import dataclasses
    import re

    from .case import Case, CaseError

    where = "--case"
    body = text.strip()
    if not body.startswith("{") and body.endswith(".json"):
        try:
            data = json.loads(Path(body).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--case {text!r}: the file could not be read as JSON ({e}); give a case as JSON, a "
                             ".json file holding a case or a repro, or the one-line form the harness prints "
                             "(seed=3 seq_lens=[1, 1] ...).") from None
        where = body
        data = data.get("case", data) if isinstance(data, dict) else data
    elif body.startswith("{"):
        try:
            data = json.loads(body)
        except ValueError as e:
            raise UsageError(f"--case: not valid JSON ({e}); quote the object for the shell, or give the one-line "
                             "form the harness prints (seed=3 seq_lens=[1, 1] ...).") from None
        data = data.get("case", data) if isinstance(data, dict) else data
    else:
        names = [f.name for f in dataclasses.fields(Case)]
        unknown = sorted({m.group(1) for m in re.finditer(r"(?:^|\s)(\w+)=", body)} - set(names))
        if unknown:
            raise UsageError(f"--case: {', '.join(unknown)} {'is not a case field' if len(unknown) == 1 else 'are not case fields'}"
                             f"; the fields are {', '.join(names)}.")
        marks = list(re.finditer(r"(?:^|\s)(" + "|".join(names) + r")=", body))
        twice = sorted({m.group(1) for m in marks if [x.group(1) for x in marks].count(m.group(1)) > 1})
        if twice:
            raise UsageError(f"--case gives {', '.join(twice)} more than once; give each field once.")
        if not marks or marks[0].start() > 0:
            raise UsageError(f"--case {text!r} is not a case: give JSON, a .json file, or the one-line form the "
                             f"harness prints, `name=value` for fields among {', '.join(names)} (seed=3 seq_lens=[1, 1]).")
        data = {"schema": 2}
        for m, nxt in zip(marks, [*marks[1:], None]):
            raw = body[m.end():nxt.start() if nxt is not None else len(body)].strip()
            try:
                data[m.group(1)] = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                raise UsageError(f"--case: the value of {m.group(1)} ({raw!r}) is not a literal (a number, a "
                                 "quoted string, a list or a dict).") from None
    try:
        if isinstance(data, dict) and "schema" not in data:
            data = {"schema": 2, **data}
        return Case.from_json(data)
    except CaseError as e:
        raise UsageError(f"{where}: {e}") from None


@cli.command()
@click.argument("pair_name", metavar="PAIR")
@click.option("--case", "case_text", required=True, metavar="CASE",
              help="The case: JSON, a .json file (a case or a repro), or the one-line form the harness prints.")
@click.option("--corpus", "corpus_dir", type=click.Path(path_type=Path), default=Path("corpora"), show_default=True)
@click.option("--threshold", type=POSITIVE, default=None, help="The line its judged k3 (expected k3) or exact KL must stay under (default: the pair's own TargetPair(threshold=...), else 0.001).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--timeout", type=POSITIVE, default=None, help="Seconds the case may run (default: the pair's, else 60).")
@plugin_option
def record(pair_name: str, case_text: str, corpus_dir: Path, threshold: float | None, device: str,
           timeout: float | None, plugins: tuple[str, ...]) -> None:
    """Make a case you know fails a repro: run it on the pair (in a worker process) and, when it fails,
    write it to the corpus as a campaign would (not shrunk: `harness shrink FILE` does that next)."""
    from . import corpus
    from .env import resolve_device
    from .execute import DEFAULT_THRESHOLD
    from .fuzz import PairResult, _finding, reproduces_with
    from .pairs import REGISTRY
    from .worker import DEFAULT_TIMEOUT, Worker

    load_plugins(plugins)
    pair = REGISTRY.get(pair_name)
    case = parse_case(case_text)
    corpus.check_case_size(case, "--case")
    try:  # (a repro file of another pair: its case, on this pair, is what runs; said, as it may be a slip)
        other = json.loads(Path(case_text).read_text()).get("pair") if case_text.endswith(".json") else None
    except (OSError, ValueError, AttributeError):
        other = None
    if isinstance(other, str) and other != pair.name:
        echo_err(f"note: {case_text} is a repro of pair {other}; its case runs on {pair.name} here")
    dev = resolve_device(device)
    thr = threshold if threshold is not None else (getattr(pair, "threshold", None) or DEFAULT_THRESHOLD)
    limit = timeout or getattr(pair, "timeout", None) or DEFAULT_TIMEOUT
    with Worker(dev, tuple(plugins), limit) as worker:
        ev = worker.evaluate(pair, case, thr, timeout=max(limit, 300.0))  # (a fresh worker: imports first)
        if ev.setup:
            raise UsageError(f"{pair.name} cannot run here: {ev.error['type']}: {ev.error['message']}")
        took = (f" (build, both paths and metrics took {ev.seconds:.2f} s, a first build of the pair's model included)"
                if ev.seconds is not None else "")
        if not ev.failed:
            click.echo(f"{pair.name}: the case passes ({ev.headline}): nothing recorded{took}. "
                       f"Case: {case.one_line()}")
            sys.exit(EXIT_OK)
        f = _finding(pair, ev, PairResult(pair.name, pair.expected, examples=1), complete=False)
        f.recorded_by = "harness record"  # (no campaign found it: its repro says so, `show` too)
        # (as a campaign asks it: a repro of the pair's divergences whose own case passes now holds another
        # bug, and this case gets a file of its own, not that one's recurrence)
        reproduces = reproduces_with(lambda c: worker.evaluate(pair, c, thr), pair.name, f.base_signature)
        path = corpus.record_finding(f, corpus_dir, thr, case.seed, dev, log=echo_err, reproduces=reproduces)
    if not (f.new or f.recurrence or f.updated):  # the bug's repro is that file, with its own case
        click.echo(f"{pair.name}: {ev.symptom.value}, {ev.headline} [{f.status}, {f.state}]: {path}{took}\n"
                   f"  this case is not saved: the corpus keeps one repro per bug (pair and symptom), and this bug's is "
                   f"that file, which keeps its own case ({corpus.replay_command_for(pair.name, path).replace('harness replay', 'harness show', 1)}). "
                   f"To keep this case as a repro too, record it into another corpus (--corpus DIR). Case: {case.one_line()}")
        sys.exit(EXIT_FOUND)
    click.echo(f"{pair.name}: {ev.symptom.value}, {ev.headline} [{f.status}, {f.state}] -> {path}" + took
               + f"\n  shrink it: {corpus.shrink_command_for(pair.name, path, tracking=False)}"
               + f"\n  replay:    {corpus.replay_command_for(pair.name, path)}")
    sys.exit(EXIT_FOUND)


# ---------------------------------------------------------------------------------------------
@cli.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--inputs/--no-inputs", "show_inputs", default=None,
              help="Build the case's inputs to list their shapes (default: for op pairs only; a model pair's "
                   "build loads its model).")
@plugin_option
def show(file: Path, device: str, show_inputs: bool | None, plugins: tuple[str, ...]) -> None:
    """Print a repro for a person: case, tensor shapes, metrics, and the command that replays it."""
    import math

    from .corpus import load_plugin_for, load_repro, replay_command_for, shrink_command_for
    from .env import resolve_device
    from .execute import boundary_swap_note
    from .metrics import judged_means
    from .pairs import REGISTRY

    r = load_repro(file)
    unavailable = None
    click.echo(f"repro {r.id}  pair {r.pair}  status {r.status}  symptom {r.symptom}  threshold {r.threshold:g}")
    found = r.found
    rec = found.get("recorded") if isinstance(found.get("recorded"), dict) else None
    if rec:  # a recorded rollout `harness score` flagged: no campaign, no shrinking
        cut = rec.get("response_cut_to")
        click.echo(f"scored {found.get('at', '?')} by `harness score`: sample {rec.get('sample_id', '?')} at line "
                   f"{rec.get('line', '?')} of {rec.get('file', '?')}"
                   + (f"; its response cut to its first {cut} tokens (the kept tokens score as in the file)"
                      if cut else ""))
    elif found:
        head = f"found {found.get('at', '?')} by campaign seed {found.get('campaign_seed', '?')}" + (
            f" (stream {found['stream']} of {found['streams']}, counted from 0; cases below are that stream's)"
            if isinstance(found.get("streams"), int) and found["streams"] > 1 else "")
        if found.get("by"):  # a case given by hand (`harness record`): no campaign found it
            head = (f"recorded {found.get('at', '?')} by `{found['by']}` from a case given by hand"
                    if str(found["by"]).startswith("harness ") else  # (a command; else where the case came from)
                    f"recorded {found.get('at', '?')} from {found['by']}")
        elif "cases_to_first" in found:  # the first sighting, then shrinking (not counted as cases to find it)
            head += (f" after {found['cases_to_first']} cases in {float(found.get('seconds_to_first', 0)):.1f} s; "
                     f"shrunk in {float(found.get('shrink_seconds', 0)):.1f} s "
                     f"({found.get('cases_total', found.get('examples', '?'))} cases in all)")
        else:  # recorded before the first sighting was: only the total is known
            head += f"; {found.get('examples', '?')} cases in all, shrinking included"
        shrunk = [h for h in r.history if h.get("event") == "shrunk further"]
        if shrunk:  # a later campaign or `harness shrink` replaced that minimal case with a smaller one
            last = shrunk[-1]
            by = (last.get("note") or (f"a campaign, seed {last['campaign_seed']}" if "campaign_seed" in last
                                       else "?"))
            spent = (f" in {float(last['seconds']):.1f} s" if isinstance(last.get("seconds"), (int, float)) else "") + (
                f", {last['cases_tried']} cases tried" if isinstance(last.get("cases_tried"), int) else "")
            head += (f"; then shrunk further {len(shrunk)} time(s), last {last.get('at', '?')} by {by}{spent}")
        click.echo(head + ("" if found.get("shrink_complete", True) is not False else
                           f" (shrinking was cut short: `{shrink_command_for(r.pair, file, r.tracking.get('uri'))}` goes on)")
                   + (" (NOT DETERMINISTIC: its case gave other values when run again; it may not replay)"
                      if found.get("deterministic") is False else ""))
    click.echo("\ncase (the recorded sample):" if rec else "\ncase (edited by hand since it was recorded):"
               if r.case_edited else "\ncase (shrinking cut short: not minimal yet):"
               if found.get("shrink_complete", True) is False else "\ncase (minimal):")
    from .case import Case, brief_value

    defaults = Case(seed=0).to_json()
    at_default = []
    for k, v in r.case.to_json().items():
        if k == "schema":
            continue
        if k == "params" and isinstance(v, dict):
            v = {pk: brief_value(pv) for pk, pv in v.items()}  # (shown cut, kept whole in the file)
        shown = "top_k (router)" if k == "top_k" else k  # (beside sample_top_k, the sampler's)
        if k in ("seed", "seq_lens") or v != defaults.get(k):
            click.echo(f"  {shown:13s} {v}")
        else:
            at_default.append(f"{shown} {v}")
    if at_default and rec:  # (the model's own experts, the recording's prompt and sampling: not these fields)
        click.echo(f"  fields a recorded sample does not use (the model's config and the recording say what ran): "
                   f"{', '.join(at_default)}")
    elif at_default:  # (a pair reads only the fields its axes draw: most of these are not its axes)
        click.echo(f"  at neutral values (the defaults; a pair reads only the fields its code uses): "
                   f"{', '.join(at_default)}")
    click.echo(f"  -> {r.case.size_text()}")
    if r.case.batch_size > 1:  # (where a packed trainer puts them: what a boundary bug reads off)
        rows = r.case.packed_rows()
        click.echo(f"  -> a packed trainer's rows (case.packed_rows(): first fit in packing order, capacity "
                   f"{r.case.capacity} tokens{'' if r.case.row_capacity else ', row_capacity 0: every sequence in one row'}"
                   f"): {rows}" + (f"; sequence boundaries inside a row: {', '.join(f'{a}|{b}' for row in rows for a, b in zip(row, row[1:]))}"
                                   if any(len(row) > 1 for row in rows) else ""))
    for g in (g for g in r.case.groups if len(g) > 1):  # (prompt ids are stream ids: name the sharing plainly)
        pid = r.case.prompt_id(g[0])
        owner = (f"sequence {r.case.ids.index(pid)}'s own" if pid in r.case.ids
                 else f"stream {pid}'s, a sequence shrinking dropped")
        click.echo(f"  -> sequences {', '.join(map(str, g))} share one prompt ({r.case.prompt_len(g[0])} token{'s' if r.case.prompt_len(g[0]) != 1 else ''}, "
                   f"{owner}); in batch order, the first of them is the one a prefix cache is filled by")
    if r.neighbours and not r.case_edited:
        from .shrink import EDGE_MARGIN

        click.echo(f"  simpler cases shrinking ran (none fails as this one does: {r.symptom} starts here; "
                   f"judged = the verdict's value, line {r.threshold:g}):")
        rows = [(n["change"] + (f" (+{n['cases'] - 1} more like it)" if n.get("cases", 1) > 1 else ""), n)
                for n in r.neighbours]
        width = min(64, max(len(text) for text, _ in rows))
        for text, n in rows:
            many = n.get("cases", 1) > 1
            what = ("pass" if many else "passes") if n.get("symptom", "none") == "none" else \
                (f"fails too, by less than {EDGE_MARGIN}x the line (a knob is bisected only as far as that margin "
                 "holds)" if n["symptom"] == r.symptom else f"fails another way ({n['symptom']})")
            click.echo(f"    {text:{width}s}  {what}, judged{' at most' if many else ''} {_fmt(n.get('judged'))}")
    if (r.found or {}).get("severe") is not None:
        from .corpus import Severe

        sev = Severe.from_json(r.found["severe"])
        plugin = _plugin_flags(r, plugins)
        click.echo("  severe case: (not readable: its found.severe was edited by hand?)" if sev is None else
                   f"  severe case: this finding's campaign reached {_fmt(sev.peak)}; its worst case, shrunk keeping "
                   f"{sev.keeping}, is {sev.case.one_line()} ({sev.headline}). Shrinking keeps "
                   "the simplest trigger over the line: where several bugs share a pair that is the mildest. "
                   f"`harness triage --severe{plugin} {file}` names the components of this one: other components "
                   "than the minimal case's are a second bug")
    try:
        load_plugins(plugins)
        why = load_plugin_for(r)
        if why is not None:
            raise CannotEvaluate(f"repro {file} cannot be evaluated here: {why}")
        pair = REGISTRY.get(r.pair)
        click.echo(f"\npair: {pair.description or pair.name} ({pair.kind}, expected {pair.expected})"
                   + ("; here only its trainer ran: the rollout is the recording, from the engine that wrote it"
                      if rec else ""))
        from .pairs import lead_of

        lead, marks = lead_of(pair, r.case), getattr(pair, "size_marks", None) or {}
        if lead or marks:  # (positions as the pair's sequences have them: what a window or position bug reads)
            j = max(range(r.case.batch_size), key=r.case.total_len)
            n = lead + r.case.total_len(j)
            click.echo(f"positions: its longest sequence (sequence {j}) spans {n}"
                       + (f" = {lead} token(s) the pair puts before each prompt + {r.case.prompt_len(j)} prompt + "
                          f"{r.case.seq_lens[j]} response, positions 0..{n - 1}" if lead else "")
                       + "".join(f"; {k} {v}: {'past it' if n > v else 'not past it'}" for k, v in marks.items()))
        import torch

        if r.symptom in ("crash", "timeout"):  # its case may kill or hang this process: not built here
            click.echo(f"inputs: not built here (a {r.symptom} repro: `harness replay` runs it in a worker process)")
        elif not (show_inputs if show_inputs is not None else pair.kind == "op"):
            # (a model pair's build loads its weights: seconds and the model's memory, for a list of shapes)
            again = (f"harness show --inputs{_plugin_flags(r, plugins)} {file}" if plugins else
                     replay_command_for(r.pair, file).replace("harness replay", "harness show --inputs", 1))
            click.echo(f"inputs: not built (a {pair.kind} pair: its build loads the model; `{again}` lists them)"
                       if show_inputs is None else "inputs: not built (--no-inputs)")
        else:
            try:
                with torch.inference_mode():
                    inputs = pair.build(r.case, resolve_device(device))
            except Exception as e:  # noqa: BLE001 - an error repro's build may be what raises
                click.echo(f"inputs: build() raised {type(e).__name__}: {str(e)[:300]}")
            else:
                click.echo("inputs:")
                shown = 0
                for name, value in _tensors(inputs):
                    click.echo(f"  {name:13s} {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}")
                    shown += 1
                if not shown:
                    click.echo(f"  (no tensors found in the {type(inputs).__name__} that build() returned)")
    except HarnessError as e:
        unavailable = e
        click.echo(f"\n(pair not available here: {e})")
    # (a later campaign or `harness shrink` may have replaced the case found with a smaller one: the metrics are its)
    shrunk = [h for h in r.history if h.get("event") == "shrunk further"]
    if r.metrics:  # (an error, crash or hang has none: its error follows)
        click.echo(f"\nmetrics of the case as recorded, not of this one (its case was edited by hand since; "
                   f"`harness replay {file}` measures this one, `harness rerecord {file}` records them):"
                   if r.case_edited else "\nmetrics when found:" if not shrunk else
                   f"\nmetrics of this case (shrunk further {shrunk[-1].get('at', '?')}, from "
                   f"{Case.from_json(shrunk[0]['replaced_case']).one_line() if shrunk[0].get('replaced_case') else '?'}):")
    for k, v in r.metrics.items():
        if k not in ("fired", "verdict_over", "rows"):
            note = (" (a correlation needs 2 or more tokens)" if k == "pearson" and isinstance(v, float) and math.isnan(v)
                    and r.case.n_tokens < 2 else "")
            if k in ("kl", "kl_seq_max", "entropy") and (rec or r.metrics.get("rows") == "two_outcome"):
                note = " (of the two-outcome rows {sampled token, every other}: the rollout reports only its tokens')"
            if rec and k in ("flip_rate", "tie_flip_rate") and not r.case.params.get("rec_experts"):
                v, note = "n/a", " (no experts recorded: nothing to compare the trainer's routing with)"
            click.echo(f"  {k:18s} {v if v == 'n/a' else _fmt(v)}{note}")
    if r.metrics:
        two_outcome = rec or r.metrics.get("rows") == "two_outcome"
        fired = r.metrics.get("fired")
        k3e, k3s = r.metrics.get("k3_expected", math.nan), r.metrics.get("k3_kl")
        judged, judged_kl = judged_means(r.metrics)
        per_seq = r.metrics.get("verdict_over") == "sequence"
        why = ("a sampled token the trainer excludes" if k3s == math.inf else
               "the expected k3 over the vocabulary" if isinstance(k3e, (int, float)) and not math.isnan(k3e)
               else "the sampled tokens' mean: no expected k3 (a rollout that reports its sampled tokens only, a "
                     "recording, or an older repro)")
        if per_seq:
            why += ", the worst sequence's mean: the pair judges each sequence (verdict_over='sequence')"
        click.echo("  over the threshold: " + (fired if fired else "neither mean" if fired == "" else
                                              "not recorded (a repro from before the exact-KL verdict)")
                   + f" (judged k3 {_fmt(judged)}: {why}; sampled tokens' mean k3 "
                   f"{_fmt(r.metrics.get('k3_kl'))}; "
                   + (f"mean two-outcome KL {_fmt(r.metrics.get('kl'))} ({'a recording' if rec else 'its rollout reports its sampled tokens only'}: "
                      "only their probabilities are known, so a lower bound of the exact KL where both paths' "
                      "log-probs are normalised); " if two_outcome else
                      f"mean exact KL {_fmt(r.metrics.get('kl'))}"
                      + (f", worst sequence's {_fmt(judged_kl)}; " if per_seq else "; "))
                   + f"rollout mass the trainer excludes {_fmt(r.metrics.get('kl_excluded', 'not recorded'))})")
        if two_outcome and fired == "kl" and isinstance(k3s, (int, float)) and k3s <= r.threshold:
            click.echo("  the two-outcome KL fired with the sampled tokens' k3 under the line: it takes the rest of "
                       "each row's mass as 1 - p, so a path whose log-probs are not normalised (a fused log-sum-exp "
                       "off by a little, every token of a row shifted alike) reads far more here, on confident "
                       "tokens, than its full rows' exact KL would (which normalises that shift away); the sampled "
                       "k3, what an importance ratio reads, is the measure of such a shift")
        swap = boundary_swap_note(r.metrics)
        if swap:
            click.echo(f"  {swap} (`harness triage {file}`)")
        flips = r.metrics.get("flip_rate")
        if isinstance(flips, (int, float)) and flips > 0:
            ties = r.metrics.get("tie_flip_rate")
            click.echo(f"  routing flipped: the two paths chose other experts for {flips:.1%} of routed (token, layer) choices"
                       + (f" ({ties:.1%} where a path had an exact tie at the top-k boundary)" if isinstance(ties, (int, float)) and ties > 0
                          else "")
                       + ". The divergence may come through the flip (a rounding difference that changed a choice, "
                       "and every later token of that sequence) rather than the gap itself, so the case keeps what "
                       f"makes the flip (near ties, sampling): `harness triage {file}` splits flips from the "
                       "rest, and router replay removes flips.")
    if r.error:
        click.echo(f"\nerror: {r.error.get('type')}: {r.error.get('message')}\n{r.error.get('traceback', '')}")
    env = r.environment
    if env:
        click.echo("\nenvironment: " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None))
    if r.history:
        click.echo(f"\nhistory: {len(r.history)} event(s), last: {r.history[-1].get('event')} at "
                   f"{r.history[-1].get('at')}")
    env_loader = r.loader.get("kind")
    if env_loader:
        click.echo("loaded from: " + ", ".join(f"{k} {v}" for k, v in r.loader.items()))
    click.echo(f"\nreplay: {f'harness replay{_plugin_flags(r, plugins)} {file}' if plugins else r.replay_command(file)}")
    if unavailable is not None:
        echo_err(f"error: {unavailable}")
        sys.exit(EXIT_USAGE)


def _tensors(obj: Any, prefix: str = "", depth: int = 0):
    import dataclasses

    import torch

    if depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        yield prefix or "input", obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # e.g. the HF backend's inputs
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name, None), f"{prefix}.{f.name}" if prefix else f.name, depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj[:64]):
            yield from _tensors(v, f"{prefix}[{i}]", depth + 1)


# ---------------------------------------------------------------------------------------------
@cli.group(cls=LazyGroup, lazy=LAZY_BENCHMARKS)
def bench() -> None:
    """Benchmarks that write figures to reports/BENCHMARKS.md."""


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    from .worker import ENTRY_POINT

    ENTRY_POINT[0] = True
    try:
        cli.main(args=argv, prog_name="harness", standalone_mode=False)
    except click.exceptions.Abort:
        echo_err("interrupted.")
        sys.exit(EXIT_INTERRUPTED)
    except click.exceptions.ClickException as e:
        e.show()
        sys.exit(EXIT_USAGE)
    except HarnessError as e:
        echo_err(f"error: {e}")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        echo_err("interrupted.")
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        sys.exit(EXIT_OK)
    except OSError as e:  # a path the command could not write or read (a file where a folder should be,
        # a read-only folder, a full disk): what the OS said and which path, not a traceback
        import errno

        if not e.filename and e.errno not in (errno.EACCES, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                                              errno.EISDIR, errno.EEXIST, errno.EFBIG, errno.EPERM):
            # not the file system (a connection, a library's own OSError): what it said, exit 2 (not 1,
            # which means findings)
            echo_err(f"error: the command stopped on an operating-system error: {type(e).__name__}: {e}. If it "
                     "names a server (an MLflow tracking URI), check that it is reachable, or pass --no-tracking; "
                     "files already written (corpus repros) are complete.")
            sys.exit(EXIT_USAGE)
        where = f" {e.filename!r}" + (f" -> {e.filename2!r}" if e.filename2 else "") if e.filename else ""
        echo_err(f"error: the command stopped on a file-system error: {e.strerror or e}{where} (errno {e.errno}). "
                 "Check that path: a folder the command writes into must be a folder (not a file) and writable, "
                 "and the disk must have space; then run it again. Files already written (corpus repros) are "
                 "complete: they are written whole or not at all.")
        sys.exit(EXIT_USAGE)
    sys.exit(EXIT_OK)
