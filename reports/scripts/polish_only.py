"""Shrinking a finding with Hypothesis's shrinker then the polish pass (the default for pairs whose
cases take under `CampaignConfig.slow_case_seconds`) against the polish pass alone (what a slower
pair gets), on the same campaigns: cases run after the first sighting, and the minimal case.

    OMP_NUM_THREADS=1 python reports/scripts/polish_only.py model.bf16_rollout model.moe_aggregate_bf16

In-process campaigns (seeds 1-3, 60 examples), no corpus written.
"""
import os
import sys


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.pairs import REGISTRY
    from harness.tracking import NullTracker

    print("| pair | seed | shrink | cases to first | cases after | shrink s | minimal case |")
    print("|---|---:|---|---:|---:|---:|---|")
    for name in sys.argv[1:]:
        for seed in (1, 2, 3):
            for label, slow in (("Hypothesis + polish", 1e9), ("polish only", 0.0)):
                cfg = CampaignConfig(pairs=[REGISTRY.get(name)], seed=seed, max_examples=60, write_corpus=False,
                                     isolation=False, slow_case_seconds=slow)
                r = run_campaign(cfg, NullTracker(), log=lambda m: None).results[0]
                for f in r.findings:
                    print(f"| {name} | {seed} | {label} | {f.cases_to_first} | {f.examples - f.cases_to_first} | "
                          f"{f.shrink_seconds:.1f} | {f.case.size_text()}; {f.evaluation.headline} |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
