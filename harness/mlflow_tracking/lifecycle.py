"""A regression's life in MLflow: campaign and regression runs created, seen again, reopened,
listed, shown, fetched and closed."""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..metrics import verdict_mean
from ..pairs import is_glob
from .payload import _append_note, _finite_metrics, _g, flatten_case, found_metrics, regression_note
from .plots import write_artifacts
from .store import (CAMPAIGN, REGRESSION, REPRO_ARTIFACTS, TRIAGE_STATUSES, Store, _q, _short, now_iso, open_store,
                    resolve_uri, sqlite_path)


def _verdict(m: dict[str, Any]) -> str:
    """The mean the verdict read, for a note: `mean k3 0.012` or `mean exact KL 0.003`."""
    name, value = verdict_mean(m)
    return f"{'mean exact KL' if name == 'kl' else 'mean k3'} {_g(value)}"

# ---------------------------------------------------------------------------------------------
# Writing runs
# ---------------------------------------------------------------------------------------------
def _tags(d: dict[str, Any]) -> list:
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)) for k, v in d.items()]


def start_campaign(store: Store, camp: dict[str, Any]) -> str:
    """The campaign run of a payload: found by its uid (an earlier upload), else created."""
    from mlflow.entities import Param

    with store.lock():
        run = store.campaign_with_uid(camp["uid"])
        if run is not None:
            return run.info.run_id
        run = store.client.create_run(
            store.experiment_id, start_time=camp.get("started_ms"),
            run_name=camp.get("run_name") or (f"campaign seed {camp['seed']}"
                                              + ("" if camp["shard"] == "none" else f" shard {camp['shard']}")),
            tags={"harness.kind": CAMPAIGN, "harness.campaign_uid": camp["uid"], "harness.started": camp["started"]})
        store.client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in camp["params"].items()])
    return run.info.run_id


def finish_campaign(store: Store, run_id: str, metrics: dict[str, float], label: str | None) -> None:
    """Campaign metrics; `label` set when the run is shared by several workers (keys get a prefix)."""
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    prefix = f"{label}." if label else ""
    from .payload import FLAGS

    listed = {}
    for suffix, tag in ((".missed", "missed_demonstrations"), *((s, s[1:]) for s in FLAGS.values())):
        names = sorted(k[len("pair."):-len(suffix)] for k, v in metrics.items()
                       if k.startswith("pair.") and k.endswith(suffix) and v)
        if names:
            listed[f"harness.{prefix}{tag}"] = ",".join(names)[:5000]
    tags = _tags(listed)
    with store.lock():
        store.client.log_batch(run_id, metrics=[Metric(prefix + k, v, ts, 0) for k, v in metrics.items()], tags=tags)
        if not label:
            store.client.set_terminated(run_id, "KILLED" if metrics.get("interrupted") else "FINISHED")


def log_regression(store: Store, p: dict[str, Any], parent_run_id: str | None, campaign_uid: str) -> tuple[str, str]:
    """Log one finding; returns (run id, what happened: created | seen | reopened | already | already-known)."""
    with store.lock():
        existing = store.regressions_with_signature(p["signature"])
        if existing:
            return existing[0].info.run_id, _seen_again(store, existing[0], p, parent_run_id, campaign_uid)
        run_id = _create_regression(store, p, parent_run_id, campaign_uid)
        # a remote store has no lock: if another writer created the same signature meanwhile, the
        # oldest run wins and this one is deleted and counted there
        again = store.regressions_with_signature(p["signature"])
        if len(again) > 1 and again[0].info.run_id != run_id:
            store.client.delete_run(run_id)
            return again[0].info.run_id, _seen_again(store, store.client.get_run(again[0].info.run_id), p,
                                                     parent_run_id, campaign_uid)
    return run_id, "created"


def seen_tag(campaign_uid: str) -> str:
    """The tag a regression run carries for every campaign that saw it: each campaign counts once
    in `seen_count`, whatever order and however often spooled campaigns are uploaded."""
    return f"harness.seen_by.{campaign_uid}"


