"""`harness rerecord`: rewrite corpus files after a change that moves metrics in their last bits.

A repro's recorded metrics are compared bit-for-bit on replay, so a harness change that computes
them differently (another summation order, another normalisation) makes every file "not
bit-for-bit" without changing any verdict. This command replays each repro and, only when the
replay keeps the recorded verdict (same symptom; a divergence still above its threshold; a `fixed`
repro still clean), writes the new metrics into the file, rewrites the case in the current schema
(a schema-1 case keeps `streams: "single"`, so its tensors are unchanged), and appends a
`rerecorded` entry to its history. A file that did not record the torch thread count it was found
with gets this process's (the count its new metrics were computed with; replay uses it). A rewritten
file also records this machine's facts (`env.machine_facts`: torch, numpy, CPU, ...) as
`environment.metrics_recorded_on`, beside the environment the bug was found in, which stays; so
does a file whose metrics this machine reproduces bit for bit although they were recorded without a
fact or on another machine. A repro whose verdict changed, or whose metrics moved beyond last-bit
noise (more than 1%: `ReplayResult.beyond_noise`) with the same verdict, is left untouched and
reported: that is a behaviour change for a person to look at, not a rounding change
(`--accept-changes` rewrites the second kind, for a metric now computed differently). The history
entry of a rewrite keeps the replaced metrics.

A repro whose case was edited by hand since it was recorded (its `case_fingerprint` no longer
matches; replay then does not compare its metrics, which are another case's) gets the edited
case's metrics and fingerprint, under the same rule.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click


def rerecord_file(path: Path, device: str = "cpu", accept_changes: bool = False,
                  reason: str | None = None) -> tuple[str, str]:
    """(outcome, detail) for one file: outcome is "rewritten", "unchanged", "verdict changed", "metrics
    changed" (a metric moved beyond last-bit noise, `ReplayResult.beyond_noise`: left alone unless
    `accept_changes`) or "skipped". `reason`: the person's, kept in the history entry of a rewrite."""
    from . import corpus
    from .env import METRICS_ON, machine_differences, record_metrics_machine, recorded_threads
    from .errors import HarnessError

    try:
        repro = corpus.load_repro(path)
        why = corpus.load_plugin_for(repro)
        if why:
            return "skipped", why
        res = corpus.replay(repro, device=device)
    except HarnessError as e:
        return "skipped", str(e)
    ev = res.evaluation
    same_symptom = ev.symptom.value == repro.symptom
    if repro.status == "fixed":
        keeps = not ev.failed
    else:
        keeps = same_symptom and ev.failed
    if not keeps:
        return "verdict changed", (f"recorded {repro.symptom} ({repro.status}), replay gives "
                                   f"{ev.symptom.value if ev.failed else 'clean'} {ev.headline}"
                                   + (" (its case was edited by hand and passes: restore it from git, or record a "
                                      "case that fails)" if repro.case_edited and not ev.failed else ""))
    fixed_clean = repro.status == "fixed" and not ev.failed
    if fixed_clean and not repro.case_edited:  # the metrics document the bug
        return "unchanged", "fixed: its metrics are the bug's, kept as they are"
    if fixed_clean:  # edited: the bug's metrics stay; the fingerprint becomes the edited case's
        repro.case_edited = False
        repro.history.append({"event": "rerecorded", "at": corpus.now_iso(), **({"why": reason} if reason else {}),
                              "note": "case edited by hand, "
                              "fingerprint renewed; fixed: its metrics stay those of the bug"})
        repro.save(path)
        return "rewritten", "fixed: case fingerprint renewed, the bug's metrics kept"
    new_metrics = corpus.metrics_json(ev) if ev.divergence is not None else repro.metrics
    threads = recorded_threads(repro.environment)
    recorded = {k: corpus.encode_float(v) for k, v in repro.metrics.items()}  # (NaN == NaN as "nan")
    if new_metrics == recorded and not repro.case_edited and threads is not None:
        elsewhere = machine_differences(repro.environment, device)
        if not elsewhere or not repro.metrics:  # (no metrics: nothing a machine decides)
            return "unchanged", ""
        # recorded without a fact, or on another machine, and reproduced bit for bit here: the
        # metrics are this machine's too, and a replay here can hold them to their last bit
        repro.environment = record_metrics_machine(repro.environment, device, threads)
        repro.history.append({"event": "rerecorded", "at": corpus.now_iso(), **({"why": reason} if reason else {}),
                              "differed_in": elsewhere,
                              "note": "metrics reproduced bit for bit on this machine; its facts recorded in "
                                      f"environment.{METRICS_ON}"})
        repro.save(path)
        return "rewritten", "metrics reproduced bit for bit here; this machine's facts recorded"
    beyond = res.beyond_noise()  # (empty for an edited case: its metrics are another case's)
    if res.nondeterministic and not repro.case_edited and not accept_changes:
        return "unchanged", ("recorded as not deterministic: every run of its case gives other metrics, so there is "
                             "nothing to rerecord (replay and the corpus test hold it to its failure only); "
                             "--accept-changes records this run's draw")
    if beyond and not accept_changes:
        moved = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(beyond.items())[:4])
        return "metrics changed", (f"{moved}: more than last-bit noise, with the same verdict; look at why, and rerun "
                                   "with --accept-changes if it is intended (a metric now computed differently)")
    moved_keys = sorted(res.mismatches) if res.compared else []
    edited, repro.case_edited = repro.case_edited, False  # (the metrics are now this case's: a new fingerprint)
    if edited:
        repro.history.append({"event": "case edited", "at": corpus.now_iso(), "replaced_metrics": repro.metrics,
                              **({"replaced_error": repro.error} if repro.error else {})})
        if ev.error is not None:  # an error/crash/timeout repro: the edited case's own error
            repro.error = ev.error
    elsewhere = machine_differences(repro.environment, device)
    repro.metrics = new_metrics
    # the metrics are now this machine's and software's: its facts go beside the finding's environment
    # (which stays where the bug was found), so a replay here compares bit for bit and one elsewhere
    # knows it may differ in the last bits
    if threads is None:  # replayed with this process's thread count: the metrics are that count's
        import torch

        threads = torch.get_num_threads()
        repro.environment = {**repro.environment, "torch_threads": threads}
    repro.environment = record_metrics_machine(repro.environment, device, threads)
    entry = {"event": "rerecorded", "at": corpus.now_iso(), **({"why": reason} if reason else {})}
    if elsewhere:
        entry["differed_in"] = elsewhere
    if not edited:  # (an edited case's replaced metrics are in its "case edited" entry)
        entry["replaced_metrics"] = recorded
    if beyond:  # (accepted with --accept-changes)
        entry["changed_beyond_noise"] = sorted(beyond)
    entry["note"] = ("metrics recomputed for the case as edited by hand; verdict unchanged" if edited else
                     "metrics recomputed here (another harness version, or another machine: see differed_in); "
                     "verdict unchanged")
    repro.history.append(entry)
    repro.save(path)
    return "rewritten", ev.headline + (f"; {len(moved_keys)} metric(s) moved: {', '.join(moved_keys[:6])}"
                                       + (", ..." if len(moved_keys) > 6 else "") if moved_keys else "")


