"""The repro format, atomic writes, loading with clear errors, and replay.

A repro is one JSON file, `corpora/<pair>/<id>.json` (id = the first 12 hex digits of the
finding's signature, see `harness.fuzz`). It holds the minimal case (a few hundred bytes: tensors
are rebuilt from the case's seed), the metrics measured when it was found (non-finite values as the
strings "nan", "inf", "-inf"), the environment, and a triage status:

- `open`: a regression nobody has fixed yet (tests mark it as an expected failure, showing its k3);
- `fixed`: must replay under the threshold (a test fails if it diverges again);
- `expected`: a demonstration pair's divergence that must keep being caught;
- `wontfix`: accepted; replayed and reported, never failing a test.

Files are written atomically (temporary file in the same folder, fsync, rename): a campaign killed
mid-write leaves the old file or the new one, never half of one. Nothing is unpickled.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .case import Case, CaseError
from .errors import CannotEvaluate, UsageError
from .execute import DEFAULT_THRESHOLD, Evaluation, Symptom, run_case
from .metrics import METRIC_KEYS

REPRO_SCHEMA = "harness.repro/1"
STATUSES = ("open", "fixed", "expected", "wontfix")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def encode_float(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def decode_float(x: Any) -> Any:
    return float(x) if x in ("nan", "inf", "-inf") else x


def metrics_json(ev: Evaluation) -> dict[str, Any]:
    if ev.divergence is None:
        return {}
    return {k: encode_float(v) for k, v in ev.divergence.as_dict().items()}


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=False, allow_nan=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ---------------------------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------------------------
@dataclass
class Repro:
    path: Path | None
    id: str
    pair: str
    symptom: str
    signature: str
    status: str
    threshold: float
    case: Case
    metrics: dict[str, Any]
    error: dict[str, str] | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    found: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    tracking: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": REPRO_SCHEMA,
            "id": self.id,
            "pair": self.pair,
            "symptom": self.symptom,
            "signature": self.signature,
            "status": self.status,
            "threshold": self.threshold,
            "case": self.case.to_json(),
            "metrics": {k: encode_float(v) for k, v in self.metrics.items()},
            "error": self.error,
            "environment": self.environment,
            "found": self.found,
            "history": self.history,
            "tracking": self.tracking,
        }

    def save(self, path: Path | None = None) -> Path:
        path = Path(path or self.path)
        write_json_atomic(path, self.to_json())
        self.path = path
        return path

    def replay_command(self) -> str:
        return f"harness replay {self.path}" if self.path else "harness replay FILE"


def finding_to_repro(finding: Any, threshold: float, campaign_seed: int, device: str) -> Repro:
    from .env import environment

    ev = finding.evaluation
    return Repro(
        path=None, id=finding.id, pair=finding.pair, symptom=finding.symptom.value,
        signature=finding.signature, status=finding.status, threshold=threshold, case=finding.case,
        metrics=metrics_json(ev), error=ev.error, environment=environment(device),
        found={"at": now_iso(), "campaign_seed": campaign_seed, "examples": finding.examples,
               "shrink_complete": finding.shrink_complete},
    )


def record_finding(finding: Any, corpus_dir: Path, threshold: float, campaign_seed: int, device: str) -> Path:
    """Write a finding to `corpus_dir/<pair>/<id>.json`, unless the corpus already has its signature.

    An existing file is left as it is, except a `fixed` one, which is reopened: its status becomes
    `open` and the recurrence, with the new minimal case, is appended to its history.
    """
    path = Path(corpus_dir) / finding.pair / f"{finding.id}.json"
    finding.path = path
    if path.exists():
        finding.new = False
        try:
            old = load_repro(path)
        except UsageError:
            old = None
        if old is not None and old.status == "fixed":
            finding.recurrence = True
            old.status = "open"
            old.history.append({"at": now_iso(), "event": "recurred", "campaign_seed": campaign_seed,
                                "case": finding.case.to_json(), "metrics": metrics_json(finding.evaluation)})
            old.save(path)
        if old is not None:
            return path
    finding_to_repro(finding, threshold, campaign_seed, device).save(path)
    return path


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def load_repro(path: str | Path) -> Repro:
    path = Path(path)
    fix = "pass a repro file written by `harness fuzz` (corpora/<pair>/<id>.json)"
    if not path.exists():
        raise UsageError(f"repro file {str(path)!r} does not exist; {fix}.")
    if path.is_dir():
        raise UsageError(f"{str(path)!r} is a folder, not a repro file; {fix}, or list the folder's *.json files.")
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise UsageError(f"repro file {str(path)!r} is not text (JSON expected); {fix}.") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"repro file {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}, column "
                         f"{e.colno}); restore it from git or re-run the campaign that found it.") from None
    if not isinstance(data, dict) or data.get("schema") != REPRO_SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"repro file {str(path)!r} has schema {got!r}, but this harness reads {REPRO_SCHEMA!r}; "
                         f"{fix}, or re-record it with this version of the harness.")
    missing = [k for k in ("pair", "case", "status") if k not in data]
    if missing:
        raise UsageError(f"repro file {str(path)!r} lacks the field(s) {missing}; every repro needs pair, case "
                         "and status. Restore it from git or re-run the campaign that found it.")
    if data["status"] not in STATUSES:
        raise UsageError(f"repro file {str(path)!r} has status {data['status']!r}; it must be one of {STATUSES}. "
                         "Edit the status field or use `harness regressions close`.")
    try:
        case = Case.from_json(data["case"])
    except CaseError as e:
        raise UsageError(f"repro file {str(path)!r} holds an invalid case: {e} Fix the field or re-record the "
                         "repro.") from None
    metrics = {k: decode_float(v) for k, v in (data.get("metrics") or {}).items()}
    return Repro(
        path=path, id=str(data.get("id") or path.stem), pair=str(data["pair"]),
        symptom=str(data.get("symptom", "divergence")), signature=str(data.get("signature", "")),
        status=data["status"], threshold=float(data.get("threshold", DEFAULT_THRESHOLD)), case=case,
        metrics=metrics, error=data.get("error"), environment=data.get("environment") or {},
        found=data.get("found") or {}, history=list(data.get("history") or []),
        tracking=dict(data.get("tracking") or {}),
    )


def iter_corpus(corpus_dir: str | Path) -> list[Path]:
    root = Path(corpus_dir)
    if not root.exists():
        return []
    return sorted(p for p in root.rglob("*.json") if not p.name.startswith("."))


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    repro: Repro
    evaluation: Evaluation
    mismatches: dict[str, tuple[Any, Any]]  # metric -> (recorded, now), where not bit-for-bit equal

    @property
    def bit_for_bit(self) -> bool:
        return not self.mismatches

    @property
    def diverges(self) -> bool:
        return self.evaluation.failed


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def replay(repro: Repro, device: str = "cpu", threshold: float | None = None, registry: Any = None,
           keep_outcomes: bool = False) -> ReplayResult:
    from .pairs import REGISTRY

    registry = registry or REGISTRY
    try:
        pair = registry.get(repro.pair)
    except UsageError as e:
        raise CannotEvaluate(f"repro {repro.path} needs pair {repro.pair!r}, which is not registered here: {e}") from None
    ev = run_case(pair, repro.case, device, threshold if threshold is not None else repro.threshold,
                  keep_outcomes=keep_outcomes)
    now = metrics_json(ev)
    mismatches = {}
    for k in METRIC_KEYS:
        if k in repro.metrics and not _same(repro.metrics[k], decode_float(now.get(k))):
            mismatches[k] = (repro.metrics[k], decode_float(now.get(k)))
    if repro.symptom != ev.symptom.value:
        mismatches["symptom"] = (repro.symptom, ev.symptom.value)
    return ReplayResult(repro, ev, mismatches)


def load_many(paths: Iterable[str | Path]) -> list[Repro]:
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out.extend(load_repro(q) for q in iter_corpus(p))
        else:
            out.append(load_repro(p))
    return out
