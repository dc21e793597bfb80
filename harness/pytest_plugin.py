"""pytest plugin: every registered target pair as one test item (`pytest --harness-fuzz`).

    pytest --harness-fuzz [-n auto] [--harness-pairs GLOB] [--harness-budget SECONDS]
           [--harness-seed N] [--harness-profile dev|ci|nightly] [--shard i/N]

Registered through the `pytest11` entry point and off unless `--harness-fuzz` is given: without it
the plugin adds its options and nothing else (this module imports only pytest and the standard
library; the engine, torch and MLflow are imported when a campaign runs).

With `--harness-fuzz` the session runs one item per selected pair (this shard's share, see
`harness.fuzz.shard_pairs`) instead of the collected tests, so pytest-xdist (`-n auto`) spreads
the pairs over workers. Each item is a one-pair `harness.fuzz.run_campaign`: Hypothesis draws,
targets and shrinks, each finding is written to the corpus, then tracked. What an item reports:

- an `aligned` pair with a new finding (or a recurrence of a `fixed` one) fails, with the pair, k3,
  minimal case and replay command; one whose findings are all already in the corpus (open,
  wontfix) is an expected failure (xfail), so a known bug does not fail every night;
- a `diverges` pair (a demonstration) passes when caught; one not caught (MISSED), and any pair
  that ran no case, are reported (a warning and the summary) without failing the run; one whose
  cases raised, crashed, hung or gave non-finite output (BROKEN) fails: a demonstration that
  cannot run demonstrates nothing (as `harness gpucheck` fails it, and `harness fuzz` exits 1);
- a pair that cannot run here (CANNOT RUN: its case raised a harness error) or whose first case
  never came back (UNFINISHED) fails. What it raised is said once, in the item's failure: its
  captured campaign log and the terminal table point there (`summary.md` and `summary.json` keep
  the whole message).

The controller (the only process without xdist) chooses the campaign seed, opens one MLflow
campaign run and passes both to the workers (`workerinput`); workers log regression runs under that
campaign run and send their pair results back (`workeroutput`); the controller aggregates them into
one summary (terminal, `<out>/summary.json`, `<out>/summary.md`) and closes the campaign run. New
repros are also copied to `<out>/new-repros/<pair>/<id>.json` for CI to upload (emptied when a session
starts; a shard's `new-repros.shard<i>of<N>/`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

NODE_PREFIX = "harness-fuzz"
DEFAULT_MAX_EXAMPLES = 100  # cases per pair without a profile (as `harness fuzz`)


class HarnessFuzzWarning(UserWarning):
    """A demonstration pair not caught, or a pair that ran no case."""


class FuzzFailure(Exception):
    """An item's failure: its message is the whole report (no traceback)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness", "differential fuzzing of trainer/rollout pairs (harness)")
    group.addoption("--harness-fuzz", action="store_true", default=False,
                    help="Run every registered target pair as one test item instead of the collected tests.")
    group.addoption("--harness-pairs", action="append", default=[], metavar="GLOB",
                    help="Pairs to fuzz, by name or glob (repeatable; default: all).")
    group.addoption("--harness-budget", type=float, default=None, metavar="SECONDS",
                    help="Wall seconds per pair, shrinking included (default: the profile's, else none).")
    group.addoption("--harness-max-examples", type=int, default=None, metavar="N",
                    help="Hypothesis examples per pair (before shrinking; each is followed by uniform random cases, "
                    f"so a pair runs more cases than this; default: the profile's, else {DEFAULT_MAX_EXAMPLES}).")
    group.addoption("--harness-seed", type=int, default=None, metavar="N",
                    help="Campaign seed (default: from the profile; else fresh, printed).")
    group.addoption("--harness-run-id", default=None, metavar="ID",
                    help="Run id the nightly profile derives its seed from (default: $HARNESS_RUN_ID, "
                    "$GITHUB_RUN_ID, $SLURM_ARRAY_JOB_ID).")
    group.addoption("--harness-profile", default=None, metavar="dev|ci|nightly",
                    help="Named campaign settings (harness/profiles.py); default: the harness_profile ini value.")
    group.addoption("--harness-shard", "--shard", dest="harness_shard", default=None, metavar="i/N",
                    help="Fuzz only this shard's share of the pairs (deterministic, no overlap).")
    group.addoption("--harness-device", default="cpu", choices=("cpu", "cuda", "auto"),
                    help="Device both paths run on (default: cpu).")
    group.addoption("--harness-threshold", action="append", default=None, metavar="K3|GLOB=K3",
                    help="The line a case's judged k3 (expected k3) or exact KL must stay under (default: 1e-3). "
                    "GLOB=K3 (repeatable): the matching pairs' own line, over a pair's own "
                    "TargetPair(threshold=...), which a plain K3 leaves as it is.")
    group.addoption("--harness-corpus", default=None, metavar="DIR",
                    help="Where repros are written (default: corpora); the corpus tests/test_corpus.py replays "
                         "(default: the harness repository's own), relative to the working directory.")
    group.addoption("--harness-out", default=os.path.join("reports", "fuzz"), metavar="DIR",
                    help="Where the summary and copies of new repros go (default: reports/fuzz).")
    group.addoption("--harness-plugin", action="append", default=[], metavar="FILE.py|MODULE",
                    help="Load target pairs from a Python file or module (repeatable).")
    group.addoption("--harness-no-skips", action="store_true", default=False,
                    help="Corpus tests: fail a repro that cannot replay here (its pair not registered, its extra or "
                         "device missing) instead of skipping it: a nightly's gate, where a replay step run without "
                         "its --harness-plugin would pass with every repro skipped.")
    group.addoption("--harness-tracking-uri", default=None, metavar="URI",
                    help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else reports/mlflow.db).")
    group.addoption("--harness-no-tracking", action="store_true", default=False,
                    help="Do not log to MLflow (the corpus is still written).")
    group.addoption("--harness-streams", type=int, default=1, metavar="N",
                    help="Split each pair into N independently seeded streams, one test item each, so xdist workers "
                    "and shards scale past the number of pairs (default: 1).")
    group.addoption("--harness-uniform-per-example", type=int, default=None, metavar="N",
                    help="Uniform random cases after each Hypothesis example (default: 3 for op pairs, 1 for model "
                    "pairs; 0: Hypothesis alone).")
    group.addoption("--harness-timeout", action="append", default=None, metavar="SECONDS|GLOB=SECONDS",
                    help="Per-case wall seconds before a case is a `timeout` finding (default: 60; a pair registered "
                         "with its own TargetPair(timeout=) keeps that); GLOB=SECONDS sets it for the matching pairs, "
                         "their own included (repeat the option for several).")
    group.addoption("--harness-no-isolation", action="store_true", default=False,
                    help="Run cases in the test process instead of a supervised worker (debugging only).")
    parser.addini("harness_profile", "campaign profile used by --harness-fuzz when --harness-profile is not given",
                  default="")


def _enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("harness_fuzz", False))