def _create_regression(store: Store, p: dict[str, Any], parent_run_id: str | None, campaign_uid: str) -> str:
    from mlflow.entities import Metric, Param

    c = store.client
    tags = {
        "harness.kind": REGRESSION,
        "harness.pair": p["pair"],
        "harness.expected": p["expected"],
        "harness.symptom": p["symptom"],
        "harness.fired": str((p.get("metrics") or {}).get("fired", "")),  # which mean crossed the threshold
        # what those means are over (`TargetPair.verdict_over`)
        "harness.verdict_over": str((p.get("metrics") or {}).get("verdict_over", "batch")),
        "harness.signature": p["signature"],
        "harness.finding_id": p["id"],
        "harness.status": p["status"],
        "harness.severity": p["severity"],
        "harness.first_seen": p["seen_at"],
        "harness.last_seen": p["seen_at"],
        "harness.seen_count": "1",
        "harness.recurrence": "true" if p.get("corpus_recurrence") else "false",
        "harness.corpus_path": p.get("corpus_path") or "",
        "harness.case": p["case_line"][:5000],
        "harness.last_campaign": campaign_uid,
        "harness.first_campaign": campaign_uid,  # (what `_seen_again` tells a known regression from tonight's by)
        seen_tag(campaign_uid): p["seen_at"],
    }
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    if _infinite(p.get("metrics")):
        tags[INFINITE_TAG] = _infinite(p.get("metrics"))
    run = c.create_run(store.experiment_id, tags=tags, run_name=f"{p['pair']} {p['symptom']} {p['id']}")
    run_id = run.info.run_id
    ts = int(time.time() * 1000)
    metrics = [Metric(k, v, ts, 0) for k, v in {**_finite_metrics(p["metrics"]), **found_metrics(p)}.items()]
    params = [Param(k, v[:6000]) for k, v in flatten_case(p["case"]).items()]
    params.append(Param("threshold", str(p["threshold"])))
    c.log_batch(run_id, metrics=metrics, params=params)
    c.set_tag(run_id, "mlflow.note.content", regression_note(p, run_id, store.uri))
    with tempfile.TemporaryDirectory(prefix="harness-artifacts-") as tmp:
        for artifact_dir, path in write_artifacts(p, Path(tmp)).items():
            c.log_artifact(run_id, str(path), artifact_dir)
    c.set_terminated(run_id, "FINISHED")
    return run_id


def _seen_again(store: Store, run: Any, p: dict[str, Any], parent_run_id: str | None, campaign_uid: str) -> str:
    from mlflow.entities import Metric

    c = store.client
    tags = run.data.tags
    if tags.get("harness.last_campaign") == campaign_uid or seen_tag(campaign_uid) in tags:
        # this campaign was counted already (another shard or stream of the night, an upload run twice,
        # a spool restored): "already" when this campaign created the run, "already-known" when an
        # earlier one did (a known regression, for `pytest_plugin`; runs from before the tag: "already")
        first = tags.get("harness.first_campaign")
        return "already-known" if first is not None and first != campaign_uid else "already"
    count = int(tags.get("harness.seen_count", "1") or 1) + 1
    updates = {
        "harness.seen_count": str(count),
        "harness.last_seen": max(tags.get("harness.last_seen", ""), p["seen_at"]),
        "harness.last_campaign": campaign_uid,
        # the case this sighting's metrics (logged below, a step per sighting) are of: another corpus's
        # minimal case, or a half-shrunk one, need not be the first sighting's (`harness.case`)
        "harness.last_case": p["case_line"][:5000],
        seen_tag(campaign_uid): p["seen_at"],
    }
    if parent_run_id:
        updates["harness.last_campaign_run_id"] = parent_run_id
    if (p.get("metrics") or {}).get("fired"):
        updates["harness.fired"] = str(p["metrics"]["fired"])
    if p.get("metrics") and (_infinite(p["metrics"]) or tags.get(INFINITE_TAG)):  # (this sighting's, as the metrics)
        updates[INFINITE_TAG] = _infinite(p["metrics"])
    rank = ["low", "medium", "high", "critical"]  # (a later campaign whose cases got worse raises it)
    was = tags.get("harness.severity")
    note = tags.get("mlflow.note.content", "")
    if p.get("severity") in rank and rank.index(p["severity"]) > (rank.index(was) if was in rank else -1):
        updates["harness.severity"] = p["severity"]
        if was in rank:  # the note's headline said the old one: say the new one there and why at the end
            peak, thr = p.get("peak_judged"), p.get("threshold")
            reached = (f": its cases reached {peak:.3g}, {peak / thr:.0f}x the line" if isinstance(peak, (int, float))
                       and math.isfinite(peak) and thr else "")
            note = _append_note(note.replace(f"Severity **{was}**", f"Severity **{p['severity']}** (raised from "
                                             f"{was}: see the end of this note)", 1),
                                f"#### Severity raised {p['seen_at']}\n\nCampaign seed {p['campaign_seed']}: "
                                f"**{was}** -> **{p['severity']}**{reached}.")
            updates["mlflow.note.content"] = note
    what = "seen"
    if p.get("corpus_recurrence"):  # the corpus file said fixed and the engine reopened it
        updates["harness.recurrence"] = "true"
        updates["harness.reopened_at"] = p["seen_at"]
    if tags.get("harness.status") == "fixed":
        what = "reopened"
        updates["harness.status"] = "open"
        updates["harness.recurrence"] = "true"
        updates["harness.reopened_at"] = p["seen_at"]  # (the morning report's headline: reopened tonight)
        if tags.get("harness.reopen_note"):  # (a reopen by hand before: not why it is open now)
            updates["harness.reopen_note"] = ""
        updates["mlflow.note.content"] = _append_note(
            _note_status(note, "fixed", "open"),
            f"#### Recurrence {p['seen_at']}\n\nMarked fixed, seen again by campaign seed {p['campaign_seed']}: "
            f"{_verdict(p['metrics'])}, minimal case `{p['case_line']}`. Reopened.")
    replaced = _corpus_case_replaced(tags, p)
    if replaced:  # the run's repro is what `harness replay --run-id` replays: the corpus file's case, as it is now
        updates["harness.case"] = p["case_line"][:5000]
        updates["mlflow.note.content"] = _append_note(
            updates.get("mlflow.note.content", note),
            f"#### Minimal case replaced {p['seen_at']}\n\nCampaign seed {p['campaign_seed']} wrote a smaller case "
            f"to the corpus file: `{tags.get('harness.case', '')}` -> `{p['case_line']}`, {_verdict(p['metrics'])}. "
            "The run's repro artifact is that case.")
    c.log_batch(run.info.run_id, tags=_tags(updates))
    if replaced:
        with tempfile.TemporaryDirectory(prefix="harness-artifacts-") as tmp:
            for artifact_dir, path in write_artifacts(p, Path(tmp)).items():
                c.log_artifact(run.info.run_id, str(path), artifact_dir)
    ts = int(time.time() * 1000)
    metrics = [Metric(k, v, ts, count - 1) for k, v in {**_finite_metrics(p["metrics"]), **found_metrics(p)}.items()]
    if metrics:
        c.log_batch(run.info.run_id, metrics=metrics)
    return what


