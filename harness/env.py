"""Facts about the software and machine a finding was made on (stored with every repro)."""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from pathlib import Path


@functools.lru_cache(maxsize=None)
def git_commit(cwd: str | None = None) -> str | None:
    """The commit of the checkout the harness runs from (or `cwd`), with '+dirty' if modified."""
    where = cwd or str(Path(__file__).resolve().parent)
    try:
        proc = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=where, capture_output=True,
                              text=True, timeout=5)
        sha = proc.stdout.strip()
        if proc.returncode != 0 or not sha:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when CUDA is present else 'cpu'; 'cuda' without CUDA is a usage error."""
    import torch

    from .errors import UsageError

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but torch sees no CUDA device here; use --device cpu "
                         "or --device auto, or run on a machine with a GPU and a CUDA build of torch.")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r} is not one of cpu, cuda, auto.")
    return device


def environment(device: str) -> dict:
    import numpy
    import torch

    from . import __version__

    env = {
        "harness": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": f"{sys.platform}-{platform.machine()}",
        "device": device,
        "git_commit": git_commit(),
        # CPU kernels (GEMMs above all) may split their sums by thread count: a replay uses this one
        "torch_threads": torch.get_num_threads(),
    }
    if device == "cuda":
        env["cuda_device"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def recorded_threads(env: dict) -> int | None:
    """The torch thread count a repro was found with, if it recorded a sane one (the file is untrusted)."""
    n = env.get("torch_threads") if isinstance(env, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024 else None


class threads_as:
    """`with threads_as(n):` torch runs with n threads inside (None: unchanged), as before after."""

    def __init__(self, n: int | None) -> None:
        self.n, self.before = n, None

    def __enter__(self) -> "threads_as":
        if self.n is not None:
            import torch

            self.before = torch.get_num_threads()
            if self.before != self.n:
                torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.n is not None and self.before is not None and self.before != self.n:
            import torch

            torch.set_num_threads(self.before)
