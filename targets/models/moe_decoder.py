"""A small decoder-only MoE transformer in the style of Qwen3-MoE, with every numerics choice named.

Read top-down: the config, the numerics profile (component -> setting), the weights (drawn from a
seed, cached), then the modules bottom-up (RMSNorm, rotary, attention, MoE, block, model).

One forward serves all three uses, so trainer and rollout run *the same modules with the same
names* (triage compares them module by module):

- trainer: packed rows, block-diagonal causal mask, per-sequence positions, no past;
- rollout prefill: a padded batch, causal mask with key padding, no past;
- rollout decode: one token per sequence, the static KV cache (every slot, invalid ones masked) as `past`.

What differs between a trainer and a rollout engine is a `Numerics` profile passed at call time:
the dtype of each component's arithmetic, the attention kernel, the MoE summation order, the
KV-cache dtype (and that of its late slots), and how positions are counted (by the paths). The
profile's `sampling` setting is read by the paths (`paths.process`), not the model. Nothing else in
the model branches.

Near-tie routing: the router of one drawn layer sees its input nudged (in float32, the same
construction on both paths) so that the tokens the case forces sit at the top-k boundary with the
case's gap (the near_tie_hidden construction of `harness.strategies`, as tensor ops so it exports
to ONNX). Each path then scores that input in its own router precision: a bf16 router GEMM reorders
a pair a float32 one keeps apart. The nudge feeds the router only; experts see the true hidden state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD_ID = 0  # token id of padding
BOS_ID = 1  # token id every sequence starts with


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512  # vocabulary size
    hidden: int = 64  # width of the residual stream
    layers: int = 2  # decoder blocks
    heads: int = 4  # query heads
    kv_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int = 16  # width of one head
    experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts chosen per token
    expert_hidden: int = 64  # SwiGLU width of one expert
    shared_expert: bool = False  # Qwen2-MoE style always-on expert added to the routed ones
    norm_topk: bool = True  # renormalise the top-k gate weights to sum to one (Qwen3-MoE: yes)
    rope_theta: float = 10000.0  # rotary base
    context: int = 0  # unscored context tokens before each sequence (long prompts on GPU)
    weight_pool: int = 0  # 0: weights drawn from each case's seed; n: from (seed mod n), cached
    eps: float = 1e-6  # RMSNorm epsilon


TINY = ModelConfig()  # CPU: fast enough to fuzz hundreds of cases on two cores
# GPU (`--device cuda`): real sizes (Qwen3-30B-A3B's vocabulary, width, heads and expert width; 64
# experts top-8), two layers (per-layer numerics are what is tested; the GPU check runs in minutes).
# 400 unscored context tokens per sequence: up to 8 x (1 + 400 + 32 + 64) = 3976 tokens per case
# under the model axes. One set of weights (weight_pool=1): 1.25e9 float32 parameters, 5 GB.
LARGE = ModelConfig(vocab=151936, hidden=2048, layers=2, heads=32, kv_heads=4, head_dim=128, experts=64,
                    top_k=8, expert_hidden=768, context=400, weight_pool=1)


# ---------------------------------------------------------------------------------------------
# Numerics profile: component -> setting
# ---------------------------------------------------------------------------------------------
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DT = {**DT, "float8_e5m2": torch.float8_e5m2}  # storage dtypes a KV cache may use (fp8: vLLM's fp8_e5m2)


@dataclass(frozen=True)
class Numerics:
    activation: str = "float32"  # dtype of the residual stream, projections and expert MLPs
    attention: str = "sdpa"  # attention kernel: "sdpa" (F.scaled_dot_product_attention) or "eager" (fp32 softmax)
    norm: str = "float32"  # RMSNorm arithmetic dtype (input upcast, normalised, cast back)
    rotary: str = "float32"  # dtype of rotary angles, cos/sin tables and the rotation
    router: str = "float32"  # dtype of the router GEMM (softmax and top-k run on its rounded logits)
    moe_aggregate: str = "float32"  # dtype of weighting expert outputs, summing them and the residual add
    moe_order: str = "rank"  # summation order of expert outputs: "rank" (by gate) or "expert_id"
    lm_head: str = "float32"  # dtype of the LM-head GEMM (log-softmax always in float32 on its logits)
    kv_cache: str = "float32"  # dtype keys and values are stored in (the trainer rounds them the same way)
    kv_late: str = "same"  # dtype of keys/values at positions >= KV_LATE_FROM ("same": kv_cache; a planted bug)
    positions: str = "per_sequence"  # "per_sequence" (from each sequence's first token), "run_on" (packed rows
    #                                  run on across sequences) or "pad_start" (left-padded rows count from the
    #                                  pad start): the last two are planted bugs
    sampling: str = "case"  # how the path applies the case's sampling parameters: "case" (as given),
    #                         "top_k_50" (an engine default top-k 50 when the case has none) or
    #                         "temperature_twice" (logits divided by the temperature twice): planted bugs

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def replace(self, **changes: str) -> "Numerics":
        return dataclasses.replace(self, **changes)

    def differs(self, other: "Numerics") -> list[str]:
        return [c for c in COMPONENTS if getattr(self, c) != getattr(other, c)]


# component -> (allowed settings, what a person calls it in a verdict)
COMPONENTS: dict[str, tuple[tuple[str, ...], str]] = {
    "activation": (tuple(DT), "activation dtype (residual stream, projections, expert MLPs)"),
    "attention": (("sdpa", "eager"), "attention kernel"),
    "norm": (tuple(DT), "RMSNorm precision"),
    "rotary": (tuple(DT), "rotary embedding precision"),
    "router": (tuple(DT), "router score precision"),
    "moe_aggregate": (tuple(DT), "MoE aggregation precision"),
    "moe_order": (("rank", "expert_id"), "MoE summation order"),
    "lm_head": (tuple(DT), "LM-head precision"),
    "kv_cache": (tuple(DT), "KV-cache dtype"),
    "kv_late": (("same",) + tuple(KV_DT), "KV-cache dtype of late slots (positions >= 32)"),
    "positions": (("per_sequence", "run_on", "pad_start"), "rotary positions (packed rows, left padding)"),
    "sampling": (("case", "top_k_50", "temperature_twice"), "sampling parameters (temperature, top-k, top-p)"),
}
KV_LATE_FROM = 32  # first position whose keys/values `kv_late` applies to

FP32 = Numerics()  # a float32 trainer
BF16_ENGINE = Numerics(activation="bfloat16", router="bfloat16", moe_aggregate="bfloat16", lm_head="bfloat16",
                       kv_cache="bfloat16")  # a bf16 rollout engine (norm and rotary kept in float32, as vLLM does)
BF16_TRAINER = BF16_ENGINE  # a bf16 trainer with the same kernels as the engine


def check_numerics(n: Numerics) -> Numerics:
    for comp, (allowed, _) in COMPONENTS.items():
        if getattr(n, comp) not in allowed:
            raise ValueError(f"numerics {comp}={getattr(n, comp)!r} is not one of {allowed}")
    return n


# ---------------------------------------------------------------------------------------------
# Weights: a pure function of (config, seed), cached
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter, float32 on CPU, drawn from one generator seeded by `seed`."""
    g = torch.Generator().manual_seed(seed)
    h, d, f, e = cfg.hidden, cfg.head_dim, cfg.expert_hidden, cfg.experts

    def n(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"embed.weight": n(cfg.vocab, h, std=1.0)}  # (V, H)
    for i in range(cfg.layers):
        p = f"layers.{i}."
        w[p + "attn_norm.weight"] = 1 + n(h, std=0.1)  # (H,)
        w[p + "attn.wq"] = n(h, cfg.heads * d, std=h**-0.5)  # (H, nh*D)
        w[p + "attn.wk"] = n(h, cfg.kv_heads * d, std=h**-0.5)  # (H, nkv*D)
        w[p + "attn.wv"] = n(h, cfg.kv_heads * d, std=h**-0.5)  # (H, nkv*D)
        w[p + "attn.wo"] = n(cfg.heads * d, h, std=(cfg.heads * d) ** -0.5)  # (nh*D, H)
        w[p + "attn.q_norm.weight"] = 1 + n(d, std=0.1)  # (D,)
        w[p + "attn.k_norm.weight"] = 1 + n(d, std=0.1)  # (D,)
        w[p + "moe_norm.weight"] = 1 + n(h, std=0.1)  # (H,)
        w[p + "moe.router"] = n(h, e, std=h**-0.5)  # (H, E)
        w[p + "moe.w_gate"] = n(e, h, f, std=h**-0.5)  # (E, H, F)
        w[p + "moe.w_up"] = n(e, h, f, std=h**-0.5)  # (E, H, F)
        w[p + "moe.w_down"] = n(e, f, h, std=f**-0.5)  # (E, F, H)
        if cfg.shared_expert:
            w[p + "moe.shared_gate"] = n(h, f, std=h**-0.5)  # (H, F)
            w[p + "moe.shared_up"] = n(h, f, std=h**-0.5)  # (H, F)
            w[p + "moe.shared_down"] = n(f, h, std=f**-0.5)  # (F, H)
    w["final_norm.weight"] = 1 + n(h, std=0.1)  # (H,)
    w["lm_head.weight"] = n(h, cfg.vocab, std=h**-0.5)  # (H, V): logits of std ~1 before the logit scale
    return w


