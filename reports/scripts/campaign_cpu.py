"""CPU per case of an isolated campaign, split between the campaign process and its harness worker.

    OMP_NUM_THREADS=1 python reports/scripts/campaign_cpu.py attention.aligned 300 [--sync] [--hand-ahead]

Runs one warm-up campaign of the pair (`max_examples` as given, seed 0), then a timed one, and prints
wall time per case, this process's CPU per case (getrusage) and the worker's (/proc/<pid>/stat).
`--sync`: no cases handed ahead (what a campaign does without a spare core, as under 2 xdist workers
on 2 cores); `--hand-ahead`: cases handed ahead whatever the core count. Linux only.
"""
import os
import resource
import sys
import time


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from harness.fuzz import CampaignConfig, Executor, fuzz_pair, pair_seed
    from harness.pairs import REGISTRY

    name, n = sys.argv[1], int(sys.argv[2])
    pair = REGISTRY[name]
    cfg = CampaignConfig(pairs=[pair], seed=0, max_examples=n, write_corpus=False, isolation=True)
    ex = Executor(cfg)
    if "--sync" in sys.argv:
        ex.hand_ahead = False
    if "--hand-ahead" in sys.argv:
        ex.hand_ahead = True

    def run() -> int:
        return fuzz_pair(pair, cfg, pair_seed(0, pair.name), deadline=None, evaluate=ex.evaluator(pair, None)).examples

    def worker_cpu() -> float:
        fields = open(f"/proc/{ex.worker.proc.pid}/stat").read().split(")")[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    run()  # warm-up: imports, the worker's start
    w0, r0, t = worker_cpu(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    m = run()
    wall, r1, w1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF), worker_cpu()
    own = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    print(f"{name}: cases {m} wall/case {wall / m * 1e3:.3f} ms  campaign cpu/case {own / m * 1e3:.3f} ms  "
          f"worker cpu/case {(w1 - w0) / m * 1e3:.3f} ms")
    ex.close()


if __name__ == "__main__":  # (the worker processes import this file again)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
