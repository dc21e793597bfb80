"""Triage commands on the MLflow store: `harness regressions [show|close]` and `harness sync`.

    harness regressions [--status open] [--pair 'router_*'] [--json]   # list
    harness regressions show ID                                          # note, metrics, artifacts
    harness regressions close ID --status fixed|wontfix --note TEXT      # MLflow and corpus file
    harness sync                                                         # upload reports/pending/

ID is the 12-hex finding id (also the corpus file's name), the MLflow run id, or the repro file. Every command takes
--tracking-uri (default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/reports/mlflow.db).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import click

from .bench import check_out_file
from .corpus import STATUSES
from .errors import UsageError

URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///<abs>/reports/mlflow.db)."


def _fmt_k3(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else "-"


def _fmt_mean(r: dict[str, Any]) -> str:
    """The mean the verdict read: `0.0118` for a k3, `kl 0.003` for an exact KL."""
    name, value = r.get("verdict_mean") or ("k3", r.get("k3"))
    return _fmt_k3(value) if name == "k3" else f"kl {_fmt_k3(value)}"


def _day(iso: str) -> str:
    return iso.replace("T", " ")[:16] if iso else "-"


def corpus_status(r: dict[str, Any]) -> str | None:
    """The status the regression's corpus file says (its `corpus_path`, from the working directory),
    None where there is no such file here or it does not read."""
    from pathlib import Path

    p = r.get("corpus_path")
    if not p:
        return None
    try:
        status = json.loads(Path(p).read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None
    return status if isinstance(status, str) else None


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("id", "pair", "symptom", "k3 / kl", "first seen", "last seen", "count", "status", "severity (worst seen)")
    body = [(r["id"], r["pair"], r["symptom"], _fmt_mean(r), _day(r["first_seen"]), _day(r["last_seen"]),
             str(r["seen_count"]), r["status"] + (" (recurrence)" if r["recurrence"] else "")
             + (f"; corpus file: {r['corpus_status']}" if r.get("corpus_status") not in (None, r["status"]) else ""),
             r["severity"])
            for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body])


@click.group(invoke_without_command=True)
@click.option("--status", type=click.Choice(STATUSES), default=None, help="Only regressions in this state.")
@click.option("--pair", default=None, metavar="PAIR|GLOB", help="Only this pair (globs like 'moe_*' work).")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@click.option("--tracking-uri", default=None, help=URI_HELP)
@click.pass_context
def regressions(ctx: click.Context, status: str | None, pair: str | None, as_json: bool,
                tracking_uri: str | None) -> None:
    """List the regressions in MLflow (id, pair, symptom, k3, first/last seen, count, status)."""
    ctx.ensure_object(dict)
    ctx.obj["tracking_uri"] = tracking_uri
    if ctx.invoked_subcommand is not None:
        return
    from .mlflow_tracking import list_regressions, resolve_uri

    rows = list_regressions(tracking_uri, status=status, pair=pair)
    for r in rows:
        r["corpus_status"] = corpus_status(r)
    if as_json:  # (strict JSON: an infinite k3 is the string "inf", as in repro files)
        from .corpus import encode_tree

        click.echo(json.dumps(encode_tree(rows), indent=2, allow_nan=False))
        return
    if not rows:
        what = " ".join(x for x in (f"status {status}" if status else "", f"pair {pair}" if pair else "") if x)
        others = ""
        if pair:  # (a typo in the glob reads as "nothing wrong": name the pairs that do have regressions there)
            import fnmatch

            names = sorted({r["pair"] for r in list_regressions(tracking_uri, status=status)})
            if names and not any(fnmatch.fnmatchcase(n, pair) for n in names):
                others = (f" Its regressions are of {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}: "
                          f"check the --pair glob.")
        click.echo(f"no regressions{' with ' + what if what else ''} in {resolve_uri(tracking_uri)}.{others}")
        return
    click.echo(_table(rows))
    click.echo(f"\n{len(rows)} regression(s) in {resolve_uri(tracking_uri)} (k3 / kl: the latest sighting's; "
               "its case is `last_case` in --json). "
               "`harness regressions show ID` for one, with the command that replays it (`harness replay "
               "--run-id ID`, and `--plugin FILE` for a plugin's pair).")
    apart = [r for r in rows if r["corpus_status"] not in (None, r["status"])]
    if apart:  # (a file restored with git, a close that reached one side only): the replay tests judge the file
        click.echo(f"{len(apart)} regression(s) whose corpus file says another status than the store: "
                   + ", ".join(f"{r['id']} (store {r['status']}, file {r['corpus_status']})" for r in apart[:6])
                   + (", ..." if len(apart) > 6 else "") + ". The corpus tests judge the file: where it says fixed or "
                   "wontfix, `harness regressions close ID --status <that>` brings the store in step (fixed replays "
                   "the repro first); where it says open, the next campaign that sees the bug updates the store, or "
                   "restore the file's closed status with git.")


@regressions.command("show")
@click.argument("ident", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
@click.option("--tracking-uri", default=None, help=URI_HELP)
@click.pass_context
def show(ctx: click.Context, ident: str, as_json: bool, tracking_uri: str | None) -> None:
    """Print one regression: its note, triage tags, metrics and artifacts."""
    from .mlflow_tracking import show_regression

    ident, _ = _id_of_file(ident)
    r = show_regression(ident, tracking_uri or ctx.obj.get("tracking_uri"))
    if as_json:
        from .corpus import encode_tree

        click.echo(json.dumps(encode_tree(r), indent=2, allow_nan=False))
        return
    click.echo(r["note"] or f"(no note) regression {r['id']} of {r['pair']}")
    click.echo(f"\nrun {r['run_id']}  status {r['status']}  severity {r['severity']}  seen {r['seen_count']}x "
               f"({_day(r['first_seen'])} .. {_day(r['last_seen'])})" + ("  RECURRENCE" if r["recurrence"] else ""))
    if r["tags"].get("harness.triage_verdict"):  # `harness triage --run-id` (its report: artifacts/triage)
        click.echo(f"triage verdict (harness.triage_verdict): {r['tags']['harness.triage_verdict']}")
    t = r["tags"]
    if t.get("harness.triage_note"):  # (written by `regressions close`: the note of the last close)
        closed = f"closed {_day(t.get('harness.closed_at', ''))} by {t.get('harness.closed_by', '?')}"
        if r["status"] in ("fixed", "wontfix"):
            click.echo(f"{closed} as {r['status']}: {t['harness.triage_note']}")
        else:  # seen again after it was closed: the note is history, not why it is open
            click.echo(f"{closed}, reopened {_day(t.get('harness.reopened_at', ''))}"
                       + (f" by {t.get('harness.reopened_by', '?')} ({t['harness.reopen_note']})"
                          if t.get("harness.reopen_note") else "")
                       + f"; the close note said: {t['harness.triage_note']}")
    last = t.get("harness.last_case", "")
    click.echo("metrics" + (f" (of its latest sighting's case, `{last}`)" if last and last != t.get("harness.case")
                            else "") + ": " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(r["metrics"].items())))
    click.echo("artifacts: " + (", ".join(r["artifacts"]) or "-"))
    if r["corpus_path"]:
        click.echo(f"corpus file: {r['corpus_path']}")


def _id_of_file(ident: str, corpus_file: str | None = None) -> tuple[str, str | None]:
    """A repro file given as ID: (its finding id, the file as --corpus-file unless one was given)."""
    if not ident.endswith(".json"):
        return ident, corpus_file
    from .corpus import load_repro

    repro = load_repro(ident)  # (a file that is not there, or not a repro: its one-paragraph error)
    return repro.id, corpus_file or ident


@regressions.command("close")
@click.argument("ident", metavar="ID")
@click.option("--status", type=click.Choice(["fixed", "wontfix"]), required=True,
              help="fixed: replays must stay under the threshold from now on; wontfix: accepted.")
@click.option("--note", required=True, help="Why: the fix (commit, PR) or why it is accepted.")
@click.option("--corpus-file", default=None, type=click.Path(dir_okay=False),
              help="The repro file to update when the path recorded in MLflow is not on this machine.")
@click.option("--tracking-uri", default=None, help=URI_HELP)
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE",
              help="Load the regression's pair from a plugin (to replay it before closing it as fixed).")
@click.option("--no-tracking", "no_tracking", is_flag=True,
              help="A corpus kept without MLflow: change the --corpus-file alone (ID may be that file).")
@click.pass_context
def close(ctx: click.Context, ident: str, status: str, note: str, corpus_file: str | None,
          tracking_uri: str | None, plugins: tuple[str, ...], no_tracking: bool) -> None:
    """Close a regression: set its status in MLflow and in its corpus file, with a note.

    --status fixed replays the repro first and refuses one that still diverges; where its severe case
    (found.severe) still fails, that case is recorded as an open repro of its own (a second bug)."""
    _set_status(ctx, ident, status, note, corpus_file, tracking_uri, plugins, no_tracking)


@regressions.command("reopen")
@click.argument("ident", metavar="ID")
@click.option("--note", required=True, help="Why: e.g. closed as wontfix by mistake.")
@click.option("--corpus-file", default=None, type=click.Path(dir_okay=False),
              help="The repro file to update when the path recorded in MLflow is not on this machine.")
@click.option("--tracking-uri", default=None, help=URI_HELP)
@click.option("--no-tracking", "no_tracking", is_flag=True,
              help="A corpus kept without MLflow: change the --corpus-file alone (ID may be that file).")
@click.pass_context
def reopen(ctx: click.Context, ident: str, note: str, corpus_file: str | None, tracking_uri: str | None,
           no_tracking: bool) -> None:
    """Reopen a regression closed by mistake (a wontfix that hides a real bug; a fixed that is not):
    status open in MLflow and in its corpus file, with the note; campaigns and the corpus tests treat
    it as open again."""
    _set_status(ctx, ident, "open", note, corpus_file, tracking_uri, (), no_tracking)


def _set_status(ctx: click.Context, ident: str, status: str, note: str, corpus_file: str | None,
                tracking_uri: str | None, plugins: tuple[str, ...], no_tracking: bool) -> None:
    verb = "reopen" if status == "open" else "close"
    if no_tracking:
        from .mlflow_tracking.lifecycle import close_in_corpus

        if corpus_file is None and ident.endswith(".json"):
            corpus_file = ident
        if corpus_file is None:
            raise UsageError(f"--no-tracking {verb}s the corpus file alone: pass it, --corpus-file "
                             "corpora/<pair>/<id>.json (or give the file as ID).")
        if not ident.endswith(".json") and Path(corpus_file).stem != ident:
            raise UsageError(f"--corpus-file {corpus_file} is not the repro of {ident} (its name is its id); pass "
                             f"that regression's own file, corpora/<pair>/{ident}.json. Nothing was changed.")
        r = close_in_corpus(corpus_file, status, note, plugins)
    else:
        from .mlflow_tracking import close_regression

        ident, corpus_file = _id_of_file(ident, corpus_file)
        try:
            r = close_regression(ident, status, note, tracking_uri or ctx.obj.get("tracking_uri"), corpus_file, plugins)
        except UsageError as e:
            if not str(e).startswith(("no regression ", "MLflow store ")) or corpus_file is None \
                    or not Path(corpus_file).is_file():
                raise
            # a repro found with --no-tracking is in no store: its file alone is what there is to close
            flag = "" if status == "open" else f" --status {status}"
            raise UsageError(f"{e} A repro found without MLflow (--no-tracking) is in no store: {verb} its file alone "
                             f"with `harness regressions {verb} {shlex.quote(corpus_file)}{flag} --note ... "
                             "--no-tracking`. Nothing was changed.") from None
    if r.get("unchanged"):
        click.echo(f"regression {r['id']} ({r['pair']}) is already {r['status']} ({r['unchanged']}): nothing changed.")
        return
    if not no_tracking:
        click.echo(f"regression {r['id']} ({r['pair']}, run {r['run_id']}): status {r['status']} in MLflow.")
    if r["corpus_updated"]:
        click.echo(f"corpus file {r['corpus_updated']}: status {r['status']}, note added to its history "
                   "(commit it so the replay tests follow).")
    elif r["corpus_missing"]:
        click.echo(f"warning: corpus file {r['corpus_missing']} is not on this machine; update it where it lives, "
                   "or pass --corpus-file PATH.", err=True)
    sev = r.get("severe")
    if sev and sev["path"]:
        for line in sev["lines"]:  # (its warnings; the line recording it says what the one below says)
            if line.startswith("warning"):
                click.echo(line, err=True)
        click.echo(f"its severe case still fails ({sev['headline']}): a second bug its minimal case did not hold, "
                   + (f"now open repro {sev['id']}: {sev['path']}" if sev["new"] else f"already in the corpus: {sev['path']}")
                   + (f" (MLflow regression run {sev['run_id']})" if sev["run_id"] else "")
                   + ". Commit it; `harness triage` it to see which component it is.")
    elif sev:
        click.echo(f"warning: its severe case still fails ({sev['headline']}): a second bug, not recorded, since the "
                   f"corpus file is not here; record it where the corpus lives: `harness record {r['pair']} --case "
                   f"'{sev['case']}'`.", err=True)


@click.command()
@click.option("--tracking-uri", default=None, help=URI_HELP)
@click.option("--pending", "pending_dir", default=None, type=click.Path(file_okay=False),
              help="Spool folder (default: reports/pending of the working directory).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def sync(tracking_uri: str | None, pending_dir: str | None, as_json: bool) -> None:
    """Upload findings spooled while the MLflow store was unreachable (safe to run twice).

    Exit 0 when the spool is empty afterwards, 1 when some findings are still pending or a spooled
    file could not be uploaded (it stays in the spool).
    """
    from .mlflow_tracking import sync_pending

    s = sync_pending(tracking_uri, pending_dir, log=lambda m: click.echo(m, err=True))
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        click.echo(f"sync to {s['uri']}: {s['campaigns']} campaign(s); regressions created {s['created']}, "
                   f"seen again {s['seen']}, reopened {s['reopened']}, already uploaded {s['already']}; "
                   f"failed {s['failed']}, still pending {s['remaining']}.")
    sys.exit(1 if s["remaining"] or s["failed"] else 0)


# ---------------------------------------------------------------------------------------------
# `harness bench tracking`: what MLflow tracking adds to a campaign
# ---------------------------------------------------------------------------------------------
def tracking_overhead(pair_names: tuple[str, ...], max_examples: int, seed: int) -> dict[str, Any]:
    """One campaign without tracking, then the same campaign logged to a fresh embedded store, again
    to that store (every finding already there: the dedup path), and to a closed port (the spool).
    Tracker time is measured inside the tracker's own calls, so campaign noise does not enter it."""
    import socket
    import tempfile
    import time
    from pathlib import Path

    from .fuzz import CampaignConfig, run_campaign
    from .mlflow_tracking import MlflowTracker
    from .pairs import REGISTRY
    from .tracking import NullTracker

    REGISTRY.load_builtins()
    pairs = REGISTRY.select(pair_names)
    rows = []
    with tempfile.TemporaryDirectory(prefix="harness-bench-tracking-") as tmp:
        uri = f"sqlite:///{tmp}/store/mlflow.db"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        runs = [("off (--no-tracking)", None), ("fresh embedded store (includes `import mlflow` and schema "
                                               "creation)", uri), ("same store again (findings dedup)", uri),
                ("closed port (spooled)", dead)]
        for label, target in runs:
            tracker = NullTracker() if target is None else MlflowTracker(target, log=lambda m: None,
                                                                         spool_dir=Path(tmp) / "pending")
            cfg = CampaignConfig(pairs=pairs, seed=seed, max_examples=max_examples, corpus=Path(tmp) / "corpora")
            t0 = time.perf_counter()
            result = run_campaign(cfg, tracker, log=lambda m: None)
            wall = time.perf_counter() - t0
            timings = getattr(tracker, "timings", {})
            n = len(result.findings)
            rows.append({"tracking": label, "wall": wall, "cases": result.examples, "findings": n,
                         "tracker": getattr(tracker, "seconds", 0.0), "start": timings.get("campaign_started", 0.0),
                         "per_finding": timings.get("finding", 0.0) / n if n else 0.0,
                         "finish": timings.get("campaign_finished", 0.0)})
        # a new process (a night's `harness fuzz`) pays the import and the store connection again
        import subprocess
        import sys

        code = ("import time; t = time.perf_counter(); import mlflow; t1 = time.perf_counter(); "
                "from harness.mlflow_tracking import Store; Store(%r); t2 = time.perf_counter(); "
                "print(t1 - t, t2 - t1)" % uri)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        new_process = {"import_mlflow": float(out[0]), "open_store": float(out[1])}
    return {"pairs": [p.name for p in pairs], "max_examples": max_examples, "seed": seed, "rows": rows,
            "new_process": new_process}


