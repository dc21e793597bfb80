"""A bf16 expert combine in a config-built MoE model, with and without router replay: how much of the
divergence `patched.bf16_combine` shows is the combine's own rounding, and how much the expert flips
that rounding causes in the next layer's router.

    python reports/scripts/combine_replay.py [CASES]

Runs the README's module-patch plugin (`tests/hf/plugin_patch.py`: Qwen3-MoE tiny config, the rollout's
experts weighted and summed in bf16) on CASES (default 40) uniform cases of the pair's axes (seed 0),
once as registered and once with `replay=True` (the trainer reuses the rollout's experts), and prints
the judged mean k3 (expected k3) and the flip rate of each.
"""
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from harness import REGISTRY
    from harness.execute import run_case
    from harness.strategies import uniform_cases
    from targets.hf import FP32, hf_pair

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    REGISTRY.load_plugin(str(ROOT / "tests" / "hf" / "plugin_patch.py"))
    plain = REGISTRY.get("patched.bf16_combine")
    replayed = hf_pair("patched.bf16_combine.replay", plain.profiles.model, FP32, FP32.replace(patch="bf16_combine"),
                       expected="diverges", replay=True)
    rng = random.Random(0)
    cases = [uniform_cases(plain.axes, rng, log_gap=True) for _ in range(n)]
    for pair in (plain, replayed):
        k3, flips = [], []
        for case in cases:
            d = run_case(pair, case).divergence
            k3.append(d.k3_expected)
            flips.append(d.flip_rate + d.tie_flip_rate)
        over = sum(v > 1e-3 for v in k3)
        print(f"{pair.name}: {n} cases, judged k3 median {statistics.median(k3):.2e}, max {max(k3):.2e}, "
              f"{over} over 1e-3; flip rate mean {statistics.mean(flips):.3f}", flush=True)


if __name__ == "__main__":
    main()
