"""MLflow as the system of record for regressions: campaigns, findings, dedup, triage state, spool.

Where things go
---------------
Store: `--tracking-uri`, else `$MLFLOW_TRACKING_URI`, else the embedded store
`sqlite:///<cwd>/reports/mlflow.db` with artifacts beside it in `reports/mlartifacts` (resolved to
absolute paths: MLflow's own default depends on the working directory). Experiment: "harness"
(`$HARNESS_MLFLOW_EXPERIMENT` overrides it).

- One *campaign run* per `harness fuzz` (tag `harness.kind=campaign`): params pairs, seed,
  max_examples, budget, threshold, device, shard, profile, versions, git commit; metrics cases,
  cases_per_second, findings and findings per symptom.
- One *regression run* per signature, nested under the campaign that first found it (tag
  `mlflow.parentRunId`): tags `harness.kind=regression`, pair, expected, symptom, signature,
  finding_id, status, severity, first_seen / last_seen / seen_count, recurrence, corpus_path and a
  markdown note (`mlflow.note.content`) saying what diverged, by how much, the minimal case in one
  line and the replay command; params the flattened minimal case (`case.*`); metrics k3_kl,
  k3_seq_max, kl, max_abs_dlogp, flip_rate, ...; artifacts `repro/<id>.json`,
  `per_token/<id>.csv` and `plots/<id>_k3.png`.

Dedup across campaigns
----------------------
A finding whose signature already has a regression run updates that run: `last_seen`, `seen_count`
(once per campaign: the tag `harness.last_campaign` makes a repeated upload a no-op), the metrics
again at step seen_count - 1 (their history is the k3 of every night that saw it). A `fixed`
regression seen again is reopened (`status=open`, `recurrence=true`) and the note says when.
Params are immutable in MLflow, so everything a person changes (status, notes) lives in tags.

Offline safety
--------------
The engine writes the corpus file before it calls the tracker, and the tracker never raises into
the campaign. Before MLflow makes a request, HTTP retries and timeouts are bounded (MLflow's defaults
wait about four minutes on a dead server) and a remote store is probed with a 3-second TCP connect.
When the store cannot be reached, or any logging call fails, the tracker warns once, stops talking
to MLflow for the rest of the campaign and spools what it would have logged as JSON under
`reports/pending/<campaign uid>/`. `harness sync` uploads the spool later; an upload that ran
before is recognised by its campaign uid, so running it twice creates nothing twice.

Many writers
------------
MLflow migrates the schema of a fresh sqlite file on first access, and simultaneous first accesses
race (seen: 7 of 8 processes crashed). For a sqlite store every write here runs under an exclusive
`fcntl.flock` on `<db>.lock`, which serialises the first initialisation and the search-then-create
of a regression run. Remote stores need no lock for the schema; a regression run created twice by
a race is resolved after the fact (the newer one is deleted and counted on the older one).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

from .errors import UsageError

DEFAULT_EXPERIMENT = "harness"
EXPERIMENT_ENV = "HARNESS_MLFLOW_EXPERIMENT"
DEFAULT_DB = Path("reports") / "mlflow.db"  # relative to the working directory, resolved
DEFAULT_ARTIFACTS = "mlartifacts"  # beside a sqlite store's file
DEFAULT_SPOOL = Path("reports") / "pending"  # relative to the working directory, resolved
PENDING_SCHEMA = "harness.pending/1"

# MLflow reads these on every request. Its defaults (7 retries with backoff, 120 s timeout) wait
# about four minutes on a dead server; these fail within ~10 s. A value already set in the
# environment wins.
HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",  # one retry after the first failure
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # ~1 s before that retry
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",  # at most 0.5 s added to it
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "4",  # seconds per request: 4 + ~1 + 4 s in all on a silent server
}
PROBE_TIMEOUT = 3.0  # seconds for the TCP connect that tells a reachable server from a dead one

# Severity from the magnitude of the mean k3 relative to the threshold (first match wins).
SEVERITIES = (
    # (name, symptoms it applies to, smallest k3 / threshold)
    ("critical", ("nonfinite", "error"), 0.0),  # NaN/inf out of a path, or a path that crashes
    ("high", ("divergence",), 100.0),  # k3 >= 100 x threshold: ratios far off, training is biased
    ("medium", ("divergence",), 10.0),  # k3 >= 10 x threshold
    ("low", ("divergence",), 0.0),  # above the threshold, within 10 x of it
)

TRIAGE_STATUSES = ("fixed", "wontfix")  # what `harness regressions close` may set
REGRESSION = "regression"
CAMPAIGN = "campaign"


# ---------------------------------------------------------------------------------------------
# Where: store, experiment, spool
# ---------------------------------------------------------------------------------------------
def default_uri() -> str:
    return "sqlite:///" + str((Path.cwd() / DEFAULT_DB).resolve())


def resolve_uri(uri: str | None = None) -> str:
    """`uri`, else $MLFLOW_TRACKING_URI, else the embedded store under ./reports (absolute)."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()
    path = sqlite_path(uri)
    if path is not None:  # make a relative sqlite path absolute, so it means one file wherever
        return "sqlite:///" + str(path)
    return uri


