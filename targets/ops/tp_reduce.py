"""Simulated tensor-parallel reductions: a row-parallel linear all-reduced in different orders.

A row-parallel projection (attention output, MLP down) splits the reduction dimension over `shards`
ranks; each computes a partial product and the partials are all-reduced. Trainers and rollout
engines run with different parallel layouts and collectives, so the same output is summed in
different orders and precisions. Simulated on one device, exactly as the collectives order it:

- ring (NCCL ring all-reduce): the output is cut into `shards` chunks; chunk c is accumulated
  starting at rank c+1 and going round the ring, rounding to the partials' dtype at every hop.
- tree: pairwise, ((p0 + p1) + (p2 + p3)) ..., rounding at every level.
- dense: one product over the whole reduction dimension (no tensor parallelism).

Pairs (the shard count is the case parameter `shards`):
- `tp_reduce.aligned`: dense fp32 on both sides.
- `tp_reduce.ring_fp32`: fp32 partials, ring all-reduce vs dense: reordered, under threshold.
- `tp_reduce.ring_bf16`: bf16 partials all-reduced in bf16 in ring order (a TP rollout whose
  collective runs in the model dtype) vs one dense bf16 product with fp32 accumulation (trainer).
- `tp_reduce.ring_vs_tree_bf16`: bf16 partials reduced in ring order vs tree order: same layout,
  only the collective's algorithm differs.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from harness import Axes, Outcome, Readout, TargetPair, register

from ._common import ONE_SIDE, low_dtype

K_IN = 128  # reduction dimension, split over the shards
N_OUT = 32  # output features


def build(case, device):
    t = case.n_tokens
    x = case.token_randn(K_IN, "x", device=device)  # (T, K)
    w = case.randn((K_IN, N_OUT), "w", device=device) / K_IN**0.5  # (K, N)
    return {"x": x, "w": w, "shards": int(case.params.get("shards", 2)), "dtype": low_dtype(case)}


def partials(inp, dtype):
    """Per rank, its partial product (T, N) in `dtype` (fp32 accumulation inside, one rounding)."""
    xs, ws = inp["x"].chunk(inp["shards"], -1), inp["w"].chunk(inp["shards"], 0)
    return [xc.to(dtype) @ wc.to(dtype) for xc, wc in zip(xs, ws)]


def ring(parts):
    s = len(parts)
    cols = torch.arange(parts[0].shape[-1]).chunk(s)  # output chunk c: the columns reduced together
    out = torch.empty_like(parts[0])
    for c, cc in enumerate(cols):
        ranks = [(c + 1 + i) % s for i in range(s)]  # the ring order this chunk travels in
        acc = parts[ranks[0]][:, cc]
        for r in ranks[1:]:
            acc = acc + parts[r][:, cc]  # rounds to the partials' dtype at every hop
        out[:, cc] = acc
    return out  # (T, N)


def tree(parts):
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]  # (T, N)


# --- paths ----------------------------------------------------------------------------------------
def dense_fp32(inp):
    return Outcome(hidden=inp["x"] @ inp["w"])  # (T, N)


def dense_low(inp):
    return Outcome(hidden=inp["x"].to(inp["dtype"]) @ inp["w"].to(inp["dtype"]))  # (T, N)


def ring_fp32(inp):
    return Outcome(hidden=ring(partials(inp, torch.float32)))


def ring_low(inp):
    return Outcome(hidden=ring(partials(inp, inp["dtype"])))


def tree_low(inp):
    return Outcome(hidden=tree(partials(inp, inp["dtype"])))


# --- pairs ----------------------------------------------------------------------------------------
SHARDS = st.sampled_from([2, 4, 8])  # tensor-parallel ranks (2 = simplest)
AXES = Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 64.0), params={"shards": SHARDS}, pad_sides=ONE_SIDE)
READOUT = Readout(vocab=256)

register(TargetPair(
    name="tp_reduce.aligned", kind="op", expected="aligned", build=build, trainer=dense_fp32,
    rollout=dense_fp32, axes=AXES, readout=READOUT,
    description="one dense fp32 product on both sides: exactly equal",
))
register(TargetPair(
    name="tp_reduce.ring_fp32", kind="op", expected="aligned", build=build, trainer=dense_fp32,
    rollout=ring_fp32, axes=AXES, readout=READOUT,
    description="fp32 partials all-reduced in ring order vs one dense product: reordered, under threshold",
))
register(TargetPair(
    name="tp_reduce.ring_bf16", kind="op", expected="diverges", build=build, trainer=dense_low,
    rollout=ring_low, axes=AXES, readout=READOUT,
    description="bf16 partials all-reduced in bf16, ring order (TP rollout) vs one dense bf16 product (trainer)",
))
register(TargetPair(
    name="tp_reduce.ring_vs_tree_bf16", kind="op", expected="diverges", build=build, trainer=tree_low,
    rollout=ring_low, axes=AXES, readout=READOUT,
    description="bf16 partials reduced in ring order (rollout) vs tree order (trainer): the collective's algorithm",
))
