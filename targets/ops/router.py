"""MoE router: how scores become a top-k selection and gate weights.

The op is one MoE layer on given router logits (T, E): pick k experts per token, weight their
outputs, add to the residual (`out = x + sum_j g_j * E_j(x)`; the residual makes a change in the
gates' total visible through the readout). Expert outputs are exact fp32 on both sides, so only
the router differs. Logits come from `harness.strategies.near_tie_logits`: a `tie_fraction` of the
tokens have their k-th and (k+1)-th expert `tie_gap` apart. (`router_topk` is the same question
with the near-tie built into the hidden states before the router GEMM.)

- `router.aligned`: softmax -> top-k -> renormalise, fp32, both sides.
- `router.bf16_scores`: the rollout's softmax scores in bf16 (a bf16 router), the trainer's in fp32:
  gaps below bf16 rounding become exact ties or reverse, and experts flip.
- `router.topk_softmax`: softmax -> top-k -> renormalise (Qwen-MoE with norm_topk_prob) vs top-k of
  the logits -> softmax over the k (Mixtral). The gates are equal in exact arithmetic, but the
  selection is not: fp32 softmax rounding merges logit gaps below ~1e-7 relative into ties (or
  reverses them), so near-tie tokens pick other experts. Found by the fuzzer while this pair was
  declared aligned; minimal: one token at a gap of a few 1e-8.
- `router.no_renorm`: softmax -> top-k without renormalising (norm_topk_prob=False) vs top-k ->
  softmax: the gates differ by the top-k mass, so the layer's output scale differs.
- `router.tie_break`: on exact ties torch.topk keeps the lower expert id; the rollout's kernel keeps
  the higher one (seen between torch and ONNX Runtime). Minimal: one token at an exact tie.
- `router.replay`: bf16 router in the rollout; the trainer reuses its selection (router replay)
  and recomputes the gates in fp32: selection flips are gone, the gate precision is not (k3 > 0 on
  near-tie cases, under the threshold): `aligned`.
"""

from __future__ import annotations

import torch

from harness import Axes, Outcome, Readout, Routing, RoutingAxes, TargetPair, register
from harness.strategies import near_tie_logits

from ._common import ONE_SIDE, low_dtype

HIDDEN = 32


def build(case, device):
    t, e = case.n_tokens, case.n_experts
    logits = near_tie_logits(case.token_randn(e, "router"), case).to(device)  # (T, E)
    x = case.token_randn(HIDDEN, "hidden", device=device)  # (T, H)
    w_experts = case.randn((e, HIDDEN, HIDDEN), "experts", device=device) / HIDDEN**0.5  # (E, H, H)
    return {"logits": logits, "x": x, "w_experts": w_experts, "k": case.top_k, "dtype": low_dtype(case)}


def moe(inp, idx, gate, scores):
    y = torch.einsum("th,tkhd->tkd", inp["x"], inp["w_experts"][idx])  # (T, k, H) expert outputs, fp32
    out = inp["x"] + (gate.float()[..., None] * y).sum(1)  # (T, H)
    return Outcome(hidden=out, routing={"router": Routing(experts=idx, scores=scores)})


# --- routers --------------------------------------------------------------------------------------
def softmax_topk(scores, k, renorm=True):
    gate, idx = scores.topk(k, -1)  # (T, k); torch keeps the lower id on exact ties
    return idx, gate / gate.sum(-1, keepdim=True) if renorm else gate


def softmax_topk_fp32(inp):
    scores = torch.softmax(inp["logits"], -1)  # (T, E)
    return moe(inp, *softmax_topk(scores, inp["k"]), scores)


def softmax_topk_no_renorm(inp):
    scores = torch.softmax(inp["logits"], -1)  # (T, E)
    return moe(inp, *softmax_topk(scores, inp["k"], renorm=False), scores)


def topk_softmax(inp):
    top, idx = inp["logits"].topk(inp["k"], -1)  # (T, k) top-k of the logits
    return moe(inp, idx, torch.softmax(top, -1), inp["logits"])


def softmax_topk_low(inp):
    scores = torch.softmax(inp["logits"].to(inp["dtype"]), -1)  # (T, E) bf16 scores
    idx, gate = softmax_topk(scores, inp["k"])
    return moe(inp, idx, gate, scores)


def softmax_topk_high_id_ties(inp):
    scores = torch.softmax(inp["logits"], -1)  # (T, E)
    flipped = scores.flip(-1)  # expert e sits at column E-1-e: ties now keep the higher id
    gate, j = flipped.topk(inp["k"], -1)
    idx = scores.shape[-1] - 1 - j  # (T, k) back to expert ids
    return moe(inp, idx, gate / gate.sum(-1, keepdim=True), scores)


def replay_fp32(inp, rollout_outcome):
    scores = torch.softmax(inp["logits"], -1)  # (T, E) fp32
    idx = rollout_outcome.routing["router"].experts  # the rollout's selection, replayed
    gate = scores.gather(-1, idx)
    return moe(inp, idx, gate / gate.sum(-1, keepdim=True), scores)


# --- pairs ----------------------------------------------------------------------------------------
AXES = Axes(
    n_seqs=(1, 4), seq_len=(1, 16),
    routing=RoutingAxes(n_experts=(4, 16), top_k=(1, 4), max_gap=1e-2, tie_fraction=(0.0, 1.0)),
    logit_scale=(1.0, 8.0), pad_sides=ONE_SIDE)
READOUT = Readout(vocab=256)

register(TargetPair(
    name="router.aligned", kind="op", expected="aligned", build=build, trainer=softmax_topk_fp32,
    rollout=softmax_topk_fp32, axes=AXES, readout=READOUT,
    description="softmax, top-k, renormalise in fp32 on both sides: exactly equal",
))
register(TargetPair(
    name="router.bf16_scores", kind="op", expected="diverges", build=build, trainer=softmax_topk_fp32,
    rollout=softmax_topk_low, axes=AXES, readout=READOUT,
    description="router scores in bf16 (rollout) vs fp32 (trainer): near-tie experts flip",
))
register(TargetPair(
    name="router.topk_softmax", kind="op", expected="diverges", build=build, trainer=softmax_topk_fp32,
    rollout=topk_softmax, axes=AXES, readout=READOUT,
    description="softmax-top-k-renormalise vs top-k-then-softmax: same gates, but softmax rounding flips near ties",
))
register(TargetPair(
    name="router.no_renorm", kind="op", expected="diverges", build=build, trainer=softmax_topk_no_renorm,
    rollout=topk_softmax, axes=AXES, readout=READOUT,
    description="softmax-then-top-k without renormalising (trainer) vs top-k-then-softmax (rollout)",
))
register(TargetPair(
    name="router.tie_break", kind="op", expected="diverges", build=build, trainer=softmax_topk_fp32,
    rollout=softmax_topk_high_id_ties, axes=AXES, readout=READOUT,
    description="exact top-k ties: lower expert id wins (torch) vs higher id wins (another engine's kernel)",
))
register(TargetPair(
    name="router.replay", kind="op", expected="aligned", build=build, trainer=replay_fp32,
    rollout=softmax_topk_low, axes=AXES, readout=READOUT,
    description="router replay: bf16 router in the rollout, trainer reuses its experts with fp32 gates",
))
