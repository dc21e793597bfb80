"""Forced near ties against a rollout whose weights are 1e-3 off the trainer's (a weight sync one
optimizer step stale), with router replay: the expected k3 of each case with every token forced to
an exact tie, against the same case without forced ties, on the tiny Qwen3-MoE config.

    OMP_NUM_THREADS=1 python reports/scripts/forced_ties_stale.py [--seeds 12]

Prints the five cases with the largest forced/plain ratio. Before each path's tie nudge followed the
rollout's choice of expert pairs (`targets.hf.backend.follow_pairs`), seeds 4 and 5 at layer 0 read
0.0099 and 0.0154 forced against 1e-4 plain; `tests/hf/test_hf_backend.py` holds the ratio under 3.
"""
import argparse

import torch

from harness import Case
from harness.execute import run_case
from targets.hf import FP32, hf_pair, register_patch
from targets.hf.configs import TINY


def stale(model):
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * p.abs().mean() * torch.sign(torch.randn(p.shape, generator=g)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    register_patch("script_stale_step", stale)
    pair = hf_pair("script.stale.replay", TINY["qwen3_moe"], FP32, FP32.replace(patch="script_stale_step"),
                   replay=True)
    rows = []
    for s in range(args.seeds):
        for layer in (0, 1):
            case = Case(seed=s, seq_lens=(9, 5, 12), prompt_lens=(4, 0, 7), n_experts=8, top_k=2,
                        params={"tie_layer": layer})
            forced = run_case(pair, case.replace(tie_fraction=1.0, tie_gap=0.0)).divergence.k3_expected
            plain = run_case(pair, case).divergence.k3_expected
            rows.append((forced / plain, s, layer, forced, plain))
    rows.sort(reverse=True)
    for r in rows[:5]:
        print("forced/plain %.3g  seed %d layer %d  forced %.3g  plain %.3g" % r)


if __name__ == "__main__":
    main()