# ---------------------------------------------------------------------------------------------
# Settings shared by the controller and the workers
# ---------------------------------------------------------------------------------------------
class FuzzSession:
    """The campaign of one pytest session (controller or worker)."""

    def __init__(self, config: pytest.Config) -> None:
        from harness.errors import UsageError
        from harness.profiles import get_profile

        self.config = config
        opt = config.getoption
        self.is_worker = hasattr(config, "workerinput")
        self.profile_name = opt("harness_profile") or config.getini("harness_profile") or None
        try:
            self.profile = get_profile(self.profile_name) if self.profile_name else None
            self.shard = _parse_shard(opt("harness_shard"))
        except UsageError as e:
            raise pytest.UsageError(str(e)) from None
        self.globs = list(opt("harness_pairs") or [])
        self.plugins = list(opt("harness_plugin") or [])
        self.device_option = opt("harness_device")
        _check_options(opt)
        max_examples = opt("harness_max_examples")
        self.max_examples = max_examples if max_examples is not None else (
            self.profile.max_examples if self.profile else DEFAULT_MAX_EXAMPLES)
        budget = opt("harness_budget")
        self.budget = budget if budget is not None else (self.profile.budget_per_pair if self.profile else None)
        self.notes: list[str] = []  # what the session's end says below the summary table (an empty shard, ...)
        from harness.profiles import fills_budget

        self.fill_budget = fills_budget(self.profile, max_examples, budget)
        from harness.execute import DEFAULT_THRESHOLD

        from harness.cli import parse_thresholds

        self.thresholds = tuple(opt("harness_threshold") or ())
        self.threshold = parse_thresholds(self.thresholds, [], "--harness-threshold", require_match=False)[0] \
            if self.thresholds else DEFAULT_THRESHOLD  # (checked in `_check_options`)
        self.corpus = Path(opt("harness_corpus") or "corpora")
        self.streams = opt("harness_streams")
        self.uniform_per_example = opt("harness_uniform_per_example")
        if self.uniform_per_example is not None and not 0 <= self.uniform_per_example <= 1000:
            raise pytest.UsageError(f"--harness-uniform-per-example {self.uniform_per_example!r} must be 0..1000 "
                                    "(uniform cases per Hypothesis example).")
        from harness.cli import MAX_STREAMS

        if not 1 <= self.streams <= MAX_STREAMS:
            raise pytest.UsageError(f"--harness-streams {self.streams!r} must be from 1 to {MAX_STREAMS} (streams per "
                                    "pair; default 1).")
        if opt("harness_seed") is not None and opt("harness_seed") < 0:
            raise pytest.UsageError(f"--harness-seed {opt('harness_seed')!r} must be >= 0 (the campaign seed).")
        from harness.corpus import check_limits
        from harness.errors import UsageError as _UsageError

        from harness.worker import memory_limits

        try:
            check_limits()
            memory_limits()
        except _UsageError as e:
            raise pytest.UsageError(str(e)) from None
        from harness.worker import DEFAULT_TIMEOUT

        from harness.cli import parse_timeouts
        from harness.errors import UsageError

        self.timeouts = tuple(opt("harness_timeout") or ())
        try:  # (the format; which pairs a GLOB matches is known per item)
            self.timeout = parse_timeouts(self.timeouts, [], "--harness-timeout", require_match=False)[0]
        except UsageError as e:
            raise pytest.UsageError(f"{e} (per case; default {DEFAULT_TIMEOUT:g}).") from None
        self.isolation = not opt("harness_no_isolation")
        self.unit_list: list[dict] | None = None  # workers: the controller's units (no imports to collect)
        self.executor: Any = None  # harness.fuzz.Executor shared by this process's items
        self.out = Path(opt("harness_out"))
        if not self.is_worker:  # a folder the session writes into: a file there is a mistake to say now, not
            for flag, folder in (("--harness-out", self.out), ("--harness-corpus", self.corpus)):  # at the end
                bad = _not_a_folder(folder)
                if bad is not None:
                    raise pytest.UsageError(f"{flag}={folder}: {bad} is a file, not a folder; the session writes "
                                            "into that folder. Pass a folder (it is created if missing).")
        self.tracking = not opt("harness_no_tracking")
        self.tracking_uri = opt("harness_tracking_uri")
        if self.tracking:  # a scheme no store takes is a mistake to fix now, not an outage to spool through
            import os

            from harness.mlflow_tracking.store import check_scheme

            uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            try:
                if uri:
                    check_scheme(uri, "--harness-tracking-uri", "--harness-no-tracking")
            except UsageError as e:
                raise pytest.UsageError(str(e)) from None
        self.results: list[dict] = []  # this process's pair results (serialised)
        self.campaign_run_id: str | None = None
        self.campaign_uid: str | None = None  # the controller's campaign: what a regression counts as seen by
        self.night: str | None = None  # (the controller's, see below)
        self.tracker: Any = None
        self.tracking_error: str | None = None
        self.start = time.time()
        self.started = self.start  # when the session began (the controller's): repros recorded since are this run's
        if self.is_worker:
            shared = config.workerinput["harness"]
            self.started = shared.get("started", self.start)
            self.seed = shared["seed"]
            self.seed_origin = shared["seed_origin"]
            self.campaign_run_id = shared["campaign_run_id"]
            self.campaign_uid = shared.get("campaign_uid")
            self.tracking_uri = shared["tracking_uri"]
            self.unit_list = shared.get("units")
        else:
            from harness.fuzz import fresh_seed
            from harness.profiles import resolve_seed

            choice = resolve_seed(self.profile, opt("harness_seed"), opt("harness_run_id"))
            self.seed = choice.seed if choice.seed is not None else fresh_seed()
            self.night = choice.night  # (a run id's shards: one campaign for `seen_count`)
            self.seed_origin = choice.origin if choice.seed is not None else f"fresh seed {self.seed}"

    # -- pairs ---------------------------------------------------------------------------------
    def device(self) -> str:
        from harness.env import resolve_device

        return resolve_device(self.device_option, "--harness-device")

    def all_pairs(self) -> list:
        """Every selected pair that runs on the device, in name order, before sharding."""
        from harness.pairs import REGISTRY

        REGISTRY.load_builtins()
        REGISTRY.plugin_flag = "--harness-plugin="  # (how its messages name the option, here)
        for spec in self.plugins:
            REGISTRY.load_plugin(spec)
        dev = self.device()
        chosen, note = REGISTRY.select_default(self.globs)
        if note and not self.is_worker and not getattr(self, "_said_default", False):
            self._said_default = True
            _log(note.replace("(name pairs", "(--harness-pairs GLOB").replace("'*' for all", "'*' for all of the"))
        return [p for p in chosen if dev in p.devices]

    def select(self) -> list:
        """This shard's pairs that run on the device, in name order (the same in every process): those
        with a unit (pair, stream) in the shard (with streams, a pair's streams spread over shards)."""
        from harness.fuzz import campaign_units, unit_pairs

        return unit_pairs(campaign_units(self.all_pairs(), self.streams, self.shard))  # (units in name order)

    def units(self) -> list[dict]:
        """This shard's (pair, stream) units as plain data; a worker gets them from the controller, so
        collecting its items imports no target module (each item imports only its own pair's)."""
        if self.unit_list is None:
            from harness.fuzz import campaign_units

            units = [{"pair": u.pair.name, "expected": u.pair.expected, "source": u.pair.source,
                      "stream": u.stream, "kind": u.pair.kind}
                     for u in campaign_units(self.all_pairs(), self.streams, self.shard)]
            # heaviest first (model pairs, then ops; by name within each): xdist hands items out in
            # this order as workers free up, so a long model item never starts last on one worker
            # while the others sit idle
            self.unit_list = sorted(units, key=lambda u: (u["kind"] != "model", u["pair"], u["stream"]))
        return self.unit_list

    def campaign_config(self, pairs: list) -> Any:
        from harness.fuzz import CampaignConfig

        cfg = CampaignConfig(pairs=pairs, seed=self.seed, max_examples=self.max_examples, budget=None,
                             threshold=self.threshold, thresholds=self.pair_thresholds(pairs),
                             device=self.device(), corpus=self.corpus,
                             shard=self.shard, isolation=self.isolation, timeout=self.timeout,
                             timeouts=self.pair_timeouts(pairs), plugins=tuple(self.plugins), streams=self.streams,
                             uniform_per_example=self.uniform_per_example, fill_budget=self.fill_budget)
        cfg.budget = self.budget * len(pairs) if self.budget is not None else None  # per pair -> campaign
        cfg.profile = self.profile_name  # stored with the campaign run
        return cfg

    def pair_thresholds(self, pairs: list) -> dict[str, float]:
        """`--harness-threshold GLOB=K3`: the line of each matching pair."""
        from harness.cli import parse_thresholds

        return parse_thresholds(self.thresholds, pairs, "--harness-threshold", require_match=False)[1]

    def threshold_of(self, pair: Any) -> float:
        """The line `pair` is judged at in this session (`CampaignConfig.threshold_of`)."""
        return self.campaign_config([pair]).threshold_of(pair.name)

    def pair_timeouts(self, pairs: list) -> dict[str, float]:
        """`--harness-timeout GLOB=SECONDS`: the per-case timeout of each matching pair."""
        from harness.cli import parse_timeouts

        return parse_timeouts(self.timeouts, pairs, "--harness-timeout", require_match=False)[1]

    # -- tracking ------------------------------------------------------------------------------
    def open_campaign(self) -> None:
        """Controller: one campaign run for the whole session."""
        if not self.tracking:
            return
        try:
            from harness.tracking import make_tracker

            self.tracker = make_tracker(self.tracking_uri, enabled=True, log=_log, night=self.night)
            pairs = self.select()
            self.tracker.campaign_started(self.campaign_config(pairs), self.seed, pairs)
            self.campaign_run_id = _campaign_run_id(self.tracker)
        except Exception as e:  # tracking must never stop a campaign: the corpus has every finding
            self.tracking_error = f"{type(e).__name__}: {e}"
            self.tracker = None
            _log(f"harness: tracking is off for this session ({self.tracking_error})")

    def finding_tracker(self, pairs: list | None = None) -> Any:
        """The tracker items hand their findings to: under the session's campaign run."""
        from harness.tracking import NullTracker

        if not self.tracking or (self.campaign_run_id is None and not self.is_worker and self.tracker is None):
            return NullTracker()
        if not self.is_worker:
            return self.tracker or NullTracker()
        if self.tracker is None:
            if self.campaign_run_id is None:
                return NullTracker()
            try:
                from harness.mlflow_tracking import MlflowTracker

                # (the controller's campaign uid: two workers running streams of one pair are one campaign,
                # so a regression both find is seen once, not once per worker)
                self.tracker = MlflowTracker(self.tracking_uri, log=_log, campaign_run_id=self.campaign_run_id,
                                             campaign_uid=self.campaign_uid)
                pairs = pairs if pairs is not None else self.select()
                self.tracker.campaign_started(self.campaign_config(pairs), self.seed, pairs)  # attaches: creates nothing
            except Exception as e:
                self.tracking_error = f"{type(e).__name__}: {e}"
                _log(f"harness: worker tracking is off ({self.tracking_error}); findings are in the corpus")
                self.tracker = NullTracker()
        return self.tracker

    def close_campaign(self, results: list[dict], interrupted: bool) -> None:
        if self.tracker is None or self.is_worker:
            return
        try:
            self.tracker.campaign_finished(self.campaign_result(results, interrupted))
            _log_pair_metrics(self.tracker, results)
        except Exception as e:
            self.tracking_error = f"{type(e).__name__}: {e}"
            _log(f"harness: could not close the campaign run ({self.tracking_error})")

    def campaign_result(self, results: list[dict], interrupted: bool = False) -> Any:
        from harness.fuzz import CampaignResult

        pair_results = [_pair_result(d) for d in sorted(results, key=lambda d: d["pair"])]
        cfg = self.campaign_config([])
        cfg.budget = self.budget * len(pair_results) if self.budget is not None else None
        res = CampaignResult(seed=self.seed, config=cfg, results=pair_results,
                             seconds=time.time() - self.start, interrupted=interrupted)
        return res

    # -- one item ------------------------------------------------------------------------------
    def run_pair(self, item: "FuzzItem") -> None:
        from harness.fuzz import run_campaign
        from harness.worker import load_pair

        pair = load_pair(item.pair_name, item.source, tuple(self.plugins))  # imports only this pair's module
        cfg = self.campaign_config([pair])
        cfg.shard = None  # sharding happened at collection; this item is one stream of one pair
        cfg.stream = item.stream
        if cfg.budget is not None:
            cfg.budget /= self.streams  # the pair's budget, shared by its streams
        outer = self.finding_tracker([pair])
        fresh: list[Path] = []

        def on_finding(f: Any) -> None:
            # (a known repro this campaign changed, a smaller or a worse severe case, is a file to commit too)
            if (f.new or f.recurrence or f.updated) and f.path is not None and Path(f.path).exists():
                dest = new_repros_dir(self) / f.pair / Path(f.path).name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f.path, dest)
                fresh.append(dest)

        if self.executor is None:
            from harness.fuzz import Executor

            self.executor = Executor(cfg)  # one worker process for all of this process's items
            self.executor.prepare(None)  # its start is not charged to the first item's budget
        if cfg.budget is not None:  # ... nor a pair's cold start (imports, a model's build) to its budget
            cold = self.executor.warm_up(pair, cfg)
            if cold > 1.0:
                _log(f"  {pair.name}: cold start {cold:.1f} s, before its budget (imports, a model's build)")
        result = run_campaign(cfg, tracker=_FindingsOnly(outer), log=_item_log(pair.name), on_finding=on_finding,
                              executor=self.executor, on_progress=lambda unit, r: _leave_progress(self, unit, r))
        if result.interrupted:
            raise KeyboardInterrupt
        r = result.results[0]
        tracked = getattr(outer, "logged", {})  # finding id -> (regression run id, what logging it did)
        for f in r.findings:
            # new to this checkout's corpus, but an open (or wontfix) regression run held it from an
            # earlier campaign: a runner whose corpus never got the repro committed, not a new bug
            if f.new and not f.recurrence and tracked.get(f.id, ("", ""))[1] in ("seen", "already-known"):
                f.new, f.known_in_tracking = False, tracked[f.id][0]
        data = _pair_result_json(r)
        data["unreached"] = r.unreached(pair)  # (its size marks its cases never passed: nothing past them tested)
        data["worker"] = self.config.workerinput["workerid"] if self.is_worker else "main"
        data["stream"] = item.stream
        self.results.append(data)
        item.user_properties.append(("harness", data))
        if result.unsaved:  # a finding that is not on disk fails its item, whatever the pair expects
            kept = _keep_unsaved(self, cfg, result)
            data["unwritten"] = [f.id for f in result.unsaved]
            raise FuzzFailure(f"{pair.name}: {len(result.unsaved)} finding(s) could not be written to the corpus "
                              f"{cfg.corpus} (the reason and each repro as JSON are on stderr"
                              + (f"; saved instead to {', '.join(map(str, kept))}, with the session's outputs: copy "
                                 f"them to {Path(cfg.corpus) / pair.name}/ to keep them" if kept else
                                 f": save a line as {Path(cfg.corpus) / pair.name}/<id>.json to keep it")
                              + "); fix the folder (space, permissions) and rerun."
                              f"\n  rerun: {self.rerun(pair.name)}")
        self.judge(pair, r)

    def replay_command(self, path: Any) -> str:
        if path is None:
            return "(not written: the corpus could not take it; its repro JSON is on stderr)"
        from harness.corpus import _display, plugin_flags

        return f"harness replay{plugin_flags(self.plugins)} {_display(Path(path))}"

    def rerun(self, pair: str | None = None) -> str:
        """The pytest command that runs this campaign again (one pair of it, with `pair`): the same
        seed and every option given that changes what runs. Path options take `=`: pytest reads
        `--opt PATH` with a space as a test path when it picks the rootdir, before plugins load,
        and a path outside the project then drops the project's pytest configuration."""
        import shlex

        opt = self.config.getoption
        parts = ["pytest --harness-fuzz"]
        parts += [f"--harness-pairs {shlex.quote(g)}" for g in ([pair] if pair else self.globs)]
        parts += [f"--harness-plugin={shlex.quote(p)}" for p in self.plugins]
        if self.profile_name:  # (from the ini too: the command may run from another directory)
            parts.append(f"--harness-profile {shlex.quote(self.profile_name)}")
        for name, flag in (("harness_max_examples", "--harness-max-examples"),
                           ("harness_budget", "--harness-budget"),
                           ("harness_uniform_per_example", "--harness-uniform-per-example")):
            if opt(name) is not None:
                parts.append(f"{flag} {shlex.quote(str(opt(name)))}")
        if self.device_option != "cpu":
            parts.append(f"--harness-device {self.device_option}")
        if self.streams != 1:
            parts.append(f"--harness-streams {self.streams}")
        if opt("harness_corpus") is not None:
            parts.append(f"--harness-corpus={shlex.quote(str(opt('harness_corpus')))}")
        parts += [f"--harness-timeout {shlex.quote(t)}" for t in self.timeouts]
        parts += [f"--harness-threshold {shlex.quote(t)}" for t in self.thresholds]
        if not self.isolation:
            parts.append("--harness-no-isolation")
        if not self.tracking:
            parts.append("--harness-no-tracking")
        elif self.tracking_uri:
            parts.append(f"--harness-tracking-uri={shlex.quote(str(self.tracking_uri))}")
        if opt("harness_out") != os.path.join("reports", "fuzz"):
            parts.append(f"--harness-out={shlex.quote(str(opt('harness_out')))}")
        parts.append(f"--harness-seed {self.seed}")
        if self.shard and pair is None:
            parts.append(f"--shard {self.shard[0]}/{self.shard[1]}")
        return " ".join(parts)

    def judge(self, pair: Any, r: Any) -> None:
        rerun = self.rerun(pair.name)
        if pair.expected == "aligned":
            new = [f for f in r.findings if f.new or f.recurrence]
            if new:
                raise FuzzFailure("\n".join(
                    [f"aligned pair {pair.name}: {len(new)} new regression(s) (threshold {self.threshold_of(pair):g}, "
                     f"{r.examples} cases, campaign seed {self.seed})"]
                    + [_describe(f, self) for f in new] + [f"  rerun: {rerun}"]))
            if r.findings:
                listed = "; ".join(f"{f.id} (seen again, {f.evaluation.headline} on this run's case; the corpus file "
                                   f"holds its own: {self.replay_command(f.path)})" for f in r.findings)
                elsewhere = [f for f in r.findings if f.known_in_tracking]
                if elsewhere:  # (its corpus file was written by this run, but not as a new bug)
                    pytest.xfail(f"known regression(s) of {pair.name}: {listed}; "
                                 + "; ".join(f"{f.id} is a regression in MLflow (run {f.known_in_tracking}) "
                                             f"but was not in this checkout's corpus: commit "
                                             f"{new_repros_dir(self) / f.pair / (f.id + '.json')} to "
                                             f"{self.corpus}/{f.pair}/ so that a run without the store knows it"
                                             for f in elsewhere))
                if all(self._recorded_this_run(f) for f in r.findings):
                    pytest.xfail(f"regression(s) of {pair.name} found by another stream of this run too, whose item "
                                 f"reports it (fails for a new one, xfails for a known one): {listed}")
                pytest.xfail(f"known regression(s) of {pair.name}, already in the corpus: {listed}")
        verdict = r.verdict
        if verdict == "CANNOT RUN":  # its own setup (a harness error), not its paths: fix it, nothing recorded
            raise FuzzFailure(f"{r.setup_error}\n  rerun: {rerun}")
        if verdict == "UNFINISHED":  # a first case that never came back: a hang until shown otherwise
            from harness.fuzz import unfinished_note

            timeout = self.campaign_config([pair]).timeout_for(pair.name, getattr(pair, "timeout", None))
            raise FuzzFailure(f"{pair.name}: {unfinished_note(r, timeout, '--harness-budget')}\n  rerun: {rerun}")
        if verdict == "BROKEN":  # a demonstration that cannot run demonstrates nothing (gpucheck fails it too)
            raise FuzzFailure(f"{broken_message(pair.name, r, self)}\n  rerun: {rerun}")
        if verdict == "MISSED" and self.streams > 1:
            return  # one stream of a demonstration: the session summary judges the pair's streams together
        if verdict == "not run":  # nothing was tested: not a pass (a skip; a session that ran no case fails)
            why = (f"it waited for the first case of {r.waited_for} (same module, same worker), which never finished"
                   if r.waited_for else "the budget ended before its first case came back")
            pytest.skip(f"{pair.name}: not run: {why}; nothing was tested (give it more time: --harness-budget)")
        if verdict == "MISSED":
            from harness.fuzz import missed_hint

            why = f"demonstration not caught ({missed_hint(r, self.threshold_of(pair), pair)})"
            warnings.warn(HarnessFuzzWarning(f"{pair.name}: {verdict}: {why}"), stacklevel=1)

    def _recorded_this_run(self, f: Any) -> bool:
        """The finding's corpus file was first written by this session (another stream of the pair)."""
        import datetime as dt

        try:
            found = json.loads(Path(f.path).read_text()).get("found", {})
            at = dt.datetime.fromisoformat(str(found.get("at", ""))).timestamp()
        except (OSError, ValueError, TypeError, AttributeError):
            return False
        return found.get("campaign_seed") == self.seed and at >= self.started - 1.0  # (whole seconds)


