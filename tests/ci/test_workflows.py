"""The GitHub workflows parse, have the jobs and triggers the nightly and pull-request runs need, and
every `pytest` / `harness` command in them uses options that exist in this checkout."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
NIGHTLY, PR = WORKFLOWS / "nightly.yml", WORKFLOWS / "pr.yml"


def load(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as the boolean true
    return doc


def steps(job: dict) -> list[dict]:
    return job.get("steps", [])


def runs(job: dict) -> list[str]:
    return [s["run"] for s in steps(job) if "run" in s]


def commands(script: str) -> list[list[str]]:
    """Each `pytest ...` or `harness ...` command in a run script, as tokens (${{ }} made literal)."""
    script = re.sub(r"\$\{\{[^}]*\}\}", "X", script)
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        for part in re.split(r"\|\||&&|;", line):
            try:
                tokens = shlex.split(part)
            except ValueError:
                continue
            if tokens and tokens[0] in ("pytest", "harness"):
                out.append(tokens)
    return out


@lru_cache(maxsize=None)
def help_text(*argv: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run([sys.executable, "-m", *argv, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("-")]


def test_both_workflows_parse_with_jobs():
    for path in (NIGHTLY, PR):
        doc = load(path)
        assert doc["name"] and doc["on"] and doc["jobs"], path
        for name, job in doc["jobs"].items():
            assert job.get("runs-on") and steps(job), (path.name, name)


def test_nightly_triggers_and_inputs():
    on = load(NIGHTLY)["on"]
    (cron,) = [s["cron"] for s in on["schedule"]]
    assert len(cron.split()) == 5
    assert set(on["workflow_dispatch"]["inputs"]) == {"budget", "pairs", "shards"}


def test_nightly_jobs():
    doc = load(NIGHTLY)
    jobs = doc["jobs"]
    cpu, gpu = jobs["cpu"], jobs["gpu"]
    assert cpu["runs-on"] == "ubuntu-latest" and "shard" in cpu["strategy"]["matrix"]
    assert cpu["strategy"]["fail-fast"] is False
    assert set(gpu["runs-on"]) == {"self-hosted", "gpu"}
    assert doc["env"]["HARNESS_RUN_ID"] == "${{ github.run_id }}"
    for name, job in (("cpu", cpu), ("gpu", gpu)):
        fuzz = [c for r in runs(job) for c in commands(r) if "--harness-fuzz" in c]
        assert len(fuzz) == 1, name
        cmd = fuzz[0]
        assert cmd[cmd.index("--harness-profile") + 1] == "nightly"
        assert "-n" in cmd  # xdist workers inside each job
        assert cmd[cmd.index("--harness-device") + 1] == ("cpu" if name == "cpu" else "cuda")
        setup = [s for s in steps(job) if s.get("uses", "").startswith("actions/setup-python")]
        assert setup and setup[0]["with"]["cache"] == "pip"
        uploads = [s for s in steps(job) if s.get("uses", "").startswith("actions/upload-artifact")]
        assert uploads and all(u.get("if") == "always()" for u in uploads)
        paths = uploads[0]["with"]["path"]
        assert "reports/fuzz/" in paths and "reports/nightly.md" in paths and "reports/mlflow.db" in paths
        text = "\n".join(runs(job))
        assert "secrets.MLFLOW_TRACKING_URI" in str(job) and "MLFLOW_TRACKING_URI=" in text
        report = [s for s in steps(job) if "harness report" in s.get("run", "")]
        assert report and report[0]["if"] == "always()" and report[0]["continue-on-error"] is True
    cmd = next(c for r in runs(cpu) for c in commands(r) if "--harness-fuzz" in c)
    assert cmd[cmd.index("--shard") + 1] == "X/X"  # ${{ matrix.shard }}/${{ needs.plan.outputs.count }}
    assert cpu["strategy"]["matrix"]["shard"] == "${{ fromJSON(needs.plan.outputs.shards) }}"
    assert "matrix.shard" in next(u for u in steps(cpu) if "upload-artifact" in u.get("uses", ""))["with"]["name"]
    install = runs(cpu)[0]
    assert install.index("download.pytorch.org/whl/cpu") < install.index('-e ".[dev]"')  # CPU torch first


def test_nightly_plan_step_makes_the_shard_matrix(tmp_path):
    """Run the plan step's script as Actions would, with SHARDS=3."""
    (plan,) = steps(load(NIGHTLY)["jobs"]["plan"])
    out = tmp_path / "github_output"
    proc = subprocess.run(["bash", "-c", plan["run"]], env={**os.environ, "SHARDS": "3", "GITHUB_OUTPUT": str(out)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().split() == ["count=3", "shards=[1,", "2,", "3]"]


def test_pr_workflow():
    doc = load(PR)
    assert "pull_request" in doc["on"]
    cmds = [c for job in doc["jobs"].values() for r in runs(job) for c in commands(r)]
    assert ["pytest", "-n", "auto"] in cmds
    campaign = [c for c in cmds if "--harness-fuzz" in c]
    assert len(campaign) == 1 and campaign[0][campaign[0].index("--harness-profile") + 1] == "ci"


@pytest.mark.parametrize("path", [NIGHTLY, PR], ids=lambda p: p.name)
def test_commands_use_options_that_exist(path):
    pyproject = (ROOT / "pyproject.toml").read_text()
    for job in load(path)["jobs"].values():
        for script in runs(job):
            if '".[dev]"' in script:
                assert re.search(r"^dev = \[", pyproject, re.M), "the dev extra is gone"
            for cmd in commands(script):
                if cmd[0] == "pytest":
                    text = help_text("pytest", "-p", "no:cacheprovider")
                else:
                    text = help_text("harness", cmd[1])
                for flag in flags(cmd[1:]):
                    assert re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", text, re.M), (path.name, cmd, flag)
                if "--harness-profile" in cmd:
                    from harness.profiles import PROFILES

                    assert cmd[cmd.index("--harness-profile") + 1] in PROFILES


def test_the_nightly_replays_the_corpus_once_and_fuzzes_on_every_shard_even_if_it_fails():
    """`--harness-fuzz` deselects the test files: the corpus replay (where a fixed regression shows)
    is a step of its own, on one shard; the fuzz step runs whatever the replay said."""
    cpu = load(NIGHTLY)["jobs"]["cpu"]
    replay = [s for s in steps(cpu) if "run" in s and "tests/test_corpus.py" in s["run"]]
    assert len(replay) == 1 and replay[0].get("if") == "matrix.shard == 1"
    fuzz = [s for s in steps(cpu) if "run" in s and "--harness-fuzz" in s["run"]]
    assert len(fuzz) == 1 and fuzz[0].get("if") == "${{ !cancelled() }}"  # (not after a cancelled run)
    assert steps(cpu).index(replay[0]) < steps(cpu).index(fuzz[0])
