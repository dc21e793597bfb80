"""Shared fixtures. Tests are sorted by purpose: unit/ (fast, the engine), test_corpus.py (replay of
every committed repro), quality/ (detection power), gpu/ (CUDA only), and one folder per feature."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "tests" / "plugins"


def pytest_configure(config):
    # The pairs are small: one intra-op thread per test process. Two threads per xdist worker on a
    # two-core machine oversubscribe it and make every case 20-50x slower. (Not in a `--harness-fuzz`
    # session: no test runs there, and the harness gives its campaigns their threads, as in a user's
    # repository.)
    if config.getoption("harness_fuzz", default=False):
        return
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One torch thread for a test (use with `pytest.mark.usefixtures("one_thread")`): with xdist on two
    cores, more threads only spin; restored afterwards."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture
def harness_cli():
    """Run the real command line in a subprocess: returns (exit code, stdout, stderr)."""

    def run(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd or ROOT, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout, proc.stderr

    return run
