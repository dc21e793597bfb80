"""A pair whose own setup fails (it raises a harness error: a checkpoint folder that is gone, a
setting it refuses) cannot run here: its campaign stops at that case and says so ("CANNOT RUN",
the message, exit 2), and nothing is recorded for it (no repro, no MLflow regression): the error
says nothing of its paths. The other pairs of the campaign run as usual."""

from __future__ import annotations

import json

import pytest

from harness import REGISTRY
from harness.fuzz import CampaignConfig, run_campaign

from ..conftest import PLUGINS

FAULTS = str(PLUGINS / "faults.py")


@pytest.mark.parametrize("isolation", [False, True], ids=["in-process", "isolated"])
def test_a_pair_that_cannot_run_is_not_a_finding(tmp_path, isolation):
    REGISTRY.load_plugin(FAULTS)
    pairs = [REGISTRY.get("faults.setup_gone"), REGISTRY.get("faults.setup_batches"), REGISTRY.get("faults.diverges")]
    cfg = CampaignConfig(pairs=pairs, seed=3, max_examples=12, corpus=tmp_path / "corpus", isolation=isolation,
                         plugins=(FAULTS,))
    result = run_campaign(cfg, log=lambda msg: None)
    by = {r.pair: r for r in result.results}
    gone, batches, demo = by["faults.setup_gone"], by["faults.setup_batches"], by["faults.diverges"]
    assert gone.verdict == "CANNOT RUN" and gone.examples == 0 and not gone.findings
    assert "faults.setup_gone cannot run here: its case raised UsageError: the checkpoint folder " \
           "/nonexistent/faults-ckpt is gone" in gone.setup_error
    assert "nothing was recorded for it" in gone.setup_error
    # batch 1 runs (and is clean); the first batched case stops it
    assert batches.verdict == "CANNOT RUN" and not batches.findings
    assert "batch" in batches.setup_error and "raise max_num_seqs" in batches.setup_error
    assert demo.verdict == "caught"  # the campaign went on with the other pairs
    written = sorted(p.parent.name for p in (tmp_path / "corpus").rglob("*.json"))
    assert written == ["faults.diverges"], written


@pytest.mark.parametrize("isolation", [False, True], ids=["in-process", "isolated"])
def test_a_pair_breaking_the_contract_on_its_first_case_cannot_run_and_on_later_ones_is_a_finding(tmp_path,
                                                                                                  isolation):
    """A rollout that returns a row too few on every case (its adapter slices wrong) was recorded as an
    open regression, which the corpus tests then xfailed, green, forever: it cannot run. One that
    does so on batches only (an engine that loses a token when it batches) is a finding."""
    REGISTRY.load_plugin(FAULTS)
    pairs = [REGISTRY.get("faults.wrong_shape"), REGISTRY.get("faults.wrong_shape_batches")]
    cfg = CampaignConfig(pairs=pairs, seed=3, max_examples=12, corpus=tmp_path / "corpus", isolation=isolation,
                         plugins=(FAULTS,))
    by = {r.pair: r for r in run_campaign(cfg, log=lambda msg: None).results}
    always, batches = by["faults.wrong_shape"], by["faults.wrong_shape_batches"]
    assert always.verdict == "CANNOT RUN" and not always.findings, always
    assert "faults.wrong_shape cannot run here: its first case, the simplest, raised ValueError: " \
           "faults.wrong_shape: rollout logprobs have shape" in always.setup_error
    assert "fix the pair's paths" in always.setup_error
    assert batches.verdict == "REGRESSION" and [f.symptom.value for f in batches.findings] == ["error"]
    assert batches.findings[0].case.batch_size == 2  # shrunk to the smallest batch that loses a row
    written = sorted(p.parent.name for p in (tmp_path / "corpus").rglob("*.json"))
    assert written == ["faults.wrong_shape_batches"], written


def test_fuzz_command_says_so_and_exits_2(tmp_path, harness_cli):
    rc, out, err = harness_cli("fuzz", "--plugin", FAULTS, "faults.setup_gone", "--max-examples", "10",
                               "--seed", "1", "--corpus", str(tmp_path / "corpus"), "--no-tracking")
    assert rc == 2, (out, err)
    assert "CANNOT RUN" in out and "faults.setup_gone" in out
    assert "error: faults.setup_gone cannot run here" in err and "Traceback" not in err
    assert "no case ran" not in err  # (it is not a budget that ended too soon)
    assert not (tmp_path / "corpus").exists() or not list((tmp_path / "corpus").rglob("*.json"))
    # what it raised: in the progress line as it happens and in the error line at the end; the table
    # points to the error line (it said it a third time)
    assert (out + err).count("cannot run here: its case raised") == 2, (out, err)
    assert "cannot run here: see the error below" in out


def test_pairs_of_one_broken_checkpoint_say_its_error_once(tmp_path, harness_cli):
    """Every pair of a checkpoint that does not load raises the same error: the progress lines name the
    first pair that said it, the error line after the table names them all, once."""
    rc, out, err = harness_cli("fuzz", "--plugin", FAULTS, "faults.setup_gone", "faults.setup_gone_too",
                               "faults.setup_batches", "--max-examples", "10", "--seed", "1", "--corpus",
                               str(tmp_path / "corpus"), "--no-tracking")
    assert rc == 2, (out, err)
    assert "faults.setup_gone_too: CANNOT RUN" in err and "the same error as faults.setup_gone" in err, err
    assert "error: 2 pairs cannot run here (faults.setup_gone, faults.setup_gone_too), each for the same reason: " \
           "its case raised UsageError: the checkpoint folder /nonexistent/faults-ckpt is gone" in err, err
    assert "error: faults.setup_batches cannot run here" in err  # (another reason: a paragraph of its own)
    assert (out + err).count("/nonexistent/faults-ckpt is gone") == 2, (out, err)  # progress line + error line


