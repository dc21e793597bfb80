"""Tiny random configs of seven MoE families through `hf_pairs`: output entropy of the aligned pair,
and the judged mean (expected k3 or exact KL; * = over the line) of its aligned and bf16-rollout pairs
on four RL cases (3 sequences, prompts 4/0/7, responses 9/5/12).

    OMP_NUM_THREADS=1 python reports/scripts/hf_archs.py

gpt-oss runs with `base=FP32.replace(attention="eager", packing="per_sequence")` (no sdpa; its packed
forward leaks across sequences); GraniteMoE twice: with Granite-3.0-like multipliers, and with them at 1.
"""
import os

V = 512
CFGS = {
 "mixtral": dict(model_type="mixtral", vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
 "olmoe": dict(model_type="olmoe", vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=1, bos_token_id=None, eos_token_id=0),
 "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
 "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=0, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False, rope_scaling=None),
 "deepseek_v2": dict(model_type="deepseek_v2", vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=0,
        max_position_embeddings=512, tie_word_embeddings=False),
 "gpt_oss": dict(model_type="gpt_oss", vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16, max_position_embeddings=512, tie_word_embeddings=False, layer_types=["sliding_attention","full_attention"]),
 "granitemoe": dict(model_type="granitemoe", vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False, embedding_multiplier=12.0, logits_scaling=4.0,
        residual_multiplier=0.22, attention_multiplier=0.0625),
}
CFGS["granitemoe_unit"] = dict(CFGS["granitemoe"], embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0, attention_multiplier=0.25)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from harness import Case
    from harness.execute import run_case
    from targets.hf import FP32, hf_pairs

    cases = [Case(seed=s, seq_lens=(9, 5, 12), prompt_lens=(4, 0, 7)) for s in range(4)]
    for arch, cfg in CFGS.items():
        base = FP32.replace(attention="eager", packing="per_sequence") if arch == "gpt_oss" else FP32
        pairs = {p.name.split(".", 2)[-1]: p for p in hf_pairs(f"u.{arch}", cfg, base=base)}
        cols = []
        for name in ("aligned", "bf16_rollout"):
            evs = [run_case(pairs[name], c) for c in cases]
            cols.append(f"{name}: " + " ".join(f"{e.score:.1e}{'*' if e.failed else ''}" if e.divergence is not None
                                               else e.symptom.value for e in evs))
        ent = run_case(pairs["aligned"], cases[0]).divergence.entropy
        print(f"{arch:16s} entropy {ent:.2f}  " + " | ".join(cols), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
