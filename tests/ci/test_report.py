"""`harness report`: new, recurring and fixed regressions per pair from a real MLflow store, with
cases, cases/s, replay commands and the findings-over-nights plot."""

from __future__ import annotations

import datetime as dt
import re
import time

import pytest
from click.testing import CliRunner

from harness.errors import UsageError
from harness.report import classify, parse_since, report_command

NOW = dt.datetime(2026, 1, 31, 6, 0, tzinfo=dt.timezone.utc)


def test_parse_since():
    assert parse_since("24h", NOW) == NOW - dt.timedelta(hours=24)
    assert parse_since("7d", NOW) == NOW - dt.timedelta(days=7)
    assert parse_since("90m", NOW) == NOW - dt.timedelta(minutes=90)
    assert parse_since("2026-01-30", NOW) == dt.datetime(2026, 1, 30, tzinfo=dt.timezone.utc)
    with pytest.raises(UsageError, match="24h"):
        parse_since("yesterday", NOW)
    east = parse_since("2026-01-31T06:00+02:00", NOW)  # printed as UTC: 04:00, not 06:00
    assert east == dt.datetime(2026, 1, 31, 4, 0, tzinfo=dt.timezone.utc) and f"{east:%H:%M}" == "04:00"


def test_campaign_counters_of_a_run_shared_by_shards_count_each_case_once():
    from harness.report import _campaign_metric, pair_cases

    metrics = {"shard1of2.cases": 10, "shard1of2.pair.a.cases": 10, "shard1of2.pair.a.cases_per_second": 5,
               "shard2of2.cases": 5, "shard2of2.pair.b.cases": 3, "shard2of2.pair.a.cases": 2,
               "shard2of2.pair.a.cases_per_second": 1}
    assert _campaign_metric(metrics, "cases") == 15
    assert pair_cases(metrics) == {"a": (12.0, 6.0), "b": (3.0, 0.0)}
    assert pair_cases({"pair.a.cases": 4, "pair.a.cases_per_second": 2}) == {"a": (4.0, 2.0)}
    both = {"pair.a.cases": 4, "shard1of2.pair.a.cases": 4, "cases": 4, "shard1of2.cases": 4}
    assert pair_cases(both) == {"a": (4.0, 0.0)} and _campaign_metric(both, "cases") == 4  # the unprefixed one


def test_classify_against_the_window():
    def reg(i, first, last, status="open", closed=""):
        return {"id": i, "pair": "p", "first_seen": first, "last_seen": last, "status": status, "closed_at": closed}

    since = NOW - dt.timedelta(hours=24)
    old, recent = "2026-01-20T00:00:00+00:00", "2026-01-31T01:00:00+00:00"
    groups = classify([reg("new", recent, recent), reg("again", old, recent), reg("quiet", old, old),
                       reg("fixed", old, old, "fixed", recent), reg("fixed_long_ago", old, old, "fixed", old),
                       reg("seen_then_fixed", old, recent, "fixed", recent)], since)
    assert [r["id"] for r in groups["new"]] == ["new"]
    assert [r["id"] for r in groups["recurring"]] == ["again"]  # (seen, then closed: counted once, as fixed)
    assert [r["id"] for r in groups["fixed"]] == ["fixed", "seen_then_fixed"]


