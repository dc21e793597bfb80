"""What a campaign leaves in MLflow beyond its findings: missed demonstrations (on the campaign
run and in the morning report), the corpus's minimal case for a finding the corpus already had,
and replay commands that load the pair's plugin."""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

from harness import REGISTRY
from harness.corpus import record_finding
from harness.execute import run_case
from harness.fuzz import CampaignConfig, CampaignResult, Finding, PairResult, signature

from .conftest import DIVERGING, first_diverging, logged, make_finding

ROOT = Path(__file__).resolve().parents[2]


def test_a_missed_demonstration_is_on_the_campaign_run_and_in_the_report(fresh_cwd):
    from harness.mlflow_tracking import MlflowTracker, Store
    from harness.report import read_store, render

    pairs = [REGISTRY.get("rotary.bf16_angles"), REGISTRY.get("linear.aligned")]
    cfg = CampaignConfig(pairs=pairs, seed=3)
    tracker = MlflowTracker(log=lambda m: None)
    tracker.campaign_started(cfg, 3, pairs)
    result = CampaignResult(seed=3, config=cfg, seconds=2.0, results=[
        PairResult("rotary.bf16_angles", "diverges", examples=5, seconds=1.0),  # ran, caught nothing: MISSED
        PairResult("linear.aligned", "aligned", examples=5, seconds=1.0)])
    assert result.results[0].verdict == "MISSED"
    tracker.campaign_finished(result)
    [run] = Store().search("tags.`harness.kind` = 'campaign'")
    assert run.data.metrics["missed_demonstrations"] == 1 and run.data.metrics["demonstrations"] == 1
    assert run.data.metrics["pair.rotary.bf16_angles.missed"] == 1
    assert "pair.linear.aligned.missed" not in run.data.metrics
    assert run.data.tags["harness.missed_demonstrations"] == "rotary.bf16_angles"
    campaigns, regressions = read_store(None)
    now = dt.datetime.now(dt.timezone.utc)
    text = render(campaigns, regressions, now - dt.timedelta(hours=1), now, None, "uri")
    assert "## Missed demonstrations (1)" in text
    assert f"| rotary.bf16_angles | {campaigns[0]['start']:%Y-%m-%d %H:%M} | 3 |" in text
    assert "could not run" not in text


def test_a_pair_that_cannot_run_is_on_the_campaign_run_and_in_the_report_not_a_regression(fresh_cwd):
    from harness.mlflow_tracking import MlflowTracker, Store
    from harness.report import read_store, render

    pairs = [REGISTRY.get("linear.aligned")]
    cfg = CampaignConfig(pairs=pairs, seed=4)
    tracker = MlflowTracker(log=lambda m: None)
    tracker.campaign_started(cfg, 4, pairs)
    result = CampaignResult(seed=4, config=cfg, seconds=1.0, results=[
        PairResult("linear.aligned", "aligned", setup_error="linear.aligned cannot run here: ...")])
    assert result.results[0].verdict == "CANNOT RUN"
    tracker.campaign_finished(result)
    [run] = Store().search("tags.`harness.kind` = 'campaign'")
    assert run.data.metrics["pairs_cannot_run"] == 1 and run.data.metrics["pair.linear.aligned.cannot_run"] == 1
    assert run.data.tags["harness.cannot_run"] == "linear.aligned"
    campaigns, regressions = read_store(None)
    assert regressions == []
    now = dt.datetime.now(dt.timezone.utc)
    text = render(campaigns, regressions, now - dt.timedelta(hours=1), now, None, "uri")
    assert "## Pairs that could not run (1)" in text
    assert f"| linear.aligned | {campaigns[0]['start']:%Y-%m-%d %H:%M} | 4 |" in text