def weight_seed(cfg: ModelConfig, case_seed: int) -> int:
    return case_seed % cfg.weight_pool if cfg.weight_pool else case_seed


# ---------------------------------------------------------------------------------------------
# Modules, bottom-up
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, nx: Numerics) -> torch.Tensor:
        dt = DT[nx.norm]
        y = x.to(dt)  # (..., W)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., W)
        return (y * self.weight.to(dt)).to(x.dtype)


def rope_tables(pos: torch.Tensor, head_dim: int, theta: float, nx: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, S, 1, D/2) of the rotary angles at positions pos (B, S), in nx.rotary
    (computed once per forward, shared by every layer's q and k)."""
    dt = DT[nx.rotary]
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=pos.device) / half)  # (D/2,)
    angle = pos.to(dt)[..., None] * inv_freq.to(dt)  # (B, S, D/2) rounded to the rotary dtype
    return angle.cos()[:, :, None, :], angle.sin()[:, :, None, :]  # (B, S, 1, D/2)


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], nx: Numerics) -> torch.Tensor:
    """Rotary embedding of x (B, S, n, D) with the tables of `rope_tables`, arithmetic in nx.rotary."""
    dt = DT[nx.rotary]
    half = x.shape[-1] // 2
    cos, sin = tables
    xr = x.to(dt)
    x1, x2 = xr[..., :half], xr[..., half:]  # (B, S, n, D/2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)  # (B, S, n, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Parameter(torch.empty(cfg.hidden, cfg.heads * hd), requires_grad=False)
        self.wk = nn.Parameter(torch.empty(cfg.hidden, cfg.kv_heads * hd), requires_grad=False)
        self.wv = nn.Parameter(torch.empty(cfg.hidden, cfg.kv_heads * hd), requires_grad=False)
        self.wo = nn.Parameter(torch.empty(cfg.heads * hd, cfg.hidden), requires_grad=False)
        self.q_norm = RMSNorm(hd, cfg.eps)
        self.k_norm = RMSNorm(hd, cfg.eps)

    def forward(self, x, pos, rope, mask, past_k, past_v, nx: Numerics):
        cfg, act, kv = self.cfg, DT[nx.activation], DT[nx.kv_cache]
        b, s, _ = x.shape
        q = (x @ self.wq.to(act)).view(b, s, cfg.heads, cfg.head_dim)  # (B, S, nh, D)
        k = (x @ self.wk.to(act)).view(b, s, cfg.kv_heads, cfg.head_dim)  # (B, S, nkv, D)
        v = (x @ self.wv.to(act)).view(b, s, cfg.kv_heads, cfg.head_dim)  # (B, S, nkv, D)
        q, k = self.q_norm(q, nx), self.k_norm(k, nx)  # per-head QK-norm (Qwen3)
        q, k = rotate(q, rope, nx), rotate(k, rope, nx)
        k_new = k.transpose(1, 2).to(kv)  # (B, nkv, S, D) as the cache stores it
        v_new = v.transpose(1, 2).to(kv)  # (B, nkv, S, D)
        if nx.kv_late != "same":  # late slots stored in their own dtype (read back in the cache's)
            late = (pos >= KV_LATE_FROM)[:, None, :, None]  # (B, 1, S, 1)
            ldt = KV_DT[nx.kv_late]
            k_new = torch.where(late, k_new.to(ldt).to(kv), k_new)
            v_new = torch.where(late, v_new.to(ldt).to(kv), v_new)
        k_all = torch.cat([past_k.to(kv), k_new], 2).to(act)  # (B, nkv, P+S, D)
        v_all = torch.cat([past_v.to(kv), v_new], 2).to(act)  # (B, nkv, P+S, D)
        rep = cfg.heads // cfg.kv_heads
        k_all = k_all.repeat_interleave(rep, 1)  # (B, nh, P+S, D)
        v_all = v_all.repeat_interleave(rep, 1)  # (B, nh, P+S, D)
        q = q.transpose(1, 2)  # (B, nh, S, D)
        if nx.attention == "sdpa":
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)  # (B, nh, S, D)
        else:  # eager: scores, softmax and weighting in float32
            sc = (q.float() @ k_all.float().transpose(-1, -2)) / math.sqrt(cfg.head_dim)  # (B, nh, S, P+S)
            sc = sc.masked_fill(~mask, float("-inf"))
            o = (torch.softmax(sc, -1) @ v_all.float()).to(act)  # (B, nh, S, D)
        o = o.transpose(1, 2).reshape(b, s, cfg.heads * cfg.head_dim)  # (B, S, nh*D)
        return o @ self.wo.to(act), k_new, v_new  # (B, S, H)


