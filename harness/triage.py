"""Triage: localize a divergence to the component that causes it, and write a report.

`harness triage FILE` (or `--run-id ID`) replays one repro and answers "which component?":

1. **Per-module divergence.** Both paths' module outputs are captured by module name with forward
   hooks, mapped to the case's token rows, and compared module by module (relative L2 error over
   the tokens both paths computed). The *noise floor* of a module is what the same comparison gives
   when both paths run the trainer's numerics (layout noise: packed rows vs padded decode), times
   `FLOOR_FACTOR`, and never under `MIN_FLOOR`. The first module, in execution order, whose error
   exceeds its floor is where the divergence starts.
2. **Localization by swapping.** For every component whose setting differs between the two paths,
   the case is rerun with that one component aligned (the rollout takes the trainer's setting, and
   back: the trainer takes the rollout's), then the set of differing components is delta-debugged
   (ddmin) down to a minimal set that, left differing while every other component is aligned, still
   puts k3 above the threshold. The verdict names that set and the k3 once it is aligned too:
   "MoE aggregation precision, all layers: k3 0.0123 -> 0.0000 when aligned".
3. **Routing.** Expert-selection flips per router layer, split into near-tie flips (the k-th and
   (k+1)-th scores within `NEAR_TIE` in either path, exact ties included) and the rest.
4. **A report**: `reports/<finding id>/report.md` with PNG plots (per-token k3 along the sequence,
   divergence per module, flips per layer, k3 per swap), attached to the MLflow regression run when
   the repro came from one (`--run-id`) and tracking is on.

The protocol (what a pair provides to get each part; nothing else is model-specific)
-------------------------------------------------------------------------------------
*Localization*: `TargetPair.profiles` is an object with

    trainer: Mapping[str, str]       # component -> setting of the trainer path
    rollout: Mapping[str, str]       # component -> setting of the rollout path (same keys)
    labels:  Mapping[str, str]       # component -> what a person calls it (optional; default the key)
    variant(trainer, rollout) -> TargetPair   # the same pair, its paths running these profiles

*Per-module table*: the inputs `build` returns expose the torch modules each path runs, as
`inputs.extra["modules"]`, `inputs["modules"]` or `inputs.modules`: `{"trainer": module, "rollout":
module}` (the same object for both is fine; `None` for a path that is not torch, e.g. ONNX
Runtime). Submodules with the same name are compared. The root module's forward takes a keyword
`rows`: a (B, S) int64 tensor giving the case-order token row of every position it computes (-1 for
padding and unscored positions); a submodule output whose two leading dimensions are (B, S) is
filed under those rows (tuples: their first tensor). Pairs without these get the rest of the report.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import click

from .errors import UsageError

FLOOR_FACTOR = 10.0  # a module diverges when its error exceeds this multiple of its aligned-run error
MIN_FLOOR = 1e-6  # ... and this absolute relative error (float32 layout noise is ~1e-7)
NEAR_TIE = 1e-3  # boundary score gap (k-th vs (k+1)-th) under which a routing flip counts as near-tie


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
@dataclass
class ModuleRow:
    name: str  # module name, e.g. "layers.0.moe"
    error: float  # relative L2 error trainer vs rollout over the common tokens
    floor: float  # noise floor
    tokens: int  # tokens compared

    @property
    def exceeds(self) -> bool:
        return self.error > self.floor


@dataclass
class Swap:
    component: str
    label: str
    trainer: str  # the trainer's setting
    rollout: str  # the rollout's setting
    k3_rollout_aligned: float  # k3 with the rollout taking the trainer's setting
    k3_trainer_aligned: float  # k3 with the trainer taking the rollout's setting

    @property
    def best(self) -> float:
        vals = [v for v in (self.k3_rollout_aligned, self.k3_trainer_aligned) if math.isfinite(v)]
        return min(vals) if vals else float("nan")


@dataclass
class Localization:
    differing: list[str]
    swaps: list[Swap]
    minimal: list[str]  # the minimal set of components that keeps k3 above the threshold
    k3_minimal_only: float  # k3 with only the minimal set differing
    k3_minimal_aligned: float  # k3 with the minimal set aligned too (everything else as found)
    k3_all_aligned: float  # k3 with every component aligned
    runs: int  # cases run to localize
    explained: bool  # aligning the minimal set brings k3 under the threshold
    aligned_profiles: tuple[dict, dict] = ({}, {})  # (trainer, rollout) with every component aligned


@dataclass
class Triage:
    repro: Any
    pair: Any
    k3: float
    threshold: float
    evaluation: Any
    modules: list[ModuleRow] = field(default_factory=list)
    first_module: str | None = None
    localization: Localization | None = None
    flips: dict[str, dict[str, int]] = field(default_factory=dict)
    verdict: str = ""
    seconds: float = 0.0
    report: Path | None = None
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# 1. Per-module divergence
# ---------------------------------------------------------------------------------------------
def exposed_modules(inputs: Any) -> dict[str, Any] | None:
    extra = getattr(inputs, "extra", None)
    mods = None
    if isinstance(extra, dict):
        mods = extra.get("modules")
    if mods is None and isinstance(inputs, dict):
        mods = inputs.get("modules")
    if mods is None:
        mods = getattr(inputs, "modules", None)
    if not isinstance(mods, dict) or mods.get("trainer") is None or mods.get("rollout") is None:
        return None
    return mods


class _Recorder:
    """Forward hooks filing module outputs under case-order token rows."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.rows = None
        self.store: dict[str, dict[int, Any]] = {}
        self.order: list[str] = []
        self.handles: list[Any] = []

    def __enter__(self) -> "_Recorder":
        def pre(module: Any, args: Any, kwargs: dict) -> None:
            self.rows = kwargs.get("rows")

        self.handles.append(self.root.register_forward_pre_hook(pre, with_kwargs=True))
        for name, mod in self.root.named_modules():
            self.handles.append(mod.register_forward_hook(self._hook(name or "output")))
        return self

    def _hook(self, name: str) -> Callable:
        def hook(module: Any, args: Any, out: Any) -> None:
            import torch

            t = out[0] if isinstance(out, (tuple, list)) else out
            rows = self.rows
            if rows is None or not isinstance(t, torch.Tensor) or t.dim() < 2 or tuple(t.shape[:2]) != tuple(rows.shape):
                return
            sel = rows >= 0
            ids = rows[sel].tolist()
            vals = t[sel].detach().to(torch.float64).cpu().reshape(len(ids), -1)
            slot = self.store.setdefault(name, {})
            if name not in self.order:
                self.order.append(name)
            for i, v in zip(ids, vals):
                slot[i] = v

        return hook

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