def test_a_finding_the_corpus_had_is_logged_with_the_corpus_minimal_case(fresh_cwd):
    """A fresh store, a corpus that already holds the signature with a smaller case: the regression
    run shows the corpus's minimal case (params, case tag, repro artifact), not the campaign's."""
    from harness.mlflow_tracking import MlflowTracker, Store

    minimal = make_finding(fresh_cwd)  # written to the corpus first
    name = DIVERGING[0]
    bigger = first_diverging(name, seq_lens=(3, 2), n_experts=5, top_k=1, tie_fraction=1.0)
    ev = run_case(REGISTRY.get(name), bigger, "cpu", 1e-3)
    f = Finding(pair=name, expected="aligned", symptom=ev.symptom, signature=signature(name, ev), case=bigger,
                evaluation=ev, examples=40, shrink_complete=False)
    assert f.id == minimal.id
    record_finding(f, fresh_cwd / "corpora", 1e-3, 9, "cpu")
    assert not f.new
    tracker = logged(MlflowTracker(log=lambda m: None), [f])
    run_id, what = tracker.logged[f.id]
    assert what == "created"
    run = Store().client.get_run(run_id)
    assert run.data.params["case.seq_lens"] == json.dumps(list(minimal.case.seq_lens))
    assert run.data.params["case.seed"] == str(minimal.case.seed)
    assert run.data.tags["harness.case"] == minimal.case.one_line()
    assert "cut short" not in run.data.tags["mlflow.note.content"]  # the corpus's case was shrunk fully
    local = Store().client.download_artifacts(run_id, f"repro/{f.id}.json", str(fresh_cwd))
    assert json.loads(Path(local).read_text())["case"] == minimal.case.to_json()


def test_the_note_of_a_plugin_pair_replays_as_printed(fresh_cwd, monkeypatch):
    from harness.mlflow_tracking import MlflowTracker, Store

    plugin = ROOT / "tests" / "plugins" / "lm_head_bf16.py"
    REGISTRY.load_plugin(str(plugin))
    pair = REGISTRY.get("example.lm_head_bf16")
    from harness import Case

    case = next(c for c in (Case(seed=s, seq_lens=(4,), logit_scale=16.0) for s in range(50))
                if run_case(pair, c, "cpu", 1e-3).failed)
    ev = run_case(pair, case, "cpu", 1e-3)
    f = Finding(pair=pair.name, expected="diverges", symptom=ev.symptom, signature=signature(pair.name, ev),
                case=case, evaluation=ev, examples=1)
    record_finding(f, fresh_cwd / "corpora", 1e-3, 1, "cpu")
    tracker = logged(MlflowTracker(log=lambda m: None), [f])
    run_id, _ = tracker.logged[f.id]
    note = Store().client.get_run(run_id).data.tags["mlflow.note.content"]
    assert f"harness replay --plugin {plugin} --run-id {run_id}" in note
    assert f"harness replay --plugin {plugin} corpora/{pair.name}/{f.id}.json" in note
    from harness.report import replay_command

    assert replay_command({"corpus_path": str(f.path), "run_id": run_id}) == \
        f"harness replay --plugin {plugin} corpora/{pair.name}/{f.id}.json"


def test_workers_attached_to_one_campaign_count_a_regression_once(fresh_cwd):
    """pytest-xdist workers running streams of one pair attach to the controller's campaign run with
    its uid: a regression both find is seen once by that campaign, live or uploaded from a spool."""
    from harness.fuzz import CampaignConfig
    from harness.mlflow_tracking import MlflowTracker, Store, resolve_uri, sync_pending

    f = make_finding(fresh_cwd)
    controller = MlflowTracker(log=lambda m: None, spool_dir=fresh_cwd / "spool")
    cfg = CampaignConfig(pairs=[REGISTRY.get(f.pair)], seed=7)
    controller.campaign_started(cfg, 7, cfg.pairs)
    workers = [MlflowTracker(log=lambda m: None, campaign_run_id=controller.run_id, campaign_uid=controller.uid,
                             spool_dir=fresh_cwd / "spool") for _ in range(2)]
    for w in workers:
        w.campaign_started(cfg, 7, cfg.pairs)
        w.finding(f)
    assert [w.logged[f.id][1] for w in workers] == ["created", "already"]
    [reg] = Store().search("tags.`harness.kind` = 'regression'")
    assert reg.data.tags["harness.seen_count"] == "1"
    # a later campaign: its two workers count it once more, one of them through the spool (offline)
    controller2 = MlflowTracker(log=lambda m: None, spool_dir=fresh_cwd / "spool")
    controller2.campaign_started(cfg, 8, cfg.pairs)
    live = MlflowTracker(log=lambda m: None, campaign_run_id=controller2.run_id, campaign_uid=controller2.uid,
                         spool_dir=fresh_cwd / "spool")
    offline = MlflowTracker("http://127.0.0.1:9", log=lambda m: None, campaign_run_id=controller2.run_id,
                            campaign_uid=controller2.uid, spool_dir=fresh_cwd / "spool")
    for w in (live, offline):
        w.campaign_started(cfg, 8, cfg.pairs)
        w.finding(f)
    assert offline.spooled
    assert sync_pending(resolve_uri(None), fresh_cwd / "spool", log=lambda m: None)["seen"] == 0  # already seen live
    [reg] = Store().search("tags.`harness.kind` = 'regression'")
    assert reg.data.tags["harness.seen_count"] == "2"