class _FindingsOnly:
    """Forwards findings to a session tracker; the campaign run belongs to the controller."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def campaign_started(self, config: Any, seed: int, pairs: list) -> None:
        pass

    def finding(self, finding: Any) -> None:
        try:
            self.inner.finding(finding)
        except Exception as e:  # never lose the item's verdict to a tracking error
            _log(f"harness: could not track finding {finding.id}: {type(e).__name__}: {e}")

    def campaign_finished(self, result: Any) -> None:
        pass


def _log_pair_metrics(tracker: Any, results: list[dict]) -> None:
    """Per-pair cases and cases/s on the campaign run (`pair.<name>.cases`), for the morning report."""
    store, run_id = getattr(tracker, "store", None), getattr(tracker, "run_id", None)
    if store is None or not run_id or not results:
        return
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    metrics = []
    for d in results:
        rate = d["examples"] / d["seconds"] if d["seconds"] > 0 else 0.0
        metrics += [Metric(f"pair.{d['pair']}.cases", float(d["examples"]), ts, 0),
                    Metric(f"pair.{d['pair']}.cases_per_second", rate, ts, 0)]
    with store.lock():
        store.client.log_batch(run_id, metrics=metrics)


def _campaign_run_id(tracker: Any) -> str | None:
    for attr in ("campaign_run_id", "run_id"):
        value = getattr(tracker, attr, None)
        if isinstance(value, str) and value:
            return value
    return None


# what a demonstration's case did instead of diverging, by symptom (`Symptom` values)
_BROKE = {"error": "raised", "crash": "killed its worker process", "timeout": "hung past its timeout",
          "nonfinite": "gave NaN/inf"}


def broken_message(name: str, r: Any, session: FuzzSession) -> str:
    """One paragraph for a BROKEN demonstration: what its cases did instead of diverging, each
    finding with its minimal case and replay command, and what to do."""
    bad = [f for f in r.findings if f.symptom.value != "divergence"]
    caught = any(f.symptom.value == "divergence" for f in r.findings)
    did = sorted({_BROKE.get(f.symptom.value, f.symptom.value) for f in bad})
    listed = "; ".join(f"{f.symptom.value} {f.evaluation.headline} (finding {f.id}, "
                       f"{'new' if f.new else 'already in the corpus'}; minimal case {f.case.one_line()}; "
                       f"replay: {session.replay_command(f.path)})" for f in bad)
    stopped = ""
    if r.setup_error:
        from harness.fuzz import setup_headline

        stopped = f" It then stopped running: {setup_headline(r.setup_error)}"
    return (f"demonstration pair {name} is BROKEN: it is registered expected='diverges', so its cases must run "
            f"and be caught diverging, but " + ("besides the divergence it was caught on, " if caught else "")
            + f"its cases {' or '.join(did)} ({r.examples} case(s) run): {listed}.{stopped} A demonstration that "
            "cannot run demonstrates nothing, so this item fails; replay the repro to see what went wrong, fix "
            "the pair (its build or paths) so that its cases run, and run it again.")


def _item_log(name: str) -> Any:
    """The campaign log of one item: a pair that cannot run says what it raised in its item's failure
    (`FuzzSession.judge`), so its log line says where to look instead of saying it a second time."""
    said = f"{name} cannot run here: "

    def log(msg: str) -> None:
        at = msg.find(said)
        if at > 0 and ": CANNOT RUN (" in msg[:at]:
            msg = msg[:at] + "this item's failure message says why"
        _log(msg)

    return log


def _keep_unsaved(fs: Any, cfg: Any, result: Any) -> list[Path]:
    """The findings the corpus could not take, written where the session's outputs go (`new-repros`,
    which a CI job uploads): the paths written (none where that fails too: stderr has them)."""
    from harness.corpus import finding_to_repro

    kept = []
    for f in result.unsaved:
        dest = new_repros_dir(fs) / f.pair / f"{f.id}.json"
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            finding_to_repro(f, cfg.threshold_of(f.pair), result.seed, cfg.device).save(dest)
        except Exception:  # noqa: BLE001 - stderr holds it already
            continue
        kept.append(dest)
    return kept


def _shrink_command(fs: Any, pair: str, path: str) -> str:
    from harness.corpus import shrink_command_for

    try:
        return shrink_command_for(pair, path, fs.tracking_uri, fs.tracking)
    except Exception:  # noqa: BLE001 - a summary is written whatever a path lookup raises
        return f"harness shrink {path}"


def _cut_short(fs: Any, results: list[dict]) -> list[dict]:
    """The session's findings whose shrinking the budget or an interrupt cut short, each with the
    `harness shrink` command that goes on."""
    return [{"id": f["id"], "pair": d["pair"], "command": _shrink_command(fs, d["pair"], f["path"])}
            for d in results for f in d["findings"] if f.get("shrink_complete") is False and f.get("path")]


def _describe(f: Any, session: FuzzSession) -> str:
    state = "new" if f.new else ("recurrence of a fixed finding" if f.recurrence else "known")
    cut = ""
    if not f.shrink_complete and f.path:  # (the budget or an interrupt stopped its shrinking: it goes on)
        cut = f"\n    shrinking was cut short: `{_shrink_command(session, f.pair, str(f.path))}` goes on"
    sev = getattr(f, "severe", None)
    severe = ""
    if sev:  # (the worst case, shrunk far above the minimal one: maybe a second bug of the pair)
        cmd = session.replay_command(f.path).replace("harness replay", "harness triage --severe", 1) if f.path else ""
        severe = (f"\n    severe: its cases reached {sev.peak:.3g}; the worst, shrunk keeping {sev.keeping}: "
                  f"{sev.case.one_line()} ({sev.headline}): most often this bug where it is worst, a second one "
                  f"where triage names another component or module" + (f": `{cmd}`" if cmd else ""))
    return (f"  finding {f.id} [{state}] {f.symptom.value}: {f.evaluation.headline}\n"
            f"    {'case so far' if cut else 'minimal case'}: {f.case.one_line()}\n"
            f"    replay: {session.replay_command(f.path)}" + cut + severe)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _check_options(opt: Any) -> None:
    """The CLI's checks on the numeric options: a bad value is a usage error, never a green run."""
    import math

    budget, max_examples = opt("harness_budget"), opt("harness_max_examples")
    from harness.cli import parse_thresholds
    from harness.errors import UsageError

    try:  # (the format; which pairs a GLOB matches is known per item)
        parse_thresholds(tuple(opt("harness_threshold") or ()), [], "--harness-threshold", require_match=False)
    except UsageError as e:
        raise pytest.UsageError(str(e)) from None
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise pytest.UsageError(f"--harness-budget {budget!r} must be a finite number of seconds > 0 (wall time per "
                                "pair, shrinking included); leave it out for no time limit.")
    if max_examples is not None and max_examples < 1:
        raise pytest.UsageError(f"--harness-max-examples {max_examples!r} must be >= 1 (cases per pair; default "
                                f"the profile's, else {DEFAULT_MAX_EXAMPLES}).")


