"""MoE expert-output aggregation: weight the top-k expert outputs and add them to the residual.

The real difference (the seeds' Qwen MoE case, k3 0.296): a trainer upcasts the bf16 expert
outputs and weights them, sums them and adds the residual in fp32; a rollout engine does the same
in bf16, rounding after each product and each addition. Expert selection is identical on both
sides (as with router replay): only the precision of combining the outputs differs.

Both paths see the same bf16-representable expert outputs and residual; the output is the new
residual stream (T, H), judged through the pair's readout.

Variants beyond the seeds' pair:
- `moe_aggregate.order`: both paths bf16; the trainer sums the k weighted outputs in expert-id
  order, the rollout in rank order (descending gate), as fused kernels do. With k = 2 the order
  cannot matter (a + b = b + a), so top-k is drawn from 3..8.
- `moe_aggregate.order_fp32`: the same reordering in fp32: under the threshold, `aligned`.
- `moe_aggregate.bf16_residual`: the expert sum in fp32 on both sides, but the rollout keeps its
  residual stream in bf16 (every add of RESIDUAL_LAYERS MoE layers rounds to bf16) while the
  trainer's stays fp32.
- `moe_aggregate.no_replay` / `moe_aggregate.replay`: a whole MoE combine on near-tie router logits.
  The rollout routes with bf16 scores and aggregates in bf16; the trainer routes in fp32 (its own
  selection, or the rollout's replayed) and aggregates in fp32. Replay removes the selection
  flips but not the aggregation precision, so both keep being caught: replay alone is not enough.
"""

from __future__ import annotations

import torch

from harness import Axes, Outcome, Readout, Routing, RoutingAxes, TargetPair, register

from ._common import ONE_SIDE

HIDDEN = 128


def build(case, device):
    t, k, e = case.n_tokens, case.top_k, case.n_experts
    x = case.token_randn(HIDDEN, "residual", device=device).bfloat16().float()  # (T, H)
    y = case.token_randn((k, HIDDEN), "expert_out", device=device).bfloat16().float()  # (T, k, H)
    logits = case.token_randn(e, "router", device=device)  # (T, E)
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
    logit_scale=(1.0, 64.0), dtypes=("bfloat16",),  # the bf16 combine sits near the line: peaked readouts show it
    pad_sides=ONE_SIDE,
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


# ---------------------------------------------------------------------------------------------
# Summation order, bf16 residual, router replay
# ---------------------------------------------------------------------------------------------
def build_ids(case, device):
    """`build`, plus the expert id of each of the k outputs (rank order: descending gate)."""
    inp = build(case, device)
    logits = case.token_randn(case.n_experts, "router", device=device)  # same stream as build
    inp["idx"] = torch.softmax(logits, -1).topk(case.top_k, -1).indices  # (T, k)
    return inp


def weighted_sum(g, y, order, dt):
    """sum_j g_j * y_j over the k slots in the given (T, k) order, rounding to dt after each step."""
    acc = None
    for j in range(order.shape[1]):
        sel = order[:, j]  # (T,) which slot is added at step j
        term = g.gather(1, sel[:, None]).to(dt) * y[torch.arange(y.shape[0]), sel].to(dt)  # (T, H)
        acc = term if acc is None else acc + term
    return acc


def rank_order(inp):
    return torch.arange(inp["g"].shape[1]).expand(inp["g"].shape[0], -1)  # (T, k) slots as ranked


def id_order(inp):
    return inp["idx"].argsort(-1)  # (T, k) slots sorted by expert id


def sum_id_order_low(inp):
    dt = inp["dtype"]
    return Outcome(hidden=inp["x"].to(dt) + weighted_sum(inp["g"], inp["y"], id_order(inp), dt))


def sum_rank_order_low(inp):
    dt = inp["dtype"]
    return Outcome(hidden=inp["x"].to(dt) + weighted_sum(inp["g"], inp["y"], rank_order(inp), dt))


def sum_id_order_fp32(inp):
    return Outcome(hidden=inp["x"] + weighted_sum(inp["g"], inp["y"], id_order(inp), torch.float32))


def sum_rank_order_fp32(inp):
    return Outcome(hidden=inp["x"] + weighted_sum(inp["g"], inp["y"], rank_order(inp), torch.float32))


RESIDUAL_LAYERS = 4  # MoE layers whose outputs accumulate into the residual stream


def residual_fp32(inp):
    moe = (inp["g"][..., None] * inp["y"]).sum(1)  # (T, H) fp32 weights, products and sum
    acc = inp["x"]
    for layer in range(RESIDUAL_LAYERS):  # each layer adds its output (here: the same one, rotated)
        acc = acc + moe.roll(layer, -1)
    return Outcome(hidden=acc)  # (T, H) fp32 residual stream


def residual_low(inp):
    moe = (inp["g"][..., None] * inp["y"]).sum(1)  # (T, H) fp32 expert sum, as in the trainer
    acc = inp["x"].to(inp["dtype"])
    for layer in range(RESIDUAL_LAYERS):
        acc = acc + moe.roll(layer, -1).to(inp["dtype"])  # the bf16 residual stream rounds every add
    return Outcome(hidden=acc)


