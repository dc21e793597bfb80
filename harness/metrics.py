"""Divergence metrics between a trainer and a rollout path. Pure functions, float64.

Names follow the rollout-correction metrics RL users already log (verl): `k3_kl`, `kl`,
`log_ppl_diff`, `ppl_ratio`, `chi2_token`, `probs_diff_max`, `pearson`, so a harness figure can be
read next to a training dashboard. Per token, with logp_t (trainer) and logp_r (rollout) of the
token the rollout produced:

    log r = logp_t - logp_r,   r = exp(log r),   k3 = (r - 1) - log r        (>= 0, 0 iff equal)

`k3_kl` (the verdict) is the mean of k3 over all tokens of the case. Where full distributions exist,
`kl` is the exact KL(rollout || trainer) per position, averaged: the expectation k3 estimates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Keys of `Divergence.as_dict()`, in display order.
METRIC_KEYS = (
    "k3_kl", "k3_seq_max", "kl", "max_abs_dlogp", "probs_diff_max", "log_ppl_diff", "ppl_ratio",
    "chi2_token", "pearson", "entropy", "flip_rate", "tie_flip_rate", "nonfinite_trainer", "nonfinite_rollout",
    "n_tokens",
)


@dataclass
class Divergence:
    k3_kl: float  # mean k3 over tokens: the verdict
    k3_seq_max: float  # largest per-sequence mean k3
    kl: float  # mean exact KL(rollout || trainer) per position
    max_abs_dlogp: float  # max |logp_t - logp_r| over tokens
    probs_diff_max: float  # max |p_t - p_r| over tokens
    log_ppl_diff: float  # mean over sequences of mean(logp_t - logp_r) = log ppl_rollout - log ppl_train
    ppl_ratio: float  # mean over sequences of exp(per-sequence log_ppl_diff)
    chi2_token: float  # mean(r^2) - 1
    pearson: float  # correlation of p_t and p_r over tokens (nan for fewer than 2 distinct values)
    entropy: float  # mean entropy of the rollout distribution (nats): k3 grows as it falls
    flip_rate: float  # routed (token, layer) pairs whose expert set differs, not at an exact tie
    tie_flip_rate: float  # ... whose expert set differs where either path had an exact boundary tie
    nonfinite_trainer: int  # tokens whose trainer row has NaN/+inf or whose logp_t is not finite
    nonfinite_rollout: int  # same for the rollout
    n_tokens: int
    flips_per_layer: dict[str, dict[str, int]] = field(default_factory=dict)  # layer -> counts
    per_token: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # for tables and plots

    def as_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in METRIC_KEYS}

    @property
    def nonfinite(self) -> bool:
        return self.nonfinite_trainer > 0 or self.nonfinite_rollout > 0 or not math.isfinite(self.k3_kl)


def sample_tokens(logp_rollout: Any, generator: Any) -> Any:
    """One token per row from the rollout distribution (rows that are not distributions: argmax)."""
    import torch

    return _sample(torch.exp(logp_rollout.to(torch.float64).cpu()), generator)


def _sample(p: Any, generator: Any) -> Any:
    import torch

    p = torch.nan_to_num(p, nan=0.0, posinf=0.0, neginf=0.0)
    bad = p.sum(-1) <= 0
    if bool(bad.any()):
        p[bad] = 1.0
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


def boundary_tie(scores: Any, k: int) -> np.ndarray:
    """(T,) bool: the k-th and (k+1)-th largest scores are exactly equal."""
    if scores is None:
        return np.zeros(0, dtype=bool)
    s = _np(scores).astype(np.float32)
    if s.shape[-1] <= k:
        return np.zeros(s.shape[0], dtype=bool)
    top = -np.partition(-s, (k - 1, k), axis=-1)  # ranks k-1 and k (0-based) in place
    return top[:, k - 1] == top[:, k]


def routing_flips(routing_t: dict, routing_r: dict) -> dict[str, dict[str, int]]:
    """Per router layer present in both paths: tokens routed, flips at an exact tie, other flips."""
    out: dict[str, dict[str, int]] = {}
    for layer in sorted(set(routing_t) & set(routing_r)):
        et = np.sort(_np(routing_t[layer].experts), axis=-1)
        er = np.sort(_np(routing_r[layer].experts), axis=-1)
        flipped = (et != er).any(-1)
        k = et.shape[-1]
        tie = np.zeros_like(flipped)
        for s in (routing_t[layer].scores, routing_r[layer].scores):
            if s is not None:
                tie |= boundary_tie(s, k)
        out[layer] = {"tokens": int(flipped.size), "tie_flips": int((flipped & tie).sum()),
                      "flips": int((flipped & ~tie).sum())}
    return out


def _np(t: Any) -> np.ndarray:
    """A CPU numpy view of a tensor (bf16/fp16 widened to float32 first: numpy has no bf16)."""
    import torch

    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return t.cpu().numpy()
    return np.asarray(t)


def compare(trainer: Any, rollout: Any, seq_lens: tuple[int, ...], tokens: Any = None,
            generator: Any = None) -> Divergence:
    """Compare two (T, V) log-probability tensors at (T,) tokens; rows in case order.

    With `tokens=None` one token per row is sampled from the rollout distribution with `generator`.
    Computed in float64 numpy: dozens of small torch ops cost more than the metrics themselves.
    """
    import torch

    lt_all = trainer.logprobs.detach().to(torch.float64).cpu().numpy()  # (T, V)
    lr_all = rollout.logprobs.detach().to(torch.float64).cpu().numpy()  # (T, V)
    if lt_all.shape != lr_all.shape:
        raise ValueError(f"trainer logprobs {tuple(lt_all.shape)} and rollout logprobs "
                         f"{tuple(lr_all.shape)} differ in shape")
    n = sum(seq_lens)
    if lt_all.shape[0] != n:
        raise ValueError(f"logprobs have {lt_all.shape[0]} rows but the case has {n} tokens")
    with np.errstate(all="ignore"):
        p_r = np.exp(lr_all)  # (T, V); NaN where the rollout is NaN
        if tokens is None:
            tokens = _sample(torch.from_numpy(p_r), generator)
        tok = _np(tokens).astype(np.int64)  # (T,)
        rows = np.arange(n)
        lt, lr = lt_all[rows, tok], lr_all[rows, tok]  # (T,)

        def nonfinite(all_rows: np.ndarray, picked: np.ndarray) -> int:
            bad_rows = ~(all_rows < math.inf).all(-1)  # NaN or +inf anywhere in the row
            return int((bad_rows | ~np.isfinite(picked)).sum())

        d = lt - lr
        k3 = np.expm1(d) - d  # (T,)
        seg = np.repeat(np.arange(len(seq_lens)), seq_lens)  # (T,)
        counts = np.asarray(seq_lens, dtype=np.float64)
        k3_seq = np.bincount(seg, weights=k3, minlength=len(seq_lens)) / counts
        d_seq = np.bincount(seg, weights=d, minlength=len(seq_lens)) / counts
        mass = p_r > 0  # (T, V): 0 * log 0 terms are 0, not NaN
        kl = np.where(mass, p_r * (lr_all - lt_all), 0.0).sum(-1)  # (T,)
        entropy = -np.where(mass, p_r * lr_all, 0.0).sum(-1)  # (T,)
        pt, pr = np.exp(lt), np.exp(lr)
        if n >= 2 and pt.std() > 0 and pr.std() > 0:
            pearson = float(np.corrcoef(pt, pr)[0, 1])
        else:
            pearson = float("nan")
        return Divergence(
            k3_kl=float(k3.mean()),
            k3_seq_max=float(k3_seq.max()),
            kl=float(kl.mean()),
            max_abs_dlogp=float(np.abs(d).max()),
            probs_diff_max=float(np.abs(pt - pr).max()),
            log_ppl_diff=float(d_seq.mean()),
            ppl_ratio=float(np.exp(d_seq).mean()),
            chi2_token=float(np.exp(2 * d).mean() - 1),
            pearson=pearson,
            entropy=float(entropy.mean()),
            flip_rate=0.0,
            tie_flip_rate=0.0,
            nonfinite_trainer=nonfinite(lt_all, lt),
            nonfinite_rollout=nonfinite(lr_all, lr),
            n_tokens=n,
            per_token={
                "sequence": seg,
                "position": np.concatenate([np.arange(m) for m in seq_lens]),
                "token": tok,
                "logp_trainer": lt,
                "logp_rollout": lr,
                "k3": k3,
                "kl": kl,
            },
        )


def with_routing(div: Divergence, trainer: Any, rollout: Any) -> Divergence:
    """Fill the tie-aware flip rates from both outcomes' routing decisions."""
    per_layer = routing_flips(trainer.routing, rollout.routing)
    routed = sum(v["tokens"] for v in per_layer.values())
    if routed:
        div.flip_rate = sum(v["flips"] for v in per_layer.values()) / routed
        div.tie_flip_rate = sum(v["tie_flips"] for v in per_layer.values()) / routed
    div.flips_per_layer = per_layer
    return div
