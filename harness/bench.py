"""Benchmarks that write figures to reports/BENCHMARKS.md, one section each.

`harness bench overhead`: the harness's cost per case against bare calls of the same pair on the
same inputs, measured side by side in one run (rounds alternate bare and harness so machine noise
hits both). Harness = a real campaign of the pair, wall time per case it evaluated; bare = `build`
+ `rollout` + `trainer` called directly on exactly the cases that campaign evaluated.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import click

from .clitypes import FiniteFloat


def check_out_file(ctx: Any, param: Any, value: Any) -> Any:
    """A click callback for a benchmark's `--out FILE.md`: refused before the benchmark runs (it may
    take minutes) when it is a folder or its folder cannot be made or written."""
    import os

    path = Path(value)
    if path.is_dir():
        raise click.BadParameter(f"{str(path)!r} is a folder; give the markdown file the figures go into "
                                 f"(e.g. {path / 'BENCHMARKS.md'}).")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise click.BadParameter(f"{str(path)!r} cannot be written here ({str(parent)!r} is not a writable folder); "
                                 "give a file in a folder you can write.")
    return path


def write_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) the section `name` of a markdown file, between marker comments. A file
    that cannot be written is a UsageError, after the section is printed (the figures are not lost)."""
    from .errors import UsageError

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = path.read_text() if path.exists() else "# Benchmarks\n\nFigures written by `harness bench ...`; " \
            "each section says the command that produced it.\n"
        begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        block = f"{begin}\n{body.rstrip()}\n{end}"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
        text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
        path.write_text(text)
    except OSError as e:
        click.echo(body)
        raise UsageError(f"the figures could not be written to {str(path)!r} ({e.strerror or e}); they are printed "
                         "above. Pass --out with a file in a folder you can write.") from None


def machine(threads: int | None = None) -> str:
    """The machine and software; `threads`: the torch threads the measurements ran with, where that is
    not this process's count (a measuring subprocess's)."""
    import os

    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{threads or torch.get_num_threads()} threads, python {platform.python_version()}")


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bare_calls(pair: Any, cases: list, device: str = "cpu") -> None:
    """The pair's own functions on the cases, nothing of the harness: build, rollout, trainer."""
    import torch

    with torch.inference_mode():
        for c in cases:
            inputs = pair.build(c, device)
            r = pair.rollout(inputs)
            pair.trainer(inputs, r) if pair.trainer_reads_rollout else pair.trainer(inputs)