def test_fuzz_command_with_a_finding_too_exits_1(tmp_path, harness_cli):
    rc, out, err = harness_cli("fuzz", "--plugin", FAULTS, "faults.setup_gone",
                               "faults.diverges", "--max-examples", "10", "--seed", "1", "--corpus",
                               str(tmp_path / "corpus"), "--no-tracking")
    assert rc == 1, (out, err)  # the finding is on disk, to triage; the pair that cannot run is still named
    assert "CANNOT RUN" in out and "error: faults.setup_gone cannot run here" in err


def test_pytest_item_fails_with_the_message(tmp_path):
    from ..ci.test_pytest_plugin import run_pytest

    rc, out = run_pytest(["--harness-fuzz", f"--harness-plugin={FAULTS}", "--harness-pairs", "faults.setup_gone",
                          "--harness-max-examples", "10", "--harness-no-tracking", "--harness-out", str(tmp_path / "out"),
                          "--harness-corpus", str(tmp_path / "corpus"), "-q"])
    assert rc == 1, out
    assert "faults.setup_gone cannot run here" in out and "CANNOT RUN" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["cannot_run"] == ["faults.setup_gone"]
    assert "cannot run here" in summary["pairs"][0]["setup_error"]
    assert not list((tmp_path / "corpus").rglob("*.json")) if (tmp_path / "corpus").exists() else True


def _error(setup: bool, message: str) -> dict:
    return {"type": "UsageError" if setup else "RuntimeError", "message": message, "where": "x.py:f", "traceback": ""}


def test_a_setup_error_while_a_finding_is_polished_keeps_the_finding():
    """The pair stops running while a finding (hit by a uniform case) is being polished: the finding
    is kept at its smallest so far, the pair says it cannot run now, and the campaign goes on."""
    from harness.execute import Evaluation, Symptom
    from harness.fuzz import fuzz_pair

    REGISTRY.load_builtins()
    pair = REGISTRY.get("moe_aggregate.bf16")
    n = [0]

    def evaluate(case):
        n[0] += 1
        if n[0] == 1:  # the Hypothesis example passes
            return Evaluation(pair.name, case, Symptom.NONE)
        if n[0] == 2:  # its first uniform case is an error finding
            return Evaluation(pair.name, case, Symptom.ERROR, error=_error(False, "boom"))
        return Evaluation(pair.name, case, Symptom.ERROR, error=_error(True, "refused"), setup=True)  # polish: refused

    cfg = CampaignConfig(pairs=[pair], seed=1, uniform_per_example=3, write_corpus=False)
    r = fuzz_pair(pair, cfg, seed=1, deadline=None, evaluate=evaluate, max_examples=5)
    assert [f.symptom.value for f in r.findings] == ["error"] and not r.findings[0].shrink_complete
    assert "cannot run here" in r.setup_error and r.verdict == "BROKEN"  # (a demonstration pair: an error breaks it)


def test_a_fill_round_whose_first_case_cannot_run_says_so(monkeypatch, tmp_path):
    """The checkpoint goes away after the pair's first share: the next round's first case raises the
    harness error, and the pair is CANNOT RUN (not clean, exit 0)."""
    import harness.fuzz as fuzz

    plugin = tmp_path / "gone_later.py"
    plugin.write_text(
        "import torch\n"
        "from harness import Axes, Outcome, TargetPair, register\n"
        "from harness.errors import UsageError\n"
        "GONE = [False]\n"
        "def build(case, device):\n"
        "    if GONE[0]:\n"
        "        raise UsageError('the checkpoint folder /x is gone')\n"
        "    return {'x': case.randn((case.n_tokens, 16), 'x', device=device)}\n"
        "def fine(inp):\n"
        "    return Outcome(logprobs=torch.log_softmax(inp['x'], -1))\n"
        "register(TargetPair(name='later.gone', kind='op', expected='aligned', build=build, trainer=fine, rollout=fine,\n"
        "                    axes=Axes(n_seqs=(1, 4), seq_len=(1, 8))))\n")
    REGISTRY.load_plugin(str(plugin))
    pair = REGISTRY.get("later.gone")
    import sys

    gone = sys.modules[pair.build.__module__].GONE
    real, calls = fuzz.fuzz_pair, [0]

    def fuzz_pair(*args, **kwargs):
        calls[0] += 1
        gone[0] = calls[0] > 1  # gone from the first fill round on
        return real(*args, **kwargs)

    monkeypatch.setattr(fuzz, "fuzz_pair", fuzz_pair)
    cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=5, budget=4.0, fill_budget=True, isolation=False,
                         write_corpus=False)
    [r] = run_campaign(cfg, log=lambda m: None).results
    assert calls[0] >= 2 and r.verdict == "CANNOT RUN" and "/x is gone" in r.setup_error


def test_gpucheck_fails_a_pair_that_cannot_run(tmp_path):
    from harness.gpucheck import check_pair_campaign

    REGISTRY.load_plugin(FAULTS)
    row = check_pair_campaign(REGISTRY.get("faults.setup_gone"), "cpu", 1, 5, 10.0, tmp_path / "corpus")
    assert row.verdict == "CANNOT RUN" and row.failed
    assert row.note.startswith("faults.setup_gone cannot run here: its case raised UsageError")
