"""The two execution paths of a model pair: a packed teacher-forced trainer and a padded KV-cache rollout.

Both paths drive a `forward` function with the signature of `MoEDecoder.forward` (the torch model, a
torch.compile'd one, or an ONNX Runtime session behind the same call), so a backend is a rollout
path without a second copy of this bookkeeping.

A case is an RL batch. Sequence j is a prefix and a response:

    positions   0     1 .. C      C+1 .. C+P          C+P+1 .. C+P+R-1
    input       BOS   context     prompt_0..P-1       y_0 .. y_{R-2}        (C = cfg.context, 0 on CPU)
    row         -     -           - .. -   0          1   .. R-1            (row i: where y_i is drawn from)

P = case.prompt_len(j) prompt tokens (`case.prompt_tokens`, sequence j's own stream), R = case.seq_lens[j]
response tokens y_i, all decoded by the rollout and scored by the trainer. Outcome rows are the response
tokens in case order.

- Rollout: the prefixes (BOS, context, prompt) padded on the case's pad side into one batch and
  prefilled in one forward; then every response token is decoded from a static KV cache, one batched
  forward of all B sequences per step (finished sequences ride along, their outputs unused). Each step's
  distribution goes through the case's temperature / top-k / top-p (`harness.sampling.process_logits`)
  and token y_i of sequence j is drawn by inverse CDF from `case.token_uniforms("sample")[offsets[j] + i]`,
  so the tokens do not depend on the batch layout or the other sequences. `Outcome.logprobs` is the
  processed distribution each token was drawn from.
- Trainer: the finished sequences packed into rows (first-fit in the case's order and row capacity,
  which counts prompt + response), block-diagonal causal mask, positions restarting per sequence,
  one teacher-forced forward; the response rows go through the same sampling processing.

Planted bugs are numerics settings (`Numerics.positions`, `kv_late`, `sampling`), so a pair and
its fixed twin differ in one named component and triage can swap it.

Repros recorded before case schema 2 (`case.streams == "single"`) run the schema-1 layout of
`targets.models.schema1` unchanged, so they replay bit-for-bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harness import Case, Outcome, Routing
from harness.sampling import process_logits, sample_rows
from harness.strategies import forced_tokens

from . import schema1
from .moe_decoder import BOS_ID, DT, PAD_ID, ModelConfig, Numerics

Forward = Callable[..., tuple]  # forward(ids, pos, mask, past_k, past_v, tie, forced, gap, scale, replay,
#                                           replay_on, nx=..., rows=...) -> (logprobs, k, v, experts, scores)

TIE_FLOOR = schema1.TIE_FLOOR  # floor added to the boundary gap (see schema1.TIE_FLOOR for why)
ENGINE_TOP_K = 50  # the engine default of the `top_k_50` sampling bug (generate()'s default top_k)


@dataclass
class ModelInputs:
    """Everything both paths need for one case (tensors drawn from the case's streams on CPU)."""

    case: Case
    cfg: ModelConfig
    device: str
    weight_seed: int  # the model's weights are weights(cfg, weight_seed)
    prefixes: list[torch.Tensor]  # per sequence: (1 + C + P_j,) int64 BOS, context and prompt
    uniforms: torch.Tensor  # (T,) float64 sampling uniforms, case order
    forced: torch.Tensor  # (T,) bool tokens the tie layer's router forces to the top-k boundary
    tie_layer: int  # layer whose router input is nudged (-1: none)
    extra: dict[str, Any] = field(default_factory=dict)  # per-pair state (modules, sessions) for triage

    @property
    def scale(self) -> float:
        return self.case.logit_scale

    def tensor(self, value: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(value, dtype=dtype).to(self.device)


def make_inputs(case: Case, cfg: ModelConfig, device: str, weight_seed: int) -> Any:
    if case.streams == "single":
        return schema1.make_inputs(case, cfg, device, weight_seed)
    prefixes = []
    for j in range(case.batch_size):
        g = case.prompt_generator(j, "context")  # (the prompt's stream: a group's shared prompt shares it)
        context = torch.randint(2, cfg.vocab, (cfg.context,), generator=g)  # (C,)
        prompt = case.prompt_tokens(j, cfg.vocab, low=2)  # (P_j,)
        prefixes.append(torch.cat([torch.tensor([BOS_ID]), context, prompt]))
    t = case.n_tokens
    forced = forced_tokens(case, t) if case.tie_fraction > 0 else torch.zeros(t, dtype=torch.bool)  # (T,)
    tie_layer = int(case.params.get("tie_layer", 0)) % cfg.layers if case.tie_fraction > 0 else -1
    return ModelInputs(case=case, cfg=cfg, device=device, weight_seed=weight_seed, prefixes=prefixes,
                       uniforms=case.token_uniforms("sample"), forced=forced, tie_layer=tie_layer)


def sampling(case: Case, nx: Numerics) -> tuple[float, int, float, int]:
    """(temperature, top-k, top-p, times the temperature is applied) as the path applies them."""
    t, k, p = case.temperature, case.sample_top_k, case.top_p
    if nx.sampling == "top_k_50":
        k = k or ENGINE_TOP_K
    return t, k, p, 2 if nx.sampling == "temperature_twice" else 1


def process(logp: torch.Tensor, case: Case, nx: Numerics) -> torch.Tensor:
    """(N, V) raw log-probabilities -> (N, V) float32 log-probabilities of the path's sampling distribution."""
    t, k, p, times = sampling(case, nx)
    x = logp.float()
    for _ in range(times - 1):
        x = x / t  # the extra division of the temperature_twice bug
    return process_logits(x, t, k, p, case.min_p)


def _common(inp: ModelInputs) -> dict[str, torch.Tensor]:
    tie = torch.zeros(inp.cfg.layers, dtype=torch.bool)
    if inp.tie_layer >= 0:
        tie[inp.tie_layer] = True
    return {"tie": tie.to(inp.device), "gap": inp.tensor(inp.case.tie_gap + TIE_FLOOR, torch.float32),
            "scale": inp.tensor(inp.scale, torch.float32)}


def _no_replay(inp: ModelInputs, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = inp.cfg
    return (torch.zeros(c.layers, b, s, c.top_k, dtype=torch.int64, device=inp.device),
            torch.zeros(b, s, dtype=torch.bool, device=inp.device))


# ---------------------------------------------------------------------------------------------
# Trainer: packed rows, one teacher-forced forward
# ---------------------------------------------------------------------------------------------
def trainer(inp: Any, tokens: Any, forward: Forward, nx: Numerics,
            replay: dict[str, Routing] | None = None) -> Outcome:
    """Log-probabilities of the response `tokens` (T,) (the rollout's, case order) from packed rows."""
    if isinstance(inp, schema1.Schema1Inputs):
        return schema1.trainer(inp, tokens, forward, nx, replay)
    case, c, dev = inp.case, inp.cfg, inp.device
    tokens = torch.as_tensor(tokens).long().cpu()  # (T,)
    offsets = case.offsets
    seqs = []  # per sequence: input ids (prefix + response[:-1]) and case-order row of each position
    for j, n in enumerate(case.seq_lens):
        pre = inp.prefixes[j]
        ids = torch.cat([pre, tokens[offsets[j]:offsets[j] + n - 1]])  # (L_j + n - 1,)
        rows = torch.full((len(ids),), -1, dtype=torch.long)
        rows[len(pre) - 1:] = torch.arange(offsets[j], offsets[j] + n)
        seqs.append((ids, rows))
    packs = case.packed_rows()
    width = max(sum(len(seqs[j][0]) for j in pack) for pack in packs)
    r = len(packs)
    ids = torch.full((r, width), PAD_ID, dtype=torch.long)  # (R, W)
    pos = torch.zeros(r, width, dtype=torch.long)  # (R, W)
    seg = torch.full((r, width), -1, dtype=torch.long)  # (R, W) sequence id, -1 = padding
    rows = torch.full((r, width), -1, dtype=torch.long)  # (R, W) case-order row, -1 = unscored
    for i, pack in enumerate(packs):
        at = 0
        for j in pack:
            sid, srows = seqs[j]
            m = len(sid)
            ids[i, at:at + m] = sid
            seg[i, at:at + m] = j
            rows[i, at:at + m] = srows
            pos[i, at:at + m] = torch.arange(at, at + m) if nx.positions == "run_on" else torch.arange(m)
            at += m
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # (W, W)
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)  # (R, W, W)
    mask = (same & causal) | torch.eye(width, dtype=torch.bool)  # (R, W, W) pads attend to themselves
    forced = torch.where(rows >= 0, inp.forced[rows.clamp_min(0)], False)  # (R, W)
    rep, rep_on = _no_replay(inp, r, width)
    if replay is not None:  # router replay: the rollout's experts, moved into the packed layout
        rep = torch.stack([torch.as_tensor(replay[f"layers.{l}"].experts).cpu()[rows.clamp_min(0)]
                           for l in range(c.layers)]).to(dev)  # (L, R, W, k)
        rep_on = (rows >= 0).to(dev)
    z = torch.zeros(c.layers, r, c.kv_heads, 0, c.head_dim, dtype=DT[nx.kv_cache], device=dev)
    logp, _, _, experts, scores = forward(ids.to(dev), pos.to(dev), mask[:, None].to(dev), z, z,
                                          forced=forced.to(dev), replay=rep, replay_on=rep_on, nx=nx,
                                          rows=rows.to(dev), **_common(inp))
    sel = (rows >= 0).to(dev)  # (R, W)
    order = rows.to(dev)[sel]  # (T,) the case-order row of each scored position, in packed order
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=dev)

    def case_order(t: torch.Tensor) -> torch.Tensor:
        return t[sel][inv]

    routing = {f"layers.{l}": Routing(experts=case_order(experts[l]), scores=case_order(scores[l]))
               for l in range(c.layers)}
    return Outcome(logprobs=process(case_order(logp), case, nx), tokens=tokens, routing=routing)


# ---------------------------------------------------------------------------------------------
# Rollout: padded prefill, then batched decode of every response token from a static KV cache
# ---------------------------------------------------------------------------------------------
def rollout(inp: Any, forward: Forward, nx: Numerics) -> Outcome:
    if isinstance(inp, schema1.Schema1Inputs):
        return schema1.rollout(inp, forward, nx)
    case, c, dev = inp.case, inp.cfg, inp.device
    b = case.batch_size
    resp = torch.tensor(case.seq_lens)  # (B,) response lengths R_j
    offs = torch.tensor(case.offsets)  # (B,) first case row of each sequence
    lens = torch.tensor([len(p) for p in inp.prefixes])  # (B,) prefix lengths L_j
    width, steps = int(lens.max()), int(resp.max())
    cap = width + steps - 1  # static cache slots: the prefix and every fed response token but the last
    left = case.pad_side == "left"
    start = (width - lens) if left else torch.zeros(b, dtype=torch.long)  # (B,) first real slot

    # prefill: (B, W) prefixes on the pad side
    slot = torch.arange(width)  # (W,)
    valid = (slot[None] >= start[:, None]) & (slot[None] < (start + lens)[:, None])  # (B, W)
    ids = torch.full((b, width), PAD_ID, dtype=torch.long)
    for j, p in enumerate(inp.prefixes):
        ids[j, int(start[j]):int(start[j]) + len(p)] = p
    pos = slot[None] - (0 if nx.positions == "pad_start" else start[:, None])  # (B, W)
    pos = torch.where(valid, pos, 0)
    last = start + lens - 1  # (B,) slot of each prefix's last token: it gives response token 0
    rows = torch.full((b, width), -1, dtype=torch.long)  # (B, W) case-order row each slot's output scores
    rows[torch.arange(b), last] = offs
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (causal & valid[:, None, :]) | torch.eye(width, dtype=torch.bool)  # (B, W, W)

    t = case.n_tokens
    out_lp = torch.zeros(t, c.vocab, dtype=torch.float32, device=dev)  # (T, V)
    out_tok = torch.zeros(t, dtype=torch.long)  # (T,)
    out_ex = torch.zeros(c.layers, t, c.top_k, dtype=torch.long, device=dev)  # (L, T, k)
    out_sc = torch.zeros(c.layers, t, c.experts, dtype=torch.float32, device=dev)  # (L, T, E)
    common = _common(inp)
    forced_all = inp.forced

    def run(ids, pos, mask, past_k, past_v, rows):
        forced = torch.where(rows >= 0, forced_all[rows.clamp_min(0)], False)
        rep, rep_on = _no_replay(inp, *ids.shape)
        return forward(ids.to(dev), pos.to(dev), mask[:, None].to(dev), past_k, past_v, forced=forced.to(dev),
                       replay=rep, replay_on=rep_on, nx=nx, rows=rows.to(dev), **common)

    kv = DT[nx.kv_cache]
    empty = torch.zeros(c.layers, b, c.kv_heads, 0, c.head_dim, dtype=kv, device=dev)
    logp, k_new, v_new, experts, scores = run(ids, pos, mask, empty, empty, rows)
    cache_k = torch.zeros(c.layers, b, c.kv_heads, cap, c.head_dim, dtype=kv, device=dev)  # (L, B, nkv, S, D)
    cache_v = torch.zeros_like(cache_k)
    cache_k[:, :, :, :width] = k_new
    cache_v[:, :, :, :width] = v_new
    cache_ok = torch.zeros(b, cap, dtype=torch.bool)  # (B, S) slots holding a real token
    cache_ok[:, :width] = valid
    ar = torch.arange(b)
    step_logp = logp[ar.to(dev), last.to(dev)]  # (B, V) the distributions of response token 0
    step_ex, step_sc = experts[:, ar.to(dev), last.to(dev)], scores[:, ar.to(dev), last.to(dev)]  # (L, B, .)
    u = inp.uniforms  # (T,) float64

    for i in range(steps):
        live = i < resp  # (B,) sequences with a token i
        at = offs[live] + i  # (n,) their case rows
        live_d = live.to(dev)
        lp = process(step_logp, case, nx)  # (B, V)
        ui = torch.where(live, u[(offs + i).clamp_max(t - 1)], 0.5)  # (B,)
        tok = sample_rows(lp, ui).cpu()  # (B,)
        out_lp[at.to(dev)] = lp[live_d]
        out_tok[at] = tok[live]
        out_ex[:, at.to(dev)] = step_ex[:, live_d]
        out_sc[:, at.to(dev)] = step_sc[:, live_d].float()
        if i == steps - 1:
            break
        # feed token i of every sequence at its next slot; its output gives token i + 1
        w = (width + i) if left else (lens + i)  # slot written: () left, (B,) right
        w = torch.as_tensor(w).expand(b)  # (B,)
        step_pos = (w - (0 if nx.positions == "pad_start" else start))[:, None]  # (B, 1) = L_j + i
        step_rows = torch.where(i + 1 < resp, offs + i + 1, -1)[:, None]  # (B, 1)
        step_mask = torch.cat([cache_ok, torch.ones(b, 1, dtype=torch.bool)], 1)[:, None, :]  # (B, 1, S+1)
        logp, k_new, v_new, experts, scores = run(tok[:, None], step_pos, step_mask, cache_k, cache_v, step_rows)
        idx = w.to(dev)[None, :, None, None, None].expand(c.layers, b, c.kv_heads, 1, c.head_dim)
        cache_k.scatter_(3, idx, k_new)
        cache_v.scatter_(3, idx, v_new)
        cache_ok[ar, w] = True
        step_logp, step_ex, step_sc = logp[:, 0], experts[:, :, 0], scores[:, :, 0]

    routing = {f"layers.{l}": Routing(experts=out_ex[l], scores=out_sc[l]) for l in range(c.layers)}
    return Outcome(logprobs=out_lp, tokens=out_tok, routing=routing)
