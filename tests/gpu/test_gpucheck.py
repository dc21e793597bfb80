"""`harness gpucheck`: skips cleanly without CUDA; its campaigns and table, tried on the CPU."""

import json

import pytest
import torch

from harness.gpucheck import PairCheck, table


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run, not skip")
def test_without_cuda_it_skips_with_the_reason_and_exits_0():
    from click.testing import CliRunner

    from harness.gpucheck import gpucheck_command

    res = CliRunner().invoke(gpucheck_command, [])  # (.ci/run runs the real command line as its last step)
    assert res.exit_code == 0, res.output
    assert res.output.startswith("gpucheck: skipped: torch ") and "sees no CUDA device" in res.output
    res = CliRunner().invoke(gpucheck_command, ["--device", "cuda:1"])
    assert res.exit_code == 0 and "skipped" in res.output
    res = CliRunner().invoke(gpucheck_command, ["--json"])  # rows as JSON: none, in the same shape
    assert res.exit_code == 0 and res.output.splitlines()[-1] == "[]"


def test_the_module_runs_as_a_script_too(harness_cli):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "harness.gpucheck", "--device", "tpu"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "not cpu, cuda or cuda:N" in proc.stderr and "Traceback" not in proc.stderr


def test_on_cpu_it_prints_one_table_with_every_column(harness_cli):
    code, out, err = harness_cli("gpucheck", "--device", "cpu", "--pairs", "lm_head.aligned", "--pairs",
                                 "lm_head.bf16", "--budget", "20", "--max-examples", "25", "--json")
    assert code == 0, err
    lines = out.splitlines()
    assert "| pair" in lines[2] and all(c in lines[2] for c in ("cases/s", "harness/bare", "metrics ms", "verdict"))
    body = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines[4:6]}
    assert set(body) == {"lm_head.aligned", "lm_head.bf16"}
    assert body["lm_head.aligned"][-1] == "clean" and body["lm_head.bf16"][-1] == "caught"
    rows = json.loads(out[out.index("["):])
    for r in rows:
        assert r["cases"] >= 2 and r["rate"] > 0 and r["bare_ms"] > 0 and r["metrics_ms"] > 0
        assert r["ratio"] == pytest.approx(r["harness_ms"] / r["bare_ms"])


def test_an_aligned_pair_that_diverges_fails_the_check(harness_cli, tmp_path):
    plugin = tmp_path / "regressed.py"
    plugin.write_text(
        "import torch\nfrom harness import Axes, Outcome, TargetPair, register\n"
        "def build(case, device):\n    return case.token_randn(8, 'x', device=device) * 4\n"
        "register(TargetPair(name='example.regressed', kind='op', expected='aligned', build=build,\n"
        "    trainer=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)),\n"
        "    rollout=lambda x: Outcome(logprobs=torch.log_softmax(x.flip(-1), -1)),\n"
        "    axes=Axes(n_seqs=(1, 2), seq_len=(1, 4))))\n")
    code, out, err = harness_cli("gpucheck", "--device", "cpu", "--plugin", str(plugin), "--pairs", "example.*",
                                 "--budget", "20", "--max-examples", "10")
    assert code == 1, out + err
    assert "| REGRESSION |" in out and "failed: example.regressed" in out


def test_table_marks_what_was_not_measured():
    rows = [PairCheck("a.pair", "aligned", cases=3, rate=2.0, harness_ms=10.0, bare_ms=8.0, metrics_ms=1.25,
                      verdict="clean"),
            PairCheck("b.pair", "aligned", verdict="BROKEN", note="error: RuntimeError: boom")]
    text = table(rows).splitlines()
    assert text[2].split("|")[1:-1] == [" a.pair ", " 3     ", " 2.0     ", " 1.25         ", " 1.2        ",
                                        " clean "]
    assert text[3].split("|")[3:6] == [" -       ", " -            ", " -          "]
    assert "BROKEN (error: RuntimeError: boom)" in text[3]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this would run the CUDA tests for real")
def test_the_cuda_test_run_collects_the_gpu_marked_tests_and_reports_pytests_summary():
    from harness.gpucheck import run_tests

    got = run_tests(timeout=600)
    assert got.ran and got.ok and got.code == 0, got.summary
    assert "skipped" in got.summary and "passed" not in got.summary  # every gpu test skips without CUDA


def test_cuda_n_under_a_schedulers_visible_devices_is_that_allocations_nth_gpu(monkeypatch):
    """`--device cuda:1` with CUDA_VISIBLE_DEVICES=4,5 (a Slurm allocation) is physical GPU 5: the
    tests' process must be given 5, not 1 (another job's GPU)."""
    import subprocess

    from harness import gpucheck

    seen = {}

    def fake_run(cmd, **kw):
        seen["env"] = kw["env"]
        return subprocess.CompletedProcess(cmd, 0, "1 skipped\n", "")

    monkeypatch.setattr(gpucheck.subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    gpucheck.run_tests(10, index=1)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa, GPU-bbbb")
    gpucheck.run_tests(10, index=0)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    gpucheck.run_tests(10, index=1)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "1"



def test_a_pair_whose_cuda_case_never_touched_the_gpu_is_named_not_on_gpu():
    # (the check's own data, tried without a GPU: what `metrics_ms` measures on CUDA is passed in)
    from harness import Outcome
    from harness.gpucheck import off_device

    on_cpu = (Outcome(logprobs=torch.zeros(3, 5)), Outcome(logprobs=torch.zeros(3, 5), tokens=torch.zeros(3, dtype=int)))
    why = off_device("cuda", on_cpu, allocated=0)
    assert "asked to run on cuda, both paths ran without it" in why and "came back on cpu" in why
    assert "devices=('cpu',)" in why and "torch.from_dlpack" in why
    assert off_device("cuda", on_cpu, allocated=4096) == ""  # torch used the GPU; the outcomes were moved back
    assert off_device("cpu", on_cpu, allocated=0) == ""
    assert PairCheck("a.pair", "aligned", verdict="NOT ON GPU").failed
