"""Fault injection: what a target or the machine does must never stop a campaign, lie to CI or lose a
finding. Each test runs the real command line in a subprocess on the misbehaving pairs of
tests/plugins/faults.py and asserts the message, the exit code and that every finding is on disk
(or, when the disk cannot take it, printed in full)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.corpus import iter_corpus, load_repro

from ..conftest import PLUGINS, ROOT

FAULTS = str(PLUGINS / "faults.py")


def fuzz(harness_cli, tmp_path, *args, env=None):
    return harness_cli("fuzz", *args, "--plugin", FAULTS, "--no-tracking", "--seed", "1",
                       "--corpus", str(tmp_path / "corpus"), env=env)


def by_pair(corpus: Path) -> dict:
    out: dict = {}
    for p in iter_corpus(corpus):
        r = load_repro(p)
        out.setdefault(r.pair, []).append(r)
    return out


def test_a_hang_is_a_timeout_finding_and_the_campaign_goes_on(tmp_path, harness_cli):
    t = time.monotonic()
    code, out, err = fuzz(harness_cli, tmp_path, "faults.hang", "faults.diverges", "--timeout", "1",
                          "--budget", "40", "--max-examples", "30")
    wall = time.monotonic() - t
    assert code == 1, err
    found = by_pair(tmp_path / "corpus")
    [hang] = found["faults.hang"]
    assert hang.symptom == "timeout" and hang.case.batch_size == 2  # shrunk to the smallest hanging batch
    assert "per-case timeout of 1 s" in hang.error["message"]
    # the headline (tables, finding lines, xfail reasons) is the first line, whole; the fix is below it
    from harness.execute import headline

    line = headline(hang.metrics, hang.error)
    assert line.startswith("Timeout: the case ran longer than the per-case timeout of 1 s") and "..." not in line
    assert "--harness-timeout" in hang.error["message"].splitlines()[1]
    assert "hangs_on_batches" in hang.error["traceback"]  # the worker's stack when it hung
    assert [r.symptom for r in found["faults.diverges"]] == ["divergence"]  # the next pair still ran
    assert "faults.hang: timeout" in err and "REGRESSION" in out
    assert wall < 40 + 30  # the budget is a wall (startup and imports on a loaded machine aside)


@pytest.mark.parametrize("pair, sig", [("faults.segfault", "SIGSEGV"), ("faults.abort", "SIGABRT")])
def test_a_dead_worker_is_a_crash_finding_and_the_campaign_goes_on(tmp_path, harness_cli, pair, sig):
    code, out, err = fuzz(harness_cli, tmp_path, pair, "faults.diverges", "--max-examples", "30")
    assert code == 1, err
    found = by_pair(tmp_path / "corpus")
    [crash] = found[pair]
    assert crash.symptom == "crash" and crash.case.batch_size == 2
    assert crash.error["type"] == sig and "died" in crash.error["message"]
    assert "segfaults_on_batches" in crash.error["traceback"] or "aborts_on_batches" in crash.error["traceback"]
    assert [r.symptom for r in found["faults.diverges"]] == ["divergence"]
    assert f"{pair}: crash" in err


def test_without_isolation_a_crash_takes_the_campaign_down(tmp_path, harness_cli):
    """What isolation buys (and why --no-isolation is for debugging only)."""
    code, out, err = fuzz(harness_cli, tmp_path, "faults.segfault", "--max-examples", "30", "--no-isolation")
    assert code == -signal.SIGSEGV and not iter_corpus(tmp_path / "corpus")


def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    corpus = tmp_path / "corpus"
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "fuzz", "faults.diverges", "--plugin", FAULTS, "--no-tracking", "--seed",
         "1", "--max-examples", "100000", "--corpus", str(corpus)],
        # (0.6 s a case: under `CampaignConfig.slow_case_seconds`, so Hypothesis shrinks, step by step)
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "FAULTS_SLEEP": "0.6"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # the campaign is running once the first case is in
        lines.append(line)
        if "faults.diverges:" in line and "cases" in line:
            break
    time.sleep(1.0)  # mid-shrink: every case diverges, so shrinking started with the first one
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    err = "".join(lines) + err
    assert proc.returncode == 130, err
    assert "interrupted: the findings above are on disk." in err
    [path] = iter_corpus(corpus)
    repro = load_repro(path)
    assert repro.pair == "faults.diverges" and repro.found["shrink_complete"] is False
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture
def full_corpus(tmp_path):
    """A corpus folder that cannot take a file: a full 64 kB tmpfs where this process may mount one, else
    a read-only folder (or, as root without mount rights, a path under a plain file)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                             capture_output=True).returncode == 0
    try:
        if mounted:
            try:
                with open(mnt / "filler", "wb") as fh:
                    while True:
                        fh.write(b"\0" * 4096)
                        fh.flush()
            except OSError:  # full
                pass
            yield mnt / "corpus", "No space left on device"
        elif os.geteuid() != 0:
            mnt.chmod(0o555)
            yield mnt / "corpus", "Permission denied"
        else:
            (mnt / "file").write_text("")
            yield mnt / "file" / "corpus", "Not a directory"
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], capture_output=True)
        mnt.chmod(0o755)


