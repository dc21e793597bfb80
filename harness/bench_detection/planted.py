"""Planted bug classes of the detection benchmark: each a buggy target pair and its fixed twin.

Every class reproduces one real way a rollout engine and a trainer disagree, at op level (small
tensors, small vocabularies: a case costs milliseconds on one CPU thread). Each has

- `buggy`: a `diverges` pair whose rollout (or trainer) carries the bug;
- `fixed`: its twin, the same computation with the bug removed (an `aligned` pair);
- `axes`: what a user fuzzing that op would declare: the `Axes()` defaults plus the axes the op
  needs (prompts for a decode op, sampling knobs for a sampler, a router for a router), never
  bounds tuned to the trigger;
- `simplest`: the bug's simplest trigger as a predicate on a case (one sequence where one suffices,
  every knob at its neutral value except the trigger); the benchmark also checks that no simpler
  neighbour of a repro still fails (`Case.simpler_neighbours`).

The pairs are built here and never registered: they do not appear in `harness list` or in a
campaign over the registry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch

from ..case import Case
from ..pairs import Axes, Outcome, Readout, Routing, RoutingAxes, TargetPair
from ..sampling import process_logits, sample_rows

HEAD_DIM = 16  # one attention head of this width in the attention classes
VOCAB = 128  # readout vocabulary of the attention classes


@dataclass(frozen=True)
class PlantedClass:
    name: str  # short class name, e.g. "batch_switch"
    bug: str  # one line: what the buggy path does wrong
    trigger: str  # one line: what a case needs to expose it
    buggy: TargetPair  # expected "diverges"
    fixed: TargetPair  # expected "aligned": the same pair with the bug removed
    simplest: Callable[[Case], bool]  # the expected minimal form of a repro
    simplest_text: str  # that form in words
    ties: bool = False  # a near-tie / exact-tie class (the generator must beat random by >= 10x here)


def neutral(case: Case, axes: Axes, *trigger: str) -> bool:
    """Every knob of the case at its neutral value, except the fields named in `trigger`."""
    checks = {
        "temperature": case.temperature == 1.0,
        "top_p": case.top_p == 1.0,
        "sample_top_k": case.sample_top_k == 0,
        "pad_side": case.pad_side == axes.pad_sides[0],
        "row_capacity": case.row_capacity == 0,
        "order": case.order == (),
        "tie_fraction": case.tie_fraction == 0.0,
        "logit_scale": case.logit_scale == axes.logit_scale[0],
        "prompt_lens": not any(case.prompt_lens),
        "dtype": case.dtype == axes.dtypes[0],
    }
    return all(ok for name, ok in checks.items() if name not in trigger)


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------
def position_rows(case: Case, j: int, width: int, salt: str) -> torch.Tensor:
    """(prompt + response length of sequence j, width) float32, drawn row by row from sequence j's
    own stream (a shorter response is a prefix; other sequences are untouched)."""
    g = case.seq_generator(j, salt)
    return torch.stack([torch.randn(width, generator=g) for _ in range(case.total_len(j))])


@lru_cache(maxsize=8)
def fixed_randn(*shape: int, salt: int = 0) -> torch.Tensor:
    """A weight that belongs to the op, not to the case: the same for every case."""
    g = torch.Generator().manual_seed(0xB06 + 1009 * salt + sum(shape))
    return torch.randn(*shape, generator=g)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     allowed: torch.Tensor | None = None, alibi: float = 0.0) -> torch.Tensor:
    """(..., L, D) -> (..., L, D) causal softmax attention in float32; `allowed` (..., L, L) narrows
    which keys a query may see (a query with no key at all gets zeros); `alibi` is the slope of an
    ALiBi distance penalty (recent keys weigh more)."""
    n = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (..., L, L)
    if alibi:
        dist = torch.arange(n)[:, None] - torch.arange(n)[None, :]  # (L, L) query - key
        scores = scores - alibi * dist.clamp_min(0)
    mask = torch.ones(n, n, dtype=torch.bool).tril()  # (L, L)
    if allowed is not None:
        mask = mask & allowed
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return p @ v  # (..., L, D)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (..., L, D) at integer positions (..., L), angles computed in bf16 as a
    bf16 engine does (pos * inv_freq rounded to bf16), rotation in float32."""
    d = x.shape[-1]
    inv = (1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)).to(torch.bfloat16)  # (D/2,)
    ang = (pos.to(torch.bfloat16)[..., None] * inv).float()  # (..., L, D/2)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def sampled(case: Case, logprobs: torch.Tensor) -> Outcome:
    """A rollout outcome: its log-probabilities and the tokens it sampled from them, each sequence's
    from its own stream (so dropping a sequence leaves the others' tokens, and their k3, alone)."""
    tokens = sample_rows(logprobs, case.token_uniforms("sample"))
    return Outcome(logprobs=logprobs, tokens=tokens)