def test_the_shards_of_one_run_id_count_a_regression_once(fresh_cwd):
    """CI shards are separate processes (separate trackers), but a nightly's shards share its run id:
    a regression two shards find is seen once that night, and once more by the next night."""
    from harness.mlflow_tracking import MlflowTracker, Store
    from harness.profiles import get_profile, resolve_seed
    from harness.tracking import make_tracker

    f = make_finding(fresh_cwd)
    cfg = CampaignConfig(pairs=[REGISTRY.get(f.pair)], seed=7)
    for night, shards in (("1001", 2), ("1002", 1)):
        choice = resolve_seed(get_profile("nightly"), env={"HARNESS_RUN_ID": night})
        assert choice.night and choice.night == resolve_seed(get_profile("nightly"), run_id=night).night
        for _ in range(shards):
            t = make_tracker(None, log=lambda m: None, night=choice.night)
            assert isinstance(t, MlflowTracker)
            t.campaign_started(cfg, choice.seed, cfg.pairs)
            t.finding(f)
        [reg] = Store().search("tags.`harness.kind` = 'regression'")
        assert reg.data.tags["harness.seen_count"] == {"1001": "1", "1002": "2"}[night]
    # a known regression (created by night 1001) logged twice by night 1003, as by a CPU and a GPU job:
    # the second job hears "already-known", not "already" (which means this night created it)
    night = resolve_seed(get_profile("nightly"), run_id="1003").night
    said = []
    for _ in range(2):
        t = make_tracker(None, log=lambda m: None, night=night)
        t.campaign_started(cfg, 3, cfg.pairs)
        t.finding(f)
        said.append(t.logged[f.id][1])
    assert said == ["seen", "already-known"]
    # without a run id (a given seed, or fresh) each process is its own campaign, as before
    assert resolve_seed(get_profile("nightly"), explicit=7).night is None


def test_severity_reads_the_worst_its_cases_got_not_the_minimal_case(fresh_cwd):
    """Shrinking moves every knob toward neutral, so the minimal case sits just over the line and
    every divergence read `low`: severity is that of the largest judged mean the finding's cases
    reached (`Finding.peak`); a later campaign whose cases got worse raises it."""
    from harness.mlflow_tracking import MlflowTracker, Store, severity

    f = make_finding(fresh_cwd)
    judged = f.evaluation.score
    line = judged / 2  # (a line its minimal case is just over)
    base = severity("divergence", judged, line)
    f.peak = 500 * line
    cfg = CampaignConfig(pairs=[REGISTRY.get(f.pair)], seed=7, threshold=line)
    t = MlflowTracker(log=lambda m: None)
    t.campaign_started(cfg, 7, cfg.pairs)
    t.finding(f)
    [reg] = Store().search("tags.`harness.kind` = 'regression'")
    assert reg.data.tags["harness.severity"] == "high" and base != "high", (base, judged)
    assert f"its cases reached {500 * line:.3g}, 500x the line" in reg.data.tags["mlflow.note.content"]
    # a campaign's severity never lowers an earlier one
    f.peak = math.nan
    t2 = MlflowTracker(log=lambda m: None)
    t2.campaign_started(cfg, 8, cfg.pairs)
    t2.finding(f)
    [reg] = Store().search("tags.`harness.kind` = 'regression'")
    assert reg.data.tags["harness.severity"] == "high" and reg.data.tags["harness.seen_count"] == "2"
    assert "Severity raised" not in reg.data.tags["mlflow.note.content"]
    # an inf peak (a case that sampled a token the trainer excludes) spools as strict JSON, severity high
    from .conftest import free_port

    f.peak = math.inf
    offline = MlflowTracker(f"http://127.0.0.1:{free_port()}", log=lambda m: None, spool_dir=fresh_cwd / "spool")
    offline.campaign_started(cfg, 9, cfg.pairs)
    offline.finding(f)
    (spooled,) = [p for p in offline.spooled if p.name == f"{f.id}.json"]
    payload = json.loads(spooled.read_text())
    assert payload["severity"] == "high" and payload["peak_judged"] is None