def test_an_unwritable_corpus_prints_the_finding_and_exits_3(tmp_path, harness_cli, full_corpus):
    corpus, reason = full_corpus
    code, out, err = harness_cli("fuzz", "faults.diverges", "faults.segfault", "--plugin", FAULTS, "--no-tracking",
                                 "--seed", "1", "--max-examples", "30", "--corpus", str(corpus))
    assert code == 3, err
    assert err.count("error: could not write finding") == 2 and reason in err
    printed = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
    assert sorted(d["pair"] for d in printed) == ["faults.diverges", "faults.segfault"]  # both pairs ran
    saved = tmp_path / "saved.json"
    for d in printed:  # each printed finding is a whole repro: saved to a file, it loads
        saved.write_text(json.dumps(d))
        r = load_repro(saved)
        assert r.symptom in ("divergence", "crash") and r.case.batch_size >= 1
    assert "2 finding(s) could not be written" in err


def test_a_slow_first_case_is_deferred_and_starves_no_other_pair(tmp_path, harness_cli):
    """A cold start longer than the pair's share goes on in a parked worker while the others run; the
    pair comes back at the end with its first case done. The budget stays a wall."""
    t = time.monotonic()
    code, out, err = harness_cli("fuzz", "cold.compiled", "faults.diverges", "moe_aggregate.aligned",
                                 "--plugin", str(PLUGINS / "slow_start.py"), "--plugin", FAULTS, "--no-tracking",
                                 "--seed", "1", "--budget", "21", "--corpus", str(tmp_path / "corpus"),
                                 env={"SLOW_START_SECONDS": "12"})  # a share is 7 s
    wall = time.monotonic() - t
    assert code == 1, err
    assert "cold.compiled: first case still running at the end of its share" in err
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip() and "  " in line}
    assert rows["cold.compiled"][2] == "caught" and rows["faults.diverges"][2] == "caught"
    assert rows["moe_aggregate.aligned"][2] == "clean" and int(rows["moe_aggregate.aligned"][3]) > 10
    assert wall < 21 + 30  # startup and imports on a loaded machine aside


def test_isolated_campaigns_run_the_same_cases_as_in_process_ones(tmp_path, monkeypatch):
    """Isolated, each example is handed to the worker as soon as it is drawn, its uniform cases
    queued behind it, and they run while Hypothesis draws the next example; the cases, their order
    and what is found are those of an in-process campaign. (A case handed ahead whose result is
    never asked for, behind a case that failed, is computed but not counted: as in-process, where
    it never runs.)"""
    from harness import REGISTRY, strategies
    from harness.fuzz import CampaignConfig, Executor, fuzz_pair, pair_seed

    uniform = set()
    draw = strategies.uniform_cases

    def uniform_cases(*args, **kwargs):
        case = draw(*args, **kwargs)
        uniform.add(case.key())
        return case

    monkeypatch.setattr(strategies, "uniform_cases", uniform_cases)
    for name in ("moe_aggregate.aligned", "moe_aggregate.no_replay", "router.topk_softmax"):
        pair = REGISTRY.get(name)
        runs, ahead = [], []
        for isolation in (False, True):
            seen: list = []
            cfg = CampaignConfig(pairs=[pair], seed=5, max_examples=25, write_corpus=False, isolation=isolation)
            executor = Executor(cfg)
            executor.hand_ahead = True  # whatever cores this machine spares: the mechanism is under test
            inner = executor.evaluator(pair, None)

            def evaluate(case, inner=inner, seen=seen):
                seen.append(case.key())
                return inner(case)

            if hasattr(inner, "prefetch"):
                def prefetch(case, inner=inner):
                    ok = inner.prefetch(case)
                    if ok:
                        ahead.append(case)
                    return ok

                evaluate.prefetch = prefetch
            try:
                r = fuzz_pair(pair, cfg, pair_seed(5, name), deadline=None, evaluate=evaluate)
            finally:
                executor.close()
            runs.append((r.examples, r.max_k3, sorted(f.case.key() for f in r.findings),
                         list(dict.fromkeys(seen))))
        assert runs[0][:3] == runs[1][:3], name
        assert runs[0][3] == runs[1][3], name  # the same distinct cases, in the same order
        assert ahead, name  # ... and the isolated one did run cases ahead
        if name == "moe_aggregate.aligned":  # (a clean pair: every example after the first)
            assert sum(c.key() not in uniform for c in ahead) >= 20, name  # Hypothesis's examples too


