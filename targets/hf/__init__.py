"""Hugging Face transformers backend (the optional `hf` extra): pairs for any causal LM.

Registers built-in pairs over three tiny configs (`configs.TINY`: a Qwen3-MoE-style, a
Mixtral-style and a dense Qwen3/Llama-style model) when transformers is installed. transformers
itself is imported only when a pair first runs a case, so `harness list` stays fast.

Public API for your own model (a checkpoint directory or a config): `hf_pairs`, `hf_pair`,
`HFModel`, `Numerics`, `FP32`, `BF16`, `register_patch` (your own modules in a path), `register_sampler`
(your engine's own temperature / top-k / top-p code),
`current_phase` / `current_sampling` (what a patch's forward is part of). See `backend.py` for what the paths do.
"""

from __future__ import annotations

import importlib.util

from .backend import BF16, FP32, HFModel, Numerics, Sampling, current_phase, current_sampling, register_patch, \
    register_sampler
from .pairs import default_axes, hf_pair, hf_pairs



def _available() -> bool:
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


AVAILABLE = _available()  # transformers importable (without importing it)

__all__ = ["AVAILABLE", "BF16", "FP32", "HFModel", "Numerics", "Sampling", "current_phase", "current_sampling",
           "default_axes", "hf_pair", "hf_pairs", "register_patch", "register_sampler"]
