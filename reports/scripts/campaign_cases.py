"""The cases a benchmark script times: those of a 100-example in-process campaign of the pair (seed
0), the first 300, with both paths' outcomes computed once (`judge_time.py`, `metrics_ab.py`)."""


def campaign_cases(name: str, n: int = 300) -> tuple:
    """(pair, its campaign config, the cases, their (trainer, rollout) outcomes)."""
    from harness.execute import run_case, run_paths
    from harness.fuzz import CampaignConfig, fuzz_pair, pair_seed
    from harness.pairs import REGISTRY

    pair = REGISTRY[name]
    cfg = CampaignConfig(pairs=[pair], seed=0, max_examples=100, write_corpus=False, isolation=False)
    seen = []

    def evaluate(c):
        seen.append(c)
        return run_case(pair, c, cfg.device, cfg.threshold)

    fuzz_pair(pair, cfg, pair_seed(0, pair.name), deadline=None, evaluate=evaluate)
    cases = seen[:n]
    return pair, cfg, cases, [run_paths(pair, c, cfg.device) for c in cases]