def _finish(fn: Callable, rollout: bool) -> Callable:
    """A path whose hidden states go through the shared float64 readout (`Readout(VOCAB)`) inside the
    path, and, for the rollout, tokens sampled from its own log-probabilities (`sampled`)."""
    def path(inp: dict) -> Outcome:
        out, case = fn(inp), inp["case"]
        if out.logprobs is None:
            out.logprobs = Readout(VOCAB).apply(out.hidden, case)
        if rollout and out.tokens is None:
            out.tokens = sample_rows(out.logprobs, case.token_uniforms("sample"))
        return out
    return path


def _pair(name: str, expected: str, build: Callable, rollout: Callable, trainer: Callable, axes: Axes,
          description: str) -> TargetPair:
    pair = TargetPair(name=f"planted.{name}", kind="op", expected=expected, build=build,
                      trainer=_finish(trainer, rollout=False), rollout=_finish(rollout, rollout=True), axes=axes,
                      devices=("cpu",), description=description,
                      source="harness.bench_detection.planted")
    pair.validate()
    return pair


def _class(name: str, bug: str, trigger: str, build: Callable, bad: Callable, good: Callable,
           trainer: Callable, axes: Axes, simplest: Callable[[Case], bool], simplest_text: str,
           ties: bool = False, bug_in_trainer: bool = False) -> PlantedClass:
    if bug_in_trainer:  # `bad`/`good` are trainers, `trainer` is the (shared) rollout
        buggy = _pair(name, "diverges", build, trainer, bad, axes, bug)
        fixed = _pair(f"{name}.fixed", "aligned", build, trainer, good, axes, f"fixed twin of {name}")
    else:
        buggy = _pair(name, "diverges", build, bad, trainer, axes, bug)
        fixed = _pair(f"{name}.fixed", "aligned", build, good, trainer, axes, f"fixed twin of {name}")
    return PlantedClass(name, bug, trigger, buggy, fixed, simplest, simplest_text, ties)


def _lens(case: Case) -> list[int]:
    return list(case.seq_lens)


# ---------------------------------------------------------------------------------------------
# 1. A batch-size kernel switch
# ---------------------------------------------------------------------------------------------
SWITCH_K, SWITCH_TILE, SWITCH_VOCAB = 80, 64, 128


def _switch_build(case: Case, device: str) -> dict:
    return {"case": case, "h": case.token_randn(SWITCH_K), "w": fixed_randn(SWITCH_K, SWITCH_VOCAB)}


def _switch_logprobs(inp: dict, k: int) -> torch.Tensor:
    h, w, case = inp["h"].double(), inp["w"].double(), inp["case"]
    logits = h[:, :k] @ w[:k] * (case.logit_scale / math.sqrt(SWITCH_K))  # (T, V)
    return torch.log_softmax(logits, dim=-1)


def _switch_bad(inp: dict) -> Outcome:  # the split-K kernel taken at batch > 8 drops the K remainder
    k = SWITCH_K if inp["case"].batch_size <= 8 else SWITCH_K // SWITCH_TILE * SWITCH_TILE
    return Outcome(logprobs=_switch_logprobs(inp, k))


def _switch_good(inp: dict) -> Outcome:
    return Outcome(logprobs=_switch_logprobs(inp, SWITCH_K))


def batch_switch() -> PlantedClass:
    axes = Axes()
    return _class(
        "batch_switch", "the rollout's GEMM switches to a split-K kernel at batch > 8 that drops the K remainder",
        "batch size >= 9", _switch_build, _switch_bad, _switch_good, _switch_good, axes,
        lambda c: c.batch_size == 9 and set(c.seq_lens) == {1} and neutral(c, axes),
        "9 sequences of 1 token, knobs neutral")


# ---------------------------------------------------------------------------------------------
# 2. Late KV-cache slots stored in lower precision
# ---------------------------------------------------------------------------------------------
LATE_SLOT = 32
KV_ALIBI = 1.0  # an ALiBi head: a query weighs its own and the last few slots most


