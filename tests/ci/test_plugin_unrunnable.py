"""`pytest --harness-fuzz` on pairs that cannot do their job (tests/ci/unrunnable_pairs.py): a
demonstration that errors on every case (BROKEN) fails its item, as `harness gpucheck` fails it and
`harness fuzz` exits 1 for it (a demonstration that cannot demonstrate proves nothing), and a pair
that CANNOT RUN says why once, in its item's failure, not again in its captured log and the table."""

from __future__ import annotations

import json
from pathlib import Path

from .test_pytest_plugin import run_pytest

PAIRS = Path(__file__).with_name("unrunnable_pairs.py")
# the end of the pairs' harness error: past where pytest's short summary line cuts a failure reason
GONE = "point the pair at an existing one"


def fuzz(tmp_path: Path, *globs: str) -> tuple[int, str]:
    args = ["--harness-fuzz", f"--harness-plugin={PAIRS}", "--harness-max-examples", "3", "--harness-seed", "1",
            "--harness-no-tracking", f"--harness-corpus={tmp_path / 'corpus'}", f"--harness-out={tmp_path / 'out'}"]
    for g in globs:
        args += ["--harness-pairs", g]
    # (an 80-column terminal, as in CI logs: the short summary line is cut at its width)
    return run_pytest(args, env={"COLUMNS": "80"}, timeout=300)


def test_a_broken_demonstration_fails_its_item(tmp_path):
    rc, out = fuzz(tmp_path, "unrunnable.demo_build_raises", "unrunnable.demo_caught")
    assert rc == 1 and "1 failed, 1 passed" in out, out
    assert "HarnessFuzzWarning" not in out, out  # a failure, not a warning
    failure = out.split("harness fuzz unrunnable.demo_build_raises (diverges)")[1].splitlines()[1]
    # one paragraph: what is wrong, the finding it left, how to fix it
    assert failure.startswith("demonstration pair unrunnable.demo_build_raises is BROKEN: "), failure
    assert "RuntimeError: unrunnable: the demonstration's input builder is broken" in failure, failure
    repro = next((tmp_path / "corpus" / "unrunnable.demo_build_raises").glob("*.json"))
    assert f"harness replay --plugin {PAIRS} {repro}" in failure, failure
    assert "fix the pair" in failure, failure
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["broken_demonstrations"] == ["unrunnable.demo_build_raises"]
    assert {d["pair"]: d["verdict"] for d in summary["pairs"]} == {
        "unrunnable.demo_build_raises": "BROKEN", "unrunnable.demo_caught": "caught"}


def test_cannot_run_is_said_once_per_pair_in_its_failure(tmp_path):
    rc, out = fuzz(tmp_path, "unrunnable.*_gone")
    assert rc == 1 and "2 failed" in out, out
    for name in ("unrunnable.aligned_gone", "unrunnable.demo_gone"):
        failure = out.split(f"harness fuzz {name} (")[1]
        assert failure.splitlines()[1].startswith(f"{name} cannot run here: its case raised UsageError: "), failure
        assert GONE in failure.splitlines()[1], failure
    # once per pair: not in the captured log, nor in the table (pytest's own short summary repeats each
    # failure's reason after that, cut to the terminal's width, or whole where CI is set)
    assert out.split("short test summary info")[0].count(GONE) == 2, out
    captured = [line for line in out.splitlines() if ": CANNOT RUN (" in line]
    assert len(captured) == 2 and all("failure message says why" in line for line in captured), captured
    table = [line for line in out.splitlines() if line.startswith("unrunnable.") and "CANNOT RUN" in line]
    assert len(table) == 2, table
    assert all(line.endswith("cannot run here: its failure above says why") for line in table), table
    # the files keep the whole message (a person reading them has no pytest output beside them)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["cannot_run"] == ["unrunnable.aligned_gone", "unrunnable.demo_gone"]
    assert all(GONE in d["setup_error"] for d in summary["pairs"])
    assert (tmp_path / "out" / "summary.md").read_text().count(GONE) == 2