def capture(pair: Any, case: Any, device: str) -> tuple[dict, dict, list[str]] | None:
    """Module outputs of both paths by name and token row, or None when the pair exposes none."""
    import torch

    with torch.inference_mode():
        inputs = pair.build(case, device)
        mods = exposed_modules(inputs)
        if mods is None:
            return None
        with _Recorder(mods["rollout"]) as rec_r:
            rollout = pair.rollout(inputs)
        with _Recorder(mods["trainer"]) as rec_t:
            if pair.trainer_reads_rollout:
                pair.trainer(inputs, rollout)
            else:
                pair.trainer(inputs)
    return rec_t.store, rec_r.store, rec_t.order


def module_errors(trainer: dict, rollout: dict, order: list[str]) -> dict[str, tuple[float, int]]:
    import torch

    out = {}
    for name in order:
        a, b = trainer.get(name, {}), rollout.get(name, {})
        common = sorted(set(a) & set(b))
        if not common:
            continue
        ta = torch.stack([a[i] for i in common])
        tb = torch.stack([b[i] for i in common])
        if ta.shape != tb.shape:
            continue
        den = float(tb.norm())
        err = float((ta - tb).norm()) / den if den > 0 else float((ta - tb).norm())
        out[name] = (err, len(common))
    return out


def per_module(pair: Any, case: Any, device: str, aligned_pair: Any | None) -> tuple[list[ModuleRow], str | None]:
    got = capture(pair, case, device)
    if got is None:
        return [], None
    errs = module_errors(*got)
    floors: dict[str, float] = {}
    if aligned_pair is not None:
        ref = capture(aligned_pair, case, device)
        if ref is not None:
            floors = {k: v[0] for k, v in module_errors(*ref).items()}
    rows = [ModuleRow(name, err, max(MIN_FLOOR, FLOOR_FACTOR * floors.get(name, 0.0)), n)
            for name, (err, n) in errs.items()]
    first = next((r.name for r in rows if r.exceeds), None)
    return rows, first