@click.command("tracking")
@click.argument("pair_names", nargs=-1, metavar="[PAIR|GLOB]...")
@click.option("--max-examples", type=click.IntRange(1), default=15, show_default=True)
@click.option("--seed", type=click.IntRange(0), default=1, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default="reports/BENCHMARKS.md", show_default=True,
              callback=check_out_file)
def bench_tracking_command(pair_names: tuple[str, ...], max_examples: int, seed: int, out: str) -> None:
    """Time MLflow tracking adds to a small campaign (fresh store, existing store, unreachable store)."""
    from pathlib import Path

    from .bench import machine, write_section

    names = pair_names or ("rmsnorm.eps_placement", "rotary.bf16_angles")
    r = tracking_overhead(names, max_examples, seed)
    lines = [
        "## Tracking overhead (MLflow)", "",
        f"`harness bench tracking {' '.join(names)} --max-examples {max_examples} --seed {seed}` on {machine()}. "
        "One process, campaigns in this order; `tracker` is the time spent inside the tracker's calls "
        "(start: campaign run and store connection; per finding: regression run with note, params, metrics, "
        "repro, CSV and plot; finish: campaign metrics).", "",
        "| tracking | campaign wall s | cases | findings | tracker s | start s | per finding s | finish s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['tracking']} | {row['wall']:.2f} | {row['cases']} | {row['findings']} | "
                     f"{row['tracker']:.2f} | {row['start']:.2f} | {row['per_finding']:.3f} | {row['finish']:.3f} |")
    npr = r["new_process"]
    lines += ["", f"A new process connecting to the existing store (what each later `harness fuzz` pays once): "
              f"`import mlflow` {npr['import_mlflow']:.2f} s, opening the store {npr['open_store']:.2f} s."]
    write_section(Path(out), "tracking", "\n".join(lines))
    click.echo("\n".join(lines))
    click.echo(f"\nwritten to {out}")