def _kv_build(case: Case, device: str) -> dict:
    return {"case": case, "qkv": [position_rows(case, j, 3 * HEAD_DIM, "qkv").view(-1, 3, HEAD_DIM)
                                  for j in range(case.batch_size)]}


def _kv_decode(inp: dict, late_dtype: torch.dtype | None) -> Outcome:
    case, outs = inp["case"], []
    for j, qkv in enumerate(inp["qkv"]):
        q, k, v = qkv.unbind(1)  # (L, D) each
        if late_dtype is not None and k.shape[0] > LATE_SLOT:  # cache slots past LATE_SLOT, low precision
            k, v = k.clone(), v.clone()
            k[LATE_SLOT:] = k[LATE_SLOT:].to(late_dtype).float()
            v[LATE_SLOT:] = v[LATE_SLOT:].to(late_dtype).float()
        outs.append(causal_attention(q, k, v, alibi=KV_ALIBI)[case.prompt_len(j):])  # the response rows
    return Outcome(hidden=torch.cat(outs))


def late_kv() -> PlantedClass:
    axes = Axes(prompt_len=(0, 64))
    return _class(
        "late_kv", "the rollout's KV cache stores slots past 32 in fp8 (e5m2); an ALiBi head",
        "a sequence longer than 32 tokens (prompt + response)", _kv_build,
        lambda inp: _kv_decode(inp, torch.float8_e5m2), lambda inp: _kv_decode(inp, None),
        lambda inp: _kv_decode(inp, None), axes,
        lambda c: c.batch_size == 1 and c.total_len(0) > LATE_SLOT and neutral(c, axes, "prompt_lens", "logit_scale"),
        "1 sequence longer than 32 tokens, knobs neutral (any logit scale)")


# ---------------------------------------------------------------------------------------------
# 3, 4. A padded batch: left-pad attention mask, left-pad position ids
# ---------------------------------------------------------------------------------------------
def _pad_build(case: Case, device: str) -> dict:
    return {"case": case, "qkv": case.token_randn((3, HEAD_DIM)), "pad": fixed_randn(3, HEAD_DIM, salt=1)}


def _per_sequence(inp: dict, use_rope: bool) -> Outcome:
    """The trainer: each sequence on its own, positions 0..n-1."""
    outs = []
    for qkv in torch.split(inp["qkv"], _lens(inp["case"])):
        q, k, v = qkv.unbind(1)  # (n, D)
        if use_rope:
            pos = torch.arange(q.shape[0])
            q, k = rope(q, pos), rope(k, pos)
        outs.append(causal_attention(q, k, v))
    return Outcome(hidden=torch.cat(outs))


def _padded(inp: dict, key_mask: bool, use_rope: bool, positions_from_mask: bool) -> Outcome:
    """The rollout: one padded batch (pad token's q/k/v in the pads) on the case's pad side."""
    case = inp["case"]
    lens = _lens(case)
    b, n = len(lens), max(lens)
    x = inp["pad"].expand(b, n, 3, HEAD_DIM).clone()  # (B, L, 3, D)
    real = torch.zeros(b, n, dtype=torch.bool)  # (B, L)
    for i, qkv in enumerate(torch.split(inp["qkv"], lens)):
        sl = slice(0, lens[i]) if case.pad_side == "right" else slice(n - lens[i], n)
        x[i, sl], real[i, sl] = qkv, True
    q, k, v = x.unbind(2)  # (B, L, D)
    if use_rope:
        pos = (real.cumsum(1) - 1).clamp_min(0) if positions_from_mask else torch.arange(n).expand(b, n)
        q, k = rope(q, pos), rope(k, pos)
    allowed = real[:, None, :].expand(b, n, n) if key_mask else None  # (B, L, L) keys that are real tokens
    return Outcome(hidden=causal_attention(q, k, v, allowed)[real])  # (T, D) in case order


def leftpad_mask() -> PlantedClass:
    axes = Axes()
    return _class(
        "leftpad_mask", "the rollout's attention mask is causal only (pads are not masked): left pads are attended",
        "left padding (a batch of unequal lengths)", _pad_build,
        lambda inp: _padded(inp, key_mask=False, use_rope=False, positions_from_mask=True),
        lambda inp: _padded(inp, key_mask=True, use_rope=False, positions_from_mask=True),
        lambda inp: _per_sequence(inp, use_rope=False), axes,
        lambda c: c.batch_size == 2 and c.pad_side == "left" and neutral(c, axes, "pad_side"),
        "2 sequences, left padding, other knobs neutral")


