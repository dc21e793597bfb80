"""Facts about the software and machine a finding was made on (stored with every repro)."""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


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


def resolve_device(device: str, option: str = "--device") -> str:
    """'auto' -> 'cuda' when CUDA is present else 'cpu'; 'cuda' without CUDA is a usage error
    (naming `option`, the flag it came from: `--harness-device` under pytest)."""
    import torch

    from .errors import UsageError

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{option} cuda was asked for but torch sees no CUDA device here; use {option} cpu "
                         f"or {option} auto, or run on a machine with a GPU and a CUDA build of torch.")
    if device not in ("cpu", "cuda"):
        raise UsageError(f"{option} {device!r} is not one of cpu, cuda, auto.")
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
    """The processor, as far as the kernels' choice of code goes: its model name, the instruction set
    torch dispatches to, the one numpy's float64 exp runs, and a hash of the CPU's feature flags
    (what oneDNN and the BLAS choose by; it also tells apart CPUs without a model name, as on ARM)."""
    import hashlib

    name, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Hardware", "CPU part") and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
                if name and flags:
                    break
    except OSError:
        pass
    parts = [name or platform.processor() or platform.machine()]
    try:
        import torch

        parts.append(f"torch {torch.backends.cpu.get_cpu_capability()}")
    except Exception:  # noqa: BLE001 - an old torch without the query
        pass
    try:
        from numpy.lib import introspect

        exp = introspect.opt_func_info(func_name="^exp$", signature="float64")["exp"]["dd"]["current"]
        parts.append(f"numpy {exp}")
    except Exception:  # noqa: BLE001 - numpy < 2 has no introspection
        pass
    if flags:
        parts.append("flags " + hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8])
    return f"{parts[0]} ({', '.join(parts[1:])})" if len(parts) > 1 else parts[0]


# What decides a replay's last bits on a CPU: the same values here mean the recorded metrics are the
# ones a replay must reproduce bit for bit (the thread count is the recorded one: `recorded_threads`).
BIT_FOR_BIT_KEYS = ("torch", "numpy", "platform", "device", "cpu")
METRICS_ON = "metrics_recorded_on"  # environment key: where `harness rerecord` recomputed the metrics


def machine_facts(device: str = "cpu") -> dict:
    """This process's values of what decides a replay's last bits on `device` (`BIT_FOR_BIT_KEYS`, and
    the GPU and CUDA version on CUDA)."""
    here = environment(device)
    keys = BIT_FOR_BIT_KEYS + (("cuda_device", "cuda") if device == "cuda" else ())
    return {k: here.get(k) for k in keys}


def machine_differences(env: Any, device: str = "cpu") -> list[str]:
    """How the machine and software a repro's metrics were recorded on differ from this process's, in
    what decides their last bits (`machine_facts`): empty when a replay here must reproduce them bit
    for bit. That is the repro's environment, or its `metrics_recorded_on` when `harness rerecord`
    recomputed the metrics elsewhere (the environment stays the finding's). A repro recorded before
    a fact was stored differs in it. Values come from the file as written (untrusted): they are
    shown as Python literals, cut at 80 characters."""
    if not isinstance(env, dict):
        return ["environment: not recorded"]
    if isinstance(env.get(METRICS_ON), dict):  # (a fact it lacks: the finding's)
        env = {**env, **env[METRICS_ON]}

    def shown(v: Any) -> str:
        text = repr(v) if v is not None else "not recorded"
        return text if len(text) <= 80 else text[:77] + "..."

    return [f"{k}: {shown(env.get(k))} (here {shown(v)})" for k, v in machine_facts(device).items() if env.get(k) != v]


def record_metrics_machine(env: dict, device: str, threads: int) -> dict:
    """`env` with `metrics_recorded_on`: this machine's facts (`machine_facts`) and the torch thread
    count the repro's metrics were now computed with, beside the environment the bug was found in
    (which stays). `machine_differences` and `recorded_threads` read it first."""
    return {**env, METRICS_ON: {**machine_facts(device), "torch_threads": threads}}


def is_thread_count(n: Any) -> bool:
    """A torch thread count a repro may record: a whole number from 1 to 1024."""
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024


def recorded_threads(env: dict) -> int | None:
    """The torch thread count a repro's metrics were computed with (its `metrics_recorded_on`'s, else
    the one it was found with), if it recorded a sane one (the file is untrusted)."""
    if not isinstance(env, dict):
        return None
    on = env.get(METRICS_ON)
    if isinstance(on, dict) and is_thread_count(on.get("torch_threads")):
        return on["torch_threads"]
    n = env.get("torch_threads")
    return n if is_thread_count(n) else None


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
