"""An aligned router whose rollout sums the router GEMM in two halves (split-K): both float32, so
at an exact tie the two paths' rounding picks different experts; a floor on the gap keeps it clean."""
import torch
from harness import Axes, Outcome, Readout, Routing, RoutingAxes, TargetPair, register
from harness.strategies import near_tie_hidden

H = 32

def build(case, device):
    w = case.randn((H, case.n_experts), "router", device=device) / H**0.5
    x = near_tie_hidden(case.token_randn(H, "hidden", device=device), w, case)
    experts = case.randn((case.n_experts, H, H), "experts", device=device) / H**0.5
    return {"x": x, "w": w, "experts": experts, "k": case.top_k}

def finish(inp, scores):
    gate, idx = scores.topk(inp["k"], -1)
    out = torch.einsum("th,tkhd->tkd", inp["x"], inp["experts"][idx])
    return Outcome(hidden=((gate / gate.sum(-1, keepdim=True))[..., None] * out).sum(1),
                   routing={"router": Routing(experts=idx, scores=scores)})

def trainer(inp):
    return finish(inp, inp["x"] @ inp["w"])

def rollout(inp):  # split-K: the same sum in another order
    h = H // 2
    return finish(inp, inp["x"][:, :h] @ inp["w"][:h] + inp["x"][:, h:] @ inp["w"][h:])

for name, floor in (("gapfloor.none", 0.0), ("gapfloor.floor", 1e-5)):
    register(TargetPair(name=name, kind="op", expected="aligned", build=build, trainer=trainer, rollout=rollout,
                        readout=Readout(vocab=64),
                        axes=Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(4.0, 4.0),
                                  routing=RoutingAxes(n_experts=(4, 8), top_k=(1, 3), max_gap=1e-2,
                                                      tie_fraction=(0.0, 1.0), min_gap=floor))))