# ---------------------------------------------------------------------------------------------
# 2. Localization by swapping one component at a time, then delta debugging
# ---------------------------------------------------------------------------------------------
def _profiles(pair: Any) -> Any | None:
    p = getattr(pair, "profiles", None)
    if p is None or not hasattr(p, "variant"):
        return None
    if not isinstance(getattr(p, "trainer", None), Mapping) or not isinstance(getattr(p, "rollout", None), Mapping):
        raise UsageError(f"pair {pair.name!r} has profiles without trainer/rollout mappings; see the protocol in "
                         "harness/triage.py (trainer, rollout, labels, variant).")
    return p


def ddmin(items: list[str], fails: Callable[[list[str]], bool]) -> list[str]:
    """Zeller's ddmin: a 1-minimal subset of `items` for which `fails` holds (it holds for `items`)."""
    n = 2
    while len(items) >= 2:
        chunk = math.ceil(len(items) / n)
        parts = [items[i:i + chunk] for i in range(0, len(items), chunk)]
        reduced = False
        for part in parts:
            if fails(part):
                items, n, reduced = part, 2, True
                break
        if not reduced:
            for part in parts:
                rest = [x for x in items if x not in part]
                if rest and fails(rest):
                    items, n, reduced = rest, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


def localize(pair: Any, case: Any, device: str, threshold: float, k3_found: float) -> Localization | None:
    from .execute import run_case

    prof = _profiles(pair)
    if prof is None:
        return None
    t0, r0 = dict(prof.trainer), dict(prof.rollout)
    differing = [c for c in t0 if t0.get(c) != r0.get(c)]
    labels = dict(getattr(prof, "labels", {}) or {})
    cache: dict[str, float] = {}

    def k3(t: dict, r: dict) -> float:
        key = json.dumps([t, r], sort_keys=True)
        if key not in cache:
            ev = run_case(prof.variant(t, r), case, device, threshold)
            cache[key] = ev.k3 if ev.divergence is not None else float("nan")
        return cache[key]

    swaps = []
    for c in differing:
        swaps.append(Swap(c, labels.get(c, c), str(t0[c]), str(r0[c]),
                          k3(t0, {**r0, c: t0[c]}), k3({**t0, c: r0[c]}, r0)))
    direction = {s.component: ("trainer" if s.k3_trainer_aligned < s.k3_rollout_aligned else "rollout")
                 for s in swaps}

    def aligned(comps: list[str]) -> tuple[dict, dict]:
        t, r = dict(t0), dict(r0)
        for c in comps:
            if direction[c] == "rollout":
                r[c] = t0[c]
            else:
                t[c] = r0[c]
        return t, r

    def fails(keep: list[str]) -> bool:
        v = k3(*aligned([c for c in differing if c not in keep]))
        return not math.isfinite(v) or v > threshold

    minimal = ddmin(list(differing), fails) if differing and fails(list(differing)) else []
    only = k3(*aligned([c for c in differing if c not in minimal])) if minimal else float("nan")
    min_aligned = k3(*aligned(minimal)) if minimal else float("nan")
    all_aligned = k3(*aligned(differing)) if differing else k3_found
    explained = bool(minimal) and math.isfinite(min_aligned) and min_aligned <= threshold
    return Localization(differing, swaps, minimal, only, min_aligned, all_aligned, len(cache), explained,
                        aligned(differing))


# ---------------------------------------------------------------------------------------------
# 3. Routing flips per layer, near-tie vs other
# ---------------------------------------------------------------------------------------------
def routing_split(trainer: Any, rollout: Any) -> dict[str, dict[str, int]]:
    import torch

    out = {}
    for layer in sorted(set(trainer.routing) & set(rollout.routing)):
        rt, rr = trainer.routing[layer], rollout.routing[layer]
        et = torch.sort(torch.as_tensor(rt.experts).cpu(), -1).values
        er = torch.sort(torch.as_tensor(rr.experts).cpu(), -1).values
        flipped = (et != er).any(-1)
        k = et.shape[-1]
        near = torch.zeros_like(flipped)
        for s in (rt.scores, rr.scores):
            if s is not None and torch.as_tensor(s).shape[-1] > k:
                top = torch.topk(torch.as_tensor(s).float().cpu(), k + 1, -1).values
                near |= (top[:, k - 1] - top[:, k]).abs() <= NEAR_TIE
        out[layer] = {"tokens": int(flipped.numel()), "near_tie": int((flipped & near).sum()),
                      "other": int((flipped & ~near).sum())}
    return out


