"""What is logged, as plain JSON (the same data goes to MLflow or to the spool), and the note a
person reads in the MLflow UI."""

from __future__ import annotations

import json
import math
import shlex
import time
from pathlib import Path
from typing import Any

from ..metrics import verdict_mean
from .store import PENDING_SCHEMA, SEVERITIES, now_iso

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
    from .. import __version__
    from ..env import git_commit

    shard = getattr(cfg, "shard", None)
    names = ",".join(p.name for p in pairs)
    params = {
        "pairs": names if len(names) <= 5000 else names[:4990] + ",...",
        "n_pairs": len(pairs),
        "seed": seed,
        "max_examples": getattr(cfg, "max_examples", None),
        "budget": getattr(cfg, "budget", None),
        "threshold": getattr(cfg, "threshold", None),
        # the pairs judged at a line of their own (`TargetPair.threshold`, `--threshold GLOB=X`)
        "own_thresholds": (",".join(f"{n}={t:g}" for n, t in sorted(cfg.own_thresholds().items()))[:5000] or "none")
        if hasattr(cfg, "own_thresholds") else "none",
        "device": getattr(cfg, "device", None),
        "shard": f"{shard[0]}/{shard[1]}" if shard else "none",
        "profile": getattr(cfg, "profile", None) or "none",
        "streams": getattr(cfg, "streams", 1),
        "uniform_per_example": ("by kind (op 3, model 1)" if getattr(cfg, "uniform_per_example", None) is None
                                else cfg.uniform_per_example),
        "harness_version": __version__,
        "torch_version": _version("torch"),
        "git_commit": git_commit() or "unknown",
    }
    return {"uid": uid, "params": {k: str(v) for k, v in params.items()}, "started": now_iso(),
            "started_ms": int(time.time() * 1000), "seed": seed, "shard": params["shard"],
            "run_name": getattr(cfg, "run_name", None)}  # (None: "campaign seed N")


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
    results = list(getattr(result, "results", ()))
    demos = [r for r in results if getattr(r, "expected", "") == "diverges"]
    out["demonstrations"] = float(len(demos))
    out["missed_demonstrations"] = float(sum(1 for r in demos if r.verdict == "MISSED"))
    # pairs nothing of which was judged: pairs_cannot_run (a harness error: their own setup, not their paths,
    # so no finding is recorded), pairs_unfinished (a first case still running when the budget ended)
    for verdict, suffix in FLAGS.items():
        out["pairs_" + suffix[1:]] = float(sum(1 for r in results if r.verdict == verdict))
    for r in results:  # per pair, as the morning report reads them
        out[f"pair.{r.pair}.cases"] = float(r.examples)
        out[f"pair.{r.pair}.cases_per_second"] = float(r.rate)
        if getattr(r, "worker_peak_mib", 0.0):  # the most its worker process was read to hold while its cases ran
            out[f"pair.{r.pair}.worker_peak_mib"] = float(r.worker_peak_mib)
        largest = getattr(r, "largest", None)
        if largest and largest[0]:  # what its cases covered, each size axis's maximum (`PairResult.largest`)
            for name, v in zip(("sequences", "prompt", "response", "tokens"), largest):
                out[f"pair.{r.pair}.largest_{name}"] = float(v)
        quantile = getattr(r, "judged_quantile", None)
        if quantile is not None and sum(getattr(r, "judged_bins", {}).values()):  # how its judged means spread
            for name, v in (("max_judged", r.max_score), ("judged_p50", quantile(0.5)), ("judged_p90", quantile(0.9))):
                if math.isfinite(v):  # (quantiles: upper edges of tenth-of-a-decade bins)
                    out[f"pair.{r.pair}.{name}"] = float(v)
        for verdict, suffix in FLAGS.items():
            if r.verdict == verdict:
                out[f"pair.{r.pair}{suffix}"] = 1.0
        if r in demos:
            out[f"pair.{r.pair}.missed"] = float(r.verdict == "MISSED")
    return out


# verdicts a campaign flags per pair as `pair.<name><suffix>` = 1 (and lists in a tag: `lifecycle.finish_campaign`)
FLAGS = {"CANNOT RUN": ".cannot_run", "UNFINISHED": ".unfinished"}


