"""Your own MoE kernel in a real model's rollout: harness fuzz 'patched.*' --plugin this_file.py

A module patch swaps modules of your own into one path's copy of the model (here the experts of
every MoE layer); the other path keeps the model's own. Two engines' experts kernels:
`bf16_combine` weights and sums the expert outputs in bf16 (the precision gap of a fused kernel),
`reference` is the same arithmetic as transformers' eager experts, in the model's dtype.
"""
import os

import torch

from harness import register
from targets.hf import FP32, hf_pair, register_patch
from targets.hf.configs import TINY

MODEL = os.environ.get("MY_CHECKPOINT") or TINY["qwen3_moe"]  # a save_pretrained() folder, or a config


class EngineExperts(torch.nn.Module):
    """Experts with transformers' weights (gate_up_proj (E, 2I, H), down_proj (E, H, I)); expert
    outputs are weighted and summed in `combine` (None: the input's dtype)."""

    def __init__(self, experts: torch.nn.Module, combine: torch.dtype | None) -> None:
        super().__init__()
        self.inner, self.combine = experts, combine

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        e, dt = self.inner, self.combine or hidden.dtype
        out = torch.zeros(hidden.shape, dtype=dt, device=hidden.device)  # (T, H)
        for x in top_k_index.unique().tolist():
            tok, rank = torch.where(top_k_index == x)
            gate, up = torch.nn.functional.linear(hidden[tok], e.gate_up_proj[x]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(e.act_fn(gate) * up, e.down_proj[x])  # (n, H)
            out.index_add_(0, tok, (y * top_k_weights[tok, rank, None]).to(dt))
        return out.to(hidden.dtype)


def swap_experts(model: torch.nn.Module, combine: torch.dtype | None) -> None:
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = EngineExperts(layer.mlp.experts, combine)


register_patch("bf16_combine", lambda model: swap_experts(model, torch.bfloat16))
register_patch("reference", lambda model: swap_experts(model, None))

register(hf_pair("patched.bf16_combine", MODEL, FP32, FP32.replace(patch="bf16_combine"), expected="diverges"))
register(hf_pair("patched.reference", MODEL, FP32, FP32.replace(patch="reference"), expected="aligned"))