def _parse_shard(value: str | None) -> tuple[int, int] | None:
    from harness.cli import parse_shard

    return parse_shard(value)


# ---------------------------------------------------------------------------------------------
# Results across processes (plain JSON types: execnet carries nothing else)
# ---------------------------------------------------------------------------------------------
def _pair_result_json(r: Any) -> dict:
    from harness.corpus import encode_float, metrics_json

    return {
        "pair": r.pair, "expected": r.expected, "examples": r.examples, "cases": r.examples, "seconds": r.seconds,
        "max_k3": r.max_k3, "max_score": r.max_score, "threshold": r.threshold, "seed": r.seed,
        "entropy_sum": r.entropy_sum, "entropy_cases": r.entropy_cases,
        "examples_asked": r.examples_asked, "examples_short": r.examples_short,
        "verdict": r.verdict, "unfinished": r.unfinished, "waited_for": r.waited_for, "setup_error": r.setup_error,
        "memory_note": r.memory_note, "largest": list(r.largest), "worker_peak_mib": r.worker_peak_mib,
        "max_seq_score": r.max_seq_score, "flaky": list(r.flaky),
        "judged_bins": {str(k): n for k, n in r.judged_bins.items()}, "judged_spread": r.spread_text,
        "findings": [{
            "id": f.id, "signature": f.signature, "base_signature": f.base_signature or f.signature,
            "symptom": f.symptom.value, "status": f.status, "corpus_status": f.corpus_status,
            "case": f.case.to_json(), "metrics": metrics_json(f.evaluation), "error": f.evaluation.error,
            "examples": f.examples, "shrink_complete": f.shrink_complete,
            "path": str(f.path) if f.path else None, "new": f.new, "recurrence": f.recurrence,
            "cases_to_first": f.cases_to_first, "seconds_to_first": f.seconds_to_first,
            "shrink_seconds": f.shrink_seconds, "peak": encode_float(float(f.peak)),
            "deterministic": f.deterministic, "updated": f.updated, "known_in_tracking": f.known_in_tracking,
            **({"severe": f.severe.to_json()} if getattr(f, "severe", None) else {}),
        } for f in r.findings],
    }


