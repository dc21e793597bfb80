"""Planted code-level bugs in one module, with the same numerics on both paths: what only the
per-module table of `harness triage` can localize.

- `planted.moe_norm_weight`: the model pairs' MoE decoder; the rollout runs a copy whose
  `layers.1.moe_norm` forgets its learned weight (float32 on both sides, profiles identical).
- `planted.moe_norm_overflow`: the trainer runs a copy whose `layers.1.moe_norm` output overflows
  float16 (inf, then NaN downstream): a non-finite finding. No numerics profiles.
- `planted.tiny_lm.aligned` / `planted.tiny_lm.block_bias`: a plain torch model whose forward takes
  nothing but token ids (no bookkeeping argument of any kind), run as one packed call (trainer)
  and one call per sequence in reverse order with temperature-scaled log-probabilities (rollout);
  the `block_bias` rollout copy adds a bias in `blocks.1`.
- `planted.tiny_moe.aligned` / `planted.tiny_moe.router_choice`: the same calls on a plain torch
  MoE LM whose router returns (logits, weights, chosen experts); the `router_choice` rollout copy
  skips each token's best expert, so its logits agree and its choice does not.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from harness import Axes, Outcome, TargetPair, register
from targets.models import pairs as model_pairs
from targets.models import paths
from targets.models.moe_decoder import DT, FP32, RMSNorm


# ---------------------------------------------------------------------------------------------
# The MoE decoder with one module's code changed in one path's copy
# ---------------------------------------------------------------------------------------------
class NormWithoutWeight(RMSNorm):
    """Planted: the normalised activations are returned without the learned scale."""

    def forward(self, x: torch.Tensor, nx) -> torch.Tensor:
        dt = DT[nx.norm]
        y = x.to(dt)  # (..., W)
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class NormFloat16Overflow(RMSNorm):
    """Planted: the output is scaled by 2**16 in float16 before it is cast back (inf)."""

    def forward(self, x: torch.Tensor, nx) -> torch.Tensor:
        y = super().forward(x, nx)
        return (y.to(torch.float16) * 65536.0).to(x.dtype)


_COPIES: dict[tuple[int, str], tuple[nn.Module, nn.Module]] = {}  # (id(model), bug) -> (model, its copy)


def with_bug(model: nn.Module, module: str, cls: type) -> nn.Module:
    """A copy of `model` whose submodule `module` runs `cls.forward` (same weights), cached."""
    key = (id(model), f"{module}:{cls.__name__}")
    if key not in _COPIES or _COPIES[key][0] is not model:
        buggy = copy.deepcopy(model)
        buggy.get_submodule(module).__class__ = cls
        _COPIES[key] = (model, buggy)
    return _COPIES[key][1]


def decoder_pair(name: str, buggy_role: str, cls: type, description: str, with_profiles: bool) -> TargetPair:
    def build(case, device):
        inp = model_pairs.build(case, device)
        m = model_pairs.torch_forward(inp)
        mods = {"trainer": m, "rollout": m}
        mods[buggy_role] = with_bug(m, "layers.1.moe_norm", cls)
        inp.extra["modules"] = mods
        return inp

    def make(trainer_nx, rollout_nx):
        def rollout(inp):
            return paths.rollout(inp, inp.extra["modules"]["rollout"], rollout_nx)

        def trainer(inp, rollout_outcome):
            return paths.trainer(inp, rollout_outcome.tokens, inp.extra["modules"]["trainer"], trainer_nx)

        profiles = None
        if with_profiles:
            profiles = model_pairs.ModelProfiles(
                trainer=trainer_nx.as_dict(), rollout=rollout_nx.as_dict(),
                labels={c: label for c, (_, label) in model_pairs.COMPONENTS.items()}, make=make)
        return TargetPair(name=name, kind="model", expected="diverges", build=build, trainer=trainer,
                          rollout=rollout, axes=model_pairs.AXES, devices=("cpu",), description=description,
                          profiles=profiles)

    return make(FP32, FP32)


register(decoder_pair("planted.moe_norm_weight", "rollout", NormWithoutWeight,
                      "planted code-level bug: the rollout's layers.1.moe_norm drops its weight (float32 both sides)",
                      with_profiles=True))
register(decoder_pair("planted.moe_norm_overflow", "trainer", NormFloat16Overflow,
                      "planted non-finite: the trainer's layers.1.moe_norm overflows float16", with_profiles=False))


# ---------------------------------------------------------------------------------------------
# A plain torch model: ids in, logits out, nothing else in its call
# ---------------------------------------------------------------------------------------------
VOCAB, WIDTH = 96, 32


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            self.embed.weight.mul_(WIDTH**0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, S, W)
        for block in self.blocks:
            x = x + torch.tanh(block(x))  # (B, S, W)
        return self.head(x) * 3.0  # (B, S, V) logits


class BiasedLinear(nn.Linear):
    """Planted: a constant added to the layer's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.5


