"""How far over the line a campaign's shrunk repro sits: Hypothesis-only campaigns (no uniform cases)
of four op families, seeds 1-2, 80 examples, in-process; per finding its judged value as a multiple
of the threshold, the cases run after the first sighting, the minimal case and its logit scale.

    OMP_NUM_THREADS=1 python reports/scripts/shrink_margin.py
"""
import os


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from harness.fuzz import CampaignConfig, run_campaign
    from harness.pairs import REGISTRY
    from harness.tracking import NullTracker

    for name in ("lm_head.bf16", "moe_aggregate.bf16", "rmsnorm.eps_placement", "rotary.bf16_angles"):
        for seed in (1, 2):
            cfg = CampaignConfig(pairs=[REGISTRY.get(name)], seed=seed, max_examples=80, write_corpus=False,
                                 isolation=False, uniform_per_example=0)
            r = run_campaign(cfg, NullTracker(), log=lambda m: None).results[0]
            for f in r.findings:
                print(f"{name} seed {seed}: {f.evaluation.score / cfg.threshold:.4f}x the line, "
                      f"{f.examples - f.cases_to_first} cases after the first sighting, {f.case.size_text()}, "
                      f"logit scale {f.case.logit_scale:.4g}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
