"""torch.compile as the rollout engine of the small MoE decoder: `model.compiled`.

The rollout runs the same decoder through `torch.compile` (Inductor, dynamic shapes); the trainer
is the eager torch model, packed and teacher-forced, both in float32. Inductor fuses the norms,
rotary, softmax and the MoE weighting into generated kernels whose reduction order can differ from
eager's, so this pair measures what a compiled rollout engine costs in k3.

The weights are arguments of the compiled function (`torch.func.functional_call` on one template
module per config), so the graph is compiled once per (config, profile, shape specialisation) in a
process, never per case: dynamic shapes cover batch, sequence and cache lengths, and Inductor
specialises the sizes 0 and 1 (prefill without a cache, one decode token, one sequence), so a
handful of compilations serve every case. The first case of a process pays them (seconds).
"""

from __future__ import annotations

import dataclasses

import functools
from typing import Any, Callable

import torch

from harness import register
from targets.models import pairs as model_pairs
from targets.models.moe_decoder import FP32, ModelConfig, MoEDecoder, Numerics, model


@functools.lru_cache(maxsize=None)
def compiled(cfg: ModelConfig, nx: Numerics, device: str) -> Callable:
    """One compiled forward per (config, profile, device): weights are its first argument."""
    template = MoEDecoder(cfg).to(device).eval()

    def forward(params: dict, ids, pos, mask, past_k, past_v, tie, forced, gap, scale, replay, replay_on):
        return torch.func.functional_call(template, params, (ids, pos, mask, past_k, past_v, tie, forced, gap,
                                                             scale, replay, replay_on), {"nx": nx})

    return torch.compile(forward, dynamic=True)


def _pad(t: torch.Tensor, dim: int, to: int, value: Any = 0) -> torch.Tensor:
    if t.shape[dim] >= to:
        return t
    shape = list(t.shape)
    shape[dim] = to - t.shape[dim]
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim)


def compiled_forward(inp: Any, nx: Numerics) -> Callable:
    """The compiled forward, called with batch, new-token and cache sizes padded to at least 2 (as
    engines pad batches for CUDA graphs): one dynamic graph then serves every call, with no
    recompilation for the sizes 0 and 1 that Inductor specialises. Padding slots are masked out
    and their outputs dropped."""
    fn = compiled(inp.cfg, nx, inp.device)
    params = dict(model(inp.cfg, inp.weight_seed, inp.device).named_parameters())

    def forward(ids, pos, mask, past_k, past_v, tie, forced, gap, scale, replay, replay_on, nx=None, rows=None):
        b, s, p = ids.shape[0], ids.shape[1], past_k.shape[3]
        pp = max(p, 2)
        if pp > p:  # dummy cache slots in front, masked out
            extra = torch.zeros(*past_k.shape[:3], pp - p, past_k.shape[4], dtype=past_k.dtype, device=past_k.device)
            past_k, past_v = torch.cat([extra, past_k], 3), torch.cat([extra, past_v], 3)
            mask = torch.cat([torch.zeros(*mask.shape[:3], pp - p, dtype=torch.bool, device=mask.device), mask], 3)
        ss, bb = max(s, 2), max(b, 2)
        if ss > s:  # dummy new tokens after the real ones; each attends to itself only
            ids, pos, forced = _pad(ids, 1, ss), _pad(pos, 1, ss), _pad(forced, 1, ss, False)
            replay, replay_on = _pad(replay, 2, ss), _pad(replay_on, 1, ss, False)
            mask = _pad(_pad(mask, 2, ss, False), 3, pp + ss, False)
            for j in range(s, ss):
                mask[:, :, j, pp + j] = True
        if bb > b:  # dummy sequences
            ids, pos, forced, replay_on = (_pad(ids, 0, bb), _pad(pos, 0, bb), _pad(forced, 0, bb, False),
                                           _pad(replay_on, 0, bb, False))
            mask = _pad(mask, 0, bb, True)
            past_k, past_v, replay = _pad(past_k, 1, bb), _pad(past_v, 1, bb), _pad(replay, 1, bb)
        logp, k_new, v_new, experts, scores = fn(params, ids, pos, mask, past_k, past_v, tie, forced, gap, scale,
                                                 replay, replay_on)
        return (logp[:b, :s], k_new[:, :b, :, :s], v_new[:, :b, :, :s], experts[:, :b, :s], scores[:, :b, :s])

    return forward


register(dataclasses.replace(model_pairs.model_pair(
    "model.compiled", "aligned", FP32, FP32, rollout_forward=compiled_forward,
    description="float32 eager torch trainer vs the same model under torch.compile (Inductor) as the rollout",
), timeout=600.0))  # a cold Inductor compile of a new shape class takes minutes on a 2-core CPU: not a hang
