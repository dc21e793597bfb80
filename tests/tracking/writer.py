"""One of many processes logging to one MLflow store at once (run by test_many_writers.py).

usage: python -m tests.tracking.writer URI CORPUS_DIR INDEX GO_FILE READY_DIR
Logs one campaign holding two findings: one whose signature every writer shares, one of its own.
The findings carry fixed numbers and no per-token table (no torch, no matplotlib): the processes stay light.
Prints a JSON line: {"index", "spooled", "logged", "offline_reason"}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from harness.case import Case
from harness.corpus import write_json_atomic
from harness.execute import Evaluation, Symptom
from harness.fuzz import CampaignConfig, CampaignResult, Finding, PairResult
from harness.metrics import Divergence

SHARED = "5" * 64


def finding(signature: str, corpus: Path, index: int) -> Finding:
    k3 = np.array([0.001, 0.004, 0.002, 0.009])  # (T,)
    div = Divergence(k3_kl=float(k3.mean()), k3_seq_max=float(k3[2:].mean()), kl=0.003, max_abs_dlogp=0.12,
                     probs_diff_max=0.01, log_ppl_diff=0.0, ppl_ratio=1.0, chi2_token=0.0, pearson=0.99,
                     entropy=2.0, flip_rate=0.0, tie_flip_rate=0.0, nonfinite_trainer=0, nonfinite_rollout=0,
                     n_tokens=4)  # no per-token table: no plot, no matplotlib import in 8 processes
    case = Case(seed=index, seq_lens=(2, 2))
    f = Finding(pair="writers.demo", expected="aligned", symptom=Symptom.DIVERGENCE, signature=signature,
                case=case, evaluation=Evaluation("writers.demo", case, Symptom.DIVERGENCE, divergence=div),
                examples=10)
    f.path = corpus / "writers.demo" / f"{f.id}.json"
    write_json_atomic(f.path, {"schema": "harness.repro/1", "id": f.id, "pair": f.pair, "symptom": "divergence",
                               "signature": signature, "status": "open", "threshold": 1e-3,
                               "case": case.to_json(), "metrics": {"k3_kl": div.k3_kl}})
    return f


def main() -> None:
    uri, corpus, index, go, ready = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5])
    from harness.mlflow_tracking import MlflowTracker  # noqa: F401 - imported before the start line
    import mlflow  # noqa: F401

    findings = [finding(SHARED, corpus / f"w{index}", index), finding(f"{index:02x}" * 32, corpus, index)]
    (ready / str(index)).touch()
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:  # all writers start together
        time.sleep(0.01)
    tracker = MlflowTracker(uri, log=lambda m: print(m, file=sys.stderr))
    cfg = CampaignConfig(pairs=[], seed=index)
    tracker.campaign_started(cfg, index, [])
    for f in findings:
        tracker.finding(f)
    tracker.campaign_finished(CampaignResult(seed=index, config=cfg, seconds=1.0,
                                             results=[PairResult("writers.demo", "aligned", 10, 1.0, findings=findings)]))
    print(json.dumps({"index": index, "spooled": len(tracker.spooled), "offline_reason": tracker.offline_reason,
                      "logged": {k: v[1] for k, v in tracker.logged.items()}}))


if __name__ == "__main__":
    main()