_TINY = TinyLM().eval()
_TINY_BUGGY = with_bug(_TINY, "blocks.1", BiasedLinear)


def tiny_pair(name: str, expected: str, rollout_model: nn.Module, description: str, flat: bool = False) -> TargetPair:
    """`flat`: both paths call the model on 1-D token ids ((T,) -> (T, V) logits), as a model without a
    batch dimension does."""
    def call(model, ids):  # (1, n) -> (n, V), or flat (n,) -> (n, V)
        return model(ids[0]) if flat else model(ids)[0]

    def build(case, device):
        ids = [torch.randint(0, VOCAB, (n,), generator=case.seq_generator(j, "ids")) for j, n in enumerate(case.seq_lens)]
        return {"ids": ids, "scale": case.logit_scale,
                "modules": {"trainer": _TINY.to(device), "rollout": rollout_model.to(device)}, "device": device}

    def trainer(inp):  # every sequence packed into one call; log-probabilities at the case's scale
        ids = torch.cat(inp["ids"]).to(inp["device"])[None]  # (1, T)
        return Outcome(logprobs=torch.log_softmax(call(inp["modules"]["trainer"], ids) * inp["scale"], -1))

    def rollout(inp):  # one call per sequence, last sequence first
        rows: list = [None] * len(inp["ids"])
        for j in reversed(range(len(inp["ids"]))):
            logits = call(inp["modules"]["rollout"], inp["ids"][j].to(inp["device"])[None])  # (n, V)
            rows[j] = torch.log_softmax(logits * inp["scale"], -1)
        return Outcome(logprobs=torch.cat(rows))

    return TargetPair(name=name, kind="model", expected=expected, build=build, trainer=trainer, rollout=rollout,
                      axes=Axes(n_seqs=(1, 3), seq_len=(1, 6), logit_scale=(1.0, 4.0)), devices=("cpu",), description=description)


register(tiny_pair("planted.tiny_lm.aligned", "aligned", _TINY, "a plain torch LM, packed vs per-sequence calls"))
register(tiny_pair("planted.tiny_lm.block_bias", "diverges", _TINY_BUGGY,
                   "planted code-level bug: the rollout's blocks.1 adds a constant"))
register(tiny_pair("planted.tiny_lm.flat_block_bias", "diverges", _TINY_BUGGY,
                   "the same bug, both paths calling the model on 1-D token ids", flat=True))


# ---------------------------------------------------------------------------------------------
# A plain torch MoE model whose router returns (logits, weights, chosen experts)
# ---------------------------------------------------------------------------------------------
N_EXPERTS, TOP_K = 4, 2


class Router(nn.Module):
    """Returns its logits first, then the top-k weights and the chosen experts (as HF MoE routers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, N_EXPERTS, bias=False)

    def choose(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(probs, TOP_K, dim=-1)  # (B, S, k) each

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.proj(x)  # (B, S, E)
        weights, chosen = self.choose(torch.softmax(logits, -1))
        return logits, weights, chosen


class RouterSkipsBest(Router):
    """Planted: the choice skips each token's best expert (the logits are those of `Router`)."""

    def choose(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, idx = torch.topk(probs, TOP_K + 1, dim=-1)
        return w[..., 1:], idx[..., 1:]


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(N_EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, chosen = self.router(x)  # (B, S, k) each
        every = torch.stack([e(x) for e in self.experts], -2)  # (B, S, E, W)
        picked = every.gather(-2, chosen[..., None].expand(*chosen.shape, WIDTH))  # (B, S, k, W)
        return (weights[..., None] * torch.tanh(picked)).sum(-2)  # (B, S, W)


class TinyMoELM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.blocks = nn.ModuleList([MoEBlock()])
        with torch.no_grad():
            for p in self.blocks.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * 2.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, S, W)
        x = x + self.blocks[0](x)
        return self.head(x) * 3.0  # (B, S, V) logits


_TINY_MOE = TinyMoELM().eval()
_TINY_MOE_BUGGY = with_bug(_TINY_MOE, "blocks.0.router", RouterSkipsBest)


def tiny_moe_pair(name: str, expected: str, rollout_model: nn.Module, description: str) -> TargetPair:
    base = tiny_pair(name, expected, rollout_model, description)

    def build(case, device):
        inp = base.build(case, device)
        inp["modules"] = {"trainer": _TINY_MOE.to(device), "rollout": rollout_model.to(device)}
        return inp

    return TargetPair(name=name, kind="model", expected=expected, build=build, trainer=base.trainer,
                      rollout=base.rollout, axes=base.axes, devices=("cpu",), description=description)


register(tiny_moe_pair("planted.tiny_moe.aligned", "aligned", _TINY_MOE, "a plain torch MoE LM, packed vs per-sequence"))
register(tiny_moe_pair("planted.tiny_moe.router_choice", "diverges", _TINY_MOE_BUGGY,
                       "planted: the rollout's router skips each token's best expert; its logits are unchanged"))