def _merge_streams(results: list[dict]) -> list[dict]:
    """One result per pair: its streams' cases and seconds added, findings deduplicated by signature."""
    from harness.fuzz import _merge

    by_pair: dict[str, list[dict]] = {}
    for d in results:
        by_pair.setdefault(d["pair"], []).append(d)
    out = []
    for name, ds in by_pair.items():
        if len(ds) == 1:
            out.append(ds[0])
            continue
        ds.sort(key=lambda d: d.get("stream", 0))
        merged = _pair_result(ds[0])
        for d in ds[1:]:
            _merge(merged, _pair_result(d))
        data = _pair_result_json(merged)
        data["worker"] = ",".join(sorted({d.get("worker", "main") for d in ds}))
        data["unwritten"] = [i for d in ds for i in d.get("unwritten", ())]
        data["streams"] = len(ds)
        data["unreached"] = min((d.get("unreached", "") for d in ds), key=len)  # (what no stream reached)
        out.append(data)
    return out


def _bins(d: dict) -> dict[int, int]:
    """A result dict's judged-value bins (`PairResult.judged_bins`; JSON keys are strings)."""
    return {int(k): int(n) for k, n in (d.get("judged_bins") or {}).items()}


def _pair_result(d: dict) -> Any:
    from harness.case import Case
    from harness.corpus import Severe, decode_float
    from harness.execute import Evaluation, Symptom
    from harness.fuzz import Finding, PairResult
    from harness.metrics import Divergence

    findings = []
    for fd in d["findings"]:
        case = Case.from_json(fd["case"])
        metrics = {k: decode_float(v) for k, v in (fd["metrics"] or {}).items()}
        try:
            div = Divergence(**metrics) if metrics else None
        except TypeError:
            div = None
        ev = Evaluation(pair=d["pair"], case=case, symptom=Symptom(fd["symptom"]), divergence=div,
                        error=fd["error"])
        findings.append(Finding(pair=d["pair"], expected=d["expected"], symptom=Symptom(fd["symptom"]),
                                signature=fd["signature"], base_signature=fd.get("base_signature", ""),
                                case=case, evaluation=ev, examples=fd["examples"],
                                shrink_complete=fd["shrink_complete"],
                                path=Path(fd["path"]) if fd["path"] else None, new=fd["new"],
                                recurrence=fd["recurrence"], cases_to_first=fd.get("cases_to_first", 0),
                                seconds_to_first=fd.get("seconds_to_first", 0.0),
                                shrink_seconds=fd.get("shrink_seconds", 0.0),
                                peak=float(decode_float(fd.get("peak", "nan"))),  # (severity reads it)
                                deterministic=fd.get("deterministic", True), updated=fd.get("updated", ""),
                                corpus_status=fd.get("corpus_status", "")))
        findings[-1].severe = Severe.from_json(fd.get("severe"))
    return PairResult(pair=d["pair"], expected=d["expected"], examples=d["examples"], seconds=d["seconds"],
                      max_k3=d["max_k3"], max_score=d.get("max_score", 0.0), threshold=d.get("threshold", 0.0), findings=findings,
                      judged_bins=_bins(d),
                      entropy_sum=d.get("entropy_sum", 0.0), entropy_cases=d.get("entropy_cases", 0),
                      examples_asked=d.get("examples_asked", 0), examples_short=d.get("examples_short", 0),
                      seed=d["seed"], unfinished=d.get("unfinished", 0.0), waited_for=d.get("waited_for", ""),
                      setup_error=d.get("setup_error", ""), memory_note=d.get("memory_note", ""),
                      largest=tuple(d.get("largest") or (0, 0, 0, 0)), worker_peak_mib=d.get("worker_peak_mib", 0.0),
                      max_seq_score=d.get("max_seq_score", 0.0), flaky=list(d.get("flaky") or []))


# ---------------------------------------------------------------------------------------------
# Items
# ---------------------------------------------------------------------------------------------
class FuzzItem(pytest.Item):
    """One target pair, fuzzed as a one-pair campaign."""

    def __init__(self, *, pair_name: str, expected: str, source: str = "", stream: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pair_name = pair_name
        self.expected = expected
        self.source = source  # where the pair was registered from (the module a worker imports)
        self.stream = stream

    def runtest(self) -> None:
        self.config.stash[SESSION_KEY].run_pair(self)

    def repr_failure(self, excinfo: Any, style: Any = None) -> Any:
        if isinstance(excinfo.value, FuzzFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple:
        return self.path, None, f"harness fuzz {self.pair_name} ({self.expected})"


SESSION_KEY = pytest.StashKey[FuzzSession]()
RESULTS_KEY = pytest.StashKey[list]()


# ---------------------------------------------------------------------------------------------
# Hooks (each returns at once unless --harness-fuzz was given)
# ---------------------------------------------------------------------------------------------
@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: Any, args: list) -> None:
    """With --harness-fuzz, before the conftest files and any other plugin's configure:

    - no assertion rewriting: the session's items are campaigns, not test files (none is collected),
      and pytest rewrites every module of each installed pytest plugin's package as it is imported
      (Hypothesis, this harness and its targets among them). Where the rewritten bytecode is not
      cached (PYTHONDONTWRITEBYTECODE, a read-only install) that re-compiles them in every process;
    - in a process that runs items (an xdist worker, or the session without xdist), the campaigns'
      fork server starts now, so its imports run beside the conftests' and the engine's.

    Together 3.3 s of a one-worker session's 8.2 s start (`reports/scripts/startup.py`)."""
    ns = early_config.known_args_namespace
    if not getattr(ns, "harness_fuzz", False):
        return
    hook = early_config.pluginmanager.rewrite_hook
    if hook in sys.meta_path:  # (pytest's own clean-up removes it only if still there)
        sys.meta_path.remove(hook)
    # (xdist names its workers in the environment before their configuration is read; a controller with
    # -n hands every item out. A guess either way costs little: an idle server, or a later start.)
    runs_items = bool(os.environ.get("PYTEST_XDIST_WORKER")) or not getattr(ns, "numprocesses", None)
    if runs_items and not getattr(ns, "harness_no_isolation", False) and not getattr(ns, "collectonly", False):
        from harness.worker import start_fork_server

        start_fork_server()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    from harness.worker import ENTRY_POINT

    ENTRY_POINT[0] = True  # (a worker that fails to start is not a user's script's missing main guard)
    # MLflow's sqlite store queries with a loader strategy SQLAlchemy deprecates: a warning in every session
    # that tracks (also filtered where the store is opened; pytest resets that filter around each test)
    config.addinivalue_line("filterwarnings", r"ignore:The ``noload`` loader strategy is deprecated")
    if not _enabled(config):
        args = [str(a) for a in getattr(config.invocation_params, "args", ())]  # (the command line, not addopts)
        given = [flag for flag in ("--shard", "--harness-shard", "--harness-pairs")
                 if any(a == flag or a.startswith(flag + "=") for a in args)]
        if given:  # (else the whole test suite runs, unsharded, and says nothing)
            raise pytest.UsageError(f"{' and '.join(given)} choose(s) what a fuzz campaign runs: add --harness-fuzz "
                                    "(without it pytest runs the test suite, which these options do not split).")
        corpus = config.getoption("harness_corpus")
        if corpus is not None and not Path(corpus).expanduser().is_dir():  # (tests/test_corpus.py replays it)
            raise pytest.UsageError(f"--harness-corpus={corpus}: no such folder, so there is no corpus to replay; give "
                                    "the folder your campaigns write repros to (the one `harness fuzz --corpus` or "
                                    "`pytest --harness-fuzz --harness-corpus` was given).")
        _load_plugins(config)
        return
    session = FuzzSession(config)
    config.stash[SESSION_KEY] = session
    config.stash[RESULTS_KEY] = []
    if session.is_worker or not getattr(config.option, "numprocesses", None):  # (the processes running campaigns)
        if session.is_worker:
            _stop_with_the_controller()
        from harness.fuzz import share_threads_among_campaigns

        share_threads_among_campaigns()  # (xdist workers on one machine's cores: torch's share each, one left per campaign)
    if not session.is_worker:
        from harness.errors import HarnessError

        try:  # a bad device, glob or plugin file is a usage error before anything starts (or is cleared)
            session.select()
            from harness.cli import parse_thresholds, parse_timeouts

            # a GLOB no selected pair matches is a typo, as for the CLI: not a night judged at the wrong line
            pairs = session.all_pairs()
            parse_thresholds(session.thresholds, pairs, "--harness-threshold")
            parse_timeouts(session.timeouts, pairs, "--harness-timeout")
        except HarnessError as e:
            raise pytest.UsageError(str(e)) from None
        _log(f"harness fuzz: campaign {session.seed_origin}; profile {session.profile_name or '-'}, "
             f"{session.max_examples} Hypothesis examples and {session.budget or '-'} s per pair"
             + (f", shard {session.shard[0]}/{session.shard[1]}" if session.shard else ""))
        from harness.corpus import new_corpus_note
        from harness.profiles import shard_seed_warning

        corpus_note = new_corpus_note(session.corpus, "--harness-corpus")
        if corpus_note:
            _log(corpus_note)
        warned = shard_seed_warning(session.shard, None if session.seed_origin.startswith("fresh") else session.seed)
        if warned:
            _log(warned)
            session.notes.append(warned)
        if not config.option.collectonly:  # --co lists the items: no campaign run, no summary
            import shutil

            shutil.rmtree(new_repros_dir(session), ignore_errors=True)  # (last session's: uploaded by then)
            shutil.rmtree(progress_dir(session), ignore_errors=True)
            session.open_campaign()
            _sigterm_as_interrupt(config)  # (from here on, sessionfinish closes the campaign run)
        session.start = time.time()  # campaign seconds (and cases/s) count fuzzing, not tracking setup
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(_XdistController(session), "harness-xdist-controller")
            # xdist's load scheduler hands each worker a chunk of consecutive items up front (a
            # quarter of its share): with the heaviest items first, one worker got every model item
            # and ran 50 s while the other ran 15 s and idled. One item at a time (as each worker
            # frees up), heaviest first, balances them; an item is a whole campaign, so the extra
            # round trips cost nothing. A --maxschedchunk given on the command line wins.
            if getattr(config.option, "maxschedchunk", 0) is None:
                config.option.maxschedchunk = 1


def _not_a_folder(path: Path) -> Path | None:
    """The path itself, or the nearest of its parents that exists, when that is not a folder."""
    for p in (path, *path.parents):
        try:
            if p.exists():
                return None if p.is_dir() else p
        except OSError:  # (a parent this user may not look into: the write says so, later, if it fails)
            return None
    return None


def _stop_with_the_controller(poll: float = 0.5) -> None:
    """An xdist worker whose controller is gone (interrupted, killed) stops as on Ctrl-C: its campaign
    writes what it found and ends, instead of fuzzing on for the rest of its budget (and recording
    findings the controller's summary, written already, never lists). Gone = this process was
    re-parented (its parent process id changed); it is sent SIGTERM."""
    import os
    import signal
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll)
            if os.getppid() != parent:
                # SIGTERM, not SIGINT: a worker started in the background (CI, nohup) ignores SIGINT. A
                # running campaign takes it as Ctrl-C (`harness.fuzz._Signals`); between items it ends
                # the worker, which has nothing in flight then
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="harness-controller-watch", daemon=True).start()