def default_spool() -> Path:
    return (Path.cwd() / DEFAULT_SPOOL).resolve()


def experiment_name() -> str:
    return os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT


def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:// URI (absolute), None for any other store."""
    if not uri.startswith("sqlite:"):
        return None
    rest = uri[len("sqlite:"):]
    if rest.startswith("///"):
        rest = rest[3:]
    elif rest.startswith("//"):
        rest = rest[2:]
    rest = rest.split("?", 1)[0]
    if not rest or rest == ":memory:":
        return None
    return Path(rest if rest.startswith("/") else Path.cwd() / rest).resolve()


def bound_http() -> None:
    """Bound MLflow's HTTP retries and timeouts (see HTTP_LIMITS) before any request is made."""
    for key, value in HTTP_LIMITS.items():
        os.environ.setdefault(key, value)


def probe(uri: str) -> str | None:
    """Why the store cannot be reached, or None when it can (a TCP connect for http(s) stores)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        host = parsed.hostname or "localhost"
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT):
                return None
        except OSError as e:
            return f"cannot connect to {host}:{port} ({e.strerror or e})"
    return None


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Exclusive across processes for a sqlite store (an flock on `<db>.lock`); no-op otherwise."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _marker(db: Path) -> Path:
    return Path(str(db) + ".initialised")


def _marker_text(db: Path) -> str:
    import mlflow

    return f"{os.stat(db).st_ino} {mlflow.__version__}"


def _initialised(db: Path | None) -> bool:
    """True when `db` was created and migrated by this MLflow version (per its marker file)."""
    if db is None or not db.exists():
        return False
    try:
        return _marker(db).read_text() == _marker_text(db)
    except OSError:
        return False


def _mark_initialised(db: Path) -> None:
    tmp = _marker(db).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(_marker_text(db))
    os.replace(tmp, _marker(db))


def _quiet_mlflow_logs() -> None:
    for name in ("mlflow.store.db.utils", "alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


def now_iso() -> str:
    from .corpus import now_iso as _now

    return _now()


# ---------------------------------------------------------------------------------------------
# The store: a connected client and the experiment
# ---------------------------------------------------------------------------------------------
class StoreUnavailable(Exception):
    """The tracking store cannot be reached or refused a call."""


class Store:
    """An MlflowClient on one tracking URI and the harness experiment in it."""

    def __init__(self, uri: str | None = None, create: bool = True) -> None:
        self.uri = resolve_uri(uri)
        bound_http()
        _quiet_mlflow_logs()
        why = probe(self.uri)
        if why:
            raise StoreUnavailable(f"MLflow store {self.uri} is unreachable: {why}")
        db = sqlite_path(self.uri)
        if db is not None and not create and not db.exists():
            raise StoreUnavailable(f"MLflow store {self.uri} does not exist (no file {db})")
        try:
            from mlflow import MlflowClient

            # the first access of a fresh sqlite file migrates its schema: serialised, unless this
            # file was already initialised by this MLflow version (a marker beside it says so)
            if db is not None and not _initialised(db):
                with self.lock():
                    if not _initialised(db):
                        MlflowClient(tracking_uri=self.uri).search_experiments(max_results=1)  # migrates
                        _mark_initialised(db)
            self.client = MlflowClient(tracking_uri=self.uri)
            with self.lock():
                self.experiment_id = self._experiment(create)
        except StoreUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the store is "unavailable" here
            raise StoreUnavailable(f"MLflow store {self.uri} failed: {type(e).__name__}: {_short(e)}") from e

    def lock(self) -> contextlib.AbstractContextManager:
        return store_lock(self.uri)

    def _experiment(self, create: bool) -> str | None:
        name = experiment_name()
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        if not create:
            return None
        db = sqlite_path(self.uri)
        location = (db.parent / DEFAULT_ARTIFACTS).as_uri() if db is not None else None
        try:
            return self.client.create_experiment(name, artifact_location=location,
                                                 tags={"harness.purpose": "trainer/rollout regressions"})
        except Exception:  # another process created it between our get and create
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    # --- searches --------------------------------------------------------------------------
    def search(self, filter_string: str, order_by: list[str] | None = None, max_pages: int = 100) -> list:
        if self.experiment_id is None:
            return []
        runs, token = [], None
        for _ in range(max_pages):
            page = self.client.search_runs([self.experiment_id], filter_string, max_results=1000,
                                           order_by=order_by, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
        return runs

    def regressions_with_signature(self, signature: str) -> list:
        return self.search(f"tags.`harness.kind` = '{REGRESSION}' AND tags.`harness.signature` = "
                           f"'{_q(signature)}'", order_by=["attributes.start_time ASC"])

    def campaign_with_uid(self, uid: str):
        runs = self.search(f"tags.`harness.kind` = '{CAMPAIGN}' AND tags.`harness.campaign_uid` = '{_q(uid)}'")
        return runs[0] if runs else None

    def find_regression(self, ident: str):
        """A regression run by run id or finding id (the 12-hex id of its corpus file)."""
        ident = ident.strip()
        if not ident or any(c not in "0123456789abcdef" for c in ident.lower()):
            raise UsageError(f"{ident!r} is not a regression id; pass the 12-hex finding id or the 32-hex run id "
                             "shown by `harness regressions`.")
        runs = self.search(f"tags.`harness.kind` = '{REGRESSION}' AND tags.`harness.finding_id` = '{_q(ident)}'")
        if runs:
            return runs[0]
        if len(ident) == 32:
            try:
                run = self.client.get_run(ident)
            except Exception:  # noqa: BLE001 - MLflow raises MlflowException for an unknown id
                run = None
            if run is not None and run.data.tags.get("harness.kind") == REGRESSION:
                return run
        raise UsageError(f"no regression {ident!r} in the MLflow store {self.uri}; run `harness regressions` "
                         "to list the ids it holds, or pass --tracking-uri for another store.")


def _q(s: str) -> str:
    return str(s).replace("'", "")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def open_store(uri: str | None, create: bool = False) -> Store:
    """A Store for a command: an unreachable or missing store is a usage error with the fix."""
    try:
        return Store(uri, create=create)
    except StoreUnavailable as e:
        raise UsageError(f"{e}. Start the tracking server, or pass --tracking-uri (or set MLFLOW_TRACKING_URI) "
                         "to the store the campaigns log to; the default is the embedded store "
                         "reports/mlflow.db of the working directory.") from None


# ---------------------------------------------------------------------------------------------
# Payloads: what is logged, as plain JSON (the same data goes to MLflow or to the spool)
# ---------------------------------------------------------------------------------------------
def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "none"


def campaign_payload(cfg: Any, seed: int, pairs: list, uid: str) -> dict[str, Any]:
    from . import __version__
    from .env import git_commit

    shard = getattr(cfg, "shard", None)
    names = ",".join(p.name for p in pairs)
    params = {
        "pairs": names if len(names) <= 5000 else names[:4990] + ",...",
        "n_pairs": len(pairs),
        "seed": seed,
        "max_examples": getattr(cfg, "max_examples", None),
        "budget": getattr(cfg, "budget", None),
        "threshold": getattr(cfg, "threshold", None),
        "device": getattr(cfg, "device", None),
        "shard": f"{shard[0]}/{shard[1]}" if shard else "none",
        "profile": getattr(cfg, "profile", None) or "none",
        "harness_version": __version__,
        "torch_version": _version("torch"),
        "git_commit": git_commit() or "unknown",
    }
    return {"uid": uid, "params": {k: str(v) for k, v in params.items()}, "started": now_iso(),
            "started_ms": int(time.time() * 1000), "seed": seed, "shard": params["shard"]}


def campaign_metrics(result: Any) -> dict[str, float]:
    findings = list(result.findings)
    out = {
        "cases": float(result.examples),
        "seconds": float(result.seconds),
        "cases_per_second": float(result.examples / result.seconds) if result.seconds > 0 else 0.0,
        "findings": float(len(findings)),
        "interrupted": float(bool(getattr(result, "interrupted", False))),
    }
    for symptom in ("divergence", "nonfinite", "error"):
        out[f"findings_{symptom}"] = float(sum(1 for f in findings if _symptom(f) == symptom))
    for r in getattr(result, "results", ()):  # per pair, as the morning report reads them
        out[f"pair.{r.pair}.cases"] = float(r.examples)
        out[f"pair.{r.pair}.cases_per_second"] = float(r.rate)
    return out


def _symptom(f: Any) -> str:
    return getattr(f.symptom, "value", str(f.symptom))


def severity(symptom: str, k3: float | None, threshold: float) -> str:
    ratio = (k3 / threshold) if (k3 is not None and math.isfinite(k3) and threshold > 0) else 0.0
    for name, symptoms, at_least in SEVERITIES:
        if symptom in symptoms and ratio >= at_least:
            return name
    return "low"


def flatten_case(case_json: dict[str, Any]) -> dict[str, str]:
    """The case as MLflow params: `case.<field>` (lists as JSON), `case.params.<name>`."""
    out = {}
    for k, v in case_json.items():
        if k == "params":
            for pk, pv in sorted((v or {}).items()):
                out[f"case.params.{pk}"] = str(pv)
        elif k != "schema":
            out[f"case.{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def _finite_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


def finding_payload(f: Any, threshold: float, campaign_seed: int, device: str) -> dict[str, Any]:
    """Everything a regression run needs, as JSON: written to MLflow now or spooled for later."""
    from .corpus import finding_to_repro, metrics_json

    ev = f.evaluation
    div = ev.divergence
    repro = None
    path = Path(f.path).resolve() if getattr(f, "path", None) else None
    if path is not None and path.exists():
        try:
            on_disk = json.loads(path.read_text())
            if on_disk.get("case") == f.case.to_json():
                repro = on_disk
        except (OSError, ValueError):
            repro = None
    if repro is None:  # no corpus file, or it holds an older minimal case of this signature
        r = finding_to_repro(f, threshold, campaign_seed, device)
        r.path = path
        repro = r.to_json()
    metrics = {k: v for k, v in metrics_json(ev).items()}
    per_token = {}
    if div is not None and div.per_token:
        per_token = {k: [v.item() if hasattr(v, "item") else v for v in arr] for k, arr in div.per_token.items()}
    k3 = ev.k3 if div is not None else None
    return {
        "schema": PENDING_SCHEMA,
        "kind": "finding",
        "id": f.id,
        "pair": f.pair,
        "expected": f.expected,
        "symptom": _symptom(f),
        "signature": f.signature,
        "status": f.status,
        "severity": severity(_symptom(f), k3, threshold),
        "threshold": threshold,
        "seen_at": now_iso(),
        "case": f.case.to_json(),
        "case_line": f.case.one_line(),
        "metrics": metrics,
        "flips_per_layer": (div.flips_per_layer if div is not None else {}),
        "error": {k: v for k, v in (ev.error or {}).items() if k != "traceback"} or None,
        "examples": f.examples,
        "shrink_complete": bool(f.shrink_complete),
        "corpus_path": str(path) if path is not None else None,
        "corpus_new": bool(getattr(f, "new", True)),
        "corpus_recurrence": bool(getattr(f, "recurrence", False)),
        "campaign_seed": campaign_seed,
        "device": device,
        "repro": repro,
        "per_token": per_token,
    }


# ---------------------------------------------------------------------------------------------
# The note a person reads in the MLflow UI
# ---------------------------------------------------------------------------------------------
def _g(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x) if x is not None else "n/a"


def _display_path(p: str | None) -> str | None:
    if not p:
        return None
    try:
        return str(Path(p).relative_to(Path.cwd()))
    except ValueError:
        return p


def regression_note(p: dict[str, Any], run_id: str | None) -> str:
    m = {k: v for k, v in p["metrics"].items()}
    sym = p["symptom"]
    title = f"### {p['pair']}: {sym}"
    if sym == "error":
        err = p.get("error") or {}
        title += f" ({err.get('type', '?')} at {err.get('where', '?')})"
        what = (f"The pair raised `{err.get('type', '?')}` in `{err.get('where', '?')}`: "
                f"{str(err.get('message', ''))[:400]}")
    else:
        k3 = m.get("k3_kl")
        ratio = f" = {float(k3) / p['threshold']:.3g}x the threshold {p['threshold']:g}" if isinstance(k3, float) \
            and math.isfinite(k3) else ""
        title += f", mean k3 {_g(k3)}"
        what = (f"Trainer and rollout paths of `{p['pair']}` give the rollout's tokens different log-probabilities: "
                f"mean k3 **{_g(k3)}**{ratio}; worst sequence k3 {_g(m.get('k3_seq_max'))}; "
                f"KL {_g(m.get('kl'))}; max |Δ log p| {_g(m.get('max_abs_dlogp'))}; "
                f"routing flip rate {_g(m.get('flip_rate'))} (at exact ties {_g(m.get('tie_flip_rate'))}); "
                f"over {_g(m.get('n_tokens'))} token(s).")
        if sym == "nonfinite":
            what += (f" Non-finite log-probabilities: trainer {_g(m.get('nonfinite_trainer'))} token(s), "
                     f"rollout {_g(m.get('nonfinite_rollout'))}.")
    expect = ("an **aligned** pair: this is a regression to fix" if p["expected"] == "aligned"
              else "a **diverges** (demonstration) pair: it must keep being caught")
    corpus = _display_path(p.get("corpus_path"))
    lines = [
        title, "",
        f"**What diverged.** {what}", "",
        f"**Pair.** `{p['pair']}` is {expect}. Severity **{p['severity']}**, status **{p['status']}**.", "",
        f"**Minimal case.** `{p['case_line']}`"
        + ("" if p.get("shrink_complete", True) else " (shrinking was cut short by the budget)"), "",
        "**Replay.**", "", "```",
    ]
    if run_id:
        lines.append(f"harness replay --run-id {run_id}")
    if corpus:
        lines.append(f"harness replay {corpus}")
    lines += ["```", "",
              f"**Triage.** `harness regressions close {p['id']} --status fixed|wontfix --note \"...\"`. "
              f"Artifacts: `repro/{p['id']}.json`, `per_token/{p['id']}.csv`, `plots/{p['id']}_k3.png`.", "",
              f"Found {p['seen_at']} by campaign seed {p['campaign_seed']} on {p['device']} after "
              f"{p['examples']} case(s); signature `{p['signature'][:16]}…`."]
    return "\n".join(lines)


NOTE_LIMIT = 7900  # MLflow tags hold 8000 characters


def _append_note(note: str, section: str) -> str:
    note = (note or "").rstrip() + "\n\n" + section
    if len(note) > NOTE_LIMIT:
        head = note[:2000]
        tail = note[-(NOTE_LIMIT - 2100):]
        note = head + "\n\n… (older entries cut; see the run's tags) …\n\n" + tail
    return note


# ---------------------------------------------------------------------------------------------
# Artifacts
# ---------------------------------------------------------------------------------------------
def write_artifacts(p: dict[str, Any], folder: Path) -> dict[str, Path]:
    """repro JSON, per-token CSV and k3 plot of a finding, written under `folder` (by artifact dir)."""
    out: dict[str, Path] = {}
    (folder / "repro").mkdir(parents=True, exist_ok=True)
    repro = folder / "repro" / f"{p['id']}.json"
    repro.write_text(json.dumps(p["repro"], indent=2) + "\n")
    out["repro"] = repro
    pt = p.get("per_token") or {}
    if pt.get("k3"):
        (folder / "per_token").mkdir(exist_ok=True)
        table = folder / "per_token" / f"{p['id']}.csv"
        cols = [c for c in ("sequence", "position", "token", "logp_trainer", "logp_rollout", "k3", "kl") if c in pt]
        with open(table, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(cols[:5] + ["dlogp"] + cols[5:] if "logp_rollout" in cols else cols)
            for i in range(len(pt["k3"])):
                row = [pt[c][i] for c in cols]
                if "logp_rollout" in cols:
                    row = row[:5] + [pt["logp_trainer"][i] - pt["logp_rollout"][i]] + row[5:]
                w.writerow(row)
        out["per_token"] = table
        (folder / "plots").mkdir(exist_ok=True)
        out["plots"] = plot_k3(p, folder / "plots" / f"{p['id']}_k3.png")
    return out


def plot_k3(p: dict[str, Any], path: Path) -> Path:
    """Per-token k3 along the case (tokens in case order), one colour per sequence, threshold line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pt = p["per_token"]
    k3 = [v if isinstance(v, (int, float)) and math.isfinite(v) else float("nan") for v in pt["k3"]]
    seqs = pt.get("sequence") or [0] * len(k3)
    fig = Figure(figsize=(8, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(k3)))
    for s in sorted(set(seqs)):
        idx = [i for i in xs if seqs[i] == s]
        ax.plot(idx, [k3[i] for i in idx], marker="o", markersize=3, linewidth=1, label=f"seq {s}")
        if idx and idx[0] > 0:
            ax.axvline(idx[0] - 0.5, color="0.8", linewidth=0.8)
    ax.axhline(p["threshold"], color="red", linestyle="--", linewidth=1, label=f"threshold {p['threshold']:g}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(-0.5, max(len(k3), 1) - 0.5)
    ax.set_xlabel("token (case order)")
    ax.set_ylabel("k3")
    ax.set_title(f"{p['pair']} {p['id']}: per-token k3 (mean {_g(p['metrics'].get('k3_kl'))})", fontsize=9)
    if len(set(seqs)) <= 12:
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(str(path))
    return path


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
            run_name=f"campaign seed {camp['seed']}" + ("" if camp["shard"] == "none" else f" shard {camp['shard']}"),
            tags={"harness.kind": CAMPAIGN, "harness.campaign_uid": camp["uid"], "harness.started": camp["started"]})
        store.client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in camp["params"].items()])
    return run.info.run_id


