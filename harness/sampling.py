"""Sampling as a rollout engine does it, for pairs to share: temperature, top-k, top-p, and seeded
token draws that replay bit-for-bit on every device.

An outcome's log-probabilities are those of the distribution its path sampled from (or scores
with): `process_logits` applies the case's sampling parameters the way vLLM and Hugging Face do
(temperature first, then top-k, then top-p over what is left; truncated tokens get -inf, and the
rest is renormalised). A rollout that samples from a truncated distribution while the trainer
scores the full one is a real mismatch: the exact KL(rollout || trainer) is -log(kept mass), while
the sampled-token k3 only sees about (1 - kept mass)^2 / 2 of it; the verdict judges both.

Tokens are drawn by inverse CDF from uniforms the case supplies (`case.token_uniforms("sample")`:
one per response token, sequence j's from its own CPU stream), so the draw does not depend on the
device, the batch layout or the other sequences.
"""

from __future__ import annotations

from typing import Any


def process_logits(logits: Any, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Any:
    """(..., V) logits -> (..., V) float32 log-probabilities of the sampling distribution.

    temperature > 0 divides the logits; top_k > 0 keeps the k largest (ties at the k-th value are
    all kept, as a threshold filter does); top_p < 1 keeps the smallest set of most likely tokens
    whose mass reaches top_p (at least one). Everything else is -inf.
    """
    import torch

    x = logits.float() / float(temperature)
    v = x.shape[-1]
    if 0 < top_k < v:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)  # (..., V)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p  # the first token always stays (before = 0 < top_p)
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_rows(logprobs: Any, u: Any) -> Any:
    """(N, V) log-probabilities and (N,) uniforms in [0, 1) -> (N,) int64 token ids, by inverse CDF
    in float64 (rows that are not distributions, e.g. all NaN, give their argmax or 0)."""
    import torch

    p = torch.exp(logprobs.to(torch.float64))  # (N, V)
    p = torch.nan_to_num(p, nan=0.0, posinf=0.0, neginf=0.0)
    c = torch.cumsum(p, dim=-1)  # (N, V)
    total = c[:, -1:]  # (N, 1)
    target = u.to(device=c.device, dtype=torch.float64)[:, None] * total  # (N, 1)
    idx = torch.searchsorted(c, target, right=True).squeeze(-1)  # (N,)
    idx = torch.minimum(idx, torch.full_like(idx, p.shape[-1] - 1))
    # never land on a zero-probability token (a -inf entry right at the boundary)
    bad = p.gather(-1, idx[:, None]).squeeze(-1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, p.argmax(-1), idx)
    return idx.to(torch.int64)
