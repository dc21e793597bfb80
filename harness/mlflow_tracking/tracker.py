"""The tracker a campaign talks to: MLflow when it can, the spool when it cannot."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from .lifecycle import finish_campaign, log_regression, start_campaign
from .payload import campaign_metrics, campaign_payload, finding_payload
from .store import PENDING_SCHEMA, Store, _short, default_spool, resolve_uri, sqlite_path

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
                 campaign_run_id: str | None = None, spool_dir: str | Path | None = None,
                 campaign_uid: str | None = None) -> None:
        self.uri = resolve_uri(uri)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.spool_dir = Path(spool_dir).resolve() if spool_dir else default_spool()
        self.shared_run_id = campaign_run_id
        self.run_id: str | None = campaign_run_id
        self.uid = uuid.uuid4().hex  # this tracker's (its spool folder)
        # the campaign a regression counts as seen by: this one's, or (`campaign_uid`, a pytest-xdist
        # worker attached to the controller's run) the controller's, so that workers running streams of
        # one pair count once per campaign, as the README says
        self.seen_uid = campaign_uid or self.uid
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
            line = cfg.threshold_of(finding.pair) if hasattr(cfg, "threshold_of") else getattr(cfg, "threshold", 1e-3)
            payload = finding_payload(finding, line, self.seed,
                                      getattr(cfg, "device", "cpu"))
            if self.store is not None:
                run_id, what = log_regression(self.store, payload, self.run_id, self.seen_uid)
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
                from ..corpus import metrics_json

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
            self.store = Store(self.uri, create=True, log=self.log)
            db = sqlite_path(self.uri)
            if getattr(self.store, "created", False) and db is not None:
                self.log(f"mlflow: created a new store at {db} (none was there)")

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
        camp.update({"schema": PENDING_SCHEMA, "kind": "campaign", "uri": self.uri, "seen_uid": self.seen_uid,
                     "shared": bool(self.shared_run_id), "label": self._label(),
                     "offline_reason": self.offline_reason})
        self._spool("campaign.json", camp, count=False)

    def _spool(self, name: str, data: dict[str, Any], count: bool = True) -> None:
        from ..corpus import write_json_atomic

        folder = self.spool_dir / self.uid
        if self.campaign is not None and not (folder / "campaign.json").exists() and name != "campaign.json":
            self._spool_campaign()
        path = folder / name
        write_json_atomic(path, data)
        if count and path not in self.spooled:
            self.spooled.append(path)