def finish_campaign(store: Store, run_id: str, metrics: dict[str, float], label: str | None) -> None:
    """Campaign metrics; `label` set when the run is shared by several workers (keys get a prefix)."""
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    prefix = f"{label}." if label else ""
    with store.lock():
        store.client.log_batch(run_id, metrics=[Metric(prefix + k, v, ts, 0) for k, v in metrics.items()])
        if not label:
            store.client.set_terminated(run_id, "KILLED" if metrics.get("interrupted") else "FINISHED")


def log_regression(store: Store, p: dict[str, Any], parent_run_id: str | None, campaign_uid: str) -> tuple[str, str]:
    """Log one finding; returns (run id, what happened: created | seen | reopened | already)."""
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


def _create_regression(store: Store, p: dict[str, Any], parent_run_id: str | None, campaign_uid: str) -> str:
    from mlflow.entities import Metric, Param

    c = store.client
    tags = {
        "harness.kind": REGRESSION,
        "harness.pair": p["pair"],
        "harness.expected": p["expected"],
        "harness.symptom": p["symptom"],
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
    }
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = c.create_run(store.experiment_id, tags=tags, run_name=f"{p['pair']} {p['symptom']} {p['id']}")
    run_id = run.info.run_id
    ts = int(time.time() * 1000)
    metrics = [Metric(k, v, ts, 0) for k, v in _finite_metrics(p["metrics"]).items()]
    params = [Param(k, v[:6000]) for k, v in flatten_case(p["case"]).items()]
    params.append(Param("threshold", str(p["threshold"])))
    c.log_batch(run_id, metrics=metrics, params=params)
    c.set_tag(run_id, "mlflow.note.content", regression_note(p, run_id))
    with tempfile.TemporaryDirectory(prefix="harness-artifacts-") as tmp:
        for artifact_dir, path in write_artifacts(p, Path(tmp)).items():
            c.log_artifact(run_id, str(path), artifact_dir)
    c.set_terminated(run_id, "FINISHED")
    return run_id


