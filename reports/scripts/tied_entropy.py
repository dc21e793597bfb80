"""Output entropy of config-built (realistic init) Hugging Face models, untied and tied LM heads.

    python reports/scripts/tied_entropy.py [--seeds N]

For each config (a 2-layer Llama, Gemma 2 with eager attention, the tiny Qwen3-MoE, a 4-layer
Llama of hidden 256 and vocabulary 2048), built with `HFModel.from_config` with
`tie_word_embeddings` False and True: the mean rollout entropy (nats) of the aligned pair over N
cases (default 3) of 3 sequences (prompts 8, 4 and 16 tokens; responses 24, 16 and 32 tokens, sampled
by the model), and the mean judged k3 of its bf16 rollout pair (`hf_pairs(...).bf16_rollout`) over
the same cases. Public API only, so it runs against any revision (PYTHONPATH=a checkout).
"""
import argparse
import math
import warnings

from harness import Case
from harness.execute import run_case
from targets.hf import FP32, HFModel, hf_pairs
from targets.hf.configs import TINY

CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rope_theta=10000.0, rms_norm_eps=1e-6),
    "gemma2": dict(model_type="gemma2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
    "qwen3_moe": dict(TINY["qwen3_moe"]),
    "llama_h256": dict(model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    base = FP32.replace(attention="eager")  # (Gemma 2 has no sdpa; the same for all, for comparison)
    print(f"{'config':12s} {'tied':5s} {'entropy':>8s} {'log V':>6s} {'bf16 mean judged':>17s}")
    for name, cfg in CONFIGS.items():
        for tied in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pairs = {p.name.split(".", 3)[-1]: p for p in
                         hf_pairs(f"t.{name}.{int(tied)}", HFModel.from_config({**cfg, "tie_word_embeddings": tied}),
                                  base=base)}
            ents, scores = [], []
            for s in range(args.seeds):
                case = Case(seed=s, seq_lens=(24, 16, 32), prompt_lens=(8, 4, 16))
                ev = run_case(pairs["aligned"], case)
                ents.append(ev.divergence.entropy)
                scores.append(run_case(pairs["bf16_rollout"], case).score)
            print(f"{name:12s} {str(tied):5s} {sum(ents) / len(ents):8.3f} {math.log(cfg['vocab_size']):6.2f} "
                  f"{sum(scores) / len(scores):17.3g}", flush=True)


if __name__ == "__main__":
    main()