def _corpus_case_replaced(tags: dict, p: dict[str, Any]) -> bool:
    """A sighting whose corpus file now holds another minimal case than the run (the campaign wrote a
    smaller one there): the run's corpus file (or, where that file is not on this machine, a case
    strictly smaller than the run's), so that the run's repro stays the file's. Another corpus's case
    (the same bug found into another checkout) leaves the run as it is."""
    held = tags.get("harness.case", "")
    if not p.get("corpus_holds_case") or not p.get("repro") or held == p["case_line"][:5000]:
        return False
    recorded, path = tags.get("harness.corpus_path") or "", p.get("corpus_path") or ""
    if recorded and path and Path(recorded).exists():
        try:
            return Path(recorded).samefile(path)
        except OSError:
            return False
    old, new = _case_size(held), _case_size(p["case_line"])
    return old is not None and new is not None and new < old


# ---------------------------------------------------------------------------------------------
# Reading back: list, show, fetch, close
# ---------------------------------------------------------------------------------------------
def _int(x: Any, default: int = 0) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


# MLflow metrics are finite: the metrics of a regression's latest sighting that were +-inf (a sampled
# token one path gives probability 0: k3 = inf) are named in this tag, comma-separated ("-name" for
# -inf), and read back
# as such by `regression_dict` (a list showed their k3 as nan)
INFINITE_TAG = "harness.infinite_metrics"


def _infinite(metrics: Any) -> str:
    """The names of a payload's metrics that are +-inf ("inf" in JSON), comma-separated ("" if none)."""
    from ..corpus import decode_float

    out = []
    for k, v in (metrics or {}).items():
        v = decode_float(v)
        if isinstance(v, float) and math.isinf(v):
            out.append(k if v > 0 else f"-{k}")
    return ",".join(sorted(out))


def _note_status(note: str, old: str, new: str) -> str:
    """A regression note whose headline states `old` as its status, stating `new` (what changed it is
    appended at the end); a note that does not say `old` is left as it is."""
    import re

    pattern = re.compile(r", status \*\*" + re.escape(old) + r"\*\*(?: \(earlier \w+; the end of this note says why\))?")
    if not old or old == new:
        return note
    return pattern.sub(f", status **{new}** (earlier {old}; the end of this note says why)", note, count=1)