def _seen_again(store: Store, run: Any, p: dict[str, Any], parent_run_id: str | None, campaign_uid: str) -> str:
    from mlflow.entities import Metric

    c = store.client
    tags = run.data.tags
    if tags.get("harness.last_campaign") == campaign_uid:
        return "already"
    count = int(tags.get("harness.seen_count", "1") or 1) + 1
    updates = {
        "harness.seen_count": str(count),
        "harness.last_seen": max(tags.get("harness.last_seen", ""), p["seen_at"]),
        "harness.last_campaign": campaign_uid,
    }
    if parent_run_id:
        updates["harness.last_campaign_run_id"] = parent_run_id
    what = "seen"
    if p.get("corpus_recurrence"):  # the corpus file said fixed and the engine reopened it
        updates["harness.recurrence"] = "true"
    if tags.get("harness.status") == "fixed":
        what = "reopened"
        updates["harness.status"] = "open"
        updates["harness.recurrence"] = "true"
        updates["mlflow.note.content"] = _append_note(
            tags.get("mlflow.note.content", ""),
            f"#### Recurrence {p['seen_at']}\n\nMarked fixed, seen again by campaign seed {p['campaign_seed']}: "
            f"mean k3 {_g(p['metrics'].get('k3_kl'))}, minimal case `{p['case_line']}`. Reopened.")
    c.log_batch(run.info.run_id, tags=_tags(updates))
    ts = int(time.time() * 1000)
    metrics = [Metric(k, v, ts, count - 1) for k, v in _finite_metrics(p["metrics"]).items()]
    if metrics:
        c.log_batch(run.info.run_id, metrics=metrics)
    return what