def test_cases_handed_ahead_come_back_in_order_and_a_crash_drops_only_what_was_queued_behind_it():
    """The worker runs queued cases one after another; a crash is the case it happened in, and the
    cases queued behind it are sent again when the campaign asks for them."""
    from harness import REGISTRY
    from harness.case import Case
    from harness.execute import Symptom
    from harness.fuzz import CampaignConfig, Executor

    REGISTRY.load_plugin(FAULTS)
    pair = REGISTRY.get("faults.segfault")
    one, two, three = Case(seed=1, seq_lens=(3,)), Case(seed=2, seq_lens=(2, 2)), Case(seed=3, seq_lens=(4,))
    cfg = CampaignConfig(pairs=[pair], seed=0, write_corpus=False, isolation=True, plugins=(FAULTS,))
    executor = Executor(cfg)
    executor.hand_ahead = True
    try:
        evaluate = executor.evaluator(pair, None)
        assert evaluate(Case(seed=9, seq_lens=(1,))).symptom is Symptom.NONE  # warm: prefetch is for warm pairs
        assert all(evaluate.prefetch(c) for c in (one, two, three))
        assert len(executor.worker.queue) == 3
        ev3 = evaluate(three)  # collects one and two on the way; two killed the worker, three is sent again
        assert ev3.symptom is Symptom.NONE and ev3.case == three
        assert evaluate(one).symptom is Symptom.NONE
        crash = evaluate(two)
        assert crash.symptom is Symptom.CRASH and crash.case == two and "SIGSEGV" in crash.error["type"]
        assert not executor.worker.queue and executor.restarts == 1
    finally:
        executor.close()


@pytest.mark.parametrize("cores, xdist_workers, ahead", [(2, None, True), (2, "2", False), (4, "2", True),
                                                        (1, None, False), (16, "8", True), (2, "junk", True)])
def test_cases_are_handed_ahead_only_with_a_core_to_spare(monkeypatch, cores, xdist_workers, ahead):
    from harness import fuzz

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    if xdist_workers is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", xdist_workers)
    assert fuzz.spare_core_per_worker() is ahead
    cfg = fuzz.CampaignConfig(pairs=[], isolation=True)
    executor = fuzz.Executor(cfg)
    assert executor.hand_ahead is ahead


def test_a_worker_replaced_after_a_crash_is_cold_again(tmp_path, harness_cli):
    """The pair takes 1.5 s on its first case in every process (a compile), then segfaults on batches:
    after the crash, the next case runs in a fresh process, cold, and gets the cold-start allowance,
    not the 1 s per-case timeout (a timeout finding there would be false, and replay would confirm it)."""
    code, out, err = fuzz(harness_cli, tmp_path, "faults.slow_start_segfault", "--timeout", "1", "--max-examples", "15",
                          "--uniform-per-example", "0", env={"FAULTS_SLOW_START": "1.5"})
    assert code == 1, err
    found = by_pair(tmp_path / "corpus")
    assert [r.symptom for r in found["faults.slow_start_segfault"]] == ["crash"], err
    [crash] = found["faults.slow_start_segfault"]
    assert crash.case.batch_size == 2  # shrunk: each step's fresh worker was given its cold start


def test_a_first_case_that_never_returns_is_unfinished_not_a_silent_not_run(tmp_path, harness_cli):
    """An engine that hangs on every case, the first one included, under a budget shorter than the
    cold-start allowance: the pair is UNFINISHED (exit 1, with why), and a pair of the same module that
    waited behind it says so; neither is a silent `not run` with exit 0."""
    code, out, err = fuzz(harness_cli, tmp_path, "faults.hang_always", "faults.diverges", "--timeout", "1",
                          "--budget", "12", "--max-examples", "10")
    assert code == 1, (out, err)
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip() and "  " in line}
    assert rows["faults.hang_always"][2] == "UNFINISHED", out
    assert "faults.hang_always: its first case was still running after" in err
    assert "a hang, or a cold start longer than the budget allows" in err
    # it ran past its 1 s timeout (inside its cold-start allowance): the stacks say where it hung
    where = err.split("where it was when stopped: ", 1)[1].splitlines()[0]
    assert where.startswith('File "') and "in hangs_always" in where.split(" <- ")[0], where
    assert rows["faults.diverges"][2] in ("not run", "caught"), out
    if rows["faults.diverges"][2] == "not run":
        assert "faults.diverges: not run: it waited for the first case of faults.hang_always" in err
        assert "it waited behind faults.hang_always's first case" in out + err  # not "its time share ran out"
        assert "faults.diverges: not run (0 cases in" not in err or "time share ran out" not in err.split(
            "faults.diverges: not run (0 cases in", 1)[1].splitlines()[0]