def tie_nudge(x: torch.Tensor, w: torch.Tensor, forced: torch.Tensor, gap: torch.Tensor, k: int,
              rounds: int = 2) -> torch.Tensor:
    """Router input x (N, H) moved, for forced tokens, so that x @ w has its top-k boundary at `gap`.

    float32 tensor ops (exportable): the move is along w[:, winner] - w[:, runner_up], the one
    direction that changes the gap between the k-th and (k+1)-th expert (higher id wins the tie).
    """
    xs, wf = x.float(), w.float()  # (N, H), (H, E)
    for _ in range(rounds):
        logits = xs @ wf  # (N, E)
        top = torch.topk(logits, k + 1, dim=-1).indices  # (N, k+1)
        a, b = top[:, k - 1], top[:, k]  # (N,)
        win, run = torch.maximum(a, b), torch.minimum(a, b)
        d = wf.t()[win] - wf.t()[run]  # (N, H)
        gap_now = logits.gather(1, win[:, None]) - logits.gather(1, run[:, None])  # (N, 1)
        alpha = (gap - gap_now) / (d * d).sum(-1, keepdim=True).clamp_min(1e-30)  # (N, 1)
        xs = torch.where(forced[:, None], xs + alpha * d, xs)
    return xs.to(x.dtype)