def regression_dict(run: Any) -> dict[str, Any]:
    t, m = run.data.tags, dict(run.data.metrics)
    for k in filter(None, t.get(INFINITE_TAG, "").split(",")):  # (not loggable: named in a tag, "-" for -inf)
        m[k.lstrip("-")] = -math.inf if k.startswith("-") else math.inf
    return {
        "id": t.get("harness.finding_id", ""),
        "run_id": run.info.run_id,
        "pair": t.get("harness.pair", ""),
        "expected": t.get("harness.expected", ""),
        "symptom": t.get("harness.symptom", ""),
        "status": t.get("harness.status", ""),
        "severity": t.get("harness.severity", ""),
        # what the list's "k3 / kl" column shows: [name, value] of the mean the verdict read (the
        # expected k3 over the vocabulary, or the exact KL); "k3" is the sampled tokens' mean k3
        "verdict_mean": list(verdict_mean({**m, "fired": t.get("harness.fired", ""),
                                           "verdict_over": t.get("harness.verdict_over", "batch")})),
        "k3": m.get("k3_kl"),
        "k3_expected": m.get("k3_expected"),
        "k3_seq_max": m.get("k3_seq_max"),
        "kl": m.get("kl"),
        "kl_excluded": m.get("kl_excluded"),
        "fired": t.get("harness.fired", ""),
        "first_seen": t.get("harness.first_seen", ""),
        "last_seen": t.get("harness.last_seen", ""),
        "seen_count": _int(t.get("harness.seen_count"), 1),
        "recurrence": t.get("harness.recurrence") == "true",
        "reopened_at": t.get("harness.reopened_at", ""),  # when it was last marked fixed and seen again
        "case": t.get("harness.case", ""),
        "last_case": t.get("harness.last_case", "") or t.get("harness.case", ""),  # (what the metrics are of)
        "corpus_path": t.get("harness.corpus_path") or None,
        "campaign_run_id": t.get("mlflow.parentRunId"),
        "signature": t.get("harness.signature", ""),
    }


def list_regressions(uri: str | None = None, status: str | None = None, pair: str | None = None) -> list[dict]:
    """Regressions in the store as plain dicts, newest last_seen first; `pair` may be a glob."""
    import fnmatch

    import os

    db = sqlite_path(resolve_uri(uri))
    if db is not None and not db.exists():
        if uri or os.environ.get("MLFLOW_TRACKING_URI"):  # a store named by the user: a typo is not "none found"
            raise UsageError(f"there is no MLflow store at {db}; check the tracking URI (--tracking-uri or "
                             "$MLFLOW_TRACKING_URI), or run a campaign that writes one there first.")
        return []  # (the default store of a checkout no campaign has run in yet)
    store = open_store(uri)
    flt = f"tags.`harness.kind` = '{REGRESSION}'"
    if status:
        flt += f" AND tags.`harness.status` = '{_q(status)}'"
    glob = pair is not None and is_glob(pair)
    if pair and not glob:
        flt += f" AND tags.`harness.pair` = '{_q(pair)}'"
    rows = [regression_dict(r) for r in store.search(flt)]
    if glob:
        rows = [r for r in rows if fnmatch.fnmatchcase(r["pair"], pair)]
    rows.sort(key=lambda r: (r["last_seen"], r["first_seen"]), reverse=True)
    return rows


def show_regression(ident: str, uri: str | None = None) -> dict[str, Any]:
    """One regression as a dict, with its note, params and artifact list."""
    store = open_store(uri)
    run = store.find_regression(ident)
    out = regression_dict(run)
    out["note"] = run.data.tags.get("mlflow.note.content", "")
    out["params"] = dict(run.data.params)
    out["metrics"] = dict(run.data.metrics)
    out["tags"] = {k: v for k, v in run.data.tags.items() if k.startswith("harness.")}
    try:
        out["artifacts"] = [f.path for d in store.client.list_artifacts(run.info.run_id)
                            for f in (store.client.list_artifacts(run.info.run_id, d.path) if d.is_dir else [d])]
    except Exception:  # noqa: BLE001 - artifacts are optional for showing
        out["artifacts"] = []
    return out


