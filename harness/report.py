"""The morning report: `harness report [--since 24h]` writes reports/nightly.md from MLflow.

What it reads (the names `harness.mlflow_tracking` writes): campaign runs (tag
`harness.kind=campaign`, metrics cases, cases_per_second, findings) and regression runs (tag
`harness.kind=regression`, tags pair, expected, status, first_seen, last_seen, seen_count,
recurrence, closed_at, corpus_path). Relative to the window (the last `--since`):

- new: first seen inside the window;
- recurring: seen inside the window, first seen before it;
  a regression that had been marked fixed and was seen again says `reopened` in either table;
- fixed: marked fixed (`harness regressions close ID --status fixed`) inside the window.

Demonstration pairs a campaign in the window did not catch (`pair.<name>.missed`) are listed too:
a missed demonstration is lost detection power, as worth a morning look as a new regression.

Each regression row carries the command that replays it. Cases and cases per second come from the
campaign runs that started inside the window. A PNG plot beside the report shows, for each of the
last `--nights` nights (UTC dates), the findings the campaigns made and the regressions first seen.
"""

from __future__ import annotations

import datetime as _dt
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import click

from .errors import HarnessError, UsageError

DEFAULT_OUT = Path("reports") / "nightly.md"
_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(value: str, now: _dt.datetime | None = None) -> _dt.datetime:
    """'24h', '90m', '7d', '2w' back from now, or an ISO date/time (UTC when no zone is given)."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([mhdw])\s*", value or "")
    if m:
        try:
            return now - _dt.timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
        except OverflowError:  # before year 1
            raise UsageError(f"--since {value!r} reaches back past the year 1; give a shorter duration or an ISO "
                             "date like 2026-01-31.") from None
    try:
        t = _dt.datetime.fromisoformat(value.strip())
    except (ValueError, AttributeError):
        raise UsageError(f"--since {value!r} is neither a duration like 24h, 90m, 7d, 2w nor an ISO date like "
                         "2026-01-31 or 2026-01-31T06:00; pass one of those.") from None
    return t.astimezone(_dt.timezone.utc) if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)  # (printed as UTC)


def _parse_iso(s: str | None) -> _dt.datetime | None:
    if not s:
        return None
    try:
        t = _dt.datetime.fromisoformat(s)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)


def _ms(t: _dt.datetime) -> int:
    return int(t.timestamp() * 1000)


def _from_ms(ms: int) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.timezone.utc)


# ---------------------------------------------------------------------------------------------
# Reading MLflow
# ---------------------------------------------------------------------------------------------
def _campaign_metric(metrics: dict[str, float], key: str) -> float:
    """A campaign metric; a campaign run shared by shards holds it per shard (`shard1of4.cases`)."""
    if key in metrics:
        return float(metrics[key])
    return float(sum(v for k, v in metrics.items()
                     if k.endswith("." + key) and not k.startswith("pair.") and ".pair." not in k))


def pair_cases(metrics: dict[str, float]) -> dict[str, tuple[float, float]]:
    """pair -> (cases, cases/s) from a campaign run of `pytest --harness-fuzz` (`pair.<name>.cases`)."""
    out: dict[str, tuple[float, float]] = {}
    plain: set[str] = set()  # pairs with an unprefixed count: that one (as `_campaign_metric` reads it)
    for k, v in metrics.items():
        i = k.find("pair.")  # `pair.<name>.cases`, or a shard's `shard1of4.pair.<name>.cases`
        if (i == 0 or (i > 0 and k[i - 1] == ".")) and k.endswith(".cases"):
            name, prefix = k[i + len("pair."):-len(".cases")], k[:i]
            here = (float(v), float(metrics.get(f"{prefix}pair.{name}.cases_per_second", 0.0)))
            if i == 0:
                out[name] = here
                plain.add(name)
            elif name not in plain:
                cases, rate = out.get(name, (0.0, 0.0))
                out[name] = (cases + here[0], rate + here[1])
    return out


def _pairs_with(metrics: dict[str, float], suffix: str, keep: Callable[[float], bool]) -> list[str]:
    """The pairs with a `pair.<name><suffix>` metric (per shard or not) whose value `keep` accepts."""
    out = set()
    for k, v in metrics.items():
        i = k.find("pair.")
        if i >= 0 and k.endswith(suffix) and keep(v):
            out.add(k[i + len("pair."):-len(suffix)])
    return sorted(out)


def flagged_pairs(metrics: dict[str, float], suffix: str, any_value: bool = False) -> list[str]:
    """The pairs a campaign flagged with `pair.<name><suffix>` = 1 (per shard or not): `.missed`,
    demonstration pairs it did not catch; `.cannot_run`, pairs that raised a harness error; `.unfinished`,
    pairs whose first case never came back before the budget ended.
    `any_value`: the pairs with that metric at all (`.missed` is logged for every demonstration)."""
    return _pairs_with(metrics, suffix, lambda v: any_value or bool(v))


def caught_pairs(metrics: dict[str, float]) -> list[str]:
    """The demonstrations a campaign (or, in a run shared by shards, one of its shards) caught: a
    `pair.<name>.missed` of 0."""
    return _pairs_with(metrics, ".missed", lambda v: not v)


NIGHT_HOURS = 12.0  # campaigns of one seed started this close together are one night's shards


def missed_by_night(window: list[dict]) -> list[tuple[dict, str, list[str]]]:
    """(first campaign, pair, run ids) per demonstration a night missed: its shards (the campaigns of one
    seed started within NIGHT_HOURS of each other: shards derive one seed from the run id) are judged
    together, so a pair one shard's streams missed and another's caught is not missed, and a pair
    every shard missed is listed once."""
    nights: list[list[dict]] = []
    for c in sorted(window, key=lambda c: c["start"]):
        night = next((n for n in nights if n[0]["seed"] == c["seed"]
                      and (c["start"] - n[0]["start"]).total_seconds() <= NIGHT_HOURS * 3600), None)
        if night is None:
            nights.append([c])
        else:
            night.append(c)
    out = []
    for night in nights:
        caught = {p for c in night for p in c.get("caught", ())}
        for name in sorted({p for c in night for p in c.get("missed", ())} - caught):
            runs = [c["run_id"] for c in night if name in c.get("missed", ())]
            out.append((next(c for c in night if name in c.get("missed", ())), name, runs))
    return out


def read_store(uri: str | None) -> tuple[list[dict], list[dict]]:
    """(campaigns, regressions) as plain dicts, from the store at `uri` (default: as `harness fuzz`)."""
    from .mlflow_tracking import CAMPAIGN, open_store, regression_dict, resolve_uri, sqlite_path
    from .mlflow_tracking.payload import FLAGS

    db = sqlite_path(resolve_uri(uri))
    if db is not None and not db.exists():
        raise UsageError(f"there is no MLflow store at {db}; run a campaign first (`harness fuzz` or "
                         "`pytest --harness-fuzz`), or pass --tracking-uri (or set MLFLOW_TRACKING_URI) to the "
                         "store the campaigns log to.")
    store = open_store(uri)
    campaigns = []
    for run in store.search(f"tags.`harness.kind` = '{CAMPAIGN}'"):
        m, p = run.data.metrics, run.data.params
        cases = _campaign_metric(m, "cases")
        seconds = _campaign_metric(m, "seconds")
        rate = m.get("cases_per_second")
        if rate is None:
            rate = cases / seconds if seconds > 0 else 0.0
        campaigns.append({
            "run_id": run.info.run_id, "start": _from_ms(run.info.start_time), "status": run.info.status,
            "seed": p.get("seed", "?"), "profile": p.get("profile", "none"), "shard": p.get("shard", "none"),
            "streams": p.get("streams", "1"),
            "device": p.get("device", "?"), "n_pairs": p.get("n_pairs", "?"), "git_commit": p.get("git_commit", "?"),
            "cases": cases, "seconds": seconds, "cases_per_second": float(rate),
            "findings": _campaign_metric(m, "findings"), "pairs": pair_cases(m), "missed": flagged_pairs(m, ".missed"),
            **{suffix[1:]: flagged_pairs(m, suffix) for suffix in FLAGS.values()},  # cannot_run, unfinished
            "demonstrations": flagged_pairs(m, ".missed", True),
            "caught": caught_pairs(m),
        })
    regressions = []
    from .mlflow_tracking import REGRESSION

    for run in store.search(f"tags.`harness.kind` = '{REGRESSION}'"):
        d = regression_dict(run)
        d["closed_at"] = run.data.tags.get("harness.closed_at", "")
        regressions.append(d)
    campaigns.sort(key=lambda c: c["start"])
    return campaigns, regressions


def classify(regressions: list[dict], since: _dt.datetime) -> dict[str, list[dict]]:
    """Split regressions into new / recurring / fixed relative to the window starting at `since`."""
    out: dict[str, list[dict]] = {"new": [], "recurring": [], "fixed": []}
    for r in regressions:
        first, last, closed = _parse_iso(r["first_seen"]), _parse_iso(r["last_seen"]), _parse_iso(r.get("closed_at"))
        fixed = r["status"] == "fixed" and closed is not None and closed >= since
        if fixed:
            out["fixed"].append(r)
        if first is not None and first >= since:
            out["new"].append(r)
        elif last is not None and last >= since and not fixed:  # (seen, then closed: once, as fixed)
            out["recurring"].append(r)
    for rows in out.values():
        rows.sort(key=lambda r: (r["pair"], r["id"]))
    return out


# (campaign key, section title, what it means) of the pairs a campaign ran nothing of to judge
UNRUN_SECTIONS = (
    ("cannot_run", "Pairs that could not run",
     "These raised a harness error (their own setup: a checkpoint that is gone, a setting they refuse), so nothing "
     "of them was tested; the campaign's log says what to fix."),
    ("unfinished", "Pairs that did not finish",
     "Their first case was still running when the budget ended (a hang, or a cold start longer than the budget "
     "allows), so nothing of them was judged and the campaign failed (exit 1); its log says how long the case ran "
     "and where it was."),
)


def reopened_in(groups: dict[str, list[dict]], since: _dt.datetime) -> list[dict]:
    """The open regressions marked fixed before and seen again inside the window (new or recurring: one
    first seen in the window, closed and seen again, is new and reopened)."""
    return [r for r in groups["new"] + groups["recurring"] if r["status"] == "open"
            and (at := _parse_iso(r.get("reopened_at"))) is not None and at >= since]


def counts_line(groups: dict[str, list[dict]], since: _dt.datetime) -> str:
    """'N new, M recurring, K fixed', with how many of them were reopened (a trial read '0 recurring' for a
    regression it had closed and seen again the same day: it is new, and reopened)."""
    reopened = len(reopened_in(groups, since))
    return (f"{len(groups['new'])} new, {len(groups['recurring'])} recurring, {len(groups['fixed'])} fixed"
            + (f" ({reopened} of them reopened: marked fixed and seen again)" if reopened else ""))


def replay_command(r: dict, uri: str | None = None) -> str:
    """The replay command of a regression, with `--plugin` when its corpus file says its pair needs one;
    from the store (`--run-id`) when that file is not on this machine (another shard's job wrote it)."""
    from .mlflow_tracking.payload import store_flag

    if r.get("corpus_path"):
        from .corpus import load_repro

        try:
            return load_repro(r["corpus_path"]).replay_command()
        except HarnessError:  # not on this machine, or unreadable: its run's repro artifact
            pass
    return f"harness replay{store_flag(uri)} --run-id {r['run_id']}"


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def nights(campaigns: list[dict], regressions: list[dict], n: int, today: _dt.date) -> list[tuple]:
    """(date, findings made by campaigns that night, regressions first seen that night) for n nights."""
    findings: dict[_dt.date, float] = defaultdict(float)
    first: dict[_dt.date, int] = defaultdict(int)
    for c in campaigns:
        findings[c["start"].date()] += c["findings"]
    for r in regressions:
        t = _parse_iso(r["first_seen"])
        if t is not None:
            first[t.date()] += 1
    days = [today - _dt.timedelta(days=i) for i in range(n - 1, -1, -1)]
    return [(d, findings.get(d, 0.0), first.get(d, 0)) for d in days]


def plot_nights(rows: list[tuple], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    try:
        ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], width=0.4, label="findings (campaigns)")
        ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], width=0.4, label="regressions first seen")
        step = max(1, len(rows) // 10)
        ax.set_xticks(xs[::step], [r[0].isoformat() for r in rows][::step], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("count")
        ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_title("Findings over nights (UTC)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def _g(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) else "-"


def _registered_expected(names: set[str]) -> dict[str, str]:
    """Pair -> its expected verdict, for the pairs no regression names (a clean aligned pair): from the
    registry of this checkout, where the pair is registered here (a plugin's pairs may not be)."""
    if not names:
        return {}
    try:
        from .pairs import REGISTRY

        known = {p.name: p.expected for p in REGISTRY.all()}
    except Exception:  # noqa: BLE001 - the report is written anyway, with '-' there
        return {}
    return {n: known[n] for n in names if n in known}


def _judged(r: dict) -> str:
    """The mean the verdict read (`k3 0.0013`: the expected k3; `kl 0.003`: the exact KL), not the
    sampled tokens' mean k3, which a small case can hold far under the line."""
    vm = r.get("verdict_mean")
    if not vm or not isinstance(vm[1], (int, float)) or vm[1] != vm[1]:
        return f"k3 {_g(r.get('k3'))}"
    return f"{vm[0]} {_g(vm[1])}"


def render(campaigns: list[dict], regressions: list[dict], since: _dt.datetime, now: _dt.datetime,
           plot_name: str | None, uri: str) -> str:
    window = [c for c in campaigns if c["start"] >= since]
    groups = classify(regressions, since)
    cases = sum(c["cases"] for c in window)
    seconds = sum(c["seconds"] for c in window)
    lines = [f"# Nightly report: {since:%Y-%m-%d %H:%M} to {now:%Y-%m-%d %H:%M} UTC", "",
             f"Store: `{uri}`. {len(window)} campaign run(s), {int(cases)} cases"
             + (f" at {cases / seconds:.1f} cases/s overall" if seconds > 0 else "")
             + f"; regressions: {counts_line(groups, since)}.", ""]
    new_aligned = [r for r in groups["new"] if r["expected"] == "aligned"]
    still = [r for r in new_aligned if r["status"] != "fixed"]  # (found and closed inside the window: said below)
    if still:
        lines += [f"**{len(still)} new regression(s) of aligned pairs**: "
                  + ", ".join(f"{r['pair']} {r['id']}" for r in still), ""]
    if len(still) < len(new_aligned):
        lines += [f"{len(new_aligned) - len(still)} new regression(s) of aligned pairs found and closed as fixed in "
                  "this window: " + ", ".join(f"{r['pair']} {r['id']}" for r in new_aligned if r["status"] == "fixed"),
                  ""]
    reopened = reopened_in(groups, since)
    if reopened:  # marked fixed and seen again inside the window: as loud as a new one
        lines += [f"**{len(reopened)} regression(s) marked fixed and seen again (reopened)**: "
                  + ", ".join(f"{r['pair']} {r['id']}" for r in reopened), ""]
    # per pair: regressions, and cases where the campaigns logged them per pair (pytest --harness-fuzz)
    per_cases: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # pair -> [cases, seconds]
    for c in window:
        for name, (n, rate) in c.get("pairs", {}).items():
            per_cases[name][0] += n
            per_cases[name][1] += n / rate if rate > 0 else 0.0
    pairs = sorted({r["pair"] for rows in groups.values() for r in rows} | set(per_cases))
    # expected verdicts: a regression's own; else the campaigns' (each logs `pair.<name>.missed` for its
    # demonstrations, so a pair it counted cases of without one is aligned: a plugin's pairs too, which
    # this process does not load); else this checkout's registry
    expected = {r["pair"]: r["expected"] for r in regressions}
    for c in window:
        for name in c.get("pairs", {}):
            expected.setdefault(name, "diverges" if name in c.get("demonstrations", ()) else "aligned")
    expected.update({p: e for p, e in _registered_expected(set(pairs) - set(expected)).items()})
    lines += ["## Per pair", ""]
    if pairs:
        lines += ["| pair | expected | new | recurring | fixed | cases | cases/s |", "|---|---|---|---|---|---|---|"]
        for p in pairs:
            counts = [sum(1 for r in groups[k] if r["pair"] == p) for k in ("new", "recurring", "fixed")]
            n, secs = per_cases.get(p, (0.0, 0.0))
            cases = (f"{int(n)} | {n / secs:.1f}" if secs > 0 else f"{int(n)} | -") if p in per_cases else "- | -"
            lines.append(f"| {p} | {expected.get(p, '-')} | " + " | ".join(map(str, counts)) + f" | {cases} |")
    else:
        lines.append("No regression was new, seen again or fixed in this window, and no campaign logged cases "
                     "per pair.")
    lines.append("")
    missed = missed_by_night(window)
    lines += [f"## Missed demonstrations ({len(missed)})", ""]
    if missed:
        lines += ["A demonstration pair diverges by design; a campaign that did not catch it lost detection power "
                  "or ran it too briefly (more cases or budget). A night's shards (one seed) are judged together: "
                  "a pair is missed when none of them caught it.", "",
                  "| pair | campaign started (UTC) | seed | run(s) |", "|---|---|---|---|"]
        lines += [f"| {name} | {c['start']:%Y-%m-%d %H:%M} | {c['seed']} | {', '.join(r[:12] for r in runs)} |"
                  for c, name, runs in missed]
    else:
        lines.append("None: every demonstration the campaigns in this window ran was caught.")
    lines.append("")
    for key, title, why in UNRUN_SECTIONS:  # pairs of which nothing was judged: each campaign that had one
        rows = [(c, name) for c in window for name in c.get(key, ())]
        if rows:
            lines += [f"## {title} ({len(rows)})", "", why, "", "| pair | campaign started (UTC) | seed | run |",
                      "|---|---|---|---|"]
            lines += [f"| {name} | {c['start']:%Y-%m-%d %H:%M} | {c['seed']} | {c['run_id'][:12]} |" for c, name in rows]
            lines.append("")
    titles = {"new": "New", "recurring": "Recurring", "fixed": "Fixed"}
    for key in ("new", "recurring", "fixed"):
        rows = groups[key]
        lines += [f"## {titles[key]} ({len(rows)})", ""]
        if not rows:
            lines += ["None.", ""]
            continue
        lines += ["| pair | id | expected | status | symptom | judged | first seen | last seen | seen | replay |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            # (a regression first seen in the window, closed as fixed and seen again, is new and reopened)
            status = r["status"] + (" (reopened)" if r["recurrence"] and r["status"] == "open" else "")
            lines.append(f"| {r['pair']} | {r['id']} | {r['expected']} | {status} | {r['symptom']} | {_judged(r)} | "
                         f"{r['first_seen']} | {r['last_seen']} | {r['seen_count']} | `{replay_command(r, uri)}` |")
        lines.append("")
    lines += ["## Campaigns", ""]
    if window:
        lines += ["| started (UTC) | profile | shard | streams | device | seed | pairs | cases | cases/s | findings "
                  "| run |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in window:
            lines.append(f"| {c['start']:%Y-%m-%d %H:%M} | {c['profile']} | {c['shard']} | {c['streams']} | "
                         f"{c['device']} | {c['seed']} | "
                         f"{c['n_pairs']} | {int(c['cases'])} | {c['cases_per_second']:.1f} | {int(c['findings'])} | "
                         f"{c['run_id'][:12]} |")
        lines += ["", "Rerun a night exactly: `harness fuzz --seed SEED --streams S` (or `pytest --harness-fuzz "
                      "--harness-seed SEED --harness-streams S --shard i/N`) with the seed, streams and shard above, "
                      "and the same profile, pairs and plugins (`--plugin`).", ""]
    else:
        lines += ["No campaign run started in this window.", ""]
    if plot_name:
        lines += ["## Findings over nights", "", f"![findings over nights]({plot_name})", ""]
    return "\n".join(lines)


@click.command("report")
@click.option("--since", default="24h", show_default=True,
              help="Window: a duration back from now (90m, 24h, 7d, 2w) or an ISO date.")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, "
              "else sqlite:///<abs>/reports/mlflow.db).")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_OUT,
              show_default=True, help="Markdown file to write; the plot goes beside it.")
@click.option("--nights", "n_nights", type=click.IntRange(1, 366), default=30, show_default=True,
              help="Nights shown in the plot.")
def report_command(since: str, tracking_uri: str | None, out: Path, n_nights: int) -> None:
    """Write the morning report (new, recurring, fixed regressions per pair; cases; a plot) from MLflow."""
    now = _dt.datetime.now(_dt.timezone.utc)
    start = parse_since(since, now)
    from .mlflow_tracking import resolve_uri

    campaigns, regressions = read_store(tracking_uri)
    plot = out.with_name(out.stem + "_findings.png")
    plot_nights(nights(campaigns, regressions, n_nights, now.date()), plot)
    text = render(campaigns, regressions, start, now, plot.name, resolve_uri(tracking_uri))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    groups = classify(regressions, start)
    click.echo(f"wrote {out} and {plot}: regressions {counts_line(groups, start)} since {start:%Y-%m-%d %H:%M} UTC.")
