"""RMSNorm: where the rounding to bf16 happens, and where eps goes.

The op is a pre-norm block's normalisation followed by the residual add the block feeds:
`out = r + w * x / rms(x)` (an RMS-scale change of the norm's output would be invisible to the
readout's own final norm; the residual makes it count, as it does in a transformer).

- `rmsnorm.aligned`: both paths normalise and scale in fp32.
- `rmsnorm.cast_order`: a common reference implementation (the trainer here) normalises in fp32,
  casts to bf16 and then multiplies by the bf16 weight (two roundings); a fused rollout kernel
  normalises and scales in fp32 and rounds once. Both add the bf16 residual in bf16.
- `rmsnorm.eps_placement`: eps inside the square root, x / sqrt(mean(x^2) + eps) (trainer) vs
  outside, x / (sqrt(mean(x^2)) + eps) (rollout), in fp32. Invisible for rows of RMS ~1, large for
  tokens whose activations are small; the per-token RMS scale is the case parameter `log10_rms`.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from harness import Axes, Outcome, Readout, TargetPair, register

from ._common import ONE_SIDE, low_dtype

HIDDEN = 64
EPS = 1e-6  # the norm's epsilon (Llama/Qwen default)


def build(case, device):
    t = case.n_tokens
    scale = 10.0 ** float(case.params.get("log10_rms", 0.0))  # RMS of the normalised activations
    x = case.token_randn(HIDDEN, "x", device=device) * scale  # (T, H)
    r = case.token_randn(HIDDEN, "residual", device=device)  # (T, H) residual stream
    w = 1.0 + 0.1 * case.randn((HIDDEN,), "weight", device=device)  # (H,) norm weight
    return {"x": x, "r": r, "w": w, "dtype": low_dtype(case)}


def _rms_inside(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)  # (T, H) eps inside the sqrt


def _rms_outside(x):
    return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + EPS)  # (T, H) eps outside the sqrt


# --- fp32 paths -----------------------------------------------------------------------------------
def norm_fp32(inp):
    return Outcome(hidden=inp["r"] + inp["w"] * _rms_inside(inp["x"]))  # (T, H)


def norm_fp32_eps_outside(inp):
    return Outcome(hidden=inp["r"] + inp["w"] * _rms_outside(inp["x"]))  # (T, H)


# --- bf16 paths: activations, weight and residual live in bf16 ------------------------------------
def norm_cast_then_scale(inp):
    dt = inp["dtype"]
    x = inp["x"].to(dt).float()  # (T, H) bf16 activations, normalised in fp32
    y = _rms_inside(x).to(dt) * inp["w"].to(dt)  # cast to bf16, then the bf16 weight multiply
    return Outcome(hidden=inp["r"].to(dt) + y)  # (T, H) bf16 residual add


def norm_fused(inp):
    dt = inp["dtype"]
    x = inp["x"].to(dt).float()  # (T, H)
    y = (_rms_inside(x) * inp["w"].to(dt).float()).to(dt)  # scale in fp32, one rounding
    return Outcome(hidden=inp["r"].to(dt) + y)  # (T, H)


# --- pairs ----------------------------------------------------------------------------------------
LOG10_RMS = st.sampled_from([0.0, -1.0, -2.0, -3.0, -4.0])  # activation RMS 1 .. 1e-4 (0 = simplest)
AXES = Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 64.0), pad_sides=ONE_SIDE)
AXES_EPS = Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 16.0), params={"log10_rms": LOG10_RMS},
                pad_sides=ONE_SIDE)
READOUT = Readout(vocab=256)

register(TargetPair(
    name="rmsnorm.aligned", kind="op", expected="aligned", build=build, trainer=norm_fp32,
    rollout=norm_fp32, axes=AXES_EPS, readout=READOUT,
    description="both paths normalise and scale in fp32, eps inside the sqrt: must stay exactly equal",
))
register(TargetPair(
    name="rmsnorm.cast_order", kind="op", expected="diverges", build=build, trainer=norm_cast_then_scale,
    rollout=norm_fused, axes=AXES, readout=READOUT,
    description="normalise, cast to bf16, then weight multiply (reference) vs fused fp32 scale with one rounding",
))
register(TargetPair(
    name="rmsnorm.eps_placement", kind="op", expected="diverges", build=build, trainer=norm_fp32,
    rollout=norm_fp32_eps_outside, axes=AXES_EPS, readout=READOUT,
    description="eps inside the sqrt (trainer) vs outside (rollout): large for tokens with small activations",
))
