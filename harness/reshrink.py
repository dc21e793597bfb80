"""`harness shrink`: go on shrinking a repro whose shrinking a campaign's budget cut short.

At a real vocabulary a case costs seconds, so a campaign's time share can run out before its
finding is minimal (the summary then says "shrinking cut short", and the repro's `found` says
`shrink_complete: false`). This command starts from the repro's own case and runs the polish pass
(`harness.shrink.polish`: drop a sequence, halve a response, neutral knobs, ...), keeping a move
only when the smaller case fails the same way (the same signature: pair, symptom, error type); it
stops when no move is accepted or `--budget` seconds are spent, and can be run again to go on.

A smaller case replaces the repro's case and metrics (the replaced ones stay in its history as
"shrunk further", as when a later campaign finds a smaller case); `found.shrink_complete` says
whether this pass finished. Cases run as replay runs them: in this process with the thread count
the repro was found with, or, for a `crash` or `timeout` repro, in a supervised worker process.
Exit status: 0 when the repro was shrunk or was already minimal, 1 when its case no longer fails
the recorded way (nothing to shrink: `harness replay` says how it differs), 2 when it cannot be
evaluated here.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click


def _size(case: Any) -> str:
    return f"{case.batch_size} sequence(s), {case.n_tokens} token(s)"


def shrink_file(path: Path, budget: float, max_evals: int, device: str = "cpu",
                plugins: tuple[str, ...] = (), log: Any = print) -> str:
    """Shrink one repro in place; returns "shrunk", "minimal", "cut short", "unchanged (cut short)",
    "does not fail" or "skipped" (with the reason logged)."""
    from contextlib import ExitStack

    from . import corpus
    from .env import recorded_threads, threads_as
    from .errors import HarnessError
    from .execute import run_case
    from .fuzz import signature
    from .pairs import REGISTRY
    from .shrink import polish

    try:
        repro = corpus.load_repro(path)
        why = corpus.load_plugin_for(repro)
        if why:
            log(f"skipped         {path}  ({why})")
            return "skipped"
        pair = REGISTRY.get(repro.pair)
    except HarnessError as e:
        log(f"skipped         {path}  ({e})")
        return "skipped"
    thr = repro.threshold
    with ExitStack() as stack:
        if repro.symptom in corpus.ISOLATED_SYMPTOMS:  # a case that kills or hangs its process
            from .worker import DEFAULT_TIMEOUT, Worker

            limit = (corpus.recorded_timeout(repro) if repro.symptom == "timeout" else None) or DEFAULT_TIMEOUT
            worker = stack.enter_context(Worker(device, tuple(plugins), limit,
                                                threads=recorded_threads(repro.environment)))

            def run(case: Any) -> Any:
                return worker.evaluate(pair, case, thr)
        else:
            stack.enter_context(threads_as(recorded_threads(repro.environment)))

            def run(case: Any) -> Any:
                return run_case(pair, case, device, thr)

        start = time.monotonic()
        first = run(repro.case)
        if first.setup:
            log(f"skipped         {path}  (its pair could not run here: {first.error['type']}: "
                f"{first.error['message']})")
            return "skipped"
        if not first.failed or first.symptom.value != repro.symptom:
            log(f"does not fail   {path}  (recorded {repro.symptom}, its case now gives {first.symptom.value} "
                f"{first.headline}; `{repro.replay_command()}` shows how it differs)")
            return "does not fail"
        sig = signature(pair.name, first)
        best = {"ev": first}

        def fails(case: Any) -> bool:
            ev = run(case)
            if ev.failed and not ev.setup and signature(pair.name, ev) == sig:
                best["ev"] = ev
                return True
            return False

        case, evals, complete = polish(repro.case, fails, max_evals=max_evals, deadline=start + budget,
                                       axes=pair.axes)
    seconds = time.monotonic() - start
    was_complete = repro.found.get("shrink_complete", True) is not False
    if case == repro.case:
        if complete and not was_complete:
            repro.found = {**repro.found, "shrink_complete": True}
            repro.history.append({"at": corpus.now_iso(), "event": "shrink completed",
                                  "note": f"`harness shrink`: no simpler case fails the same way ({evals} tried)"})
            repro.save(path)
        outcome = "minimal" if complete else "unchanged (cut short)"
        log(f"{outcome:15s} {path}  ({_size(case)}; {evals} case(s) tried in {seconds:.1f}s"
            + ("" if complete else "; the budget ran out: run again, or with a larger --budget, to go on") + ")")
        return outcome
    ev = best["ev"]
    if ev.case != case:  # (the last accepted move's evaluation is the case's; run it again if not)
        ev = run(case)
    old_case = repro.case
    repro.history.append({"at": corpus.now_iso(), "event": "shrunk further", "note": "`harness shrink`",
                          "replaced_case": old_case.to_json(), "replaced_metrics": repro.metrics})
    repro.case, repro.metrics, repro.error = case, corpus.metrics_json(ev), ev.error
    repro.case_edited = False  # (the metrics are the new case's: a fresh fingerprint)
    repro.found = {**repro.found, "shrink_complete": bool(complete)}
    repro.save(path)
    outcome = "shrunk" if complete else "cut short"
    log(f"{outcome:15s} {path}  ({_size(old_case)} -> {_size(case)}; {evals} case(s) tried in {seconds:.1f}s; "
        f"now {ev.headline}" + ("" if complete else "; the budget ran out: run again to go on") + ")")
    return outcome


@click.command("shrink")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds of shrinking per repro.")
@click.option("--max-evals", type=click.IntRange(1), default=500, show_default=True,
              help="Cases tried per repro at most.")
@click.option("--device", default="cpu", show_default=True, help="Device to run the cases on.")
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE",
              help="Load target pairs from a Python file or an importable module (repeatable): a repro of a "
                   "plugin kept outside this repository needs it.")
def shrink_command(paths: tuple[Path, ...], budget: float, max_evals: int, device: str,
                   plugins: tuple[str, ...]) -> None:
    """Go on shrinking repros (files or corpus folders) whose shrinking was cut short."""
    from . import corpus
    from .cli import load_plugins
    from .env import resolve_device

    load_plugins(plugins)
    device = resolve_device(device)
    files: list[Path] = []
    for p in paths:
        files.extend(corpus.iter_corpus(p) if p.is_dir() else [p])
    counts: dict[str, int] = {}
    for f in files:
        outcome = shrink_file(f, budget, max_evals, device, plugins, log=click.echo)
        counts[outcome] = counts.get(outcome, 0) + 1
    click.echo(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    sys.exit(1 if counts.get("does not fail") else 2 if counts.get("skipped") else 0)
