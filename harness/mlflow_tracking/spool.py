"""Findings spooled while the store was unreachable, and `harness sync` that uploads them."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

from .lifecycle import finish_campaign, log_regression, start_campaign
from .store import PENDING_SCHEMA, Store, StoreUnavailable, _short, default_spool, resolve_uri

# ---------------------------------------------------------------------------------------------
# The spool
# ---------------------------------------------------------------------------------------------
def pending(spool_dir: str | Path | None = None) -> list[Path]:
    """Spooled campaign folders (each holds a campaign.json), oldest first: the spool's own, and those
    up to two folders further down (CI artifacts downloaded into it land as `<artifact>/<campaign>/`;
    they read as an empty spool, a sync that uploaded nothing and said so with exit 0)."""
    root = Path(spool_dir).resolve() if spool_dir else default_spool()
    if not root.is_dir():
        return []
    found = [f.parent for pattern in ("*/campaign.json", "*/*/campaign.json", "*/*/*/campaign.json")
             for f in root.glob(pattern) if f.is_file()]
    return sorted(set(found), key=lambda d: ((d / "campaign.json").stat().st_mtime, str(d)))


def sync_pending(uri: str | None = None, spool_dir: str | Path | None = None,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Upload the spool to the store; each uploaded file is deleted. Idempotent (see the module note).

    `uri`: the store to upload to; None uploads each spooled campaign to the store it was meant for
    (recorded in its campaign.json), else to the default. Returns {"uri" (the stores, comma-separated),
    "campaigns", "created", "seen", "reopened", "already", "failed", "remaining"}.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    folders = pending(spool_dir)
    summary = {"uri": resolve_uri(uri), "campaigns": 0, "created": 0, "seen": 0, "reopened": 0, "already": 0,
               "failed": 0, "remaining": 0, "runs": []}
    if not folders:
        return summary
    stores: dict[str, Store | None] = {}
    targets: list[str] = []

    def store_for(camp: dict[str, Any]) -> Store | None:
        target = resolve_uri(uri) if uri else str(camp.get("uri") or resolve_uri(None))
        if target not in stores:
            targets.append(target)
            try:
                stores[target] = Store(target, create=True)
            except StoreUnavailable as e:
                stores[target] = None
                log(f"warning: {e}; the findings spooled for {target} stay in the spool.")
        return stores[target]

    for folder in folders:
        try:
            camp = json.loads((folder / "campaign.json").read_text())
            store = store_for(camp)
            if store is None:
                summary["failed"] += max(0, len(list(folder.glob("*.json"))) - 1)
                continue
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
                    rid, what = log_regression(store, p, run_id, camp.get("seen_uid") or camp["uid"])
                    summary["already" if what == "already-known" else what] += 1
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
    if targets:
        summary["uri"] = ", ".join(targets)
    return summary

