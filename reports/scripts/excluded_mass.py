"""How often aligned pairs put rollout mass on tokens the trainer excludes (`kl_excluded` > 0).

    OMP_NUM_THREADS=1 python reports/scripts/excluded_mass.py 300 'lm_head.aligned' 'model.aligned'

One in-process campaign per matching aligned CPU pair (seed 3, the given max_examples); prints its
cases, how many truncate (top-p < 1 or a sampling top-k), how many had excluded mass and the largest
mean excluded mass, with the first three such cases (mass, temperature, top-p, top-k, tokens).
"""
import os
import sys


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from harness.execute import run_case
    from harness.fuzz import CampaignConfig, fuzz_pair, pair_seed
    from harness.pairs import REGISTRY

    n = int(sys.argv[1])
    for pair in REGISTRY.select(tuple(sys.argv[2:])):
        if "cpu" not in pair.devices or pair.expected != "aligned":
            continue
        cfg = CampaignConfig(pairs=[pair], seed=3, max_examples=n, write_corpus=False, isolation=False)
        seen = []

        def evaluate(c):
            e = run_case(pair, c, cfg.device, cfg.threshold)
            if e.divergence is not None:
                seen.append((e.divergence.kl_excluded, c.temperature, c.top_p, c.sample_top_k, c.n_tokens))
            return e

        fuzz_pair(pair, cfg, pair_seed(3, pair.name), deadline=None, evaluate=evaluate)
        trunc = sum(1 for x in seen if x[2] < 1 or x[3] > 0)
        nz = [x for x in seen if x[0] > 0]
        print(f"{pair.name:40s} cases {len(seen):5d} truncating {trunc:5d} excluded>0 {len(nz):4d} "
              f"max {max([x[0] for x in seen] or [0]):.3g}", nz[:3], flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