def overhead(pair_names: tuple[str, ...], n_cases: int, out: Path, rounds: int = 3,
             plugins: tuple[str, ...] = ()) -> str:
    from .errors import HarnessError
    from .execute import judge, run_case, run_paths
    from .fuzz import CampaignConfig, Executor, fuzz_pair, pair_seed, uniform_per_example
    from .pairs import REGISTRY

    rows = []
    for pair in REGISTRY.select(pair_names):
        if "cpu" not in pair.devices:
            continue
        cfg = CampaignConfig(pairs=[pair], seed=0, max_examples=n_cases, write_corpus=False, isolation=True)
        executor = Executor(cfg)
        seen: list = []
        inside = [0.0]  # seconds spent evaluating cases during the last campaign

        def campaign(isolated: bool) -> int:
            inner = executor.evaluator(pair, None) if isolated else (
                lambda c: run_case(pair, c, cfg.device, cfg.threshold))

            def evaluate(case):
                seen.append(case)
                t0 = time.perf_counter()
                try:
                    return inner(case)
                finally:
                    inside[0] += time.perf_counter() - t0

            if hasattr(inner, "prefetch"):  # isolated: the campaign hands cases to the worker ahead
                evaluate.prefetch = inner.prefetch  # type: ignore[attr-defined]

            seen.clear()
            inside[0] = 0.0
            return fuzz_pair(pair, cfg, pair_seed(0, pair.name), deadline=None, evaluate=evaluate).examples

        def bare() -> None:
            bare_calls(pair, cases)

        def split() -> tuple[float, float]:
            """Seconds of (build + both paths + readout) and of the metrics step, over the cases."""
            paths = metrics = 0.0
            for c in cases:
                t0 = time.perf_counter()
                tr, ro = run_paths(pair, c, cfg.device)
                t1 = time.perf_counter()
                judge(pair, c, tr, ro, cfg.threshold)
                paths, metrics = paths + t1 - t0, metrics + time.perf_counter() - t1
            return paths, metrics

        try:
            campaign(True)  # warm up the worker (imports, compilation, exports, caches)
            if not campaign(False):  # ... and this process, recording the cases
                raise HarnessError(f"{pair.name}: its campaign evaluated no case (a pair that cannot run here?); "
                                   "leave it out of the benchmark")
            cases = list(seen)
            bare()
            t_bare, t_in, t_iso, t_paths, t_metrics, t_eval = [], [], [], [], [], []
            for _ in range(rounds):
                t = time.perf_counter()
                n = campaign(False)
                t_in.append((time.perf_counter() - t) / n)
                t_eval.append(inside[0] / n)
                t = time.perf_counter()
                n = campaign(True)
                t_iso.append((time.perf_counter() - t) / n)
                t_bare.append(_time(bare) / len(cases))
                paths, metrics = split()
                t_paths.append(paths / len(cases))
                t_metrics.append(metrics / len(cases))
        finally:
            executor.close()
        b, h, i = statistics.median(t_bare), statistics.median(t_in), statistics.median(t_iso)
        ro, me, ev = max(0.0, statistics.median(t_paths) - b), statistics.median(t_metrics), statistics.median(t_eval)
        rows.append((pair.name, pair.kind, uniform_per_example(pair, cfg), len(cases), b * 1e3, h * 1e3, i * 1e3,
                     ro * 1e3, me * 1e3, (ev - b - ro - me) * 1e3, max(0.0, h - ev) * 1e3))
    body = [
        "## Harness overhead per case",
        "",
        "Command: `" + " ".join([*([f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"]
                                   if os.environ.get("OMP_NUM_THREADS") else []),
                                 "harness bench overhead", *(f"--plugin {p}" for p in plugins), "--cases",
                                 str(n_cases), *(f"'{p}'" for p in pair_names)])
        + f"` ({machine()}). Median of {rounds} alternating rounds.",
        "Harness = a real campaign of the pair (`fuzz_pair`: Hypothesis generation, targeting and shrinking,",
        "readout, token sampling, metrics, verdicts), wall time per case it evaluated, in this process",
        "(`--no-isolation`) and isolated (the default: the case goes to a worker process, which builds, runs",
        "both paths and the metrics, and sends back the verdict); bare = build + rollout + trainer called",
        "directly on exactly those cases. Added = harness - bare. Goal: added <= 0.5 ms per case for op",
        "pairs, ratio <= 1.25 for CPU model pairs. *u/ex* = uniform cases per Hypothesis example.",
        "Where the in-process added time goes: *readout* (the pair's declared `Readout`, float64:",
        "`run_paths` - bare) and *metrics* (`judge`: exact sums over the vocabulary, token draw, verdict),",
        "both timed on the same cases outside the campaign; *in-campaign* (the cases' evaluation inside the",
        "campaign took this much longer than bare + readout + metrics: caches and branch predictors the",
        "engine left cold) and *engine* (campaign time outside the evaluations: Hypothesis's generation,",
        "targeting and shrinking, uniform draws, case bookkeeping).",
        "",
        "| pair | kind | u/ex | cases | bare ms/case | in-process ms/case | added ms | ratio | isolated ms/case | added ms | ratio "
        "| readout ms | metrics ms | in-campaign ms | engine ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    body += [f"| {n} | {k} | {u} | {c} | {b:.2f} | {h:.2f} | {h - b:.2f} | {h / b:.2f} | {i:.2f} | {i - b:.2f} | "
             f"{i / b:.2f} | {ro:.2f} | {me:.2f} | {ic:.2f} | {en:.2f} |"
             for n, k, u, c, b, h, i, ro, me, ic, en in rows]
    text = "\n".join(body)
    write_section(out, "overhead", text)
    return text + f"\n\nwritten to {out}"


@click.command("overhead")
@click.argument("pair_names", nargs=-1)
@click.option("--cases", type=click.IntRange(5), default=100, show_default=True,
              help="max_examples of each pair's campaign.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("reports/BENCHMARKS.md"), show_default=True,
              callback=check_out_file)
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE", help="Load pairs from a plugin.")
def overhead_command(pair_names: tuple[str, ...], cases: int, out: Path, plugins: tuple[str, ...]) -> None:
    """Harness time per case vs bare calls of the same pair on the same inputs."""
    from .cli import load_plugins

    load_plugins(plugins)
    click.echo(overhead(pair_names, cases, out, plugins=plugins))


# ---------------------------------------------------------------------------------------------
# pytest-xdist scaling
# ---------------------------------------------------------------------------------------------
def xdist(pair_globs: tuple[str, ...], budget: float | None, streams: int, out: Path, rounds: int = 1,
          max_examples: int = 60) -> str:
    """`pytest --harness-fuzz` with 1 and 2 xdist workers on the same pairs and seed, alternating.

    Fixed work (the default): every pair runs `max_examples` Hypothesis examples split over its
    streams, with no time budget, so the two configurations with the same streams run exactly the
    same cases and the ratio of their wall times is the speed-up; with `budget` each pair runs for
    that many seconds instead (then the cases differ, and so does their mix of sizes).
    cases/s = cases of the whole session / its wall time, startup included."""
    import json
    import math
    import os
    import subprocess
    import sys
    import tempfile

    configs = [(1, 1), (1, streams), (2, streams)]  # (workers, streams per pair)
    runs: dict[tuple[int, int], list[tuple[float, int, float]]] = {c: [] for c in configs}
    limit = (["--harness-budget", str(budget), "--harness-max-examples", "1000000"] if budget is not None
             else ["--harness-max-examples", str(max_examples)])
    with tempfile.TemporaryDirectory(prefix="harness-xdist-") as tmp:
        for r in range(rounds):
            for workers, n_streams in configs:
                tag = f"{r}-{workers}-{n_streams}"
                cmd = [sys.executable, "-m", "pytest", "--harness-fuzz", "-n", str(workers), "-q",
                       "-p", "no:cacheprovider", "--harness-streams", str(n_streams), *limit, "--harness-seed", "1",
                       "--harness-no-tracking", "--harness-corpus", f"{tmp}/corpus-{tag}",
                       "--harness-out", f"{tmp}/out-{tag}", *(a for g in pair_globs for a in ("--harness-pairs", g))]
                before = _busy_seconds()
                t = time.perf_counter()
                subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                wall = time.perf_counter() - t
                after = _busy_seconds()
                cpu = after - before if before is not None and after is not None else math.nan
                cases = json.loads(Path(f"{tmp}/out-{tag}/summary.json").read_text())["cases"]
                runs[(workers, n_streams)].append((wall, cases, cpu))
    base = statistics.median(c / w for w, c, _ in runs[(1, 1)])
    same = statistics.median(c / w for w, c, _ in runs[(1, streams)])
    what = (f"--harness-budget {budget:g}` (seconds per pair, shared by its streams)" if budget is not None
            else f"--harness-max-examples {max_examples}` (Hypothesis examples per pair, split over its streams; "
                 "no time budget, so the runs with the same streams evaluate the same cases)")
    body = [
        "## pytest-xdist: 2 workers against 1",
        "",
        "Command: `" + " ".join(["OMP_NUM_THREADS=1 harness bench xdist",
                                 *(["--budget", f"{budget:g}"] if budget is not None else ["--max-examples", str(max_examples)]),
                                 "--streams", str(streams), "--rounds", str(rounds), *(f"'{g}'" for g in pair_globs)])
        + f"` ({machine()}).",
        f"`pytest --harness-fuzz -n W --harness-streams S {what}, seed 1, the same pairs in every run, runs",
        "alternating, median of the rounds; cases/s = the session's cases / its wall time, startup and imports",
        "included. *cores busy* = the machine's busy CPU seconds during the session (`/proc/stat`: user, nice,",
        "system, irq, softirq; not idle, iowait or steal) / wall seconds: an xdist worker is two processes",
        "(the campaign draws examples while its harness worker runs cases), so one of them already keeps",
        "more than one core busy. Goal: 2 workers >= 1.8x the cases/s of 1.",
        "",
        "| workers | streams per pair | wall s | cases | cases/s | cores busy | vs 1 worker, 1 stream "
        "| vs 1 worker, same streams |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (workers, n_streams), rs in runs.items():
        wall = statistics.median(w for w, _, _ in rs)
        cases = int(statistics.median(c for _, c, _ in rs))
        rate = statistics.median(c / w for w, c, _ in rs)
        busy = statistics.median(u / w for w, _, u in rs)
        vs_same = f"{rate / same:.2f}x" if n_streams == streams else "-"
        body.append(f"| {workers} | {n_streams} | {wall:.1f} | {cases} | {rate:.1f} | {busy:.2f} | {rate / base:.2f}x "
                    f"| {vs_same} |")
    text = "\n".join(body)
    write_section(out, "xdist", text)
    return text + f"\n\nwritten to {out}"


def _busy_seconds() -> float | None:
    """The machine's busy CPU seconds since boot (`/proc/stat`: user, nice, system, irq, softirq), or
    None where there is no /proc/stat."""
    import os

    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return (user + nice + system + irq + softirq) / ticks


@click.command("xdist")
@click.argument("pair_globs", nargs=-1)
@click.option("--budget", type=FiniteFloat(0, min_open=True), default=None,
              help="Seconds per pair (shared by its streams) instead of a fixed number of examples.")
@click.option("--max-examples", type=click.IntRange(1), default=60, show_default=True,
              help="Hypothesis examples per pair (split over its streams; no time budget): the same cases in every run.")
@click.option("--streams", type=click.IntRange(1), default=2, show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=1, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("reports/BENCHMARKS.md"), show_default=True,
              callback=check_out_file)
def xdist_command(pair_globs: tuple[str, ...], budget: float | None, max_examples: int, streams: int, rounds: int,
                  out: Path) -> None:
    """Cases/s of `pytest --harness-fuzz` with 2 xdist workers against 1."""
    click.echo(xdist(pair_globs, budget, streams, out, rounds, max_examples))