# ---------------------------------------------------------------------------------------------
# The whole triage
# ---------------------------------------------------------------------------------------------
def _label(loc: Localization, comps: list[str]) -> str:
    labels = {s.component: s.label for s in loc.swaps}
    return " + ".join(labels.get(c, c) for c in comps)


def verdict_line(t: Triage) -> str:
    loc = t.localization
    if not math.isfinite(t.k3):
        return f"the repro did not evaluate ({t.evaluation.symptom.value}); see the report."
    if t.k3 <= t.threshold:
        return f"k3 {t.k3:.4f} is under the threshold {t.threshold:g} now: nothing to localize."
    if loc is not None and loc.explained:
        return (f"{_label(loc, loc.minimal)}, all layers: k3 {t.k3:.4f} -> {loc.k3_minimal_aligned:.4f} when aligned")
    if loc is not None and loc.differing:
        return (f"not explained by numerics settings: with every differing component aligned "
                f"({_label(loc, loc.differing)}) k3 stays {loc.k3_all_aligned:.4f}; the paths differ in "
                f"code, not numerics" + (f" (first divergent module: {t.first_module})" if t.first_module else ""))
    if t.first_module:
        return f"divergence starts at module {t.first_module} (no numerics profiles to swap)"
    return f"k3 {t.k3:.4f}; the pair exposes neither profiles nor modules to localize further"


def triage(repro: Any, device: str = "cpu", threshold: float | None = None, registry: Any = None) -> Triage:
    from .execute import run_case
    from .pairs import REGISTRY

    start = time.monotonic()
    registry = registry or REGISTRY
    pair = registry.get(repro.pair)
    thr = threshold if threshold is not None else repro.threshold
    ev = run_case(pair, repro.case, device, thr, keep_outcomes=True)
    t = Triage(repro=repro, pair=pair, k3=ev.k3, threshold=thr, evaluation=ev)
    if ev.error:
        t.notes.append(f"the pair raised {ev.error['type']}: {ev.error['message']}")
    prof = _profiles(pair)
    if ev.divergence is not None:
        if ev.trainer is not None and ev.rollout is not None:
            t.flips = routing_split(ev.trainer, ev.rollout)
        if ev.k3 > thr or not math.isfinite(ev.k3):
            t.localization = localize(pair, repro.case, device, thr, ev.k3)
        aligned_pair = None  # the noise floor: both paths with every differing component aligned
        if t.localization is not None:
            aligned_pair = prof.variant(*t.localization.aligned_profiles)
        elif prof is not None:
            aligned_pair = prof.variant(dict(prof.trainer), dict(prof.trainer))
        t.modules, t.first_module = per_module(pair, repro.case, device, aligned_pair)
    t.verdict = verdict_line(t)
    t.seconds = time.monotonic() - start
    return t