def fetch_repro(run_id: str, uri: str | None = None) -> Any:
    """The repro of a regression run (by run id or finding id), with its status as MLflow has it."""
    from ..corpus import load_repro

    store = open_store(uri)
    run = store.find_regression(run_id)
    fid = run.data.tags.get("harness.finding_id", "")
    with tempfile.TemporaryDirectory(prefix="harness-fetch-") as tmp:
        # (one small file: no progress bar on stderr, where a message is one paragraph)
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        try:
            local = store.client.download_artifacts(run.info.run_id, f"{REPRO_ARTIFACTS}/{fid}.json", tmp)
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"regression run {run.info.run_id} in {store.uri} has no artifact repro/{fid}.json "
                             f"({_short(e)}); replay its corpus file instead: "
                             f"{run.data.tags.get('harness.corpus_path') or 'corpora/<pair>/<id>.json'}.") from None
        repro = load_repro(local)
    repro.path = None
    status = run.data.tags.get("harness.status")
    if status:
        repro.status = status
    repro.tracking = {**repro.tracking, "run_id": run.info.run_id, "uri": store.uri}
    return repro


class OtherRun(Exception):
    """The store's regression run of a repro's finding holds another corpus file's case (the same bug,
    found into another corpus): `harness shrink` of this file leaves it alone. The message says why."""


def _case_size(line: str) -> tuple[int, int] | None:
    """(tokens, sequences) of a case from its `one_line` (its `seq_lens=[...]`), None if not there."""
    import re

    m = re.search(r"seq_lens=\[([0-9, ]*)\]", line or "")
    if m is None:
        return None
    lens = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
    return sum(lens), len(lens)


def _other_run(run: Any, repro: Any, old_case_line: str) -> str:
    """Why the regression run is not this corpus file's ("" when it is, or may be): it names another
    corpus file that exists here, or (its file is not here to tell) it holds neither the case this
    shrink started from nor a larger one (a run left behind by an earlier shrink with --no-tracking
    holds a larger case)."""
    tags = run.data.tags
    recorded = tags.get("harness.corpus_path") or ""
    if recorded and repro.path is not None and Path(recorded).exists():
        try:
            same = Path(recorded).samefile(repro.path)
        except OSError:
            same = False
        return "" if same else f"it records the corpus file {recorded}, not {repro.path}"
    held, new = _case_size(tags.get("harness.case", "")), _case_size(repro.case.one_line())
    if held is not None and new is not None and held <= new and tags.get("harness.case") not in (
            old_case_line[:5000], repro.case.one_line()[:5000]):
        return (f"it holds a case of {held[0]} token(s) in {held[1]} sequence(s), no larger than this shrink's "
                f"{new[0]} in {new[1]} (the same bug found into another corpus?)")
    return ""


def note_shrunk(repro: Any, old_case_line: str, headline: str, uri: str | None = None, shrunk: bool = True) -> str | None:
    """A repro `harness shrink` worked on: its regression run gets the new case (tag, note, metrics,
    the repro artifact replaced) or, with `shrunk=False` (its case was already minimal), the
    completed shrink (tag, note, the file's metrics and artifact). Returns the run id, or None when
    the store has no regression of this finding. StoreUnavailable when there is no store.

    The metrics go at the step of the last sighting (`seen_count - 1`), with a later timestamp: MLflow
    shows them as the run's latest values, and the next campaign's sighting keeps its own step."""
    from mlflow.entities import Metric

    store = Store(uri, create=False)
    try:
        run = store.find_regression(repro.id)
    except UsageError:
        return None
    tags = run.data.tags
    other = _other_run(run, repro, old_case_line)
    if other:
        raise OtherRun(f"the MLflow regression run {run.info.run_id} of {repro.id} was left as it is: {other}")
    at = now_iso()
    if shrunk:
        note = (f"#### Shrunk further {at}\n\n`harness shrink`: `{old_case_line}` -> `{repro.case.one_line()}`, now "
                f"{headline}. The run's repro artifact is the shrunk case.")
    else:
        note = (f"#### Shrink completed {at}\n\n`harness shrink`: no simpler case than `{repro.case.one_line()}` "
                "fails the same way; the case stands.")
    updates = {
        "harness.case": repro.case.one_line()[:5000],
        "harness.shrink_complete": "true" if repro.found.get("shrink_complete", True) is not False else "false",
        "mlflow.note.content": _append_note(tags.get("mlflow.note.content", ""), note),
    }
    step = max(0, int(tags.get("harness.seen_count", "1") or 1) - 1)
    ts = int(time.time() * 1000)
    # the file's metrics in both cases: a repro shrunk before with --no-tracking has a run with older ones
    metrics = [Metric(k, v, ts, step) for k, v in _finite_metrics(repro.metrics).items()]
    with store.lock():
        store.client.log_batch(run.info.run_id, tags=_tags(updates), metrics=metrics)
        with tempfile.TemporaryDirectory(prefix="harness-artifacts-") as tmp:  # (named as fetch_repro reads it)
            named = Path(tmp) / f"{repro.id}.json"
            named.write_bytes(Path(repro.path).read_bytes())
            store.client.log_artifact(run.info.run_id, str(named), REPRO_ARTIFACTS)
    return run.info.run_id


