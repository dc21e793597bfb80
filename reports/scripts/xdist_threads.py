"""pytest-xdist workers with torch's default threads (one per core, in every worker) against each
worker's share of the cores (`fuzz.share_threads_among_campaigns`, the default since it exists).

    python reports/scripts/xdist_threads.py [ROUNDS]

Runs `pytest --harness-fuzz -n 2` on model.aligned and rmsnorm.* (20 examples, 2 streams, seed 1)
from an empty folder outside this repository, so that tests/conftest.py (which sets one thread for
the test suite) does not apply: `OMP_NUM_THREADS=<cores>` gives each worker torch's default, a thread
per core (what every worker had before); no variable gives each worker cores // 2. Alternating,
ROUNDS rounds (default 2); prints wall seconds and cases of each run.
"""
import json
import os
import subprocess
import sys
import tempfile
import time


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    cores = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    configs = [(f"torch default ({cores} threads per worker)", {"OMP_NUM_THREADS": str(cores)}),
               (f"share ({max(1, cores // 2)} per worker)", {})]
    walls: dict[str, list[tuple[float, int]]] = {name: [] for name, _ in configs}
    with tempfile.TemporaryDirectory(prefix="xdist-threads-") as tmp:
        for r in range(rounds):
            for name, extra in configs:
                out = f"{tmp}/out-{r}-{len(walls[name])}"
                cmd = [sys.executable, "-m", "pytest", "--harness-fuzz", "-n", "2", "-q", "-p", "no:cacheprovider",
                       "--harness-max-examples", "20", "--harness-seed", "1", "--harness-no-tracking",
                       "--harness-streams", "2", f"--harness-corpus={tmp}/corpus-{r}", f"--harness-out={out}",
                       "--harness-pairs", "model.aligned", "--harness-pairs", "rmsnorm.*"]
                t = time.perf_counter()
                subprocess.run(cmd, cwd=tmp, env={**env, **extra}, capture_output=True, text=True)
                wall = time.perf_counter() - t
                cases = json.loads(open(f"{out}/summary.json").read())["cases"]
                walls[name].append((wall, cases))
                print(f"round {r + 1}: {name}: {wall:.1f} s, {cases} cases", flush=True)
    for name, runs in walls.items():
        print(f"{name}: best {min(w for w, _ in runs):.1f} s over {len(runs)} run(s), {runs[0][1]} cases")


if __name__ == "__main__":
    main()