# ---------------------------------------------------------------------------------------------
# The tracker the campaign talks to
# ---------------------------------------------------------------------------------------------
class MlflowTracker:
    """Logs a campaign and its findings to MLflow; spools to reports/pending/ when it cannot.

    `campaign_run_id`: log under a campaign run created elsewhere (pytest-xdist workers, shards of
    one night); this tracker then neither creates nor terminates it and prefixes its campaign
    metrics with its shard (`shard1of4.cases`) or process id.
    Never raises into the campaign: every failure becomes one warning and a spooled file.
    """

    def __init__(self, uri: str | None = None, log: Callable[[str], None] | None = None,
                 campaign_run_id: str | None = None, spool_dir: str | Path | None = None) -> None:
        self.uri = resolve_uri(uri)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.spool_dir = Path(spool_dir).resolve() if spool_dir else default_spool()
        self.shared_run_id = campaign_run_id
        self.run_id: str | None = campaign_run_id
        self.uid = uuid.uuid4().hex
        self.store: Store | None = None
        self.offline_reason: str | None = None
        self.campaign: dict[str, Any] | None = None
        self.cfg: Any = None
        self.seed = 0
        self.spooled: list[Path] = []
        self.logged: dict[str, tuple[str, str]] = {}  # finding id -> (run id, what happened)
        self.seconds = 0.0  # time spent in this tracker's calls (`harness bench tracking`)
        self.timings = {"campaign_started": 0.0, "finding": 0.0, "campaign_finished": 0.0}  # seconds per call kind
        self._warned = False

    # --- protocol ----------------------------------------------------------------------------
    def campaign_started(self, config: Any, seed: int, pairs: list) -> None:
        t0 = time.monotonic()
        try:
            self.cfg, self.seed = config, seed
            self.campaign = campaign_payload(config, seed, pairs, self.uid)
            if self.shared_run_id:
                self.campaign["run_id"] = self.shared_run_id
            self._connect()
            if self.store is not None and not self.shared_run_id:
                self.run_id = start_campaign(self.store, self.campaign)
                self.campaign["run_id"] = self.run_id
            elif self.store is not None:
                self.store.client.get_run(self.shared_run_id)  # fails early if the run is not there
        except Exception as e:  # noqa: BLE001 - the tracker must never raise into the campaign
            self._go_offline(e)
        finally:
            self._spent("campaign_started", t0)

    def finding(self, finding: Any) -> None:
        t0 = time.monotonic()
        payload = None
        try:
            cfg = self.cfg
            payload = finding_payload(finding, getattr(cfg, "threshold", 1e-3), self.seed,
                                      getattr(cfg, "device", "cpu"))
            if self.store is not None:
                run_id, what = log_regression(self.store, payload, self.run_id, self.uid)
                self.logged[finding.id] = (run_id, what)
                if what == "reopened":
                    self.log(f"  mlflow: regression {finding.id} was marked fixed and is seen again: reopened "
                             f"(run {run_id})")
                return
        except Exception as e:  # noqa: BLE001
            self._go_offline(e)
        finally:
            self._spent("finding", t0)
        t0 = time.monotonic()
        try:
            if payload is None:
                from .corpus import metrics_json

                payload = {"schema": PENDING_SCHEMA, "kind": "finding", "id": finding.id, "broken": True,
                           "corpus_path": str(finding.path) if finding.path else None,
                           "metrics": metrics_json(finding.evaluation)}
            self._spool(f"{finding.id}.json", payload)
        except Exception as e:  # noqa: BLE001
            self.log(f"warning: could not spool finding {getattr(finding, 'id', '?')} ({type(e).__name__}: "
                     f"{_short(e)}); it is in the corpus at {getattr(finding, 'path', None)}.")
        finally:
            self._spent("finding", t0)

    def campaign_finished(self, result: Any) -> None:
        t0 = time.monotonic()
        metrics = None
        try:
            metrics = campaign_metrics(result)
            if self.store is not None and self.run_id:
                finish_campaign(self.store, self.run_id, metrics, self._label())
                return
        except Exception as e:  # noqa: BLE001
            self._go_offline(e)
        finally:
            self._spent("campaign_finished", t0)
        if self.campaign is not None:
            try:
                self.campaign["metrics"] = metrics or {}
                self._spool_campaign()
            except Exception as e:  # noqa: BLE001
                self.log(f"warning: could not spool the campaign record ({type(e).__name__}: {_short(e)}).")
        if self.spooled:
            self.log(f"warning: {len(self.spooled)} record(s) spooled to {self.spool_dir / self.uid} because the "
                     f"MLflow store could not be written ({self.offline_reason}); upload them later with "
                     "`harness sync`.")

    # --- internals -----------------------------------------------------------------------------
    def _spent(self, kind: str, t0: float) -> None:
        dt = time.monotonic() - t0
        self.seconds += dt
        self.timings[kind] += dt

    def _label(self) -> str | None:
        if not self.shared_run_id:
            return None
        shard = getattr(self.cfg, "shard", None)
        return f"shard{shard[0]}of{shard[1]}" if shard else f"pid{os.getpid()}"

    def _connect(self) -> None:
        if self.store is None and self.offline_reason is None:
            self.store = Store(self.uri, create=True)

    def _go_offline(self, e: BaseException) -> None:
        self.store = None
        self.offline_reason = self.offline_reason or f"{type(e).__name__}: {_short(e)}"
        if not self._warned:
            self._warned = True
            self.log(f"warning: MLflow tracking is off for the rest of this campaign ({self.offline_reason}); "
                     f"findings stay in the corpus and are spooled to {self.spool_dir}; upload them later with "
                     "`harness sync`.")
        if self.campaign is not None:
            try:
                self._spool_campaign()
            except Exception:  # noqa: BLE001 - reported when the campaign finishes
                pass

    def _spool_campaign(self) -> None:
        camp = dict(self.campaign or {})
        camp.update({"schema": PENDING_SCHEMA, "kind": "campaign", "uri": self.uri,
                     "shared": bool(self.shared_run_id), "label": self._label(),
                     "offline_reason": self.offline_reason})
        self._spool("campaign.json", camp, count=False)

    def _spool(self, name: str, data: dict[str, Any], count: bool = True) -> None:
        from .corpus import write_json_atomic

        folder = self.spool_dir / self.uid
        if self.campaign is not None and not (folder / "campaign.json").exists() and name != "campaign.json":
            self._spool_campaign()
        path = folder / name
        write_json_atomic(path, data)
        if count and path not in self.spooled:
            self.spooled.append(path)


