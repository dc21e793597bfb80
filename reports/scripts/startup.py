"""Start-up of `pytest --harness-fuzz`: this checkout against an earlier revision, side by side.

    python reports/scripts/startup.py [--baseline REV] [--rounds N]

Runs a one-example session of rmsnorm.aligned (`--harness-max-examples 1`, seed 1, no tracking)
without xdist, with `-n 1` and with `-n 2`, from an empty folder outside the repository (as in a
user's repository: no conftest of ours applies), once with the harness of a `git worktree` at REV
(default HEAD~1) and once with this checkout's, alternating, N rounds (default 3). Prints the median
wall seconds of each: a session this short is nearly all start-up (imports, the fork server, xdist's
workers). Whether Python may write bytecode (`PYTHONDONTWRITEBYTECODE`) is printed with it: pytest's
assertion rewriting is cached there only when it may.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def session(checkout: Path, workers: str, tmp: str, tag: str) -> float:
    cmd = [sys.executable, "-m", "pytest", "--harness-fuzz", *(["-n", workers] if workers else []), "-q",
           "-p", "no:cacheprovider", "--harness-pairs", "rmsnorm.aligned", "--harness-max-examples", "1",
           "--harness-seed", "1", "--harness-no-tracking", f"--harness-corpus={tmp}/corpus-{tag}",
           f"--harness-out={tmp}/out-{tag}"]
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} (PYTHONPATH={checkout}) exited {proc.returncode}:\n{proc.stdout[-2000:]}"
                 f"\n{proc.stderr[-2000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="HEAD~1", help="git revision to compare with (default HEAD~1)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    configs = [("no xdist", ""), ("-n 1", "1"), ("-n 2", "2")]
    with tempfile.TemporaryDirectory(prefix="harness-startup-") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            work = Path(tmp) / "work"
            work.mkdir()
            variants = [(f"{rev}", base), ("this checkout", ROOT)]
            walls: dict[tuple[str, str], list[float]] = {(v, c): [] for v, _ in variants for c, _ in configs}
            for r in range(args.rounds):
                for config, workers in configs:
                    for name, checkout in variants:
                        w = session(checkout, workers, str(work), f"{r}-{workers}-{len(walls[(name, config)])}"
                                    f"-{checkout.name}")
                        walls[(name, config)].append(w)
                        print(f"round {r + 1}: {config}, {name}: {w:.2f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    print(f"\nPYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}; median of {args.rounds} "
          "rounds, wall seconds of a one-example session (rmsnorm.aligned)\n")
    print(f"| session | {rev} | this checkout | ratio |")
    print("|---|---:|---:|---:|")
    for config, _ in configs:
        b = statistics.median(walls[(f"{rev}", config)])
        n = statistics.median(walls[("this checkout", config)])
        print(f"| `pytest --harness-fuzz {config}` | {b:.2f} | {n:.2f} | {b / n:.2f}x |")


if __name__ == "__main__":
    main()