def leftpad_positions() -> PlantedClass:
    axes = Axes()
    return _class(
        "leftpad_positions", "the rollout's position ids ignore left padding (arange over the padded row), "
                             "bf16 rotary angles",
        "left padding with a large length difference (the shift shows through bf16 angle rounding)", _pad_build,
        lambda inp: _padded(inp, key_mask=True, use_rope=True, positions_from_mask=False),
        lambda inp: _padded(inp, key_mask=True, use_rope=True, positions_from_mask=True),
        lambda inp: _per_sequence(inp, use_rope=True), axes,
        lambda c: c.batch_size == 2 and c.pad_side == "left" and neutral(c, axes, "pad_side", "logit_scale"),
        "2 sequences, left padding, other knobs neutral (any logit scale)",
        )


# ---------------------------------------------------------------------------------------------
# 5, 6, 11. Sampling: temperature applied twice, truncated sampling, a top-p off by one
# ---------------------------------------------------------------------------------------------
SAMPLER_AXES = Axes(temperature=(0.25, 2.0), top_p=(0.5, 1.0), sample_top_k=(0, 64))


def _sampler_build(vocab: int) -> Callable:
    def build(case: Case, device: str) -> dict:
        return {"case": case, "logits": case.token_randn(vocab) * case.logit_scale}
    return build


def _trainer_scores(inp: dict) -> Outcome:
    c = inp["case"]
    return Outcome(logprobs=process_logits(inp["logits"], c.temperature, c.sample_top_k, c.top_p))


def _rollout_samples(inp: dict, temperature: float | None = None, top_k: int | None = None) -> Outcome:
    c = inp["case"]
    t = c.temperature if temperature is None else temperature
    k = c.sample_top_k if top_k is None else top_k
    return sampled(c, process_logits(inp["logits"], t, k, c.top_p))


def temperature_twice() -> PlantedClass:
    axes = SAMPLER_AXES
    return _class(
        "temperature_twice", "the rollout divides the logits by the temperature twice",
        "temperature != 1", _sampler_build(128),
        lambda inp: _rollout_samples(inp, temperature=inp["case"].temperature ** 2),
        _rollout_samples, _trainer_scores, axes,
        lambda c: c.n_tokens == 1 and c.temperature != 1.0 and neutral(c, axes, "temperature"),
        "1 token, temperature != 1, other knobs neutral")


def truncated_sampling() -> PlantedClass:
    axes = SAMPLER_AXES
    return _class(
        "truncated_sampling", "the rollout samples with top-k 50 when sampling top-k is off (a library default); "
                              "the trainer scores the full distribution",
        "sampling top-k off (the neutral value)", _sampler_build(128),
        lambda inp: _rollout_samples(inp, top_k=inp["case"].sample_top_k or 50),
        _rollout_samples, _trainer_scores, axes,
        lambda c: c.n_tokens == 1 and neutral(c, axes),
        "1 token, every knob neutral")


def _nucleus_exclusive(logits: torch.Tensor, c: Case) -> torch.Tensor:
    """Top-p that drops the token which crosses top_p (keeps mass strictly below it, at least one)."""
    x = logits.float() / c.temperature
    if 0 < c.sample_top_k < x.shape[-1]:
        kth = torch.topk(x, c.sample_top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if c.top_p < 1.0:
        sx, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sx, dim=-1).cumsum(-1)
        drop = cum >= c.top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def top_p_exclusive() -> PlantedClass:
    axes = SAMPLER_AXES
    return _class(
        "top_p_exclusive", "the rollout's nucleus drops the token that crosses top-p (the trainer keeps it)",
        "top-p < 1", _sampler_build(128),
        lambda inp: sampled(inp["case"], _nucleus_exclusive(inp["logits"], inp["case"])),
        _rollout_samples, _trainer_scores, axes,
        lambda c: c.n_tokens == 1 and c.top_p < 1.0 and neutral(c, axes, "top_p"),
        "1 token, top-p < 1, other knobs neutral")


# ---------------------------------------------------------------------------------------------
# 7, 8. Routers: a bias stored in bf16 (near ties), exact ties broken the other way
# ---------------------------------------------------------------------------------------------
ROUTER_VOCAB = 64
BIAS_STD = 0.02  # a load-balancing bias: small, so its bf16 rounding moves scores by ~1e-4


