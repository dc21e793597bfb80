"""The campaign engine's own cost per case: a pair's in-process campaign (seed 0, 100 examples) run once
to record every case's verdict, then again on the same cases with each evaluation replaced by its
recorded verdict, so the second run times Hypothesis's generation and targeting, the uniform draws
and the case bookkeeping alone (what the campaign process does while an isolated worker computes).

    OMP_NUM_THREADS=1 python reports/scripts/engine_only.py attention.aligned
"""
import sys
import time


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from harness.execute import run_case
    from harness.fuzz import CampaignConfig, fuzz_pair, pair_seed
    from harness.pairs import REGISTRY

    pair = REGISTRY[sys.argv[1]]
    cfg = CampaignConfig(pairs=[pair], seed=0, max_examples=100, write_corpus=False, isolation=False)
    recorded: list = []
    n = [0]

    def evaluate(case):
        i = n[0]
        n[0] += 1
        if i == len(recorded):  # the first run: evaluate and keep the verdict
            recorded.append(run_case(pair, case, cfg.device, cfg.threshold))
        ev = recorded[i]
        ev.case = case
        return ev

    fuzz_pair(pair, cfg, pair_seed(0, pair.name), deadline=None, evaluate=evaluate)
    for _ in range(3):
        n[0] = 0
        t = time.perf_counter()
        fuzz_pair(pair, cfg, pair_seed(0, pair.name), deadline=None, evaluate=evaluate)
        print(f"{pair.name}: {n[0]} cases, engine alone {(time.perf_counter() - t) / n[0] * 1e3:.3f} ms per case")


if __name__ == "__main__":
    main()
