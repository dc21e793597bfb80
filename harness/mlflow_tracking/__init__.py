"""MLflow as the system of record for regressions: campaigns, findings, dedup, triage state, spool.

Where things go
---------------
Store: `--tracking-uri`, else `$MLFLOW_TRACKING_URI`, else the embedded store
`sqlite:///<cwd>/reports/mlflow.db` with artifacts beside it in `reports/mlartifacts` (resolved to
absolute paths: MLflow's own default depends on the working directory). Experiment: "harness"
(`$HARNESS_MLFLOW_EXPERIMENT` overrides it).

- One *campaign run* per `harness fuzz` (tag `harness.kind=campaign`): params pairs, seed,
  max_examples, budget, threshold, device, shard, profile, streams, uniform_per_example, versions, git commit; metrics cases,
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
again at step seen_count - 1 (their history is the k3 of every night that saw it; `harness shrink`
adds the shrunk case's metrics at the last night's step, later, so a step can hold two points and
the run shows the shrunk case's as its latest). A `fixed`
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

Layout: `store` (where, the lock, safe creation and repair, `Store`), `payload` (what is logged, the
note), `plots` (artifacts), `lifecycle` (runs created, seen again, listed, closed), `tracker` (what
the campaign talks to), `spool` (offline records and `harness sync`).
"""

from __future__ import annotations

from .lifecycle import (close_regression, fetch_repro, finish_campaign, list_regressions, log_regression,
                        regression_dict, show_regression, start_campaign)
from .payload import (NOTE_LIMIT, campaign_metrics, campaign_payload, finding_payload, flatten_case, regression_note,
                      severity)
from .plots import plot_k3, write_artifacts
from .spool import pending, sync_pending
from .store import (CAMPAIGN, DEFAULT_ARTIFACTS, DEFAULT_DB, DEFAULT_EXPERIMENT, DEFAULT_SPOOL, EXPERIMENT_ENV,
                    HTTP_LIMITS, PENDING_SCHEMA, PROBE_TIMEOUT, REGRESSION, SEVERITIES, TRIAGE_STATUSES, Store,
                    StoreUnavailable, bound_http, default_spool, default_uri, experiment_name, open_store, probe,
                    resolve_uri, sqlite_path, store_lock)
from .tracker import MlflowTracker

__all__ = [
    "CAMPAIGN", "DEFAULT_ARTIFACTS", "DEFAULT_DB", "DEFAULT_EXPERIMENT", "DEFAULT_SPOOL", "EXPERIMENT_ENV",
    "HTTP_LIMITS", "NOTE_LIMIT", "PENDING_SCHEMA", "PROBE_TIMEOUT", "REGRESSION", "SEVERITIES", "TRIAGE_STATUSES",
    "MlflowTracker", "Store", "StoreUnavailable", "bound_http", "campaign_metrics", "campaign_payload",
    "close_regression", "default_spool", "default_uri", "experiment_name", "fetch_repro", "finding_payload",
    "finish_campaign", "flatten_case", "list_regressions", "log_regression", "open_store", "pending", "plot_k3",
    "probe", "regression_dict", "regression_note", "resolve_uri", "severity", "show_regression", "sqlite_path",
    "start_campaign", "store_lock", "sync_pending", "write_artifacts",
]
