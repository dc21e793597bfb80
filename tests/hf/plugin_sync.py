"""A weight sync, trainer -> rollout engine, as a module patch: harness fuzz 'sync.*' --plugin this_file.py

The trainer runs the model's own weights. The rollout runs them after the sync: `to_engine` converts
the trainer's state dict to an engine's layout (q, k, v fused into one qkv matrix), `load_engine`
splits it back into the engine's modules. `sync.aligned` is the correct round trip; each other pair
plants one bug of such a conversion.
"""
import os

import torch

from harness import register
from targets.hf import FP32, hf_pair, register_patch
from targets.hf.configs import TINY

MODEL = os.environ.get("MY_CHECKPOINT") or TINY["qwen3_moe"]  # a save_pretrained() folder, or a config


def to_engine(sd: dict, cfg, bug: str | None = None) -> dict:
    """The trainer's state dict in the engine's layout (what would be sent to it)."""
    eng = {k: v.detach().clone() for k, v in sd.items()}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        q, k, v = eng.pop(p + "q_proj.weight"), eng.pop(p + "k_proj.weight"), eng.pop(p + "v_proj.weight")
        eng[p + "qkv_proj.weight"] = torch.cat([q, v, k] if bug == "kv_swap" and i == 1 else [q, k, v])
        if bug == "router_bf16":
            eng[f"model.layers.{i}.mlp.gate.weight"] = eng[f"model.layers.{i}.mlp.gate.weight"].bfloat16().float()
    return eng


def load_engine(model: torch.nn.Module, eng: dict, bug: str | None = None) -> None:
    """The engine's loader: split qkv back, load."""
    cfg = model.config
    nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sd = {}
    for key, w in eng.items():
        if key.endswith("qkv_proj.weight"):
            base = key[: -len("qkv_proj.weight")]
            sd[base + "q_proj.weight"], sd[base + "k_proj.weight"], sd[base + "v_proj.weight"] = w.split([nq, nkv, nkv])
        else:
            sd[key] = w
    if bug == "stale_expert":  # expert 5 of layer 0 not copied: left at the engine's own init
        g = torch.Generator().manual_seed(7)
        for name in ("gate_up_proj", "down_proj"):
            w = sd[f"model.layers.0.mlp.experts.{name}"].clone()
            w[5] = torch.randn(w[5].shape, generator=g) * w[5].std()
            sd[f"model.layers.0.mlp.experts.{name}"] = w
    model.load_state_dict(sd, strict=False)


def sync(bug: str | None):
    def patch(model: torch.nn.Module) -> None:
        load_engine(model, to_engine(model.state_dict(), model.config, bug), bug)
    return patch


BUGS = ("kv_swap", "stale_expert", "router_bf16")
register_patch("sync", sync(None))
register(hf_pair("sync.aligned", MODEL, FP32, FP32.replace(patch="sync"), expected="aligned"))
for bug in BUGS:
    register_patch(f"sync_{bug}", sync(bug))
    register(hf_pair(f"sync.{bug}", MODEL, FP32, FP32.replace(patch=f"sync_{bug}"), expected="diverges"))
