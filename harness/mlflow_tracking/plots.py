"""The artifacts of a regression run: repro JSON, per-token CSV and the per-token k3 plot."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from .payload import _g
from .store import REPRO_ARTIFACTS

# ---------------------------------------------------------------------------------------------
# Artifacts
# ---------------------------------------------------------------------------------------------
def write_artifacts(p: dict[str, Any], folder: Path) -> dict[str, Path]:
    """repro JSON, per-token CSV and k3 plot of a finding, written under `folder` (by artifact dir)."""
    out: dict[str, Path] = {}
    (folder / REPRO_ARTIFACTS).mkdir(parents=True, exist_ok=True)
    repro = folder / REPRO_ARTIFACTS / f"{p['id']}.json"
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