# ---------------------------------------------------------------------------------------------
# Reading back: list, show, fetch, close
# ---------------------------------------------------------------------------------------------
def _int(x: Any, default: int = 0) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


def regression_dict(run: Any) -> dict[str, Any]:
    t, m = run.data.tags, run.data.metrics
    return {
        "id": t.get("harness.finding_id", ""),
        "run_id": run.info.run_id,
        "pair": t.get("harness.pair", ""),
        "expected": t.get("harness.expected", ""),
        "symptom": t.get("harness.symptom", ""),
        "status": t.get("harness.status", ""),
        "severity": t.get("harness.severity", ""),
        "k3": m.get("k3_kl"),
        "k3_seq_max": m.get("k3_seq_max"),
        "first_seen": t.get("harness.first_seen", ""),
        "last_seen": t.get("harness.last_seen", ""),
        "seen_count": _int(t.get("harness.seen_count"), 1),
        "recurrence": t.get("harness.recurrence") == "true",
        "case": t.get("harness.case", ""),
        "corpus_path": t.get("harness.corpus_path") or None,
        "campaign_run_id": t.get("mlflow.parentRunId"),
        "signature": t.get("harness.signature", ""),
    }


def list_regressions(uri: str | None = None, status: str | None = None, pair: str | None = None) -> list[dict]:
    """Regressions in the store as plain dicts, newest last_seen first; `pair` may be a glob."""
    import fnmatch

    db = sqlite_path(resolve_uri(uri))
    if db is not None and not db.exists():
        return []
    store = open_store(uri)
    flt = f"tags.`harness.kind` = '{REGRESSION}'"
    if status:
        flt += f" AND tags.`harness.status` = '{_q(status)}'"
    glob = pair is not None and any(ch in pair for ch in "*?[")
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
    from .corpus import load_repro

    store = open_store(uri)
    run = store.find_regression(run_id)
    fid = run.data.tags.get("harness.finding_id", "")
    with tempfile.TemporaryDirectory(prefix="harness-fetch-") as tmp:
        try:
            local = store.client.download_artifacts(run.info.run_id, f"repro/{fid}.json", tmp)
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


