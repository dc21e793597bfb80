"""`harness shrink`: go on shrinking a repro whose shrinking a campaign's budget cut short.

At a real vocabulary a case costs seconds, so a campaign's time share can run out before its
finding is minimal (the summary then says "shrinking cut short", and the repro's `found` says
`shrink_complete: false`). This command starts from the repro's own case and runs the polish pass
(`harness.shrink.polish`: drop a sequence, halve a response, neutral knobs, ...), keeping a move
only when the smaller case fails the same way (the same signature: pair, symptom, error type); it
stops when no move is accepted or `--budget` seconds are spent, and can be run again to go on.

A smaller case replaces the repro's case and metrics (the replaced ones stay in its history as
"shrunk further", as when a later campaign finds a smaller case); `found.shrink_complete` says
whether this pass finished, and the regression run in MLflow (when the store holds one for it) gets
the new case: tag, note, metrics and repro artifact. Cases run as a campaign runs them: in a
supervised worker process with the thread count the repro was found with, so a smaller case that
crashes or hangs is a different failure (not accepted) and the command goes on; `--budget` is a
wall for them. Ctrl-C or SIGTERM stops it with the smallest case so far saved (exit 130).
Exit status: 0 when the repro was shrunk or was already minimal, 1 when its case no longer fails
the recorded way (another symptom or error type, or none: nothing to shrink; `harness replay` says
how it differs), 2 when it cannot be evaluated here.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from .clitypes import FiniteFloat


def _size(case: Any) -> str:
    return case.size_text()


def _fails_as_recorded(repro: Any, ev: Any) -> bool:
    """The case fails as the repro recorded: the same symptom and, for an error or crash, the same
    type (for an error, a message of the same class too: `fuzz.message_class`)."""
    from .fuzz import message_class

    if not ev.failed or ev.symptom.value != repro.symptom:
        return False
    if repro.error and ev.error:
        same = ev.error.get("type") == repro.error.get("type")
        if same and repro.symptom == "error":
            same = message_class(ev.error.get("message")) == message_class(repro.error.get("message"))
        return same
    return True


def shrink_file(path: Path, budget: float, max_evals: int, device: str = "cpu", plugins: tuple[str, ...] = (),
                log: Any = print, tracking_uri: str | None = None, tracking: bool = True) -> str:
    """Shrink one repro in place; returns "shrunk", "minimal", "cut short", "unchanged (cut short)",
    "does not fail", "fixed" or "skipped" (with the reason logged). KeyboardInterrupt (Ctrl-C, SIGTERM) is
    raised again after the smallest case so far is saved."""
    from . import corpus
    from .env import recorded_threads
    from .errors import HarnessError
    from .fuzz import Executor, _Signals, signature
    from .pairs import REGISTRY
    from .shrink import EDGE_MARGIN, neighbours_of, polish
    from .worker import DEFAULT_TIMEOUT, OutOfTime, Worker

    try:
        repro = corpus.load_repro(path)
        if repro.status == "fixed":
            log(f"{'fixed':15s} {path}  (its bug is fixed: nothing to shrink)")
            return "fixed"
        why = corpus.load_plugin_for(repro)
        if why:
            log(f"skipped         {path}  ({why})")
            return "skipped"
        pair = REGISTRY.get(repro.pair)
        corpus.check_case_size(repro.case, f"repro {path}")
    except HarnessError as e:
        log(f"skipped         {path}  ({e})")
        return "skipped"
    thr = repro.threshold
    limit = ((corpus.recorded_timeout(repro) if repro.symptom == "timeout" else None) or getattr(pair, "timeout", None)
             or DEFAULT_TIMEOUT)
    # A fresh worker's first case (imports, compilation) gets the campaign's cold-start allowance; a
    # timeout repro's cases are judged at its recorded timeout, as replay judges it (a hang would
    # otherwise cost the allowance per case).
    cold = limit if repro.symptom == "timeout" else max(limit, Executor.COLD_START_TIMEOUT)
    start = time.monotonic()
    end = start + budget
    best: dict[str, Any] = {"ev": None, "case": repro.case}
    import torch

    threads = recorded_threads(repro.environment) or torch.get_num_threads()  # what its metrics are computed with
    with Worker(device, tuple(plugins), limit, threads=threads) as worker, \
            _Signals() as signals:

        def run(case: Any, wall: float | None) -> Any:
            worker.replace_if_due()  # (grown past its memory cap: replaced, so the next case is a cold one)
            fresh = worker.proc is None or not worker.proc.is_alive()  # (started again after a crash, hang or that)
            t = cold if fresh else limit
            worker.submit(pair, case, thr, timeout=t, wall=wall, cold_extra=t - limit)
            return worker.collect(wall)

        try:
            first = run(repro.case, None)  # (the repro itself runs to the end, whatever the budget)
        except (HarnessError, OutOfTime) as e:  # the pair does not load in a worker; a start past its limit
            log(f"skipped         {path}  ({e or 'its worker did not start in time'})")
            return "skipped"
        if first.setup:
            log(f"skipped         {path}  (its pair could not run here: {first.error['type']}: "
                f"{first.error['message']})")
            return "skipped"
        if not _fails_as_recorded(repro, first):
            now = first.headline if first.failed else f"passes ({first.headline_like(repro.metrics)})"
            log(f"does not fail   {path}  (recorded {repro.symptom}"
                + (f" {repro.error.get('type')}" if repro.error and repro.symptom in ("error", "crash") else "")
                + f"; its case now gives {first.symptom.value if first.failed else 'no failure'}: {now}; "
                f"`{repro.replay_command()}` shows how it differs)")
            return "does not fail"
        sig = signature(pair.name, first)
        best["ev"] = first
        results: dict[str, tuple[float, str] | None] = {}  # case key -> (judged, symptom): for `neighbours_of`
        stopped = {"wall": False}

        def fails(case: Any) -> bool:
            if stopped["wall"]:
                return False
            try:
                ev = run(case, end)
            except OutOfTime:
                stopped["wall"] = True
                return False
            results[case.key()] = (ev.score, ev.symptom.value) if not ev.setup else None
            if ev.failed and not ev.setup and signature(pair.name, ev) == sig:
                best["ev"], best["case"] = ev, case
                return True
            return False

        try:
            def strong(case: Any) -> bool:  # (the case `fails` just ran) fails by the margin, or not as a divergence
                got = results.get(case.key())
                return got is not None and (got[1] != "divergence" or got[0] >= EDGE_MARGIN * thr)

            case, evals, complete = polish(repro.case, fails, max_evals=max_evals, deadline=end, axes=pair.axes,
                                           strong=strong)
        except KeyboardInterrupt:
            with signals.critical():
                if best["case"] != repro.case:
                    try:
                        note = _save(repro, path, best["case"], best["ev"], False, device, threads, tracking,
                                     tracking_uri, seconds=round(time.monotonic() - start, 3))
                    except NotWritten:
                        log(f"interrupted     {path}  (the smallest case so far could not be written: it is on "
                            "stderr as JSON, above)")
                        raise KeyboardInterrupt from None
                    log(f"interrupted     {path}  (the smallest case so far is saved: {_size(best['case'])}; "
                        "run again to go on)")
                    if note:
                        log(note)
                else:
                    log(f"interrupted     {path}  (nothing smaller found yet; the file is unchanged)")
            raise
        complete = complete and not stopped["wall"]
        ev = best["ev"] if best["case"] == case else run(case, None)
    seconds = time.monotonic() - start
    why_stopped = ("" if complete else "; --max-evals ran out" if evals >= max_evals else "; the budget ran out")
    neighbours = neighbours_of(case, pair.axes, lambda c: results.get(c.key())) if complete else []
    if case == repro.case:
        note = ""
        if complete and (repro.found.get("shrink_complete", True) is False
                         or corpus.encode_tree(neighbours) != corpus.encode_tree(repro.neighbours)):
            if repro.found.get("shrink_complete", True) is False:
                repro.history.append({"at": corpus.now_iso(), "event": "shrink completed",
                                      "note": f"`harness shrink`: no simpler case fails the same way ({evals} tried)"})
            repro.found = {**repro.found, "shrink_complete": True}
            repro.neighbours = neighbours
            _write(repro, path, smaller=False)
            note = _tell_mlflow(repro, repro.case.one_line(), ev.headline, tracking, tracking_uri, shrunk=False)
        outcome = "minimal" if complete else "unchanged (cut short)"
        log(f"{outcome:15s} {path}  ({_size(case)}; {evals} case(s) tried in {seconds:.1f}s{why_stopped}"
            + ("" if complete else ": run again, or with a larger --budget / --max-evals, to go on") + ")")
        if note:
            log(note)
        return outcome
    old_case = repro.case
    note = _save(repro, path, case, ev, complete, device, threads, tracking, tracking_uri, neighbours=neighbours,
                 seconds=round(seconds, 3), cases_tried=evals)
    outcome = "shrunk" if complete else "cut short"
    log(f"{outcome:15s} {path}  ({_size(old_case)} -> {_size(case)}; {evals} case(s) tried in {seconds:.1f}s; "
        f"now {ev.headline}{why_stopped}" + ("" if complete else ": run again to go on") + ")")
    if note:
        log(note)
    return outcome


class NotWritten(Exception):
    """The repro file could not be written. `smaller`: it held a smaller case, printed as JSON on stderr
    instead; else only its 'shrink complete' mark was lost (the file is as it was)."""

    def __init__(self, path: str, smaller: bool) -> None:
        super().__init__(path)
        self.smaller = smaller


def _write(repro: Any, path: Path, smaller: bool = True) -> None:
    """repro.save(path); a disk or permission error prints the repro whole as JSON on stderr (so the
    work is not lost: save that line as the file) and raises NotWritten."""
    import json

    try:
        repro.save(path)
    except OSError as e:
        print(f"error: could not write {path}: {e.strerror or e} (errno {e.errno}); free space or make its folder "
              f"writable. The repro follows on one line as JSON: save that line as {path} to keep it.",
              file=sys.stderr, flush=True)
        print(json.dumps(repro.to_json(), default=str), file=sys.stderr, flush=True)
        raise NotWritten(str(path), smaller) from None


def _save(repro: Any, path: Path, case: Any, ev: Any, complete: bool, device: str, threads: int, tracking: bool,
          uri: str | None, neighbours: list | None = None, **spent: Any) -> str:
    """Write the smaller case into the repro (the replaced one into its history, with `spent`: the
    seconds and cases this shrink took; `neighbours`: what its simpler neighbours gave), then its
    MLflow run; returns a line about MLflow to print ("" when there was nothing to update)."""
    old_line = repro.case.one_line()
    repro.take_smaller_case(case, ev, complete, device, threads, note="`harness shrink`", neighbours=neighbours,
                            **spent)
    _write(repro, path)
    return _tell_mlflow(repro, old_line, ev.headline, tracking, uri, shrunk=True)


def _tell_mlflow(repro: Any, old_line: str, headline: str, tracking: bool, uri: str | None, shrunk: bool) -> str:
    """Give the repro's MLflow regression run what the file now says (`lifecycle.note_shrunk`);
    returns a line to print ("" when there was nothing to update)."""
    if not tracking:
        return ""
    import os

    holds = "the corpus file holds the shrunk case" if shrunk else "the corpus file says its shrinking is complete"

    from .mlflow_tracking.store import StoreUnavailable

    from .mlflow_tracking.lifecycle import OtherRun, note_shrunk

    try:
        run_id = note_shrunk(repro, old_line, headline, uri, shrunk=shrunk)
    except OtherRun as e:
        return f"  MLflow: {e}; {holds}"
    except StoreUnavailable as e:
        if uri or os.environ.get("MLFLOW_TRACKING_URI"):  # a store named by the user: say it was not updated
            return f"  warning: the MLflow regression run of {repro.id} was not updated ({e}); {holds}"
        # no store named and no embedded one here: a campaign that logged to another store (its
        # --tracking-uri) has a regression run showing the old case; say how to update it
        return (f"  MLflow: no store named and no reports/mlflow.db here, so no regression run was updated; if the "
                f"campaign logged {repro.id} to a store of its own, run again with --tracking-uri URI (its run "
                "shows the case before this shrink)")
    except Exception as e:  # noqa: BLE001 - the corpus file is written; MLflow is a copy
        return (f"  warning: the MLflow regression run of {repro.id} was not updated ({type(e).__name__}: "
                f"{str(e)[:200]}); {holds}")
    if not run_id:
        return ""
    return (f"  MLflow regression run {run_id}: " + ("case, metrics and repro artifact updated" if shrunk else
                                                     "shrink marked complete, metrics and repro artifact updated"))


@click.command("shrink")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--budget", type=FiniteFloat(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds of shrinking per repro.")
@click.option("--max-evals", type=click.IntRange(1), default=500, show_default=True,
              help="Cases tried per repro at most.")
@click.option("--device", default="cpu", show_default=True, help="Device to run the cases on.")
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE",
              help="Load target pairs from a Python file or an importable module (repeatable): a repro of a "
                   "plugin kept outside this repository needs it.")
@click.option("--tracking-uri", default=None, help="MLflow store whose regression runs get the shrunk cases "
              "(default: MLFLOW_TRACKING_URI, else the embedded reports/mlflow.db when it exists).")
@click.option("--no-tracking", is_flag=True, help="Leave MLflow alone: update the corpus files only.")
def shrink_command(paths: tuple[Path, ...], budget: float, max_evals: int, device: str,
                   plugins: tuple[str, ...], tracking_uri: str | None, no_tracking: bool) -> None:
    """Go on shrinking repros whose shrinking was cut short (files, or corpus folders: the cut-short
    repros in them)."""
    from . import corpus
    from .cli import load_plugins
    from .env import resolve_device
    from .errors import HarnessError

    load_plugins(plugins)
    device = resolve_device(device)
    files: list[Path] = []
    done = 0
    for p in paths:
        if not p.is_dir():
            files.append(p)
            continue
        for f in corpus.iter_corpus(p):  # in a folder: the repros whose shrinking was cut short
            try:
                r = corpus.load_repro(f)
            except HarnessError:
                files.append(f)  # (skipped with its reason below)
                continue
            if r.found.get("shrink_complete", True) is False and r.status != "fixed":
                files.append(f)
            else:
                done += 1
    if done:
        click.echo(f"{done} repro(s) in the folder(s) are fully shrunk (or fixed) and left alone; name a file to "
                   "shrink it anyway")
    counts: dict[str, int] = {}
    for f in files:
        try:
            outcome = shrink_file(f, budget, max_evals, device, plugins, log=click.echo, tracking_uri=tracking_uri,
                                  tracking=not no_tracking)
        except NotWritten as e:
            outcome = "not written" if e.smaller else "mark not written"
            click.echo(f"not written     {f}  " + ("(the smaller case is on stderr as JSON, above)" if e.smaller else
                       "(it is minimal, but the file could not take that mark; it is as it was)"))
        counts[outcome] = counts.get(outcome, 0) + 1
    click.echo(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    # 3: a smaller case found but not on disk (as `harness fuzz` exits for an unsaved finding)
    sys.exit(3 if counts.get("not written") else 1 if counts.get("does not fail") else
             2 if counts.get("skipped") or counts.get("mark not written") else 0)
