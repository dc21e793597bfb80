"""Replaying a `crash` or `timeout` repro runs its case in a worker process, as the campaign did: the
replay says "still crashes" / "still hangs" (exit 1), judged by symptom and error type, and the
replaying process survives it."""

from __future__ import annotations

import time

import pytest

from harness import REGISTRY, Case
from harness.corpus import load_repro, record_finding, replay
from harness.execute import Evaluation, Symptom
from harness.fuzz import Finding

from ..conftest import PLUGINS

FAULTS = str(PLUGINS / "faults.py")


def recorded(tmp_path, pair: str, symptom: Symptom, error: dict, seq_lens=(1, 1)):
    """A crash/timeout repro as the campaign writes it (faults.* die or hang on 2+ sequences)."""
    REGISTRY.load_plugin(FAULTS)
    case = Case(seed=0, seq_lens=seq_lens)
    ev = Evaluation(pair, case, symptom, error={"where": "worker", "traceback": "", **error})
    f = Finding(pair=pair, expected="aligned", symptom=symptom, signature=f"{abs(hash(pair)):012x}" * 2, case=case,
                evaluation=ev, examples=3)
    return load_repro(record_finding(f, tmp_path / "corpus", 1e-3, 0, "cpu"))


@pytest.mark.parametrize("pair, sig", [("faults.segfault", "SIGSEGV"), ("faults.abort", "SIGABRT")])
def test_a_crash_repro_still_crashes_and_this_process_survives(tmp_path, pair, sig):
    repro = recorded(tmp_path, pair, Symptom.CRASH, {"type": sig, "message": "the worker process died"})
    result = replay(repro)
    assert result.evaluation.symptom is Symptom.CRASH and result.diverges
    assert result.evaluation.error["type"] == sig and result.bit_for_bit, result.mismatches


def test_a_crash_repro_that_dies_another_way_is_not_bit_for_bit(tmp_path):
    repro = recorded(tmp_path, "faults.abort", Symptom.CRASH, {"type": "SIGSEGV", "message": "died"})
    result = replay(repro)
    assert result.diverges and result.mismatches == {"error": ("SIGSEGV", "SIGABRT")}


def test_a_fixed_crash_replays_clean(tmp_path):
    repro = recorded(tmp_path, "faults.segfault", Symptom.CRASH, {"type": "SIGSEGV", "message": "died"},
                     seq_lens=(3,))  # one sequence: the pair does not crash on it
    result = replay(repro)
    assert not result.diverges and "symptom" in result.mismatches


def test_a_timeout_repro_still_hangs_within_its_recorded_timeout(tmp_path):
    repro = recorded(tmp_path, "faults.hang", Symptom.TIMEOUT,
                     {"type": "Timeout", "message": "the case ran longer than the per-case timeout of 1 s",
                      "timeout_s": 1.0})
    t = time.monotonic()
    result = replay(repro)
    assert result.evaluation.symptom is Symptom.TIMEOUT and result.diverges and result.bit_for_bit
    assert "hangs_on_batches" in result.evaluation.error["traceback"]
    assert time.monotonic() - t < 60  # bounded by the recorded 1 s (plus a worker's start), not the sleep


def test_the_command_line_replays_a_crash_with_exit_1(tmp_path, harness_cli):
    repro = recorded(tmp_path, "faults.segfault", Symptom.CRASH, {"type": "SIGSEGV", "message": "died"})
    code, out, err = harness_cli("replay", str(repro.path), "--timeout", "30")
    assert code == 1, err
    assert "recorded crash" in out and "now crash" in out and "bit-for-bit yes" in out and "SIGSEGV" in out


def test_triage_of_a_timeout_repro_says_why_not_in_one_clean_paragraph(tmp_path, harness_cli):
    """triage runs pairs in-process, so it refuses a hang: with the recorded message's headline (not
    its fix paragraph cut mid-sentence) and commands that load the repro's plugin."""
    repro = recorded(tmp_path, "faults.hang", Symptom.TIMEOUT,
                     {"type": "Timeout", "message": "the case ran longer than the per-case timeout of 1 s\nIf the "
                      "pair is just slow, raise it: `harness fuzz --timeout 'faults.hang=SECONDS'`, and more",
                      "timeout_s": 1.0})
    code, out, err = harness_cli("triage", "--plugin", FAULTS, str(repro.path), "--no-tracking")
    assert code == 2 and "Traceback" not in err, err
    assert "(Timeout: the case ran longer than the per-case timeout of 1 s); triage localizes" in err, err
    assert "If the pair is just slow" not in err
    assert "`harness show --plugin " in err and "faults.py " in err.split("`harness show --plugin ", 1)[1], err