@pytest.mark.slow
def test_report_from_a_real_store(tmp_path):
    from harness import REGISTRY
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.mlflow_tracking import MlflowTracker, close_regression

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    pair = REGISTRY.get("router_topk.bf16")

    def campaign():
        cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=20, corpus=tmp_path / "corpus")
        cfg.profile = "nightly"
        return run_campaign(cfg, tracker=MlflowTracker(uri, log=lambda m: None), log=lambda m: None)

    first = campaign()
    (finding,) = first.findings
    close_regression(finding.id, "fixed", "fixed upstream", uri=uri, verify=False)  # marked fixed, still there
    out = tmp_path / "reports" / "nightly.md"
    runner = CliRunner()
    res = runner.invoke(report_command, ["--since", "24h", "--tracking-uri", uri, "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "## New (1)" in text and "## Fixed (1)" in text and "## Recurring (0)" in text
    assert f"`harness replay {finding.path}`" in text
    from harness.metrics import verdict_mean

    name, value = verdict_mean(finding.evaluation.divergence)  # the judged mean, not the sampled tokens' k3
    assert f"| divergence | {name} {value:.4g} |" in text, text
    # per pair: new, recurring, fixed, then the cases the campaigns in the window ran on it
    assert re.search(r"\| router_topk\.bf16 \| diverges \| 1 \| 0 \| 1 \| \d+ \| [\d.]+ \|", text), text
    assert f"| nightly | none | 1 | cpu | 1 | 1 | {first.examples} |" in text  # the campaign row: streams, cases
    png = out.with_name("nightly_findings.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "![findings over nights](nightly_findings.png)" in text

    time.sleep(1.1)  # seen-times have one-second resolution
    between = dt.datetime.now(dt.timezone.utc).isoformat()
    time.sleep(1.1)
    second = campaign()  # finds the same bug again: the fixed regression recurs
    assert [f.id for f in second.findings] == [finding.id]
    res = runner.invoke(report_command, ["--since", between, "--tracking-uri", uri, "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "## New (0)" in text and "## Recurring (1)" in text and "## Fixed (0)" in text
    assert "| open (reopened) |" in text and "| 2 |" in text  # seen twice
    assert text.count("| nightly |") == 1  # only the second campaign started in the window
    # a 24 h window holds both nights: first seen inside it (New), and reopened inside it too
    res = runner.invoke(report_command, ["--since", "24h", "--tracking-uri", uri, "--out", str(out)])
    text = out.read_text()
    assert "## New (1)" in text and "| open (reopened) |" in text


def test_missing_store_is_a_usage_error(tmp_path, harness_cli):
    rc, out, err = harness_cli("report", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}",
                               "--out", str(tmp_path / "r.md"))
    assert rc == 2 and "no MLflow store" in err and "Traceback" not in err


def test_a_clean_pair_in_the_report_shows_its_expected_verdict(tmp_path):
    """No regression names a clean aligned pair: its expected verdict comes from the registry."""
    from harness import REGISTRY
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.mlflow_tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = CampaignConfig(pairs=[REGISTRY.get("rmsnorm.aligned")], seed=1, max_examples=5, corpus=tmp_path / "c")
    run_campaign(cfg, tracker=MlflowTracker(uri, log=lambda m: None), log=lambda m: None)
    out = tmp_path / "nightly.md"
    res = CliRunner().invoke(report_command, ["--since", "24h", "--tracking-uri", uri, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert re.search(r"\| rmsnorm\.aligned \| aligned \| 0 \| 0 \| 0 \| \d+ \|", out.read_text()), out.read_text()


def test_an_output_path_under_a_file_is_one_paragraph_and_exit_2(tmp_path, harness_cli):
    from harness import REGISTRY
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.mlflow_tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = CampaignConfig(pairs=[REGISTRY.get("rmsnorm.aligned")], seed=1, max_examples=2, corpus=tmp_path / "c")
    run_campaign(cfg, tracker=MlflowTracker(uri, log=lambda m: None), log=lambda m: None)
    (tmp_path / "afile").write_text("")
    code, out, err = harness_cli("report", "--tracking-uri", uri, "--out", str(tmp_path / "afile" / "x.md"))
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("error: the command stopped on a file-system error: File exists") and "afile" in err


def test_a_reopened_regression_is_a_headline_like_a_new_one():
    """Marked fixed and seen again: the plugin fails the item on it, so the report says it up front,
    not only as a status in the Recurring table."""
    from harness.report import render

    r = {"id": "abc", "pair": "p.aligned", "expected": "aligned", "status": "open", "recurrence": True,
         "symptom": "divergence", "first_seen": "2026-01-20T00:00:00+00:00", "last_seen": "2026-01-31T01:00:00+00:00",
         "seen_count": 3, "run_id": "r1", "k3": 0.01, "reopened_at": "2026-01-31T01:00:00+00:00"}
    text = render([], [r], NOW - dt.timedelta(hours=24), NOW, None, "sqlite:///x.db")
    assert "**1 regression(s) marked fixed and seen again (reopened)**: p.aligned abc" in text, text
    assert "regressions: 0 new, 1 recurring, 0 fixed (1 of them reopened: marked fixed and seen again)." in text
    # first seen tonight, closed and seen again tonight: new, and reopened (a trial read '0 recurring' and
    # looked for it there)
    today = {**r, "first_seen": "2026-01-31T00:10:00+00:00"}
    text = render([], [today], NOW - dt.timedelta(hours=24), NOW, None, "sqlite:///x.db")
    assert "regressions: 1 new, 0 recurring, 0 fixed (1 of them reopened" in text, text
    # reopened weeks ago and seen again tonight: a recurring regression, not tonight's reopening
    text = render([], [{**r, "reopened_at": "2026-01-10T00:00:00+00:00"}], NOW - dt.timedelta(hours=24), NOW, None,
                  "sqlite:///x.db")
    assert "marked fixed and seen again" not in text


def test_a_plugins_pairs_show_their_expected_verdict_from_the_campaign_metrics():
    """`harness report` loads no plugin: a plugin pair's expected verdict comes from what its campaign
    logged (`pair.<name>.missed` for each demonstration; cases alone for an aligned pair), not '-'."""
    from harness.report import flagged_pairs, render

    metrics = {"pair.mine.fast.cases": 10.0, "pair.mine.fast.cases_per_second": 5.0, "pair.mine.demo.cases": 4.0,
               "pair.mine.demo.cases_per_second": 2.0, "pair.mine.demo.missed": 0.0}
    assert flagged_pairs(metrics, ".missed") == [] and flagged_pairs(metrics, ".missed", True) == ["mine.demo"]
    camp = {"run_id": "c1", "start": NOW - dt.timedelta(hours=2), "status": "FINISHED", "seed": "1",
            "profile": "none", "shard": "none", "streams": "1", "device": "cpu", "n_pairs": "2", "git_commit": "x",
            "cases": 14.0, "seconds": 3.0, "cases_per_second": 4.7, "findings": 0.0,
            "pairs": {"mine.fast": (10.0, 5.0), "mine.demo": (4.0, 2.0)}, "missed": [], "cannot_run": [],
            "demonstrations": ["mine.demo"]}
    text = render([camp], [], NOW - dt.timedelta(hours=24), NOW, None, "sqlite:///x.db")
    assert "| mine.fast | aligned | 0 | 0 | 0 | 10 | 5.0 |" in text, text
    assert "| mine.demo | diverges | 0 | 0 | 0 | 4 | 2.0 |" in text, text


def test_a_nights_shards_are_judged_together_for_missed_demonstrations():
    """Shards of one night (one seed) split a pair's streams: a pair one shard caught and another's
    streams missed is not missed; one every shard missed is listed once, with each run. The same
    seed a day later (a fixed-seed profile) is another night."""
    import datetime as dt

    from harness.report import missed_by_night

    t0 = dt.datetime(2026, 11, 30, 2, 0, tzinfo=dt.timezone.utc)

    def camp(run, hours, missed, caught, seed="601"):
        return {"run_id": run * 4, "start": t0 + dt.timedelta(hours=hours), "seed": seed, "missed": missed,
                "caught": caught}

    window = [camp("a", 0, ["x.split", "y.both"], ["z.caught"]), camp("b", 0.1, ["y.both"], ["x.split"]),
              camp("c", 24, ["x.split"], [])]
    got = [(c["run_id"], name, runs) for c, name, runs in missed_by_night(window)]
    assert got == [("aaaa", "y.both", ["aaaa", "bbbb"]), ("cccc", "x.split", ["cccc"])], got


def test_a_new_regression_closed_in_the_window_is_not_a_bold_open_headline():
    from harness.report import render

    r = {"id": "abc", "pair": "p.aligned", "expected": "aligned", "status": "open", "recurrence": False,
         "symptom": "divergence", "first_seen": "2026-01-31T01:00:00+00:00", "last_seen": "2026-01-31T01:00:00+00:00",
         "seen_count": 1, "run_id": "r1", "k3": 0.01}
    text = render([], [r], NOW - dt.timedelta(hours=24), NOW, None, "sqlite:///x.db")
    assert "**1 new regression(s) of aligned pairs**: p.aligned abc" in text
    closed = {**r, "status": "fixed", "closed_at": "2026-01-31T04:00:00+00:00"}
    text = render([], [closed], NOW - dt.timedelta(hours=24), NOW, None, "sqlite:///x.db")
    assert "**1 new regression(s)" not in text
    assert "1 new regression(s) of aligned pairs found and closed as fixed in this window: p.aligned abc" in text


def test_a_regression_whose_corpus_file_is_elsewhere_replays_from_the_store():
    from harness.report import replay_command

    r = {"run_id": "0123456789abcdef", "corpus_path": "/elsewhere/job2/corpora/p/abc.json"}
    assert replay_command(r) == "harness replay --run-id 0123456789abcdef"
    assert replay_command(r, "sqlite:////shared/mlflow.db") == \
        "harness replay --tracking-uri sqlite:////shared/mlflow.db --run-id 0123456789abcdef"