def _symptom(f: Any) -> str:
    return getattr(f.symptom, "value", str(f.symptom))


def severity(symptom: str, value: float | None, threshold: float) -> str:
    """By symptom and by how far `value`, the mean the verdict read (`metrics.verdict_mean`: the
    judged k3 or the exact KL), is above the threshold; +inf (a sampled token the trainer excludes) is high."""
    if value == math.inf:
        ratio = math.inf
    else:
        ratio = (value / threshold) if (value is not None and math.isfinite(value) and threshold > 0) else 0.0
    for name, symptoms, at_least in SEVERITIES:
        if symptom in symptoms and ratio >= at_least:
            return name
    return "low"


def _worst(judged: float | None, peak: float | None) -> float | None:
    """The larger of the minimal case's judged mean and the peak of the finding's cases (either may be
    missing or NaN: an error, a crash)."""
    vals = [v for v in (judged, peak) if isinstance(v, (int, float)) and not math.isnan(v)]
    return max(vals) if vals else judged


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


def _corpus_case(f: Any, path: Path | None, threshold: float, device: str) -> tuple[Any, Any, Any]:
    """(repro JSON, case, evaluation) of the corpus file when it already holds this signature with
    another minimal case that still fails: a regression is known by the corpus's minimal case, not
    by a later campaign's (possibly half-shrunk) one. (None, None, None) otherwise."""
    from ..corpus import load_repro
    from ..errors import HarnessError

    if path is None or not path.exists() or getattr(f, "new", True):
        return None, None, None
    if _symptom(f) in ("crash", "timeout"):  # never rerun in this process a case that kills or hangs it
        return None, None, None
    try:
        on_disk = load_repro(path)
    except HarnessError:
        return None, None, None
    if on_disk.pair != f.pair or on_disk.case == f.case:
        return None, None, None
    try:
        from ..execute import run_case
        from ..pairs import REGISTRY

        ev = run_case(REGISTRY.get(f.pair), on_disk.case, device, threshold)
    except Exception:  # noqa: BLE001 - the campaign's own case is logged instead
        return None, None, None
    if not ev.failed:  # a fixed repro that recurred with another case: the campaign's case is the news
        return None, None, None
    return on_disk.to_json(), on_disk.case, ev


