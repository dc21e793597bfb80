"""The built-in HF pairs (registered only when transformers is installed).

Per tiny config (`configs.TINY`, realistic init):

- `hf.<model>.aligned`: float32 both sides (packed teacher-forced trainer vs KV-cache decode).
- `hf.<model>.bf16_rollout`: float32 trainer vs a bf16 engine (weights, activations, router (MoE models), LM head).
- `hf.<model>.bf16_rollout.replay` (MoE): the same with router replay.
- `hf.<model>.eager_vs_sdpa`: eager attention (trainer) vs sdpa (rollout), float32.
- `hf.<model>.packed_cache_trap`: the trainer's packed forward leaves `use_cache` at its default,
  so transformers keeps a plain causal mask and packed sequences attend to each other.
- `hf.recorded` / `hf.recorded.replay`: what `harness score --model PATH` scores recorded samples
  with (the checkpoint and the recording travel in the case, so its repros replay as they are).
"""

from __future__ import annotations

from harness import register

from . import AVAILABLE
from .backend import FP32, HFModel
from .configs import TINY
from .pairs import hf_pair, hf_pairs, recorded_pair

MODELS = {name: HFModel.from_config(fields) for name, fields in TINY.items()}


def builtin_pairs() -> list:
    out = []
    for name, spec in MODELS.items():
        prefix = f"hf.{name}"
        out += hf_pairs(prefix, spec)
        out.append(hf_pair(f"{prefix}.packed_cache_trap", spec, FP32.replace(use_cache="default"), FP32,
                           expected="diverges",
                           description="packed trainer forward without use_cache=False: transformers keeps a "
                                       "plain causal mask, so packed sequences attend to each other"))
    fallback = MODELS["qwen3_moe"]
    out += [recorded_pair("hf.recorded", fallback), recorded_pair("hf.recorded.replay", fallback, replay=True)]
    return out


if AVAILABLE:
    for _pair in builtin_pairs():
        register(_pair)