def close_regression(ident: str, status: str, note: str, uri: str | None = None,
                     corpus_file: str | Path | None = None) -> dict[str, Any]:
    """Set a regression's status (fixed | wontfix) in MLflow and in its corpus file, with the note.

    Returns the regression dict plus `corpus_updated` (the file written, or None) and
    `corpus_missing` (the path that was not found here, or None).
    """
    from .corpus import load_repro

    if status not in TRIAGE_STATUSES:
        raise UsageError(f"--status {status!r} is not one of {TRIAGE_STATUSES}.")
    if not note or not note.strip():
        raise UsageError("--note is empty; say why (the fix commit, or why it is accepted) so the next reader knows.")
    store = open_store(uri)
    run = store.find_regression(ident)
    tags = run.data.tags
    at = now_iso()
    who = os.environ.get("USER") or os.environ.get("USERNAME") or "unknown"
    updates = {
        "harness.status": status,
        "harness.closed_at": at,
        "harness.triage_note": note[:4000],
        "mlflow.note.content": _append_note(tags.get("mlflow.note.content", ""),
                                            f"#### Triage {at}: {tags.get('harness.status', '?')} -> {status} "
                                            f"({who})\n\n{note}"),
    }
    with store.lock():
        store.client.log_batch(run.info.run_id, tags=_tags(updates))
    out = regression_dict(store.client.get_run(run.info.run_id))
    path = Path(corpus_file) if corpus_file else (Path(tags["harness.corpus_path"]) if tags.get("harness.corpus_path")
                                                  else None)
    out["corpus_updated"] = None
    out["corpus_missing"] = None
    if path is not None and path.exists():
        repro = load_repro(path)
        old = repro.status
        repro.status = status
        repro.history.append({"at": at, "event": "closed", "from": old, "status": status, "note": note,
                              "by": who, "run_id": run.info.run_id})
        repro.tracking = {**repro.tracking, "run_id": run.info.run_id, "uri": store.uri}
        repro.save(path)
        out["corpus_updated"] = str(path)
    elif path is not None:
        out["corpus_missing"] = str(path)
    return out


