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
        # ... and pick their code by processor: another CPU may give other last bits
        "cpu": cpu_identity(),
    }
    if device == "cuda":
        env["cuda_device"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


@functools.lru_cache(maxsize=None)
def cpu_identity() -> str:
    """The processor, as far as the kernels' choice of code goes: its model name and the instruction
    set torch dispatches to (numpy and the BLAS choose theirs from the same CPU)."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    try:
        import torch

        return f"{name} ({torch.backends.cpu.get_cpu_capability()})"
    except Exception:  # noqa: BLE001 - an old torch without the query
        return name


# What decides a replay's last bits on a CPU: the same values here mean the recorded metrics are the
# ones a replay must reproduce bit for bit (the thread count is the recorded one: `recorded_threads`).
BIT_FOR_BIT_KEYS = ("torch", "numpy", "platform", "device", "cpu")


def machine_differences(env: dict, device: str = "cpu") -> list[str]:
    """How the machine and software a repro was recorded on differ from this process's, in what
    decides its last bits (`BIT_FOR_BIT_KEYS`; on CUDA also the GPU): empty when a replay here must
    reproduce its metrics bit for bit. A repro recorded before a fact was stored differs in it."""
    if not isinstance(env, dict):
        return ["environment: not recorded"]
    here = environment(device)
    keys = BIT_FOR_BIT_KEYS + (("cuda_device", "cuda") if device == "cuda" else ())
    return [f"{k}: {env.get(k, 'not recorded')} (here {here.get(k)})" for k in keys if env.get(k) != here.get(k)]


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
