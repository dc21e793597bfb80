"""LM head and log-softmax: precision, where the temperature goes, which distribution is returned.

The op is the last step of every policy: final hidden states (T, H) -> logits (T, V) -> log-probs.
Paths return log-probabilities directly (no readout). Logits have standard deviation
`case.logit_scale` (the peakedness axis).

- `lm_head.aligned`: head GEMM and log-softmax in fp32, temperature applied to the logits, both sides.
- `lm_head.bf16`: the rollout's head GEMM and log-softmax in bf16 vs fp32 in the trainer (one
  published RL report moved its LM head to fp32 for exactly this gap).
- `lm_head.temperature_order`: the trainer divides the logits by the temperature before the
  log-softmax; the rollout divides the log-probabilities after it (no longer normalised). Equal at
  temperature 1, so the minimal repro names the temperature closest to 1 that still diverges (the
  case's `temperature` shrinks toward 1.0).
- `lm_head.processed_logprobs`: the rollout returns log-probs of the *processed* distribution it
  sampled from (temperature, then top-p truncation and renormalisation), the trainer recomputes the
  temperature-scaled but untruncated distribution; rollout engines can return either. Every
  sampled token is inside the top-p set, where the two differ by log(mass of the set).
"""

from __future__ import annotations

import torch
from harness import Axes, Outcome, TargetPair, register

from ._common import ONE_SIDE, low_dtype

HIDDEN = 64
VOCAB = 512


def build(case, device):
    t = case.n_tokens
    h = case.token_randn(HIDDEN, "hidden", device=device)  # (T, H)
    w = case.randn((HIDDEN, VOCAB), "lm_head", device=device) * (case.logit_scale / HIDDEN**0.5)  # (H, V)
    # the case's sampling fields; a schema-1 repro carries them as free parameters
    return {"h": h, "w": w, "dtype": low_dtype(case),
            "temperature": float(case.params.get("temperature", case.temperature)),
            "top_p": float(case.params.get("top_p", case.top_p))}


def logits_fp32(inp):
    return inp["h"] @ inp["w"]  # (T, V)


def head_fp32(inp):
    return Outcome(logprobs=torch.log_softmax(logits_fp32(inp) / inp["temperature"], -1))  # (T, V)


def head_low(inp):
    dt = inp["dtype"]
    z = inp["h"].to(dt) @ inp["w"].to(dt)  # (T, V) bf16 GEMM
    return Outcome(logprobs=torch.log_softmax(z / inp["temperature"], -1))  # (T, V) bf16 log-softmax


def temperature_after(inp):
    return Outcome(logprobs=torch.log_softmax(logits_fp32(inp), -1) / inp["temperature"])  # (T, V) unnormalised


def processed(inp):
    logp = torch.log_softmax(logits_fp32(inp) / inp["temperature"], -1)  # (T, V)
    sorted_lp, order = logp.sort(-1, descending=True)
    before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # (T, V) mass strictly above each token
    keep_sorted = before < inp["top_p"]  # nucleus: smallest prefix reaching top_p (the first token always)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # (T, V)
    kept = logp.masked_fill(~keep, float("-inf"))
    return Outcome(logprobs=torch.log_softmax(kept, -1))  # (T, V) renormalised over the nucleus


# --- pairs ----------------------------------------------------------------------------------------
AXES = Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 16.0), temperature=(0.5, 2.0), pad_sides=ONE_SIDE)
AXES_PROCESSED = Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 16.0), temperature=(0.5, 2.0),
                      top_p=(0.8, 1.0), pad_sides=ONE_SIDE)

register(TargetPair(
    name="lm_head.aligned", kind="op", expected="aligned", build=build, trainer=head_fp32,
    rollout=head_fp32, axes=AXES_PROCESSED,
    description="head GEMM and log-softmax in fp32, temperature on the logits, both sides: exactly equal",
))
register(TargetPair(
    name="lm_head.bf16", kind="op", expected="diverges", build=build, trainer=head_fp32,
    rollout=head_low, axes=AXES,
    description="LM head GEMM and log-softmax in bf16 (rollout) vs fp32 (trainer)",
))
register(TargetPair(
    name="lm_head.temperature_order", kind="op", expected="diverges", build=build, trainer=head_fp32,
    rollout=temperature_after, axes=AXES,
    description="temperature before the log-softmax (trainer) vs dividing the log-probs after it (rollout)",
))
register(TargetPair(
    name="lm_head.processed_logprobs", kind="op", expected="diverges", build=build, trainer=head_fp32,
    rollout=processed, axes=AXES_PROCESSED,
    description="rollout returns log-probs of the processed (temperature + top-p) distribution, trainer the raw one",
))
