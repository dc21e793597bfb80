"""Rotary position embedding (RoPE): the precision of the angles, and which positions a token gets.

The op is one causal attention head with RoPE on q and k, per sequence; its output (T, D) is judged
through the readout. RoPE is relative: q_p . k_p' depends only on p - p' in exact arithmetic, so
some position bugs vanish in fp32 and surface only where rounding depends on the absolute angle.

- `rotary.aligned`: fp32 angles and attention, positions restart at 0 for every sequence.
- `rotary.bf16_angles`: the rollout builds its cos/sin cache in the model dtype (positions and
  inverse frequencies cast to bf16 before the product, as a cache built with `.to(dtype)` does);
  the trainer in fp32. bf16 cannot represent integer positions above 256 (spacing 2, then 4, ...),
  so neighbouring tokens get the same angle. The sequence's first position is the case parameter
  `start` (the prompt length before it); the minimal repro shows the smallest start that diverges.
- `rotary.packed_positions`: the trainer packs sequences into rows and its positions run on across
  the row (the second sequence starts at the first one's length) instead of restarting; the
  rollout pads and restarts. Both paths are the same bf16 code with the cos/sin cache built in the
  model dtype, and every sequence begins at position `start` (a response after a long prompt):
  there bf16 positions are spaced 2, 4, 8 apart, so shifting a sequence by the previous one's
  length moves its tokens onto other rounded angles. Minimal: two sequences in one row.
- `rotary.packed_positions_fp32`: the same position bug in fp32: RoPE is relative, the offset
  cancels up to fp32 rounding of the angle (k3 <= ~1e-5 even at start 4096), so it stays under the
  threshold: `aligned`. This is why the bug survives fp32 tests and why the harness fuzzes bf16.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from harness import Axes, Outcome, Readout, TargetPair, register

from ._common import ONE_SIDE, low_dtype, packed_offsets

HEAD_DIM = 32
THETA = 10000.0
QK_SCALE = 2.0  # q and k standard deviation: attention as peaked as in trained models (scores std ~4)


def build(case, device):
    t = case.n_tokens
    q = case.token_randn(HEAD_DIM, "q", device=device) * QK_SCALE  # (T, D)
    k = case.token_randn(HEAD_DIM, "k", device=device) * QK_SCALE  # (T, D)
    v = case.token_randn(HEAD_DIM, "v", device=device)  # (T, D)
    return {"q": q, "k": k, "v": v, "seq_lens": case.seq_lens, "start": int(case.params.get("start", 0)),
            "offsets": packed_offsets(case), "dtype": low_dtype(case)}


def angles(pos, angle_dtype):
    """(n,) positions -> (n, D/2) rotation angles, the product taken in `angle_dtype`."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device=pos.device) / HEAD_DIM)
    return (pos.to(angle_dtype)[:, None] * inv_freq.to(angle_dtype)[None, :]).float()  # (n, D/2)


def rope(x, ang, dtype):
    """Rotate (n, D) by (n, D/2) angles (half-split layout), cos/sin and arithmetic in `dtype`."""
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)  # (n, D/2)
    x = x.to(dtype)
    x1, x2 = x[:, : HEAD_DIM // 2], x[:, HEAD_DIM // 2:]  # (n, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)  # (n, D)


def causal_attention(q, k, v):
    n = q.shape[0]
    s = (q @ k.T) / HEAD_DIM**0.5  # (n, n)
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v  # (n, D)


def attend(inp, dtype, angle_dtype, run_on: bool):
    """Per sequence: RoPE at its positions, causal attention; rows back in case order."""
    outs, start = [], 0
    for i, n in enumerate(inp["seq_lens"]):
        first = inp["start"] + (inp["offsets"][i] if run_on else 0)
        pos = torch.arange(first, first + n, device=inp["q"].device)  # (n,)
        ang = angles(pos, angle_dtype)  # (n, D/2)
        sl = slice(start, start + n)
        q, k = rope(inp["q"][sl], ang, dtype), rope(inp["k"][sl], ang, dtype)  # (n, D)
        outs.append(causal_attention(q, k, inp["v"][sl].to(dtype)))
        start += n
    return Outcome(hidden=torch.cat(outs, 0))  # (T, D)


# --- paths ----------------------------------------------------------------------------------------
def fp32_restart(inp):
    return attend(inp, torch.float32, torch.float32, run_on=False)


def fp32_run_on(inp):
    return attend(inp, torch.float32, torch.float32, run_on=True)


def bf16_angle_cache(inp):
    return attend(inp, torch.float32, inp["dtype"], run_on=False)


def low_restart(inp):  # bf16 attention, cos/sin cache in the model dtype
    return attend(inp, inp["dtype"], inp["dtype"], run_on=False)


def low_run_on(inp):
    return attend(inp, inp["dtype"], inp["dtype"], run_on=True)


# --- pairs ----------------------------------------------------------------------------------------
START = st.sampled_from([0, 64, 256, 1024, 4096])  # position of each sequence's first token (0 = simplest)
AXES = Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 16.0), params={"start": START}, pad_sides=ONE_SIDE)
AXES_PACKED = Axes(n_seqs=(1, 4), seq_len=(1, 16), packing=True, logit_scale=(1.0, 16.0), params={"start": START},
                   pad_sides=ONE_SIDE)
READOUT = Readout(vocab=256)

register(TargetPair(
    name="rotary.aligned", kind="op", expected="aligned", build=build, trainer=fp32_restart,
    rollout=fp32_restart, axes=AXES, readout=READOUT,
    description="fp32 angles and attention, positions restart per sequence on both sides: exactly equal",
))
register(TargetPair(
    name="rotary.bf16_angles", kind="op", expected="diverges", build=build, trainer=fp32_restart,
    rollout=bf16_angle_cache, axes=AXES, readout=READOUT,
    description="cos/sin cache built from bf16 positions and frequencies (rollout) vs fp32, at large positions",
))
register(TargetPair(
    name="rotary.packed_positions", kind="op", expected="diverges", build=build, trainer=low_run_on,
    rollout=low_restart, axes=AXES_PACKED, readout=READOUT,
    description="packed trainer rows whose positions run on across sequences vs per-sequence positions, bf16",
))
register(TargetPair(
    name="rotary.packed_positions_fp32", kind="op", expected="aligned", build=build, trainer=fp32_run_on,
    rollout=fp32_restart, axes=AXES_PACKED, readout=READOUT,
    description="the same run-on position bug in fp32: RoPE is relative, so it stays invisible (why bf16 is fuzzed)",
))
