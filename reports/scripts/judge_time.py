"""Time of the metrics step (`execute.judge`) against the pair's own calls, on a campaign's cases.

    OMP_NUM_THREADS=1 python reports/scripts/judge_time.py attention.aligned

Draws the cases of a 100-example in-process campaign (seed 0), then times, per case over the first
300: `judge` on outcomes computed once, `run_paths` (build, both paths, readout) and the bare calls
(`bench.bare_calls`), three times each.
"""
import os
import sys
import time


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from campaign_cases import campaign_cases
    from harness.bench import bare_calls
    from harness.execute import judge, run_paths

    pair, cfg, cases, outs = campaign_cases(sys.argv[1])

    def per_case(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) / len(cases) * 1e3

    for _ in range(3):
        j = per_case(lambda: [judge(pair, c, tr, ro, cfg.threshold) for c, (tr, ro) in zip(cases, outs)])
        p = per_case(lambda: [run_paths(pair, c, cfg.device) for c in cases])
        b = per_case(lambda: bare_calls(pair, cases))
        print(f"judge {j:.3f} ms  paths {p:.3f} ms  bare {b:.3f} ms  ({len(cases)} cases)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
