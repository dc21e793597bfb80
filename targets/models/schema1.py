"""The schema-1 layout of the model pairs, kept so that repros recorded before case schema 2 replay
bit-for-bit (`case.streams == "single"`). New cases use `paths` (prompt + response, batched decode).

Token layout of one sequence of n scored tokens x_0..x_{n-1} (case order: the case's rows):

    positions   0     1 .. C      C+1 .. C+n-1
    input       BOS   context     x_0 .. x_{n-2}        (C = cfg.context unscored tokens, 0 on CPU)
    row         -     -  .. 0     1   .. n-1            (row j: the distribution x_j was drawn from)

The first n - d tokens are the prompt (drawn from the case's seed), the last d = min(decode, n) are
sampled by the rollout (`params["decode"]`, at `params["temperature"]` applied on both paths through
the LM head's scale). The rollout prefills the prompt in one padded forward and decodes the remaining
d - 1 tokens one per step with a growing KV cache; the trainer packs the finished sequences into rows
and scores every token in one forward. Nothing here may change what a recorded case computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harness import Case, Outcome, Routing
from harness.strategies import forced_tokens

from .moe_decoder import BOS_ID, PAD_ID, ModelConfig, Numerics

Forward = Callable[..., tuple]  # forward(ids, pos, mask, past_k, past_v, tie, forced, gap, scale, replay,
#                                           replay_on, nx=..., rows=...) -> (logprobs, k, v, experts, scores)


@dataclass
class Schema1Inputs:
    """Everything both paths need for one case (tensors drawn from case.seed on CPU, then moved)."""

    case: Case
    cfg: ModelConfig
    device: str
    weight_seed: int  # the model's weights are weights(cfg, weight_seed)
    prompt: torch.Tensor  # (T,) int64 candidate prompt tokens in case order (the first n - d of each sequence)
    context: torch.Tensor  # (B, C) int64 unscored context tokens per sequence
    forced: torch.Tensor  # (T,) bool tokens the tie layer's router forces to the top-k boundary
    tie_layer: int  # layer whose router input is nudged (-1: none)
    decode: int  # tokens sampled per sequence (capped at its length)
    temperature: float  # sampling temperature (both paths score at it)
    extra: dict[str, Any] = field(default_factory=dict)  # per-pair state (modules, sessions) for triage

    @property
    def scale(self) -> float:
        return self.case.logit_scale / self.temperature

    def tensor(self, value: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(value, dtype=dtype).to(self.device)


def make_inputs(case: Case, cfg: ModelConfig, device: str, weight_seed: int) -> Schema1Inputs:
    t = case.n_tokens
    prompt = torch.randint(2, cfg.vocab, (t,), generator=case.generator("prompt"))  # (T,)
    context = torch.randint(2, cfg.vocab, (case.batch_size, cfg.context), generator=case.generator("context"))
    forced = forced_tokens(case, t) if case.tie_fraction > 0 else torch.zeros(t, dtype=torch.bool)  # (T,)
    tie_layer = int(case.params.get("tie_layer", 0)) % cfg.layers if case.tie_fraction > 0 else -1
    return Schema1Inputs(case=case, cfg=cfg, device=device, weight_seed=weight_seed, prompt=prompt,
                       context=context, forced=forced, tie_layer=tie_layer,
                       decode=int(case.params.get("decode", 1)),
                       temperature=float(case.params.get("temperature", 1.0)))


# Added to the case's boundary gap. Gaps under float32 resolution are exact ties that every engine
# breaks its own way: packed vs decode GEMMs (last-bit differences) and torch vs ONNX Runtime top-k
# flip them even when both paths are float32 (measured: 43 of 198 `model.aligned` cases over the
# threshold without this floor). With it, flips come from precision differences (a bf16 router
# rounds logits by ~4e-3), which is what the near-tie axis is for.
TIE_FLOOR = 1e-5


def _common(inp: Schema1Inputs) -> dict[str, torch.Tensor]:
    tie = torch.zeros(inp.cfg.layers, dtype=torch.bool)
    if inp.tie_layer >= 0:
        tie[inp.tie_layer] = True
    return {"tie": tie.to(inp.device), "gap": inp.tensor(inp.case.tie_gap + TIE_FLOOR, torch.float32),
            "scale": inp.tensor(inp.scale, torch.float32)}


def _empty_past(inp: Schema1Inputs, batch: int, nx: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
    from .moe_decoder import DT

    c = inp.cfg
    z = torch.zeros(c.layers, batch, c.kv_heads, 0, c.head_dim, dtype=DT[nx.kv_cache], device=inp.device)
    return z, z.clone()


def _no_replay(inp: Schema1Inputs, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = inp.cfg
    return (torch.zeros(c.layers, b, s, c.top_k, dtype=torch.int64, device=inp.device),
            torch.zeros(b, s, dtype=torch.bool, device=inp.device))


def _offsets(seq_lens: tuple[int, ...]) -> list[int]:
    out, acc = [], 0
    for n in seq_lens:
        out.append(acc)
        acc += n
    return out


# ---------------------------------------------------------------------------------------------
# Trainer: packed rows, one teacher-forced forward
# ---------------------------------------------------------------------------------------------
def trainer(inp: Schema1Inputs, tokens: Any, forward: Forward, nx: Numerics,
            replay: dict[str, Routing] | None = None) -> Outcome:
    """Log-probabilities of `tokens` (T,) (the rollout's, case order) from packed rows."""
    case, c = inp.case, inp.cfg
    tokens = torch.as_tensor(tokens).long().cpu()  # (T,)
    starts = _offsets(case.seq_lens)
    packs = case.packed_rows()
    seqs = []  # per sequence: input ids, scored-row ids
    for s, n in enumerate(case.seq_lens):
        x = tokens[starts[s]:starts[s] + n]
        ids = torch.cat([torch.tensor([BOS_ID]), inp.context[s], x[:-1]])  # (C+n,)
        rows = torch.cat([torch.full((c.context,), -1), torch.arange(starts[s], starts[s] + n)])  # (C+n,)
        seqs.append((ids, rows))
    width = max(sum(len(seqs[s][0]) for s in pack) for pack in packs)
    r = len(packs)
    ids = torch.full((r, width), PAD_ID, dtype=torch.long)  # (R, W)
    pos = torch.zeros(r, width, dtype=torch.long)  # (R, W)
    seg = torch.full((r, width), -1, dtype=torch.long)  # (R, W) sequence id, -1 = padding
    rows = torch.full((r, width), -1, dtype=torch.long)  # (R, W) case-order row, -1 = unscored
    for i, pack in enumerate(packs):
        at = 0
        for s in pack:
            sid, srows = seqs[s]
            m = len(sid)
            ids[i, at:at + m] = sid
            seg[i, at:at + m] = s
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
                           for l in range(c.layers)]).to(inp.device)  # (L, R, W, k)
        rep_on = (rows >= 0).to(inp.device)
    past_k, past_v = _empty_past(inp, r, nx)
    dev = inp.device
    logp, _, _, experts, scores = forward(ids.to(dev), pos.to(dev), mask[:, None].to(dev), past_k, past_v,
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
    return Outcome(logprobs=case_order(logp), tokens=tokens, routing=routing)


# ---------------------------------------------------------------------------------------------
# Rollout: padded prefill, then token-by-token decode with a KV cache, sampling as it goes
# ---------------------------------------------------------------------------------------------
def rollout(inp: Schema1Inputs, forward: Forward, nx: Numerics) -> Outcome:
    case, c, dev = inp.case, inp.cfg, inp.device
    b, starts = case.batch_size, _offsets(case.seq_lens)
    d = [min(inp.decode, n) for n in case.seq_lens]  # tokens sampled per sequence
    pre = [c.context + (n - ds + 1 if ds else n) for n, ds in zip(case.seq_lens, d)]  # prefill length
    steps = [c.context + n - p for n, p in zip(case.seq_lens, pre)]  # decode steps after prefill
    tokens = inp.prompt.clone()  # (T,) prompt tokens now, sampled ones written in below
    width = max(pre)
    ids = torch.full((b, width), PAD_ID, dtype=torch.long)  # (B, P)
    pos = torch.zeros(b, width, dtype=torch.long)  # (B, P)
    valid = torch.zeros(b, width, dtype=torch.bool)  # (B, P) slot holds a real token
    rows = torch.full((b, width), -1, dtype=torch.long)  # (B, P)
    for s in range(b):
        off = width - pre[s] if case.pad_side == "left" else 0
        n_in = pre[s] - 1 - c.context  # prompt tokens fed in the prefill
        seq = torch.cat([torch.tensor([BOS_ID]), inp.context[s], tokens[starts[s]:starts[s] + n_in]])
        ids[s, off:off + pre[s]] = seq
        pos[s, off:off + pre[s]] = torch.arange(pre[s])
        valid[s, off:off + pre[s]] = True
        rows[s, off + c.context:off + pre[s]] = torch.arange(starts[s], starts[s] + pre[s] - c.context)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (causal & valid[:, None, :]) | torch.eye(width, dtype=torch.bool)  # (B, P, P)
    out_lp = torch.zeros(case.n_tokens, c.vocab, dtype=torch.float32, device=dev)  # (T, V)
    out_ex = torch.zeros(c.layers, case.n_tokens, c.top_k, dtype=torch.long, device=dev)  # (L, T, k)
    out_sc = torch.zeros(c.layers, case.n_tokens, c.experts, dtype=torch.float32, device=dev)  # (L, T, E)
    common = _common(inp)
    gen = case.generator("sample")

    def run(ids, pos, mask, past_k, past_v, rows):
        forced = torch.where(rows >= 0, inp.forced[rows.clamp_min(0)], False)
        rep, rep_on = _no_replay(inp, *ids.shape)
        out = forward(ids.to(dev), pos.to(dev), mask[:, None].to(dev), past_k, past_v, forced=forced.to(dev),
                      replay=rep, replay_on=rep_on, nx=nx, rows=rows.to(dev), **common)
        logp, k_new, v_new, experts, scores = out
        sel = (rows >= 0).to(dev)
        at = rows.to(dev)[sel]
        out_lp[at] = logp[sel].float()
        out_ex[:, at] = experts[:, sel]
        out_sc[:, at] = scores[:, sel].float()
        return logp, k_new, v_new

    def sample(lp_rows: torch.Tensor) -> torch.Tensor:
        p = lp_rows.detach().double().cpu().exp()
        return torch.multinomial(p, 1, generator=gen).squeeze(-1)  # (n,)

    past_k, past_v = _empty_past(inp, b, nx)
    logp, past_k, past_v = run(ids, pos, mask, past_k, past_v, rows)
    last = torch.full((b,), PAD_ID, dtype=torch.long)  # the token each sequence feeds next
    live = [s for s in range(b) if d[s]]
    if live:
        slot = [width - 1 if case.pad_side == "left" else pre[s] - 1 for s in live]
        new = sample(logp[torch.tensor(live, device=dev), torch.tensor(slot, device=dev)])
        for s, tok in zip(live, new.tolist()):
            row = starts[s] + pre[s] - c.context - 1
            tokens[row] = tok
            last[s] = tok
    for t in range(1, max(steps) + 1):
        active = [s for s in range(b) if t <= steps[s]]
        step_ids = torch.where(torch.tensor([t <= st for st in steps]), last, PAD_ID)[:, None]  # (B, 1)
        step_pos = torch.tensor([pre[s] + t - 1 if t <= steps[s] else 0 for s in range(b)])[:, None]  # (B, 1)
        step_rows = torch.tensor([starts[s] + pre[s] - c.context - 1 + t if t <= steps[s] else -1
                                  for s in range(b)])[:, None]  # (B, 1)
        valid = torch.cat([valid, torch.tensor([t <= st for st in steps])[:, None]], 1)  # (B, P+t)
        step_mask = valid.clone()
        step_mask[:, -1] = True
        logp, k_new, v_new = run(step_ids, step_pos, step_mask[:, None, :], past_k, past_v, step_rows)
        past_k, past_v = torch.cat([past_k, k_new], 3), torch.cat([past_v, v_new], 3)
        new = sample(logp[torch.tensor(active, device=dev), 0])
        for s, tok in zip(active, new.tolist()):
            row = starts[s] + pre[s] - c.context - 1 + t
            tokens[row] = tok
            last[s] = tok
    routing = {f"layers.{l}": Routing(experts=out_ex[l], scores=out_sc[l]) for l in range(c.layers)}
    return Outcome(logprobs=out_lp, tokens=tokens, routing=routing)