# ---------------------------------------------------------------------------------------------
# 4. The report
# ---------------------------------------------------------------------------------------------
def _plots(t: Triage, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = []
    div = t.evaluation.divergence
    if div is not None and div.per_token:
        pt = div.per_token
        fig, ax = plt.subplots(figsize=(8, 3))
        x = np.arange(len(pt["k3"]))
        ax.scatter(x, np.maximum(pt["k3"], 1e-18), c=pt["sequence"], cmap="tab10", s=14)
        ax.axhline(t.threshold, color="red", lw=1, ls="--", label=f"threshold {t.threshold:g}")
        ax.set_yscale("log")
        ax.set_xlabel("token (case order; colour = sequence)")
        ax.set_ylabel("k3")
        ax.set_title(f"{t.repro.pair}: per-token k3 (mean {t.k3:.3g})")
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        out.append(folder / "k3_per_token.png")
        fig.savefig(out[-1], dpi=110)
        plt.close(fig)
    if t.modules:
        fig, ax = plt.subplots(figsize=(9, max(3, 0.22 * len(t.modules))))
        names = [m.name for m in t.modules]
        y = np.arange(len(names))
        ax.barh(y, [max(m.error, 1e-18) for m in t.modules],
                color=["tab:red" if m.exceeds else "tab:gray" for m in t.modules])
        ax.scatter([m.floor for m in t.modules], y, marker="|", color="black", s=60, label="noise floor")
        ax.set_yticks(y, names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("relative L2 error, trainer vs rollout (execution order, top to bottom)")
        ax.set_title("divergence per layer and component")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        out.append(folder / "modules.png")
        fig.savefig(out[-1], dpi=110)
        plt.close(fig)
    if t.flips:
        fig, ax = plt.subplots(figsize=(6, 3))
        layers = list(t.flips)
        near = [t.flips[l]["near_tie"] for l in layers]
        other = [t.flips[l]["other"] for l in layers]
        ax.bar(layers, near, label=f"near-tie (gap <= {NEAR_TIE:g})", color="tab:orange")
        ax.bar(layers, other, bottom=near, label="other", color="tab:blue")
        ax.set_ylabel("tokens whose experts flipped")
        ax.set_title("routing flips per layer")
        ax.legend(fontsize=8)
        fig.tight_layout()
        out.append(folder / "flips.png")
        fig.savefig(out[-1], dpi=110)
        plt.close(fig)
    loc = t.localization
    if loc is not None and loc.swaps:
        fig, ax = plt.subplots(figsize=(8, max(2.5, 0.4 * len(loc.swaps) + 1)))
        y = np.arange(len(loc.swaps))
        ax.barh(y, [max(s.best, 1e-18) for s in loc.swaps], color=["tab:green" if s.component in loc.minimal
                                                                     else "tab:gray" for s in loc.swaps])
        ax.axvline(t.k3, color="black", lw=1, label=f"as found {t.k3:.3g}")
        ax.axvline(t.threshold, color="red", lw=1, ls="--", label="threshold")
        ax.set_yticks(y, [s.label for s in loc.swaps], fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("k3 with this one component aligned")
        ax.set_title("localization by swapping")
        ax.legend(fontsize=8)
        fig.tight_layout()
        out.append(folder / "swaps.png")
        fig.savefig(out[-1], dpi=110)
        plt.close(fig)
    return out


def write_report(t: Triage, reports: Path) -> Path:
    folder = Path(reports) / t.repro.id
    folder.mkdir(parents=True, exist_ok=True)
    t.plots = _plots(t, folder)
    r, ev = t.repro, t.evaluation
    lines = [f"# Triage of {r.id}: {r.pair}", "",
             f"**Verdict:** {t.verdict}", "",
             f"- pair: `{r.pair}` ({t.pair.description or t.pair.kind}), expected {t.pair.expected}, status {r.status}",
             f"- case: `{r.case.one_line()}`",
             f"- replay: `harness replay {r.path or r.id + '.json'}`; triage again: `harness triage "
             f"{r.path or '--run-id ' + str(r.tracking.get('run_id', '?'))}`",
             f"- k3 now {t.k3:.6g} (threshold {t.threshold:g}); recorded {r.metrics.get('k3_kl', '-')}; "
             f"triage took {t.seconds:.1f}s", ""]
    if ev.divergence is not None:
        d = ev.divergence
        lines += ["## Metrics", "", "| metric | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in d.as_dict().items()]
        lines.append("")
    loc = t.localization
    if loc is not None:
        lines += ["## Localization by swapping", "",
                  f"Differing components: {', '.join(loc.differing) or 'none'}. Minimal set that keeps k3 above the "
                  f"threshold: **{', '.join(loc.minimal) or 'none'}** (k3 with only it differing: "
                  f"{loc.k3_minimal_only:.6g}; with it aligned: {loc.k3_minimal_aligned:.6g}; everything aligned: "
                  f"{loc.k3_all_aligned:.6g}; {loc.runs} cases run).", "",
                  "| component | trainer | rollout | k3, rollout takes trainer's | k3, trainer takes rollout's |",
                  "|---|---|---|---:|---:|"]
        lines += [f"| {s.label} (`{s.component}`) | {s.trainer} | {s.rollout} | {s.k3_rollout_aligned:.6g} | "
                  f"{s.k3_trainer_aligned:.6g} |" for s in loc.swaps]
        lines.append("")
    if t.modules:
        lines += ["## Divergence per module", "",
                  f"First module over its noise floor: **{t.first_module or 'none'}** (floor = {FLOOR_FACTOR:g} x the "
                  f"error with both paths on the trainer's numerics, at least {MIN_FLOOR:g}).", "",
                  "| module | relative error | noise floor | tokens | over |", "|---|---:|---:|---:|---|"]
        lines += [f"| {m.name} | {m.error:.3g} | {m.floor:.3g} | {m.tokens} | {'yes' if m.exceeds else ''} |"
                  for m in t.modules]
        lines.append("")
    if t.flips:
        lines += ["## Routing flips per layer", "", "| layer | tokens | near-tie flips | other flips |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {l} | {v['tokens']} | {v['near_tie']} | {v['other']} |" for l, v in t.flips.items()]
        lines.append("")
    for note in t.notes:
        lines.append(f"> {note}")
    if t.plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in t.plots]
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n")
    t.report = path
    return path


def attach_to_mlflow(t: Triage, run_id: str, uri: str | None) -> str:
    """Log the report folder to the regression run (artifact dir `triage`). Returns what happened."""
    from .mlflow_tracking import open_store

    try:
        open_store(uri).client.log_artifacts(run_id, str(t.report.parent), "triage")
    except Exception as e:  # noqa: BLE001 - the report on disk is the record; tracking is a copy
        return f"not attached to MLflow run {run_id}: {type(e).__name__}: {e}"
    return f"attached to MLflow run {run_id} (artifacts/triage)"


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
@click.command("triage")
@click.argument("file", required=False, type=click.Path(path_type=Path))
@click.option("--run-id", default=None, help="Triage the repro of this MLflow regression run instead of FILE.")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI for --run-id.")
@click.option("--no-tracking", is_flag=True, help="Do not attach the report to the MLflow regression run.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--threshold", type=click.FloatRange(0, min_open=True), default=None,
              help="Override the threshold recorded in the repro.")
@click.option("--reports", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"),
              show_default=True, help="The report goes to REPORTS/<finding id>/report.md.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE", help="Load pairs from a plugin.")
def triage_command(file: Path | None, run_id: str | None, tracking_uri: str | None, no_tracking: bool, device: str,
                   threshold: float | None, reports: Path, as_json: bool, plugins: tuple[str, ...]) -> None:
    """Localize a divergence: per-module table, swap-one-component localization, routing flips, report."""
    from .cli import load_plugins
    from .corpus import load_repro
    from .env import resolve_device

    if (file is None) == (run_id is None):
        raise UsageError("triage needs exactly one of FILE (a repro, e.g. corpora/<pair>/<id>.json) or --run-id ID "
                         "(an MLflow regression run); pass one of them.")
    if file is not None:
        repro = load_repro(file)
    else:
        from .tracking import fetch_repro

        repro = fetch_repro(run_id, tracking_uri)
    load_plugins(plugins)
    t = triage(repro, resolve_device(device), threshold)
    write_report(t, reports)
    attached = None
    rid = (repro.tracking or {}).get("run_id") or run_id  # the MLflow run id, also when ID was a finding id
    if rid and not no_tracking:
        attached = attach_to_mlflow(t, rid, tracking_uri or (repro.tracking or {}).get("uri"))
    if as_json:
        loc = t.localization
        click.echo(json.dumps({
            "id": repro.id, "pair": repro.pair, "k3": t.k3, "verdict": t.verdict, "first_module": t.first_module,
            "minimal": loc.minimal if loc else None, "explained": loc.explained if loc else None,
            "k3_minimal_aligned": loc.k3_minimal_aligned if loc else None, "flips": t.flips,
            "report": str(t.report), "plots": [str(p) for p in t.plots], "seconds": t.seconds, "mlflow": attached,
        }, indent=2, default=str))
    else:
        if t.first_module:
            click.echo(f"first divergent module: {t.first_module}")
        if t.flips:
            click.echo("routing flips per layer (near-tie/other): " + ", ".join(
                f"{l} {v['near_tie']}/{v['other']}" for l, v in t.flips.items()))
        click.echo(f"verdict: {t.verdict}")
        click.echo(f"report: {t.report} ({len(t.plots)} plot(s)); {t.seconds:.1f}s")
        if attached:
            click.echo(attached, err=True)
    sys.exit(0)