def _sigterm_as_interrupt(config: pytest.Config) -> None:
    """SIGTERM (a CI timeout, Slurm, `kill`) handled like Ctrl-C by the session's controller: pytest
    stops, writes the summary (the pairs not run are listed as interrupted) and closes the MLflow
    campaign run, instead of dying with 143 and leaving the run RUNNING. (A campaign running in this
    process handles it itself, writing any finding first: `harness.fuzz._Signals`.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def interrupt(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the summary short
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    config.add_cleanup(lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def _load_plugins(config: pytest.Config) -> None:
    """Without --harness-fuzz, `--harness-plugin` loads the pairs for the tests themselves: the
    corpus replay (`tests/test_corpus.py`) then replays the repros of a plugin kept outside the
    repository instead of skipping them."""
    specs = list(config.getoption("harness_plugin", default=None) or [])
    if not specs:
        return
    from harness.errors import HarnessError
    from harness.pairs import REGISTRY

    try:
        for spec in specs:
            REGISTRY.load_plugin(spec)
    except HarnessError as e:
        raise pytest.UsageError(str(e)) from None


class _XdistController:
    """xdist hooks, registered only when xdist is present (its hook names are unknown otherwise)."""

    def __init__(self, session: FuzzSession) -> None:
        self.session = session

    def pytest_configure_node(self, node: Any) -> None:
        s = self.session
        node.workerinput["harness"] = {"seed": s.seed, "seed_origin": s.seed_origin, "started": s.started,
                                       "campaign_run_id": s.campaign_run_id,
                                       "campaign_uid": getattr(s.tracker, "seen_uid", None),
                                       "tracking_uri": getattr(s.tracker, "uri", s.tracking_uri),
                                       "units": s.units()}

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        out = getattr(node, "workeroutput", None) or {}
        self.session.config.stash[RESULTS_KEY].extend(json.loads(out.get("harness_results", "[]")))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Controller: each item's result as its report arrives (an xdist worker's report carries it in
    `user_properties`), so a session interrupted before the workers hand over their output still
    has every pair that finished."""
    if report.when != "call" or not report.user_properties:
        return
    for key, data in report.user_properties:
        if key == "harness" and isinstance(data, dict) and "pair" in data:
            _REPORTED.append(data)


_REPORTED: list[dict] = []  # results seen in reports (controller); deduplicated with the workers' output