def build_routed(case, device):
    """Near-tie router logits and the outputs of every expert (bf16-representable)."""
    from harness.strategies import near_tie_logits

    t, e = case.n_tokens, case.n_experts
    logits = near_tie_logits(case.token_randn(e, "router"), case).to(device)  # (T, E)
    x = case.token_randn(HIDDEN, "residual", device=device).bfloat16().float()  # (T, H)
    y_all = case.token_randn((e, HIDDEN), "expert_out", device=device).bfloat16().float()  # (T, E, H)
    return {"logits": logits, "x": x, "y_all": y_all, "k": case.top_k, "dtype": getattr(torch, case.dtype)}


def _combine(inp, idx, gate, dt):
    y = inp["y_all"][torch.arange(idx.shape[0])[:, None], idx]  # (T, k, H) chosen experts, rank order
    acc = inp["x"].to(dt)
    for j in range(idx.shape[1]):
        acc = acc + gate[:, j, None].to(dt) * y[:, j].to(dt)
    return acc  # (T, H)


def routed_low(inp):
    dt = inp["dtype"]
    scores = torch.softmax(inp["logits"].to(dt), -1)  # (T, E) bf16 router
    gate, idx = scores.topk(inp["k"], -1)
    gate = gate / gate.sum(-1, keepdim=True)
    return Outcome(hidden=_combine(inp, idx, gate, dt), routing={"router": Routing(experts=idx, scores=scores)})


def routed_fp32(inp):
    scores = torch.softmax(inp["logits"], -1)  # (T, E)
    gate, idx = scores.topk(inp["k"], -1)
    gate = gate / gate.sum(-1, keepdim=True)
    return Outcome(hidden=_combine(inp, idx, gate, torch.float32),
                   routing={"router": Routing(experts=idx, scores=scores)})


def routed_fp32_replay(inp, rollout_outcome):
    scores = torch.softmax(inp["logits"], -1)  # (T, E)
    idx = rollout_outcome.routing["router"].experts  # the rollout's selection, replayed
    gate = scores.gather(-1, idx)
    gate = gate / gate.sum(-1, keepdim=True)
    return Outcome(hidden=_combine(inp, idx, gate, torch.float32),
                   routing={"router": Routing(experts=idx, scores=scores)})


AXES_ORDER = Axes(
    n_seqs=(1, 4), seq_len=(1, 32),
    routing=RoutingAxes(n_experts=(8, 16), top_k=(3, 8), max_gap=0.0, tie_fraction=(0.0, 0.0)),
    logit_scale=(1.0, 64.0), dtypes=("bfloat16",), pad_sides=ONE_SIDE)
AXES_RESIDUAL = Axes(
    n_seqs=(1, 4), seq_len=(1, 32),
    routing=RoutingAxes(n_experts=(4, 16), top_k=(1, 8), max_gap=0.0, tie_fraction=(0.0, 0.0)),
    logit_scale=(1.0, 64.0), dtypes=("bfloat16",), pad_sides=ONE_SIDE)
AXES_ROUTED = Axes(
    n_seqs=(1, 4), seq_len=(1, 16),
    routing=RoutingAxes(n_experts=(4, 16), top_k=(1, 8), max_gap=1e-2, tie_fraction=(0.0, 1.0)),
    logit_scale=(1.0, 64.0), dtypes=("bfloat16",), pad_sides=ONE_SIDE)

register(TargetPair(
    name="moe_aggregate.order", kind="op", expected="diverges", build=build_ids,
    trainer=sum_id_order_low, rollout=sum_rank_order_low, axes=AXES_ORDER, readout=READOUT,
    description="bf16 weighted sum of k >= 3 experts in expert-id order (trainer) vs rank order (rollout)",
))
register(TargetPair(
    name="moe_aggregate.order_fp32", kind="op", expected="aligned", build=build_ids,
    trainer=sum_id_order_fp32, rollout=sum_rank_order_fp32, axes=AXES_ORDER, readout=READOUT,
    description="the same reordering in fp32: under the threshold",
))
register(TargetPair(
    name="moe_aggregate.bf16_residual", kind="op", expected="diverges", build=build,
    trainer=residual_fp32, rollout=residual_low, axes=AXES_RESIDUAL, readout=READOUT,
    description="fp32 expert sum added into a bf16 residual stream (rollout) vs an fp32 residual (trainer)",
))
register(TargetPair(
    name="moe_aggregate.no_replay", kind="op", expected="diverges", build=build_routed,
    trainer=routed_fp32, rollout=routed_low, axes=AXES_ROUTED, readout=READOUT,
    description="bf16 router + bf16 combine (rollout) vs fp32 router + fp32 combine (trainer): flips and precision",
))
register(TargetPair(
    name="moe_aggregate.replay", kind="op", expected="diverges", build=build_routed,
    trainer=routed_fp32_replay, rollout=routed_low, axes=AXES_ROUTED, readout=READOUT,
    description="router replay removes the flips, not the bf16 combine: still caught",
))
