"""`metrics.compare` of another checkout against this one, alternating in one process over the same cases.

    git worktree add /tmp/base <rev>
    OMP_NUM_THREADS=1 python reports/scripts/metrics_ab.py /tmp/base moe_aggregate.aligned attention.aligned

For each pair: the cases of a 100-example in-process campaign (seed 0, first 300), their outcomes
computed once, then `compare` of each version on all of them, 7 alternating rounds of process
time; prints the medians. (The other checkout's `harness/metrics.py` is loaded as its own module:
it imports nothing of the harness at module level.)
"""
import importlib.util
import os
import sys
import time


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from campaign_cases import campaign_cases
    from harness import metrics as new

    spec = importlib.util.spec_from_file_location("metrics_other", os.path.join(sys.argv[1], "harness", "metrics.py"))
    old = importlib.util.module_from_spec(spec)
    sys.modules["metrics_other"] = old
    spec.loader.exec_module(old)
    for name in sys.argv[2:]:
        pair, cfg, cases, outs = campaign_cases(name)
        times = {"other": [], "this": []}
        for _ in range(7):
            for tag, m in (("other", old), ("this", new)):
                t = time.process_time()
                for c, (tr, ro) in zip(cases, outs):
                    m.compare(tr, ro, c.seq_lens, None, case=c)
                times[tag].append((time.process_time() - t) / len(cases) * 1e3)
        o, n = sorted(times["other"])[3], sorted(times["this"])[3]
        print(f"{name}: compare other {o:.3f} this {n:.3f} ms/case (median of 7), ratio {n / o:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