def _dedupe(results: list[dict]) -> list[dict]:
    """One result per (pair, stream): the same item reaches the controller from its report and from
    its worker's output."""
    seen: dict[tuple, dict] = {}
    for d in results:
        seen.setdefault((d["pair"], d.get("stream", 0)), d)
    return list(seen.values())


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With --harness-fuzz the session is the fuzz items: the test files are not even imported."""
    if _enabled(config):
        return True
    return None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    if not _enabled(config):
        return
    fs = config.stash[SESSION_KEY]
    from harness.errors import HarnessError

    try:
        units = fs.units()
    except HarnessError as e:
        raise pytest.UsageError(str(e)) from None
    if items:
        config.hook.pytest_deselected(items=list(items))
    items[:] = []
    for u in units:
        label = u["pair"] if fs.streams == 1 else f"{u['pair']}#{u['stream']}"
        items.append(FuzzItem.from_parent(session, name=f"{NODE_PREFIX}[{label}]", nodeid=f"{NODE_PREFIX}::{label}",
                                          pair_name=u["pair"], expected=u["expected"], source=u["source"],
                                          stream=u["stream"]))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _enabled(config):
        return
    fs = config.stash[SESSION_KEY]
    if fs.executor is not None:
        fs.executor.close()
    if fs.is_worker:
        config.workeroutput["harness_results"] = json.dumps(fs.results)
        return
    if config.option.collectonly:  # nothing ran: last run's summary stays
        return
    per_item = _dedupe(config.stash[RESULTS_KEY] + fs.results + _REPORTED)
    _REPORTED.clear()
    results = _merge_streams(per_item)
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED
    if interrupted:
        results += _not_run(fs, results, per_item)
    config.stash[RESULTS_KEY] = results
    fs.close_campaign(results, interrupted=interrupted)  # (its `.missed` per shard: the report judges a night's shards)
    _split_streams_missed(fs, results)
    _write_summary(fs, results, interrupted)
    if _broken_plugins() and session.exitstatus == pytest.ExitCode.OK:  # fewer pairs than installed: not a pass
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and fs.shard and not results:
        # a shard the units' split left empty (more CI jobs than pairs x streams): nothing to run, not an error
        fs.notes.append(f"shard {fs.shard[0]}/{fs.shard[1]} got no pair of this selection (more shards than pairs x "
                        "streams): nothing to run here, exit 0")
        session.exitstatus = pytest.ExitCode.OK
    elif (not interrupted and results and not sum(d["examples"] for d in results)
          and not any(d["findings"] or d.get("setup_error") or d.get("unfinished") for d in results)
          and session.exitstatus == pytest.ExitCode.OK):
        fs.notes.append(f"error: no case ran: the session ended before any pair's first case came back (budget "
                        f"{fs.budget}s per pair, {len(results)} pair(s)); give it more time (--harness-budget) or fewer "
                        "pairs. Nothing was tested, so this is not a pass (exit 4, as for a usage error)")
        session.exitstatus = pytest.ExitCode.USAGE_ERROR


def _split_streams_missed(fs: FuzzSession, results: list[dict]) -> None:
    """A demonstration none of this shard's streams caught, whose other streams ran on other shards:
    not MISSED here (`fuzz.caught_elsewhere_maybe`), as `harness fuzz --shard` says too."""
    from harness.fuzz import NOT_HERE

    if not fs.shard or fs.shard[1] < 2 or fs.streams < 2:
        return
    here: dict[str, int] = {}
    for u in fs.units():
        here[u["pair"]] = here.get(u["pair"], 0) + 1
    for d in results:
        if d["verdict"] == "MISSED" and here.get(d["pair"], 0) < fs.streams:
            d["verdict"] = NOT_HERE
            fs.notes.append(f"{d['pair']}: {NOT_HERE} ({here.get(d['pair'], 0)} of {fs.streams}); the other shards ran "
                            "the rest, so it is missed only if none caught it (compare their summaries, or `harness "
                            "report` over their store)")


def _not_run(fs: FuzzSession, results: list[dict], per_item: list[dict]) -> list[dict]:
    """The selected pairs with no result when the session was interrupted (running or queued then;
    what their streams found before is on disk): rows that say so, instead of a summary that leaves
    them out. A pair some of whose streams finished keeps its row, its verdict marked with how many
    (a demonstration one stream of four missed is not a MISSED pair)."""
    done = {d["pair"] for d in results}
    out: dict[str, dict] = {}
    try:
        units = fs.units()
    except Exception:  # noqa: BLE001 - the summary of an interrupted session must still be written
        return []
    total: dict[str, int] = {}
    for u in units:
        total[u["pair"]] = total.get(u["pair"], 0) + 1
    finished: dict[str, int] = {}
    for d in per_item:
        finished[d["pair"]] = finished.get(d["pair"], 0) + 1
    for d in results:
        if finished.get(d["pair"], total.get(d["pair"], 0)) < total.get(d["pair"], 0):
            d["verdict"] = f"{d['verdict']} (interrupted: {finished[d['pair']]}/{total[d['pair']]} streams)"
    for u in units:
        if u["pair"] not in done and u["pair"] not in out:
            out[u["pair"]] = {"pair": u["pair"], "expected": u["expected"], "examples": 0, "seconds": 0.0,
                              "max_k3": 0.0, "max_score": 0.0, "seed": fs.seed, "verdict": "not run (interrupted)",
                              "unfinished": 0.0, "waited_for": "", "findings": [], "worker": "-"}
    # the items that were running when it stopped left their counts so far: a pair that ran is not "not run"
    ended = {(d["pair"], d.get("stream", 0)) for d in per_item}
    for pair, snaps in _progress_left(fs).items():
        running = [p for p in snaps if (pair, p.get("stream", 0)) not in ended]
        d = out.get(pair) or next((r for r in results if r["pair"] == pair), None)
        if not running or d is None:
            continue
        d["examples"] += sum(int(p.get("examples", 0)) for p in running)
        d["seconds"] += sum(float(p.get("seconds", 0.0)) for p in running)
        d["max_score"] = max([d["max_score"], *(float(p.get("max_score", 0.0)) for p in running)])
        d["max_k3"] = max([d["max_k3"], *(float(p.get("max_k3", 0.0)) for p in running)])
        if pair in out:
            d["verdict"] = (f"interrupted after {d['examples']} cases (max judged {d['max_score']:.3g}): "
                            "no verdict")
    for d in [*results, *out.values()]:  # what the interrupted items found: their result never came back
        extra = _found_before_the_stop(fs, d["pair"], {f["id"] for f in d["findings"]})
        if extra:
            d["findings"] = d["findings"] + extra
            was, _, note = d["verdict"].partition(" (")
            cut = was == "not run" or was.startswith("interrupted after")  # (said again below)
            note = "" if cut else note
            if cut or was in ("clean", "MISSED", "caught"):  # (CANNOT RUN, UNFINISHED, ...: kept as they are)
                from harness.fuzz import pair_verdict

                was = pair_verdict(d["expected"], [f.get("symptom") or "" for f in d["findings"]], d["examples"])
            d["verdict"] = (f"{was} (interrupted; {len(extra)} finding(s) before the stop: in "
                            f"{new_repros_dir(fs).name}/{d['pair']}/" + (f"; {note}" if note else ")"))
    return list(out.values())


def _found_before_the_stop(fs: FuzzSession, pair: str, known: set[str]) -> list[dict]:
    """The repros an interrupted session's items wrote for the pair (their copies in `new-repros`:
    each item copies its new and recurring findings there as they are written) and that no item
    result names: an item interrupted mid-campaign never hands its result over."""
    folder = new_repros_dir(fs) / pair
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or path.stem in known:
            continue
        found.append({"id": path.stem, "signature": data.get("signature"), "symptom": data.get("symptom"),
                      "status": data.get("status"), "case": data.get("case"), "metrics": data.get("metrics") or {},
                      "error": data.get("error"), "examples": 0,
                      "shrink_complete": (data.get("found") or {}).get("shrink_complete"),
                      # (only new and recurring findings are copied there: either is tonight's)
                      "path": str(Path(fs.corpus) / pair / path.name), "new": True, "recurrence": False,
                      "cases_to_first": 0, "seconds_to_first": 0.0, "shrink_seconds": 0.0})
    return found


def _rows(fs: FuzzSession, results: list[dict], cannot_run: str | None = None) -> list[tuple]:
    """The summary table's rows; `cannot_run`, where given, is what a CANNOT RUN pair's findings
    column says instead of what it raised (said once elsewhere: the item's failure, or below the
    table)."""
    from harness.fuzz import PairResult, expected_text, rate_text

    rows = []
    for d in sorted(results, key=lambda d: d["pair"]):
        verdict = d["verdict"]
        if verdict == "REGRESSION":
            verdict = "REGRESSION (recurrence)" if any(f["recurrence"] for f in d["findings"]) \
                else "REGRESSION (new)" if any(f["new"] for f in d["findings"]) \
                else "REGRESSION (known)"
        if d.get("examples_short") and not d["findings"]:
            from harness.fuzz import time_note

            verdict += f" ({time_note(d['examples_asked'], d['examples_short'], d['examples'])})"
        rate = d["examples"] / d["seconds"] if d["seconds"] > 0 else 0.0
        found = ", ".join(f"{f['id']} {f['symptom']} {_headline(f)}"
                          + (" new" if f["new"] else "")
                          + (" (not deterministic: will not replay bit for bit)" if f.get("deterministic") is False else "")
                          + (f" (the corpus file got {f['updated']}: commit it, from new-repros)" if f.get("updated") else "")
                          for f in d["findings"]) or \
            (cannot_run if cannot_run is not None and d.get("setup_error") and d["verdict"] == "CANNOT RUN"
             else _setup_headline(d.get("setup_error", "")))
        found = "; ".join(x for x in (found, d.get("memory_note", ""), *(f"noise: {n}" for n in (d.get("flaky") or [])[:2]),
                                      f"never reached {d['unreached']}: nothing past it tested" if d.get("unreached")
                                      and not d["findings"] else "")
                          if x) or "-"
        p90 = PairResult(d["pair"], d["expected"], max_score=d.get("max_score", 0.0), judged_bins=_bins(d)).p90_text
        rows.append((d["pair"], expected_text(d["expected"], d.get("threshold"), fs.threshold), verdict,
                     str(d["examples"]), rate_text(rate), p90, _fmt(d.get("max_score", 0.0)),
                     _fmt(d["max_k3"]), d.get("worker", "main"), found))
    return rows


# *max judged*: the largest mean a verdict read (expected k3 or exact KL: what the findings show);
# *max sampled k3*: the largest sampled tokens' mean k3 (what an RL dashboard logs; noisy on small cases)
# *judged p90*: 90% of its cases were judged under it (within a factor 10^0.1; '-' under 10 cases);
# *expected* names the line a pair is judged at where it is not the session's (`aligned (line 0.02)`)
HEADER = ("pair", "expected", "verdict", "cases", "cases/s", "judged p90", "max judged", "max sampled k3", "worker",
          "findings")


def _setup_headline(message: str) -> str:
    from harness.fuzz import setup_headline

    return setup_headline(message)


def _fmt(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) else str(x)


def _headline(f: dict) -> str:
    """`Evaluation.headline` of a finding sent back as plain data."""
    from .execute import headline

    return headline(f.get("metrics"), f.get("error"))


def progress_dir(fs: FuzzSession) -> Path:
    """`<out>/.progress` (a shard's `.progress.shard<i>of<N>`): each running item's counts so far, left
    every few seconds, which an interrupted session's summary reports for the items whose result never
    came back. Emptied when a session starts."""
    return fs.out / (f".progress.shard{fs.shard[0]}of{fs.shard[1]}" if fs.shard else ".progress")


def _leave_progress(fs: FuzzSession, unit: Any, r: Any) -> None:
    try:
        folder = progress_dir(fs)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{unit.pair.name}#{unit.stream}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pair": unit.pair.name, "stream": unit.stream, "examples": r.examples,
                                   "seconds": r.seconds, "max_score": r.max_score, "max_k3": r.max_k3}))
        tmp.replace(path)
    except (OSError, ValueError):  # (a full disk: the summary says 0 cases for it, as before)
        pass


def _progress_left(fs: FuzzSession) -> dict[str, list[dict]]:
    """pair -> the counts its interrupted items left (`_leave_progress`)."""
    out: dict[str, list[dict]] = {}
    for path in sorted(progress_dir(fs).glob("*.json")) if progress_dir(fs).is_dir() else []:
        try:
            d = json.loads(path.read_text())
            out.setdefault(str(d["pair"]), []).append(d)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def new_repros_dir(fs: FuzzSession) -> Path:
    """`<out>/new-repros` (a shard's `new-repros.shard<i>of<N>`): copies of this session's new and
    recurring repros, for CI to upload. Emptied when a session starts, so a runner that keeps its
    workspace uploads tonight's, not every night's."""
    return fs.out / (f"new-repros.shard{fs.shard[0]}of{fs.shard[1]}" if fs.shard else "new-repros")


def summary_path(fs: FuzzSession, ext: str) -> Path:
    """`<out>/summary.<ext>`; a shard's is `summary.shard<i>of<N>.<ext>`, so shards run on one
    machine (or into one folder) keep each its own."""
    return fs.out / (f"summary.shard{fs.shard[0]}of{fs.shard[1]}.{ext}" if fs.shard else f"summary.{ext}")


INTERRUPTED_NOTE = ("Interrupted: this summary was written when the session stopped; a pair running then "
                    "wrote what it had found to the corpus (and new-repros/) as it stopped, which may be after "
                    "this summary: `harness replay` the corpus folder, or rerun, for the whole picture")


def _broken_plugins() -> list[str]:
    """Why each installed `harness.targets` package that failed to load did (its pairs were not fuzzed)."""
    from harness.pairs import REGISTRY

    return list(REGISTRY.broken_entry_points.values())


def _write_summary(fs: FuzzSession, results: list[dict], interrupted: bool = False) -> None:
    from harness.fuzz import NOT_HERE

    fs.out.mkdir(parents=True, exist_ok=True)
    cases = sum(d["examples"] for d in results)
    seconds = sum(d["seconds"] for d in results)
    summary = {
        "seed": fs.seed, "seed_origin": fs.seed_origin, "profile": fs.profile_name,
        "shard": list(fs.shard) if fs.shard else None, "device": fs.device_option,
        "max_examples": fs.max_examples, "budget_per_pair": fs.budget, "threshold": fs.threshold,
        "campaign_run_id": fs.campaign_run_id, "tracking_error": fs.tracking_error,
        "interrupted": interrupted, "cases": cases, "pair_seconds": seconds, "wall_seconds": time.time() - fs.start,
        "new_aligned_regressions": [f["id"] for d in results if d["expected"] == "aligned"
                                    for f in d["findings"] if f["new"] or f["recurrence"]],
        # findings the corpus could not take (a full disk, a read-only folder): in new-repros instead
        "unwritten": sorted(i for d in results for i in d.get("unwritten", ())),
        "missed_demonstrations": sorted(d["pair"] for d in results if d["verdict"] == "MISSED"),
        # demonstrations this shard's streams did not catch, whose other streams ran on other shards
        "not_caught_by_this_shard": sorted(d["pair"] for d in results if d["verdict"] == NOT_HERE),
        "cannot_run": sorted(d["pair"] for d in results if d["verdict"] == "CANNOT RUN"),
        "unfinished": sorted(d["pair"] for d in results if d["verdict"] == "UNFINISHED"),  # (their items failed)
        "broken_demonstrations": sorted(d["pair"] for d in results  # (their items failed)
                                        if d["expected"] == "diverges" and d["verdict"].startswith("BROKEN")),
        "broken_plugins": _broken_plugins(),  # installed packages whose pairs were not fuzzed: not a pass
        # findings whose shrinking the budget or an interrupt cut short: the command that goes on
        "shrink_cut_short": _cut_short(fs, results),
        "pairs": sorted(results, key=lambda d: d["pair"]),
    }
    from harness.corpus import encode_tree

    summary_path(fs, "json").write_text(json.dumps(encode_tree(summary), indent=2, default=str, allow_nan=False)
                                        + "\n")  # (strict JSON: an infinite max k3 is "inf")
    rows = _rows(fs, results, cannot_run="cannot run here: see below")
    md = [f"# harness fuzz: {len(results)} pair(s), {cases} cases, seed {fs.seed}", "",
          f"{fs.seed_origin}; profile {fs.profile_name or '-'}; threshold {fs.threshold:g} (a pair judged at "
          "another line says it under *expected*)"
          + (f"; shard {fs.shard[0]}/{fs.shard[1]}" if fs.shard else "")
          + (f"; MLflow campaign run {fs.campaign_run_id}" if fs.campaign_run_id else ""), "",
          "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    if interrupted:
        md += ["", f"**{INTERRUPTED_NOTE}.**"]
    if summary["missed_demonstrations"]:
        md += ["", f"**Missed demonstrations ({len(summary['missed_demonstrations'])})**: "
               + ", ".join(summary["missed_demonstrations"])
               + " (not caught: give them more cases or budget, or the harness lost detection power)."]
    for d in results:
        if d["verdict"] == "CANNOT RUN":
            md += ["", f"**Cannot run here**: {d.get('setup_error', '')}"]
    for why in summary["broken_plugins"]:
        md += ["", f"**A plugin package did not load, none of its pairs was fuzzed**: {why}"]
    if summary["shrink_cut_short"]:
        md += ["", f"**Shrinking cut short ({len(summary['shrink_cut_short'])})**, by the budget or an interrupt: "
               + "; ".join(f"{c['id']} ({c['pair']}): `{c['command']}`" for c in summary["shrink_cut_short"])]
    replays = [(d["pair"], f) for d in results for f in d["findings"] if f["new"] or f["recurrence"]]
    if replays:
        md += ["", "New findings:", ""]
        md += [f"- {p} {f['id']} ({f['symptom']}): `{fs.replay_command(f['path'])}`" for p, f in replays]
    summary_path(fs, "md").write_text("\n".join(md) + "\n")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    unregistered = [r for r in terminalreporter.stats.get("skipped", [])
                    if ("harness_skip", "pair not here") in (getattr(r, "user_properties", None) or [])]
    if unregistered:  # (said whatever -r says: "3 skipped" reads as a pass in a nightly's log)
        terminalreporter.write_line(
            f"harness corpus: {len(unregistered)} repro(s) skipped because their pairs cannot be loaded here (each "
            "one's reason: pytest -rs): pass the plugins that register them (--harness-plugin=PATH), or "
            "--harness-no-skips to fail such a repro")
    if not _enabled(config) or SESSION_KEY not in config.stash or config.stash[SESSION_KEY].is_worker \
            or config.option.collectonly:
        return
    fs = config.stash[SESSION_KEY]
    results = config.stash[RESULTS_KEY]
    tr = terminalreporter
    tr.write_sep("=", "harness fuzz")
    rows = [HEADER] + _rows(fs, results, cannot_run="cannot run here: its failure above says why")
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    for r in rows:
        tr.write_line("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    cases = sum(d["examples"] for d in results)
    caught = [d["pair"] for d in results if d["verdict"] == "caught"]
    clean = [d["pair"] for d in results if d["verdict"] == "clean"]
    reported = [f"{d['pair']} ({d['verdict']})" for d in results
                if d["verdict"] in ("MISSED", "BROKEN", "not run", "UNFINISHED", "CANNOT RUN") or "interrupted" in d["verdict"]]
    tr.write_line(f"{len(results)} pair(s), {cases} cases; demonstrations caught: {len(caught)}; aligned clean: "
                  f"{len(clean)}" + (f"; reported: {', '.join(reported)}" if reported else ""))
    missed = [d["pair"] for d in results if d["verdict"] == "MISSED"]
    if missed:
        tr.write_line(f"missed demonstrations: {len(missed)} of {sum(d['expected'] == 'diverges' for d in results)} "
                      f"not caught: {', '.join(sorted(missed))}")
    for c in _cut_short(fs, results):
        tr.write_line(f"{c['id']} ({c['pair']}): shrinking was cut short (by the budget or an interrupt): "
                      f"`{c['command']}` goes on")
    commit = [(d["pair"], f) for d in results for f in d["findings"]
              if f.get("new") or f.get("recurrence") or f.get("updated") or f.get("known_in_tracking")]
    if commit:  # (said whatever -r says: an xfail's reason, "commit this file", is hidden without -rx)
        why = {id(f): ("new" if f.get("new") else "reopened" if f.get("recurrence") else
                       f"in MLflow (run {f['known_in_tracking']}) but not in this checkout's corpus"
                       if f.get("known_in_tracking") else f"updated: {f['updated']}") for _, f in commit}
        tr.write_line(f"repro file(s) to commit to {fs.corpus}/ (copied to {new_repros_dir(fs)}/): "
                      + "; ".join(f"{pair}/{f['id']}.json ({why[id(f)]})" for pair, f in commit))
    origin = fs.seed_origin  # ("seed 11 (given)", "seed 7 derived from run id ...", "fresh seed 3")
    said = f"campaign {origin}" if f"seed {fs.seed}" in origin else f"campaign seed {fs.seed} ({origin})"
    tr.write_line(f"{said}; rerun: {fs.rerun()}")
    if fs.campaign_run_id:
        tr.write_line(f"MLflow campaign run {fs.campaign_run_id}")
    elif fs.tracking:
        tr.write_line("MLflow: no campaign run" + (f" ({fs.tracking_error})" if fs.tracking_error else ""))
    tr.write_line(f"summary: {summary_path(fs, 'md')}")
    for why in _broken_plugins():
        tr.write_line(f"error: {why}; none of its pairs was fuzzed (the session fails)")
    for note in fs.notes:
        tr.write_line(note)