def test_processes_a_target_started_die_with_its_worker(tmp_path, harness_cli):
    """A target that starts a helper process (as engines start schedulers) and hangs: the worker is
    killed at the timeout with its whole process group, so no helper outlives the campaign."""
    marker = f"faults-helper-{tmp_path.name}"
    code, out, err = fuzz(harness_cli, tmp_path, "faults.hang_with_helper", "--timeout", "1", "--max-examples", "10",
                          env={"FAULTS_HELPER_MARKER": marker})
    assert code == 1, err
    assert [r.symptom for r in by_pair(tmp_path / "corpus")["faults.hang_with_helper"]] == ["timeout"]
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    for pid in left:  # (clean up before failing)
        os.kill(int(pid), signal.SIGKILL)
    assert not left, f"{len(left)} helper process(es) outlived their worker"


def fuzz_op_plugin(harness_cli, tmp_path, name, expected, paths, examples):
    """Write a one-pair op plugin (`paths`: source defining `trainer` and `rollout` over a (T, 8)
    float tensor) and fuzz it isolated: (exit code, stdout, stderr)."""
    plugin = tmp_path / f"{name.split('.')[0]}.py"
    plugin.write_text("import torch\nfrom harness import Axes, Outcome, TargetPair, register\n" + paths +
                      f"\nregister(TargetPair(name={name!r}, kind='op', expected={expected!r}, "
                      "build=lambda c, d: c.token_randn(8, 'x'), trainer=trainer, rollout=rollout, "
                      "axes=Axes(n_seqs=(1, 2), seq_len=(1, 3))))\n")
    return harness_cli("fuzz", name, "--plugin", str(plugin), "--no-tracking", "--seed", "1", "--max-examples",
                       str(examples), "--corpus", str(tmp_path / "corpus"))


def test_a_repro_records_the_backend_versions_its_worker_imported(tmp_path, harness_cli):
    """The pair imports its backend inside its paths, so only the worker process has it: the repro's
    environment still names its version (provenance across backend upgrades)."""
    pytest.importorskip("safetensors")
    code, out, err = fuzz_op_plugin(harness_cli, tmp_path, "lazy.backend", "diverges", (
        "def trainer(x):\n    return Outcome(logprobs=torch.log_softmax(x, -1))\n"
        "def rollout(x):\n    import safetensors  # the backend, imported where it runs\n"
        "    return Outcome(logprobs=torch.log_softmax(0.5 * x, -1))\n"), examples=5)
    assert code == 1, err
    [repro] = by_pair(tmp_path / "corpus")["lazy.backend"]
    import safetensors

    assert repro.environment.get("safetensors") == safetensors.__version__, repro.environment


def test_what_a_target_prints_stays_off_the_campaigns_stdout(tmp_path, harness_cli):
    code, out, err = fuzz_op_plugin(harness_cli, tmp_path, "chatty.pair", "aligned", (
        "def trainer(x):\n    print('CHATTY-ENGINE step', flush=True)\n"
        "    return Outcome(logprobs=torch.log_softmax(x, -1))\n"
        "rollout = trainer\n"), examples=3)
    assert code == 0, err
    assert "CHATTY-ENGINE" not in out and "CHATTY-ENGINE" in err and "chatty.pair" in out


def test_a_passing_case_comes_back_from_the_worker_with_every_metric_bit_for_bit():
    """A passing case's verdict travels as plain values (not the pickled Evaluation): the metrics,
    the verdict's `fired` and the routing flips per layer are those of the same case in-process."""
    import dataclasses

    from harness import REGISTRY, Case
    from harness.execute import Symptom, run_case
    from harness.worker import Worker

    with Worker("cpu") as worker:
        for name in ("attention.aligned", "router.topk_softmax", "moe_aggregate.aligned"):
            pair = REGISTRY.get(name)
            case = Case(seed=11, seq_lens=(5, 3, 7), n_experts=8, top_k=2, tie_fraction=0.5)
            here, there = run_case(pair, case), worker.evaluate(pair, case, 1e-3)
            assert here.symptom is there.symptom is Symptom.NONE, name
            assert there.case is case and there.pair == name and there.error is None
            a, b = dataclasses.asdict(here.divergence), dataclasses.asdict(there.divergence)
            a.pop("per_token"), b.pop("per_token")
            assert a == b, name
            if name == "router.topk_softmax":
                assert there.divergence.flips_per_layer, name  # (a routed pair: the flips came back too)


