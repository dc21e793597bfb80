"""What realistic_init's draw of a sigmoid router's selection bias (`e_score_correction_bias`) does:

1. on the tiny DeepSeek-V3 config of `hf_archs.py` with 8 experts top-2 (no groups), the share of 4000
   unit-RMS inputs whose top-2 changes when a bias of std 0.03 / 0.1 / 0.3 is added to the router's
   sigmoid scores (what a rollout selecting without the bias gets wrong), and the scores' own spread;
2. the judged k3 of a rollout whose weight sync drops the bias (a patch zeroing the buffer) on the
   small DeepSeek-V3 test config of tests/hf/test_hf_backend.py, three cases.

    python reports/scripts/selection_bias.py
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1]), str(HERE.parents[1] / "tests" / "hf")]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_archs import CFGS
    from targets.hf.configs import make_config, realistic_init

    cfg = {**CFGS["deepseek_v3"], "n_group": 1, "topk_group": 1, "n_routed_experts": 8, "num_experts_per_tok": 2}
    model = realistic_init(AutoModelForCausalLM.from_config(make_config(cfg)), 0)
    router = next(m for m in model.modules() if hasattr(m, "e_score_correction_bias"))
    h = torch.randn(4000, cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    h = h / h.pow(2).mean(-1, keepdim=True).sqrt()
    with torch.no_grad():
        s = (h @ router.weight.T).sigmoid()
    print(f"sigmoid scores' spread over the experts (mean std per token): {float(s.std(-1).mean()):.3f}")
    base = s.topk(2, -1).indices.sort(-1).values
    for std in (0.03, 0.1, 0.3):
        b = std * torch.randn(s.shape[-1], generator=torch.Generator().manual_seed(1))
        moved = ((s + b).topk(2, -1).indices.sort(-1).values != base).any(-1).float().mean()
        print(f"bias std {std}: top-2 changes on {float(moved):.0%} of tokens")

    from harness.execute import run_case
    from targets.hf import FP32, HFModel, hf_pair, register_patch
    from test_hf_backend import rl_case, small_moe

    def drop_bias(m):
        for module in m.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.zero_()

    register_patch("script.drop_selection_bias", drop_bias)
    spec = HFModel.from_config({**small_moe("deepseek_v3"), "num_hidden_layers": 2}, init_seed=4)
    pair = hf_pair("script.dsv3.no_bias", spec, FP32, FP32.replace(patch="script.drop_selection_bias"),
                   expected="diverges")
    print("a sync dropping the bias, judged k3 on rl_case seeds 0-2:",
          ", ".join(f"{run_case(pair, rl_case(seed=seed)).score:.3g}" for seed in range(3)))


if __name__ == "__main__":
    main()