def who_closes() -> str:
    """The person closing a regression: git's user.name (and email), else the login name."""
    import getpass
    import subprocess

    def git(key: str) -> str:
        try:
            return subprocess.run(["git", "config", key], capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    name, email = git("user.name"), git("user.email")
    if name:
        return f"{name} <{email}>" if email else name
    try:
        return os.environ.get("USER") or os.environ.get("USERNAME") or getpass.getuser()
    except (KeyError, OSError):  # no login name (a container without a passwd entry)
        return f"uid {os.getuid()}"


def verify_fixed(repro: Any, plugins: tuple[str, ...] = ()) -> Any:
    """Replay a repro about to be closed as fixed; UsageError when it still diverges or cannot be run.
    Returns its severe case's Evaluation when that still fails (a second bug: `corpus.keep_severe`),
    else None."""
    from ..corpus import load_plugin_for, replay, replay_severe
    from ..errors import HarnessError
    from ..pairs import REGISTRY

    REGISTRY.load_builtins()
    for spec in plugins:
        REGISTRY.load_plugin(spec)
    why = load_plugin_for(repro)
    if why is not None:
        raise UsageError(f"regression {repro.id} cannot be replayed here to check it is fixed: {why}"
                         + ("" if "--plugin" in why else ". Pass --plugin to load its pair")
                         + ", or close it where it can be replayed.")
    try:
        result = replay(repro)
    except HarnessError as e:
        raise UsageError(f"regression {repro.id} cannot be replayed here to check it is fixed: {e}") from None
    ev = result.evaluation
    if ev.failed:
        still = (f"still diverges: {ev.symptom.value}, {ev.headline} against the threshold {repro.threshold:g}"
                 if ev.symptom.value in ("divergence", "nonfinite") else
                 f"still fails: {ev.symptom.value}, {ev.headline}")  # a crash, a hang, an error: no threshold
        raise UsageError(f"regression {repro.id} ({repro.pair}) {still} (`{repro.replay_command()}`). Fix "
                         "it first and close it from the fixed checkout, or close it as --status wontfix.")
    if getattr(result, "weights", ""):  # clean, but on other weights: that says nothing of the fix
        raise UsageError(f"regression {repro.id} replays clean here, but {result.weights}. A clean replay on other "
                         "weights does not show the bug is fixed: close it where the pair runs the weights it was "
                         "recorded with, or as --status wontfix.")
    import sys

    from ..corpus import Severe

    if (repro.found or {}).get("severe") is not None and Severe.from_json(repro.found["severe"]) is None:
        print(f"warning: regression {repro.id}'s severe case (found.severe) does not read (edited by hand?), so "
              "whether it still fails, a second bug, was not checked; restore it from git and close again to check "
              "it, or `harness record` that case yourself.", file=sys.stderr)
    try:
        severe = replay_severe(repro)
    except HarnessError as e:  # (its severe case cannot run here: the close goes on, and says so)
        print(f"warning: regression {repro.id}'s severe case could not be replayed here ({e}); whether it still "
              "fails was not checked.", file=sys.stderr)
        return None
    return severe if severe is not None and severe.failed else None


def _check_close(status: str, note: str) -> None:
    if status not in (*TRIAGE_STATUSES, "open"):  # ("open": `harness regressions reopen`)
        raise UsageError(f"--status {status!r} is not one of {TRIAGE_STATUSES}.")
    if not note or not note.strip():
        raise UsageError("--note is empty; say why (the fix commit, or why it is accepted) so the next reader knows.")


def close_in_corpus(corpus_file: str | Path, status: str, note: str, plugins: tuple[str, ...] = ()) -> dict[str, Any]:
    """`regressions close --no-tracking`: the corpus file alone (a corpus kept without MLflow): the same
    checks (`fixed` replays it first and refuses one that still diverges), status and history entry,
    and a still-failing severe case kept as a repro of its own. Returns what `close_regression` does,
    without a run."""
    from ..corpus import load_repro

    _check_close(status, note)
    path = Path(corpus_file)
    repro = load_repro(path)  # (a missing, unreadable or invalid file: UsageError, exit 2)
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        raise UsageError(f"--corpus-file {corpus_file} cannot be written here (its folder or the file is read-only); "
                         "nothing was changed.")
    if repro.status == status:  # (closing it again would only add a second, empty entry to its history)
        return {"id": repro.id, "pair": repro.pair, "status": status, "run_id": None, "corpus_updated": None,
                "corpus_missing": None, "severe": None, "unchanged": str(path)}
    severe = verify_fixed(repro, plugins) if status == "fixed" else None
    at = now_iso()
    old = repro.status
    repro.status = status
    repro.history.append({"at": at, "event": "reopened" if status == "open" else "closed", "from": old,
                          "status": status, "note": note, "by": who_closes()})
    try:
        repro.save(path)
    except OSError as e:
        raise UsageError(f"the corpus file {path} could not be written ({e.strerror or e}); it was left as it was. "
                         "Free the space or fix the permissions, then close it again.") from None
    out = {"id": repro.id, "pair": repro.pair, "status": status, "run_id": None, "corpus_updated": str(path),
           "corpus_missing": None, "severe": None}
    if severe is not None:
        out["severe"] = keep_severe_case(None, None, repro, path, severe)
    return out


def keep_severe_case(store: Store | None, run: Any, repro: Any, path: Path, ev: Any) -> dict[str, Any]:
    """The severe case of a regression just closed as fixed still fails: record it in the corpus as an
    open repro of its own (`corpus.keep_severe`) and, with a `store`, log it as a regression run beside
    the closed one (under the same campaign run). Returns what was done: `path`, `id`, `headline`,
    `new`, `run_id` (None without a store, or when MLflow could not be written: the next campaign that
    meets it logs it), `lines` (what recording it printed)."""
    import uuid

    from ..corpus import keep_severe
    from .payload import finding_payload

    lines: list[str] = []
    f = keep_severe(repro, path, ev, log=lines.append)
    out = {"path": str(f.path), "id": f.id, "headline": f"{ev.symptom.value} {ev.headline}", "new": f.new,
           "run_id": None, "lines": lines}
    if store is None:
        return out
    try:
        p = finding_payload(f, repro.threshold, int(repro.found.get("campaign_seed", 0) or 0), "cpu")
        out["run_id"], _ = log_regression(store, p, run.data.tags.get("mlflow.parentRunId"), uuid.uuid4().hex)
    except Exception as e:  # noqa: BLE001 - the repro is on disk; a campaign that meets it logs it
        lines.append(f"warning: its MLflow regression run could not be written ({type(e).__name__}: {_short(e)}); "
                     "the next campaign that meets it logs it")
    return out


def close_regression(ident: str, status: str, note: str, uri: str | None = None,
                     corpus_file: str | Path | None = None, plugins: tuple[str, ...] = (),
                     verify: bool = True) -> dict[str, Any]:
    """Set a regression's status (fixed | wontfix) in MLflow and in its corpus file, with the note.

    `fixed` is accepted only when the repro (the corpus file, else the run's artifact) replays under
    its threshold here (`verify=False` skips that check: for tests that need a fixed regression to
    recur). The corpus file records who closed it (git's user, else the login name) and
    the run id; a local sqlite store's path is not written there (it means nothing on another machine).
    A repro closed as fixed whose severe case (`found.severe`) still fails holds a second bug: that
    case is recorded as an open repro of its own and logged beside it (`keep_severe_case`).
    Returns the regression dict plus `corpus_updated` (the file written, or None),
    `corpus_missing` (the path that was not found here, or None) and `severe` (what was done with a
    still-failing severe case, or None).
    """
    from ..corpus import load_repro

    _check_close(status, note)
    store = open_store(uri)
    run = store.find_regression(ident)
    tags = run.data.tags
    path = Path(corpus_file) if corpus_file else (Path(tags["harness.corpus_path"]) if tags.get("harness.corpus_path")
                                                  else None)
    on_disk = None
    if corpus_file is not None:  # named by the user: it must be this regression's repro, checked before any change
        on_disk = load_repro(path)  # (a missing, unreadable or invalid file: UsageError, exit 2)
        fid, pair = tags.get("harness.finding_id", ""), tags.get("harness.pair", "")
        if (fid and on_disk.id != fid) or (pair and on_disk.pair != pair):
            raise UsageError(f"--corpus-file {corpus_file}: that repro is {on_disk.id} of pair {on_disk.pair}, but "
                             f"regression {ident} is {fid or '?'} of pair {pair or '?'}; pass this regression's own "
                             "corpus file (corpora/<pair>/<id>.json). Nothing was changed.")
        if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
            raise UsageError(f"--corpus-file {corpus_file} cannot be written here (its folder or the file is "
                             "read-only); nothing was changed.")
    elif path is not None and path.exists():
        on_disk = load_repro(path)
    if on_disk is not None and (not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK)):
        raise UsageError(f"the corpus file {path} cannot be written here (its folder or the file is read-only), so "
                         "its status could not follow MLflow's; nothing was changed. Make it writable, or run this "
                         "where the corpus is writable.")
    if tags.get("harness.status") == status and (on_disk is None or on_disk.status == status):
        out = regression_dict(run)  # (closing it again would only add a second, empty entry to its history)
        out.update(corpus_updated=None, corpus_missing=None, severe=None, unchanged=str(path) if path else run.info.run_id)
        return out
    severe = None  # its severe case, still failing: a second bug, kept as a repro of its own below
    if status == "fixed" and verify:
        repro = on_disk if on_disk is not None else fetch_repro(run.info.run_id, store.uri)
        severe = verify_fixed(repro, plugins)
    at = now_iso()
    who = who_closes()
    updates = {
        "harness.status": status,
        "harness.closed_at": at,
        "harness.closed_by": who,
        "harness.triage_note": note[:4000],
        "mlflow.note.content": _append_note(_note_status(tags.get("mlflow.note.content", ""),
                                                         tags.get("harness.status", ""), status),
                                            f"#### Triage {at}: {tags.get('harness.status', '?')} -> {status} "
                                            f"({who})\n\n{note}"),
    }
    if status == "open":  # reopened by hand (a close by mistake): the close's own tags stay, as history
        updates = {"harness.status": "open", "harness.reopened_at": at, "harness.reopened_by": who,
                   "harness.reopen_note": note[:4000],
                   "mlflow.note.content": _append_note(
                       _note_status(tags.get("mlflow.note.content", ""), tags.get("harness.status", ""), "open"),
                       f"#### Reopened {at}: {tags.get('harness.status', '?')} -> open ({who})\n\n{note}")}
    with store.lock():
        store.client.log_batch(run.info.run_id, tags=_tags(updates))
    out = regression_dict(store.client.get_run(run.info.run_id))
    out["corpus_updated"] = None
    out["corpus_missing"] = None
    out["severe"] = None
    if severe is not None and on_disk is None:  # (no corpus file here to keep it beside)
        out["severe"] = {"path": None, "id": None, "headline": f"{severe.symptom.value} {severe.headline}",
                         "case": severe.case.one_line(), "new": False, "run_id": None, "lines": []}
    if on_disk is not None:
        repro = on_disk
        old = repro.status
        repro.status = status
        repro.history.append({"at": at, "event": "reopened" if status == "open" else "closed", "from": old,
                              "status": status, "note": note, "by": who, "run_id": run.info.run_id})
        tracking = {k: v for k, v in repro.tracking.items() if k != "uri"}
        tracking["run_id"] = run.info.run_id
        if sqlite_path(store.uri) is None:  # a shared server means the same to everyone; a local file does not
            tracking["uri"] = store.uri
        repro.tracking = tracking
        try:
            repro.save(path)
        except OSError as e:  # (a full disk, say): put MLflow back, so the two never disagree
            restored = False
            try:
                with store.lock():
                    store.client.log_batch(run.info.run_id, tags=_tags({k: tags[k] for k in updates if k in tags}))
                    restored = True
                    for k in updates:
                        if k not in tags:
                            store.client.delete_tag(run.info.run_id, k)
                back = "the regression was left as it was in MLflow too"
            except Exception as undo:  # noqa: BLE001 - say what state MLflow is in, not a traceback
                back = (f"MLflow could not be put back entirely ({type(undo).__name__}: {undo}): " + (
                    f"its status is {tags.get('harness.status', '?')!r} again, but some closing tags remain"
                    if restored else f"it now says {status}, the file does not"))
            raise UsageError(f"the corpus file {path} could not be written ({e.strerror or e}); {back}. Free the "
                             "space or fix the permissions, then close it again.") from None
        out["corpus_updated"] = str(path)
        if severe is not None:
            out["severe"] = keep_severe_case(store, run, repro, path, severe)
    elif path is not None:
        out["corpus_missing"] = str(path)
    return out