def test_a_leaking_path_is_named_and_its_worker_replaced_before_it_takes_the_machine(tmp_path, harness_cli):
    """A path that keeps 8 MiB per case: a warning names the pair once its worker grew past the
    allowance, and past the cap the worker is replaced between cases; the campaign goes on, and
    the pair (aligned, its values right) is clean."""
    code, out, err = fuzz(harness_cli, tmp_path, "faults.leak", "--max-examples", "100", "--budget", "120",
                          env={"HARNESS_WORKER_LEAK_MB": "64", "HARNESS_WORKER_MAX_MB": "900"})
    assert code == 0, err
    assert err.count("warning: the worker process grew by") == 1 and "faults.leak's cases" in err, err
    assert "above the cap of 900 MiB; it was replaced by a fresh worker process" in err
    assert "faults.leak" in out and "clean" in out
    # ... and the summary says so too (where a passing pytest item hides stderr, it is the only trace)
    row = next(line for line in out.splitlines() if line.startswith("faults.leak"))
    assert "memory: the worker grew by" in row and "replaced at the cap" in row, row
    code, out, err = fuzz(harness_cli, tmp_path, "faults.leak", "--max-examples", "100", "--budget", "120",
                          env={"HARNESS_WORKER_MAX_MB": "lots"})
    assert code == 2 and "$HARNESS_WORKER_MAX_MB='lots' must be a number of MiB > 0" in err and "Traceback" not in err


def test_a_cold_case_that_hangs_records_the_per_case_timeout_not_the_cold_allowance():
    """A first case in a fresh worker gets its imports' allowance on top of the per-case timeout; the
    timeout finding records the per-case one (what `replay` then runs under: 0.5 s, not 1.5 s)."""
    from harness import Case
    from harness.pairs import REGISTRY
    from harness.worker import Worker

    REGISTRY.load_plugin(FAULTS)
    pair = REGISTRY.get("faults.hang_always")
    with Worker("cpu", plugins=(FAULTS,)) as worker:
        worker.submit(pair, Case(seed=1, seq_lens=(1,)), 1e-3, timeout=1.5, cold_extra=1.0)
        ev = worker.collect()
    assert ev.symptom.value == "timeout" and ev.error["timeout_s"] == 0.5, ev.error
    assert "per-case timeout of 0.5 s (+1 s for its first case" in ev.error["message"], ev.error["message"]


def test_a_pair_whose_cold_case_hung_gets_only_a_bounded_cold_allowance_after(tmp_path, monkeypatch):
    """An engine that hangs on every case: its first case (cold) gets the cold-start allowance, but
    after it hung through that, each shrink step in a replacement worker (cold again) gets the
    per-case timeout plus a bounded COLD_AFTER_HANG. It got the whole allowance again on every step:
    300 s each, with the pair's `timeout=5`, hours for a nightly."""
    from harness.fuzz import CampaignConfig, Executor, run_campaign
    from harness.pairs import REGISTRY
    from harness.worker import Worker

    REGISTRY.load_plugin(FAULTS)
    monkeypatch.setattr(Executor, "COLD_START_TIMEOUT", 4.0)
    monkeypatch.setattr(Executor, "COLD_AFTER_HANG", 0.25)
    sent: list[float] = []
    submit = Worker.submit

    def spy(self, pair, case, threshold, timeout=None, wall=None, cold_extra=0.0):
        sent.append(cold_extra)
        return submit(self, pair, case, threshold, timeout, wall, cold_extra=cold_extra)

    monkeypatch.setattr(Worker, "submit", spy)
    cfg = CampaignConfig(pairs=[REGISTRY.get("faults.hang_always")], seed=1, max_examples=3, corpus=tmp_path,
                         isolation=True, timeout=0.5, plugins=(FAULTS,))
    (r,) = run_campaign(cfg, log=lambda m: None).results
    assert [f.symptom.value for f in r.findings] == ["timeout"]
    assert len(sent) >= 2 and sent[0] == 3.5 and all(extra in (0.0, 0.25) for extra in sent[1:]), sent
    assert 0.25 in sent[1:]  # (a cold case after the hang: the bounded allowance; warm ones: none)