def _experts_out(case: Case, n_experts: int) -> torch.Tensor:
    return torch.randn(n_experts, ROUTER_VOCAB, generator=case.generator("experts"), dtype=torch.float64)


def _route(scores: torch.Tensor, k: int, prefer_high: bool) -> torch.Tensor:
    """(T, E) -> (T, k) top-k expert ids; exact ties go to the lower id, or the higher with prefer_high."""
    if prefer_high:
        flipped = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[:, :k]
        return scores.shape[-1] - 1 - flipped
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def _moe_outcome(case: Case, scores: torch.Tensor, experts_out: torch.Tensor, prefer_high: bool) -> Outcome:
    chosen = _route(scores, case.top_k, prefer_high)  # (T, k)
    w = torch.softmax(scores.double().gather(1, chosen), dim=-1)  # (T, k)
    logits = (w[..., None] * experts_out[chosen]).sum(1) * case.logit_scale  # (T, V)
    return Outcome(logprobs=torch.log_softmax(logits, -1), routing={"router": Routing(chosen, scores)})


def _bias_build(case: Case, device: str) -> dict:
    from ..strategies import near_tie_logits

    e = case.n_experts
    bias = torch.randn(e, generator=case.generator("bias"), dtype=torch.float64) * BIAS_STD  # (E,)
    scores = near_tie_logits(case.token_randn(e).double() + bias, case)  # (T, E) fp64, ties at the boundary
    return {"case": case, "logits": scores - bias, "bias": bias, "experts": _experts_out(case, e)}


def _bias_scores(inp: dict, bias_dtype: torch.dtype) -> Outcome:
    scores = inp["logits"] + inp["bias"].to(bias_dtype).double()
    return _moe_outcome(inp["case"], scores, inp["experts"], prefer_high=False)


def router_bias() -> PlantedClass:
    axes = Axes(routing=RoutingAxes())
    return _class(
        "router_bias", "the rollout stores the router's load-balancing bias in bf16 (near-tie experts flip)",
        "a token within ~1e-4 of a top-k tie", _bias_build,
        lambda inp: _bias_scores(inp, torch.bfloat16), lambda inp: _bias_scores(inp, torch.float64),
        lambda inp: _bias_scores(inp, torch.float64), axes,
        lambda c: c.n_tokens == 1 and c.tie_fraction > 0 and neutral(c, axes, "tie_fraction"),
        "1 token forced near a tie, other knobs neutral", ties=True)


def _tie_build(case: Case, device: str) -> dict:
    from ..strategies import near_tie_logits

    scores = near_tie_logits(case.token_randn(case.n_experts), case)  # (T, E) fp32: tiny gaps round to ties
    return {"case": case, "scores": scores, "experts": _experts_out(case, case.n_experts)}


def exact_tie_order() -> PlantedClass:
    axes = Axes(routing=RoutingAxes())
    return _class(
        "exact_tie_order", "the rollout's top-k breaks exact ties toward the higher expert id, the trainer's "
                           "toward the lower",
        "a token with an exact tie at the top-k boundary", _tie_build,
        lambda inp: _moe_outcome(inp["case"], inp["scores"], inp["experts"], prefer_high=True),
        lambda inp: _moe_outcome(inp["case"], inp["scores"], inp["experts"], prefer_high=False),
        lambda inp: _moe_outcome(inp["case"], inp["scores"], inp["experts"], prefer_high=False), axes,
        lambda c: c.n_tokens == 1 and c.tie_fraction > 0 and neutral(c, axes, "tie_fraction"),
        "1 token forced to an exact tie, other knobs neutral", ties=True)


# ---------------------------------------------------------------------------------------------
# 9. Softmax overflow
# ---------------------------------------------------------------------------------------------
COS_DIM, COS_VOCAB = 4, 64


def _cos_build(case: Case, device: str) -> dict:
    h = torch.nn.functional.normalize(case.token_randn(COS_DIM), dim=-1)  # (T, H)
    w = torch.nn.functional.normalize(fixed_randn(COS_DIM, COS_VOCAB, salt=2), dim=0)  # (H, V) unit columns
    return {"case": case, "logits": (h @ w) * case.logit_scale}  # (T, V): scale x cosine