# ---------------------------------------------------------------------------------------------
# The spool
# ---------------------------------------------------------------------------------------------
def pending(spool_dir: str | Path | None = None) -> list[Path]:
    """Spooled campaign folders, oldest first."""
    root = Path(spool_dir).resolve() if spool_dir else default_spool()
    if not root.exists():
        return []
    return sorted((d for d in root.iterdir() if d.is_dir() and (d / "campaign.json").exists()),
                  key=lambda d: (d / "campaign.json").stat().st_mtime)


def sync_pending(uri: str | None = None, spool_dir: str | Path | None = None,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Upload the spool to the store; each uploaded file is deleted. Idempotent (see the module note).

    Returns {"uri", "campaigns", "created", "seen", "reopened", "already", "failed", "remaining"}.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    folders = pending(spool_dir)
    summary = {"uri": resolve_uri(uri), "campaigns": 0, "created": 0, "seen": 0, "reopened": 0, "already": 0,
               "failed": 0, "remaining": 0, "runs": []}
    if not folders:
        return summary
    try:
        store = Store(uri, create=True)
    except StoreUnavailable as e:
        summary["remaining"] = sum(len(list(d.glob("*.json"))) - 1 for d in folders)
        summary["failed"] = summary["remaining"]
        log(f"warning: {e}; nothing uploaded, {summary['remaining']} finding(s) stay in the spool.")
        return summary
    for folder in folders:
        try:
            camp = json.loads((folder / "campaign.json").read_text())
            run_id = None
            if camp.get("run_id"):
                try:
                    store.client.get_run(camp["run_id"])
                    run_id = camp["run_id"]
                except Exception:  # noqa: BLE001 - that run lives in another store: make one here
                    run_id = None
            if run_id is None:
                run_id = start_campaign(store, camp)
            ok = True
            for f in sorted(folder.glob("*.json")):
                if f.name == "campaign.json":
                    continue
                try:
                    p = json.loads(f.read_text())
                    if p.get("schema") != PENDING_SCHEMA or p.get("broken"):
                        raise ValueError(f"{f} is not a complete spooled finding; its corpus file is "
                                         f"{p.get('corpus_path')}")
                    rid, what = log_regression(store, p, run_id, camp["uid"])
                    summary[what] += 1
                    summary["runs"].append({"id": p["id"], "run_id": rid, "what": what})
                    f.unlink()
                except Exception as e:  # noqa: BLE001
                    ok = False
                    summary["failed"] += 1
                    log(f"warning: could not upload {f}: {type(e).__name__}: {_short(e)}")
            if ok:
                if camp.get("metrics"):
                    finish_campaign(store, run_id, camp["metrics"], camp.get("label") if camp.get("shared") else None)
                (folder / "campaign.json").unlink()
                with contextlib.suppress(OSError):
                    folder.rmdir()
                summary["campaigns"] += 1
        except Exception as e:  # noqa: BLE001
            summary["failed"] += 1
            log(f"warning: could not upload the spooled campaign {folder}: {type(e).__name__}: {_short(e)}")
    summary["remaining"] = sum(max(0, len(list(d.glob("*.json"))) - 1) for d in pending(spool_dir))
    return summary
