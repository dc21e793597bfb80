"""MoE expert-output aggregation: weight the top-k expert outputs and add them to the residual.

The real difference (the seeds' Qwen MoE case, k3 0.296): a trainer upcasts the bf16 expert
outputs and weights them, sums them and adds the residual in fp32; a rollout engine does the same
in bf16, rounding after each product and each addition. Expert selection is identical on both
sides (as with router replay): only the precision of combining the outputs differs.

Both paths see the same bf16-representable expert outputs and residual; the output is the new
residual stream (T, H), judged through the pair's readout.
"""

from __future__ import annotations

import torch

from harness import Axes, Outcome, Readout, RoutingAxes, TargetPair, register

HIDDEN = 128


def build(case, device):
    t, k, e = case.n_tokens, case.top_k, case.n_experts
    x = case.randn((t, HIDDEN), "residual", device=device).bfloat16().float()  # (T, H)
    y = case.randn((t, k, HIDDEN), "expert_out", device=device).bfloat16().float()  # (T, k, H)
    logits = case.randn((t, e), "router", device=device)  # (T, E)
    g = torch.softmax(logits, -1).topk(k, -1).values  # (T, k)
    g = g / g.sum(-1, keepdim=True)  # renormalised top-k weights
    return {"x": x, "y": y, "g": g, "dtype": getattr(torch, case.dtype)}


def aggregate_fp32(inp):
    x, y, g = inp["x"], inp["y"], inp["g"]
    return Outcome(hidden=x + (g[..., None] * y).sum(1))  # (T, H) fp32 weights, products, sum


def aggregate_low(inp):
    dt = inp["dtype"]
    acc = inp["x"].to(dt)  # (T, H) residual in bf16
    for j in range(inp["y"].shape[1]):  # expert-id order, rounding after each product and add
        acc = acc + inp["g"][:, j, None].to(dt) * inp["y"][:, j].to(dt)
    return Outcome(hidden=acc)


AXES = Axes(
    n_seqs=(1, 4), seq_len=(1, 32),
    routing=RoutingAxes(n_experts=(4, 16), top_k=(1, 8), max_gap=0.0, tie_fraction=(0.0, 0.0)),
    logit_scale=(1.0, 16.0), dtypes=("bfloat16",),
)
READOUT = Readout(vocab=512)

register(TargetPair(
    name="moe_aggregate.bf16", kind="op", expected="diverges", build=build,
    trainer=aggregate_fp32, rollout=aggregate_low, axes=AXES, readout=READOUT,
    description="expert outputs weighted, summed and added to the residual in fp32 (trainer) vs bf16 (rollout)",
))
register(TargetPair(
    name="moe_aggregate.aligned", kind="op", expected="aligned", build=build,
    trainer=aggregate_fp32, rollout=aggregate_fp32, axes=AXES, readout=READOUT,
    description="both paths aggregate expert outputs in fp32: must stay exactly equal",
))