def _softmax_fp16(inp: dict, subtract_max: bool) -> Outcome:
    x = inp["logits"]
    if subtract_max:
        x = x - x.max(-1, keepdim=True).values
    e = torch.exp(x.half())  # (T, V) fp16: overflows past 11.09 without the max subtracted
    p = e / e.sum(-1, keepdim=True)
    return Outcome(logprobs=torch.log(p.float()))


def softmax_overflow() -> PlantedClass:
    axes = Axes()
    return _class(
        "softmax_overflow", "the rollout's fp16 softmax does not subtract the row max (exp overflows)",
        "a logit above 11.09 in fp16: logit scale >= ~10 (a normalized head: logits = scale x cosine)", _cos_build,
        lambda inp: _softmax_fp16(inp, subtract_max=False), lambda inp: _softmax_fp16(inp, subtract_max=True),
        lambda inp: Outcome(logprobs=torch.log_softmax(inp["logits"].double(), -1)), axes,
        lambda c: c.n_tokens == 1 and neutral(c, axes, "logit_scale"),
        "1 token, other knobs neutral (the logit scale is the trigger)")


# ---------------------------------------------------------------------------------------------
# 10. Cross-sequence contamination in packing
# ---------------------------------------------------------------------------------------------
BLOCK = 16


def _packed_trainer(inp: dict, block_leak: bool) -> Outcome:
    """The trainer: sequences packed into rows (first-fit in the case's order), a document mask.
    With `block_leak`, the mask is decided per 16x16 block (a block-sparse kernel that treats a
    partially allowed block as fully allowed), so a sequence sees the tail of the one before it
    when their boundary falls inside a block."""
    case = inp["case"]
    seqs = torch.split(inp["qkv"], _lens(case))
    out: list[torch.Tensor | None] = [None] * case.batch_size
    for row in case.packed_rows():
        x = torch.cat([seqs[i] for i in row])  # (R, 3, D)
        doc = torch.cat([torch.full((case.seq_lens[i],), n) for n, i in enumerate(row)])  # (R,)
        allowed = doc[:, None] == doc[None, :]  # (R, R)
        if block_leak:
            r = x.shape[0]
            blk = torch.arange(r) // BLOCK
            any_allowed = torch.zeros(blk[-1] + 1, blk[-1] + 1, dtype=torch.bool)
            any_allowed.index_put_((blk[:, None].expand(r, r)[allowed], blk[None, :].expand(r, r)[allowed]),
                                   torch.tensor(True))
            allowed = any_allowed[blk[:, None], blk[None, :]]
        q, k, v = x.unbind(1)
        y = causal_attention(q, k, v, allowed)
        at = 0
        for i in row:
            out[i] = y[at:at + case.seq_lens[i]]
            at += case.seq_lens[i]
    return Outcome(hidden=torch.cat(out))


def packing_contamination() -> PlantedClass:
    axes = Axes(packing=True)
    return _class(
        "packing_contamination", "the trainer's packed attention decides its document mask per 16-token block: "
                                 "sequences sharing a block see each other",
        "two sequences packed into one row, their boundary inside a 16-token block", _pad_build,
        lambda inp: _packed_trainer(inp, block_leak=True), lambda inp: _packed_trainer(inp, block_leak=False),
        lambda inp: _per_sequence(inp, use_rope=False), axes,
        lambda c: c.batch_size == 2 and neutral(c, axes),
        "2 sequences in one row, knobs neutral", bug_in_trainer=True)


# ---------------------------------------------------------------------------------------------
CLASSES: dict[str, Callable[[], PlantedClass]] = {
    "batch_switch": batch_switch,
    "late_kv": late_kv,
    "leftpad_mask": leftpad_mask,
    "leftpad_positions": leftpad_positions,
    "temperature_twice": temperature_twice,
    "truncated_sampling": truncated_sampling,
    "top_p_exclusive": top_p_exclusive,
    "router_bias": router_bias,
    "exact_tie_order": exact_tie_order,
    "softmax_overflow": softmax_overflow,
    "packing_contamination": packing_contamination,
}


def planted_classes(names: Any = ()) -> list[PlantedClass]:
    """The planted classes named (all, in suite order, when none are)."""
    names = list(names) or list(CLASSES)
    unknown = [n for n in names if n not in CLASSES]
    if unknown:
        from ..errors import UsageError

        raise UsageError(f"no planted bug class named {', '.join(map(repr, unknown))}; the classes are "
                         f"{', '.join(CLASSES)}.")
    return [CLASSES[n]() for n in names]