@click.command("rerecord")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--device", default="cpu", show_default=True, help="Device to replay on.")
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE",
              help="Load target pairs from a Python file or an importable module (repeatable): a repro of a "
                   "plugin kept outside this repository needs it.")
@click.option("--accept-changes", is_flag=True, help="Also rewrite metrics that moved beyond last-bit noise (more "
              "than 1%) with the verdict unchanged: a metric now computed differently. The history keeps the old.")
@click.option("--note", "reason", default=None, metavar="TEXT",
              help="Why the metrics moved (a new torch, a reduction order changed on purpose): kept in each "
                   "rewritten file's history entry.")
def rerecord_command(paths: tuple[Path, ...], device: str, plugins: tuple[str, ...], accept_changes: bool,
                     reason: str | None) -> None:
    """Replay repros and rewrite their recorded metrics where the verdict is unchanged."""
    from . import corpus
    from .cli import load_plugins

    load_plugins(plugins)

    files: list[Path] = []
    for p in paths:
        files.extend(corpus.iter_corpus(p) if p.is_dir() else [p])
    counts: dict[str, int] = {}
    for f in files:
        try:
            outcome, detail = rerecord_file(f, device, accept_changes, reason)
        except OSError as e:  # a full disk, a read-only folder: the file is as it was (writes are atomic)
            outcome, detail = "not written", (f"{e.strerror or e} (errno {e.errno}); the file is unchanged: free "
                                              "space or make its folder writable, then run again")
        counts[outcome] = counts.get(outcome, 0) + 1
        click.echo(f"{outcome:15s} {f}" + (f"  ({detail})" if detail else ""))
    click.echo(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    # as `replay`: 1 when a verdict or a metric changed beyond noise (a behaviour change to look at), else 2
    # when a repro could not be replayed here (its reason is printed beside it), else 0
    # (a file not written first: work left undone, whatever else the run says)
    sys.exit(2 if counts.get("not written") else 1 if counts.get("verdict changed") or counts.get("metrics changed")
             else 2 if counts.get("skipped") else 0)