def test_a_raised_severity_is_said_in_the_note_headline_too(fresh_cwd):
    """`regressions show` printed "Severity **low**" from the first sighting's note beside a tag that
    a later campaign had raised to medium."""
    from harness.mlflow_tracking import MlflowTracker, Store

    f = make_finding(fresh_cwd)
    line = f.evaluation.score / 2
    cfg = CampaignConfig(pairs=[REGISTRY.get(f.pair)], seed=7, threshold=line)
    for seed, peak in ((7, 5 * line), (8, 50 * line)):
        f.peak = peak
        t = MlflowTracker(log=lambda m: None)
        t.campaign_started(cfg, seed, cfg.pairs)
        t.finding(f)
        [reg] = Store().search("tags.`harness.kind` = 'regression'")
        note = reg.data.tags["mlflow.note.content"]
        if seed == 7:
            assert reg.data.tags["harness.severity"] == "low" and "Severity **low**" in note
    assert reg.data.tags["harness.severity"] == "medium"
    assert "Severity **medium** (raised from low: see the end of this note)" in note and "Severity **low**" not in note
    assert f"**low** -> **medium**: its cases reached {50 * line:.3g}, 50x the line." in note, note


def test_a_pair_that_did_not_finish_is_on_the_campaign_run_and_in_the_report(fresh_cwd):
    """A trial's failed night (its model pairs' first cases never came back) read in the morning
    report as if nothing were wrong: 'every demonstration ... was caught', no word of the pairs."""
    from harness.mlflow_tracking import MlflowTracker, Store
    from harness.report import read_store, render

    pairs = [REGISTRY.get("linear.aligned"), REGISTRY.get("rmsnorm.aligned")]
    cfg = CampaignConfig(pairs=pairs, seed=5)
    tracker = MlflowTracker(log=lambda m: None)
    tracker.campaign_started(cfg, 5, pairs)
    result = CampaignResult(seed=5, config=cfg, seconds=1.0, results=[
        PairResult("linear.aligned", "aligned", unfinished=12.0), PairResult("rmsnorm.aligned", "aligned", examples=3)])
    assert result.results[0].verdict == "UNFINISHED" and result.results[1].verdict == "clean"
    tracker.campaign_finished(result)
    [run] = Store().search("tags.`harness.kind` = 'campaign'")
    assert run.data.metrics["pairs_unfinished"] == 1 and run.data.metrics["pair.linear.aligned.unfinished"] == 1
    assert run.data.tags["harness.unfinished"] == "linear.aligned" and "harness.cannot_run" not in run.data.tags
    campaigns, regressions = read_store(None)
    now = dt.datetime.now(dt.timezone.utc)
    text = render(campaigns, regressions, now - dt.timedelta(hours=1), now, None, "uri")
    assert "## Pairs that did not finish (1)" in text and "could not run" not in text, text
    assert f"| linear.aligned | {campaigns[0]['start']:%Y-%m-%d %H:%M} | 5 |" in text