def finding_payload(f: Any, threshold: float, campaign_seed: int, device: str) -> dict[str, Any]:
    """Everything a regression run needs, as JSON: written to MLflow now or spooled for later."""
    from ..corpus import finding_to_repro, found_json, metrics_json, pair_loader, plugin_spec_of, repo_root

    path = Path(f.path).resolve() if getattr(f, "path", None) else None
    repro, case, ev = _corpus_case(f, path, threshold, device)
    on_file = repro is not None  # (the repro is the corpus file's, with the case it holds now)
    if repro is None:
        case, ev = f.case, f.evaluation
        if path is not None and path.exists():
            try:
                on_disk = json.loads(path.read_text())
                if on_disk.get("case") == f.case.to_json():
                    repro, on_file = on_disk, True
            except (OSError, ValueError):
                repro = None
    if repro is None:  # no corpus file, or it holds an older minimal case of this signature
        r = finding_to_repro(f, threshold, campaign_seed, device)
        r.path = path
        repro = r.to_json()
    div = ev.divergence
    metrics = {k: v for k, v in metrics_json(ev).items()}
    per_token = {}
    if div is not None and div.per_token:
        per_token = {k: [v.item() if hasattr(v, "item") else v for v in arr] for k, arr in div.per_token.items()}
    judged = verdict_mean(div)[1] if div is not None else None
    symptom = getattr(ev.symptom, "value", _symptom(f))
    return {
        "schema": PENDING_SCHEMA,
        "kind": "finding",
        "id": f.id,
        "pair": f.pair,
        "expected": f.expected,
        "symptom": symptom,
        "signature": f.signature,
        "status": f.status,
        # by the worst its cases got (`Finding.peak`): the minimal case sits just over the line by design
        "severity": severity(symptom, _worst(judged, getattr(f, "peak", None)), threshold),
        # (finite only: the spool writes strict JSON; an inf peak, a sampled excluded token, is severity high)
        "peak_judged": w if isinstance(w := _worst(judged, getattr(f, "peak", None)), (int, float))
        and math.isfinite(w) else None,
        "threshold": threshold,
        # the worst case shrunk far above the minimal one (`Finding.severe`): maybe a second bug of the pair
        **({"severe_case_line": f.severe.case.one_line(brief=True), "severe_judged": _judged_text(f.severe.judged)}
           if getattr(f, "severe", None) else {}),
        "seen_at": now_iso(),
        "case": case.to_json(),
        "case_line": case.one_line(brief=True),  # (a recording's params cut: the note stays under MLflow's limit)
        "metrics": metrics,
        "flips_per_layer": (div.flips_per_layer if div is not None else {}),
        "error": {k: v for k, v in (ev.error or {}).items() if k != "traceback"} or None,
        "examples": f.examples,
        # how this campaign found it: cases and seconds of the pair's stream to the first sighting,
        # seconds of shrinking (Hypothesis + polish), cases of the stream in all
        "found": {k: v for k, v in found_json(f, campaign_seed).items()
                  if k in ("cases_to_first", "seconds_to_first", "shrink_seconds", "cases_total")},
        "shrink_complete": bool(f.shrink_complete) if case is f.case else True,
        "corpus_path": str(path) if path is not None else None,
        "corpus_holds_case": on_file,  # the corpus file holds this case (its repro is the file): the run mirrors it
        "corpus_new": bool(getattr(f, "new", True)),
        "corpus_recurrence": bool(getattr(f, "recurrence", False)),
        "campaign_seed": campaign_seed,
        "device": device,
        "plugin": plugin_spec_of(pair_loader(f.pair, repo_root(path)), path),
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


def store_flag(uri: str | None) -> str:
    """` --tracking-uri URI` for a command that reads the store `uri`, when that is not the one a
    command run here finds by default (MLFLOW_TRACKING_URI, else ./reports/mlflow.db); "" otherwise."""
    import shlex

    from .store import resolve_uri

    if not uri:
        return ""
    try:
        if resolve_uri(uri) == resolve_uri(None):
            return ""
    except Exception:  # noqa: BLE001 - (a scheme the check refuses: say it as given)
        pass
    return f" --tracking-uri {shlex.quote(uri)}"


def regression_note(p: dict[str, Any], run_id: str | None, uri: str | None = None) -> str:
    m = {k: v for k, v in p["metrics"].items()}
    sym = p["symptom"]
    title = f"### {p['pair']}: {sym}"
    if sym in ("error", "crash", "timeout"):
        err = p.get("error") or {}
        title += f" ({err.get('type', '?')} at {err.get('where', '?')})"
        msg = str(err.get("message", ""))[:400]
        what = (f"The worker process running the case died (`{err.get('type', '?')}`): {msg}" if sym == "crash" else
                f"The case hung (`{err.get('type', '?')}`): {msg}" if sym == "timeout" else
                f"The pair raised `{err.get('type', '?')}` in `{err.get('where', '?')}`: {msg}")
    else:
        name, value = verdict_mean(m)
        label = "mean exact KL" if name == "kl" else "mean k3"
        if m.get("verdict_over") == "sequence":
            label = f"worst sequence's {label}"
        ratio = f" = {value / p['threshold']:.3g}x the threshold {p['threshold']:g}" if math.isfinite(value) else ""
        title += f", {label} {_g(value)}"
        what = (f"Trainer and rollout paths of `{p['pair']}` give the rollout's tokens different log-probabilities: "
                f"{label} **{_g(value)}**{ratio} (the mean the verdict read); "
                f"mean k3 of the sampled tokens {_g(m.get('k3_kl'))}, expected k3 {_g(m.get('k3_expected'))}; "
                f"worst sequence k3 {_g(m.get('k3_seq_max'))}; "
                f"mean exact KL {_g(m.get('kl'))} (rollout mass the trainer excludes: {_g(m.get('kl_excluded'))}); "
                + (f"over the threshold: **{m['fired']}**; " if m.get("fired") else "")
                + f"max |Δ log p| {_g(m.get('max_abs_dlogp'))}; "
                f"routing flip rate {_g(m.get('flip_rate'))} (at exact ties {_g(m.get('tie_flip_rate'))}); "
                f"over {_g(m.get('n_tokens'))} token(s).")
        if sym == "nonfinite":
            what += (f" Non-finite log-probabilities: trainer {_g(m.get('nonfinite_trainer'))} token(s), "
                     f"rollout {_g(m.get('nonfinite_rollout'))}.")
    expect = ("an **aligned** pair: this is a regression to fix" if p["expected"] == "aligned"
              else "a **diverges** (demonstration) pair: it must keep being caught")
    corpus = _display_path(p.get("corpus_path"))
    corpus = shlex.quote(corpus) if corpus else corpus  # (commands to paste: a path with a space is one word)
    plugin = f" --plugin {shlex.quote(str(p['plugin']))}" if p.get("plugin") else ""
    lines = [
        title, "",
        f"**What diverged.** {what}", "",
        f"**Pair.** `{p['pair']}` is {expect}. Severity **{p['severity']}**"
        + (f" (its cases reached {p['peak_judged']:.3g}, {p['peak_judged'] / p['threshold']:.0f}x the line; the "
           "minimal case is the smallest still over it)" if isinstance(p.get("peak_judged"), (int, float))
           and math.isfinite(p["peak_judged"]) and p.get("threshold") else "")
        + f", status **{p['status']}**.", "",
        f"**Minimal case.** `{p['case_line']}`"
        + ("" if p.get("shrink_complete", True) else " (shrinking was cut short, by the budget or an interrupt: "
                                                       "`harness shrink` of its corpus file goes on)"), "",
        *([f"**Severe case.** `{p['severe_case_line']}` (judged {p['severe_judged']}): the worst case, shrunk "
           "keeping it far above the minimal one; shrinking keeps the mildest of several bugs in one pair, so a "
           f"second bug shows here: `harness triage --severe{plugin} {corpus or 'FILE'}` names its components.", ""]
          if p.get("severe_case_line") else []),
        "**Replay.**", "", "```",
    ]
    if run_id:
        lines.append(f"harness replay{plugin}{store_flag(uri)} --run-id {run_id}")
    if corpus:
        lines.append(f"harness replay{plugin} {corpus}")
    lines += ["```", "",
              f"**Triage.** `harness triage --run-id {run_id or p['id']}{plugin}{store_flag(uri)}` localizes it (its report is "
              f"attached here); `harness regressions close {p['id']} --status fixed|wontfix --note \"...\"`. "
              f"Artifacts: `repro/{p['id']}.json`"
              + (f", `per_token/{p['id']}.csv`, `plots/{p['id']}_k3.png`" if (p.get("per_token") or {}).get("k3")
                 else {"crash": " (no per-token metrics: the case crashed)", "timeout": " (no per-token metrics: "
                       "the case hung)", "error": " (no per-token metrics: the case raised)"}.get(p["symptom"], ""))
              + ".", "",
              f"Found {p['seen_at']} by campaign seed {p['campaign_seed']} on {p['device']} {_found_line(p)}; "
              f"signature `{p['signature'][:16]}…`."]
    return "\n".join(lines)


def _found_line(p: dict[str, Any]) -> str:
    f = p.get("found") or {}
    if "cases_to_first" not in f:  # not known (a payload spooled by an older version, say)
        return f"after {p['examples']} case(s), shrinking included"
    return (f"after {f['cases_to_first']} case(s) in {float(f['seconds_to_first']):.1f} s; shrunk in "
            f"{float(f['shrink_seconds']):.1f} s ({f['cases_total']} case(s) in all)")


def found_metrics(p: dict[str, Any]) -> dict[str, float]:
    """The regression run's metrics of how this campaign found it (`found.cases_to_first`, ...)."""
    return {f"found.{k}": float(v) for k, v in (p.get("found") or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


NOTE_LIMIT = 7900  # MLflow tags hold 8000 characters


def _append_note(note: str, section: str) -> str:
    note = (note or "").rstrip() + "\n\n" + section
    if len(note) > NOTE_LIMIT:
        head = note[:2000]
        tail = note[-(NOTE_LIMIT - 2100):]
        note = head + "\n\n… (older entries cut; see the run's tags) …\n\n" + tail
    return note


def _judged_text(x: float) -> str:
    """A judged mean as the note prints it (inf: a sampled token the trainer excludes)."""
    return "inf (a sampled token the trainer excludes)" if x == math.inf else f"{x:.3g}"