def _eager() -> bool:
    """Plain eager execution (not traced for export, not compiled): data-dependent shortcuts allowed."""
    return not (torch.jit.is_tracing() or torch.compiler.is_compiling())


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, h, f = cfg.experts, cfg.hidden, cfg.expert_hidden
        self.router = nn.Parameter(torch.empty(h, e), requires_grad=False)
        self.w_gate = nn.Parameter(torch.empty(e, h, f), requires_grad=False)
        self.w_up = nn.Parameter(torch.empty(e, h, f), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(e, f, h), requires_grad=False)
        if cfg.shared_expert:
            self.shared_gate = nn.Parameter(torch.empty(h, f), requires_grad=False)
            self.shared_up = nn.Parameter(torch.empty(h, f), requires_grad=False)
            self.shared_down = nn.Parameter(torch.empty(f, h), requires_grad=False)

    def forward(self, x, residual, tie_on, forced, gap, replay, replay_on, nx: Numerics):
        """x (B, S, H) normalised input, residual (B, S, H); returns residual + MoE(x), the experts
        chosen (B, S, k) and the router scores (B, S, E) they were chosen from."""
        cfg, act = self.cfg, DT[nx.activation]
        b, s, h = x.shape
        xf = x.reshape(b * s, h)  # (N, H)
        # router: its input nudged at the tie layer (float32 construction), scored in nx.router
        if _eager() and not bool(tie_on):  # not the tie layer: skip the nudge (torch.where would drop it)
            xr = xf
        else:
            xr = torch.where(tie_on, tie_nudge(xf, self.router, forced.reshape(-1), gap, cfg.top_k), xf)  # (N, H)
        rdt = DT[nx.router]
        logits = xr.to(rdt) @ self.router.to(rdt)  # (N, E) rounded to the router dtype
        scores = torch.softmax(logits.float(), -1)  # (N, E)
        idx = torch.topk(scores, cfg.top_k, dim=-1).indices  # (N, k) by descending score
        idx = torch.where(replay_on.reshape(-1, 1), replay.reshape(-1, cfg.top_k), idx)  # router replay
        gate = scores.gather(1, idx)  # (N, k)
        if cfg.norm_topk:
            gate = gate / gate.sum(-1, keepdim=True)
        # experts, computed densely (every expert on every token; small E) in the activation dtype
        xa = xf.to(act)
        up = torch.einsum("nh,ehf->nef", xa, self.w_up.to(act))  # (N, E, F)
        gt = torch.einsum("nh,ehf->nef", xa, self.w_gate.to(act))  # (N, E, F)
        y = torch.einsum("nef,efh->neh", F.silu(gt) * up, self.w_down.to(act))  # (N, E, H)
        order = idx
        if nx.moe_order == "expert_id":
            order = torch.sort(idx, -1).values  # (N, k) ascending expert ids
            gate = gate.gather(1, torch.argsort(idx, -1))  # the same gates, in id order
        y_sel = y.gather(1, order[:, :, None].expand(-1, -1, h))  # (N, k, H)
        # aggregation: weight, sum and add to the residual in nx.moe_aggregate, rounding each step
        adt = DT[nx.moe_aggregate]
        acc = residual.reshape(b * s, h).to(adt)  # (N, H)
        if cfg.shared_expert:
            sh = (F.silu(xa @ self.shared_gate.to(act)) * (xa @ self.shared_up.to(act))) @ self.shared_down.to(act)
            acc = acc + sh.to(adt)
        for j in range(cfg.top_k):
            acc = acc + gate[:, j, None].to(adt) * y_sel[:, j].to(adt)
        out = acc.to(act).view(b, s, h)  # (B, S, H)
        return out, idx.view(b, s, cfg.top_k), scores.view(b, s, cfg.experts)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.moe = MoE(cfg)

    def forward(self, x, pos, rope, mask, past_k, past_v, tie_on, forced, gap, replay, replay_on, nx):
        a, k_new, v_new = self.attn(self.attn_norm(x, nx), pos, rope, mask, past_k, past_v, nx)  # (B, S, H)
        x = x + a  # (B, S, H)
        x, experts, scores = self.moe(self.moe_norm(x, nx), x, tie_on, forced, gap, replay, replay_on, nx)
        return x, k_new, v_new, experts, scores


class LMHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.hidden, cfg.vocab), requires_grad=False)

    def forward(self, x, scale, nx):
        dt = DT[nx.lm_head]
        logits = (x.to(dt) @ self.weight.to(dt)).float()  # (B, S, V)
        return torch.log_softmax(logits * scale, -1)  # (B, S, V) float32, tempered and scaled


class MoEDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = LMHead(cfg)

    def forward(self, ids, pos, mask, past_k, past_v, tie, forced, gap, scale, replay, replay_on,
                nx: Numerics = FP32, rows=None):
        """One forward over S new tokens per row.

        ids (B, S) int64; pos (B, S) int64 rotary positions; mask (B, 1, S, P+S) bool, True = may
        attend; past_k/past_v (L, B, nkv, P, D) the cache (P may be 0); tie (L,) bool: the layer
        whose router input is nudged; forced (B, S) bool: tokens nudged to the boundary; gap ()
        the boundary gap; scale () logit scale / temperature; replay (L, B, S, k) int64 experts to
        reuse where replay_on (B, S) is True. `rows` (B, S) int64 is bookkeeping for triage (the
        case-order token each position holds, -1 for none); the arithmetic never reads it.
        Returns logprobs (B, S, V) float32, new keys and values (L, B, nkv, S, D) in the KV dtype,
        experts (L, B, S, k) and router scores (L, B, S, E).
        """
        x = self.embed.weight.to(DT[nx.activation])[ids]  # (B, S, H)
        ks, vs, ex, sc = [], [], [], []
        rope = rope_tables(pos, self.cfg.head_dim, self.cfg.rope_theta, nx)  # (B, S, 1, D/2) x2
        for i, block in enumerate(self.layers):
            x, k_new, v_new, experts, scores = block(x, pos, rope, mask, past_k[i], past_v[i], tie[i], forced, gap,
                                                     replay[i], replay_on, nx)
            ks.append(k_new)
            vs.append(v_new)
            ex.append(experts)
            sc.append(scores)
        logprobs = self.lm_head(self.final_norm(x, nx), scale, nx)  # (B, S, V)
        return logprobs, torch.stack(ks), torch.stack(vs), torch.stack(ex), torch.stack(sc)


@functools.lru_cache(maxsize=8)
def model(cfg: ModelConfig, seed: int, device: str = "cpu") -> MoEDecoder:
    """The model with the weights of (cfg, seed), built once and cached."""
    m = MoEDecoder(cfg)
    state = weights(cfg, seed)
    own = dict(m.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            own[name].copy_(value)
    return m.to(device).eval()
