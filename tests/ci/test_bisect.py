"""`git bisect run harness replay FILE` finds the commit that introduced a regression.

A throwaway repository holds a plugin pair file through six commits: aligned (good), the commit
that plants a logit bias (the first bad one), a commit where the plugin does not import (replay
exits 125 during a bisect, so git skips it; it is the first commit git tests here), and three more.
The repro is found by a real campaign at the newest commit and lives outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLANTED = Path(__file__).with_name("planted_pair.py")
HARNESS = str(Path(sys.executable).with_name("harness"))


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def commit(repo: Path, text: str, message: str) -> str:
    (repo / "pair.py").write_text(text)
    git(repo, "add", "pair.py")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.mark.slow
def test_git_bisect_run_finds_the_commit_that_plants_the_bias(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    source = PLANTED.read_text()
    assert "BIAS = 0.5" in source
    aligned = source.replace("BIAS = 0.5", "BIAS = 0.0")
    good = commit(repo, aligned, "aligned pair")
    first_bad = commit(repo, source, "plant a logit bias")
    broken = commit(repo, source.replace("import torch", "import torch_that_is_not_installed"), "broken import")
    for n in range(3):
        commit(repo, source + "\n# comment\n" * (n + 1), f"unrelated change {n}")

    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    found = subprocess.run([HARNESS, "fuzz", "planted.aligned_bias", "--plugin", "pair.py", "--seed", "1",
                            "--max-examples", "10", "--corpus", str(tmp_path / "corpus"), "--no-tracking"],
                           cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 1, found.stdout + found.stderr  # the campaign finds the regression
    (repro,) = (tmp_path / "corpus" / "planted.aligned_bias").glob("*.json")

    git(repo, "bisect", "start", "HEAD", good)
    out = git(repo, "bisect", "run", HARNESS, "replay", "--plugin", "pair.py", str(repro))
    assert f"{first_bad} is the first bad commit" in out, out
    assert "plant a logit bias" in out
    assert f"git bisect skip {broken}" in git(repo, "bisect", "log")  # replay exited 125 there
    git(repo, "bisect", "reset")
