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
    cfg = CampaignConfig(pairs=pairs, seed=3, max_examples=30, corpus=tmp_path / "corpus", isolation=isolation,
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


def test_fuzz_command_says_so_and_exits_2(tmp_path, harness_cli):
    rc, out, err = harness_cli("fuzz", "--plugin", FAULTS, "faults.setup_gone", "--max-examples", "10",
                               "--seed", "1", "--corpus", str(tmp_path / "corpus"), "--no-tracking")
    assert rc == 2, (out, err)
    assert "CANNOT RUN" in out and "faults.setup_gone cannot run here" in out
    assert "error: faults.setup_gone cannot run here" in err and "Traceback" not in err
    assert "no case ran" not in err  # (it is not a budget that ended too soon)
    assert not (tmp_path / "corpus").exists() or not list((tmp_path / "corpus").rglob("*.json"))


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
