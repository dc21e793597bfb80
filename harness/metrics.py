"""Divergence metrics between a trainer and a rollout path. Pure functions on tensors.

Names follow the rollout-correction metrics RL users already log (verl): `k3_kl`, `kl`,
`log_ppl_diff`, `ppl_ratio`, `chi2_token`, `probs_diff_max`, `pearson`, so a harness figure can be
read next to a training dashboard. Per token, with logp_t (trainer) and logp_r (rollout) of the
token the rollout produced:

    log r = logp_t - logp_r,   r = exp(log r),   k3 = (r - 1) - log r        (>= 0, 0 iff equal)

`k3_kl` is the mean of k3 over all tokens of the case (what an RL dashboard logs). Where full
distributions exist, two exact means over the vocabulary are computed per position and averaged:
`k3_expected`, the expectation of k3 for a token drawn from the rollout's distribution (what the
mean k3 of a large batch converges to, without the draw's noise: it sees the log-probabilities as
reported, normaliser included), and `kl`, the exact KL(rollout || trainer) of the two normalised
distributions. The verdict judges those two (`fired`): a case diverges when either is above the
threshold, or when a sampled token is one the trainer excludes (k3 = +inf). The mean k3 of the
case's own few sampled tokens is not judged: on a case of a handful of tokens it is a noisy
estimate, and a search keeps exactly the unlucky draws (an aligned pair at KL 2e-4 crossed the line
on a two-token case). k3 is biased low when the rollout samples from a truncated distribution
(its expectation is about (1 - kept mass)^2 / 2 of a KL of -log(kept mass)): the KL sees that.

Values. -inf is log 0 (an entry truncated by top-k/top-p), not a non-finite value; NaN or +inf is.
A probability at or below e^-650 (~5e-283) counts as 0. A row with NaN or +inf anywhere is
non-finite (counted per path; its `kl` and `entropy` are NaN).

The exact KL is that of the two *distributions*: each side is normalised in float64 (log p^ = log p
- log sum p), so a path whose log-probabilities are rounded (bf16 log-softmax output sums to 1 only
to ~1e-3) is judged on the second-order gap, not on its first-order normalisation error (which has
either sign and would flag or hide a pair at random). The sum runs over the tokens the trainer
keeps: tokens the trainer gives -inf and the rollout gives mass are reported as `kl_excluded` (their
rollout mass), not folded in as +inf, because two aligned paths that both truncate (top-k/top-p on
both sides) put a boundary token in or out on last-bit differences. The rollout's distribution is
renormalised over those kept tokens, so the KL is one of two distributions on one support, never
negative (a partial sum of the rollout's full distribution would be, down to about minus the
excluded mass, and would offset a real divergence on the other tokens); a rollout with all its mass
on tokens the trainer excludes has KL +inf. A *sampled* token the trainer
excludes still has k3 = +inf: a divergence, not a non-finite value. A rollout truncating what the
trainer scores in full (an engine's default top-k) gives KL = -log(kept mass), what the verdict needs.

How it is computed. On the outcomes' device, in chunks of rows, so memory stays a small multiple of
one (T, V) fp32 tensor whatever T is (a chunk's float64 buffers hold at most `chunk_elems` elements
each: six of them, seven when it draws tokens). Per chunk, in float64: p = exp(logp_r), p_t =
exp(logp_t) (numpy's exp on a CPU: `_exp`), d = logp_r - logp_t, then five sums over the vocabulary
per row (sum p*d, sum p*logp_r, sum p, sum p_t, and sum p_t where p > 0), from which the normalised
KL, the expected k3 ((sum_{p>0} p_t - (sum p - excluded) + sum p*d) / sum p) and the entropy follow.
A chunk whose log-probabilities are all above e^-650 on both sides (no -inf, NaN or tiny value: the
common case) skips the thresholds and masks and the fifth sum (it is sum p_t there); its values are
the same either way. Tokens the trainer excludes (logp_t at or below -650) where the rollout has
mass enter d as +inf -> max, so such a row's sum p*d is above 1e8: only in a chunk with a row over
1 are those terms masked out of sum p*d and their rollout mass summed on its own (the excluded
mass), in place, for the price of three more passes over the chunk. Rows whose sums are still not
finite (NaN, +inf) or that have no mass are recomputed with the masked definition (`_exact_rows`),
which says which side is not a distribution.
Each row is summed by one thread in a fixed order (every reduction has >= 2 outputs, so torch never
splits a row across threads): a row's value does not depend on the chunk size, the other rows or the
number of CPU threads, so a replay is bit-for-bit whatever thread count the campaign ran with.
Per-token values (T of them) are gathered and computed in float64 numpy; k3 of a small log-ratio
uses its Taylor series, since expm1(d) - d loses digits to cancellation there.

Tokens, when the rollout does not return them, are drawn from the rollout distribution: by inverse
CDF (a float64 cumulative sum per row) on uniforms the case draws on the CPU, one per token from
its sequence's own stream (`case.token_uniforms("tokens")`), so the draw is the same on every
device and removing one sequence leaves the others' tokens unchanged. An upgraded schema-1 repro
(`case.streams == "single"`) keeps the schema-1 draw (`torch.multinomial` on its one stream) so it
replays the same tokens.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Keys of `Divergence.as_dict()`, in display order (all numeric; see `Divergence.fired`).
METRIC_KEYS = (
    "k3_kl", "k3_expected", "k3_seq_max", "k3_expected_seq_max", "kl", "kl_seq_max", "worst_sequence", "max_abs_dlogp",
    "probs_diff_max", "log_ppl_diff", "ppl_ratio",
    "chi2_token", "pearson", "entropy", "kl_excluded", "flip_rate", "tie_flip_rate", "nonfinite_trainer", "nonfinite_rollout",
    "n_tokens",
)

# float64 elements per chunk buffer: small enough to stay in cache on a CPU, large enough on an
# accelerator that a chunk is a few big kernels. The workspace holds five such buffers (six when it draws tokens).
CHUNK_ELEMS_CPU = 1 << 17
CHUNK_ELEMS_DEVICE = 1 << 25

# A probability at or below e^-650 (~5e-283) counts as 0: such a term adds nothing a float64 sum
# keeps, and a CPU's exp is 2-10x slower on -inf and on arguments under ~-708 (subnormal results).
# Those entries go into the exp as _EXP_FLOOR (fast) and come out as exactly 0 (p <= _P_ZERO).
LOG_ZERO = -650.0
_EXP_FLOOR = -700.0  # e^-700 ~ 1e-304
_P_ZERO = 1e-290  # between e^-700 and e^-650
_F64_MAX = 1.7976931348623157e308
_KL_CHECK = 1.0  # a row's first sum above this may hold a token the trainer excludes (see row_stats)

TOKEN_SALT = "tokens"  # the stream the case's tokens are drawn from when the rollout returns none

_K3_SERIES_BELOW = 0.0625  # |log r| under which k3 is summed as its Taylor series (above: <= 5 bits lost)
_K3_SERIES = tuple(1.0 / math.factorial(n) for n in range(2, 14))  # d^2/2!, ... d^13/13! (next: < 1e-22 rel)


@dataclass
class Divergence:
    k3_kl: float  # mean k3 over tokens
    k3_seq_max: float  # largest per-sequence mean k3
    kl: float  # mean exact KL(rollout || trainer) per position, both normalised over the tokens the trainer keeps
    max_abs_dlogp: float  # max |logp_t - logp_r| over tokens
    probs_diff_max: float  # max |p_t - p_r| over tokens
    log_ppl_diff: float  # mean over sequences of mean(logp_t - logp_r) = log ppl_rollout - log ppl_train
    ppl_ratio: float  # mean over sequences of exp(per-sequence log_ppl_diff)
    chi2_token: float  # mean(r^2) - 1
    pearson: float  # correlation of p_t and p_r over tokens (nan for fewer than 2 distinct values)
    entropy: float  # mean entropy of the rollout distribution (nats): k3 grows as it falls
    flip_rate: float  # routed (token, layer) pairs whose expert set differs, not at an exact tie
    tie_flip_rate: float  # ... whose expert set differs where either path had an exact boundary tie
    nonfinite_trainer: int  # tokens whose trainer row has NaN/+inf or whose logp_t is NaN/+inf
    nonfinite_rollout: int  # tokens whose rollout row has NaN/+inf or whose logp_r is not finite
    n_tokens: int
    kl_excluded: float = 0.0  # mean rollout mass on tokens the trainer gives -inf (kept out of `kl`; reported)
    # mean over positions of the expected k3 of a token drawn from the rollout's distribution (over
    # the tokens the trainer keeps): what `k3_kl` estimates, without the draw's noise
    k3_expected: float = math.nan
    # the largest per-sequence mean of the expected k3 and of the exact KL: what a verdict over
    # sequences (`TargetPair.verdict_over="sequence"`) judges (the worst sequence of the batch)
    k3_expected_seq_max: float = math.nan
    kl_seq_max: float = math.nan
    worst_sequence: int = 0  # the sequence (batch index) whose own mean of the two is the largest
    # Which mean crossed the verdict's threshold: "k3", "kl", "k3+kl", or "" (set by the verdict,
    # `execute.judge`; a string, so it is not one of METRIC_KEYS).
    fired: str = ""
    # What the verdict's means are over: "batch" (every token of the case) or "sequence" (the worst
    # sequence's own mean; set by `execute.judge` from the pair, with `fired`)
    verdict_over: str = "batch"
    # What a row holds: "full" (the vocabulary), or "two_outcome" (a rollout that reports its sampled
    # tokens' log-probabilities only, `Outcome.recorded`: {that token, every other}, so `kl` and
    # `entropy` are of that split, a lower bound of the exact KL; set by `execute.judge`)
    rows: str = "full"
    flips_per_layer: dict[str, dict[str, int]] = field(default_factory=dict)  # layer -> counts
    per_token: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # for tables and plots

    def as_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in METRIC_KEYS}

    @property
    def nonfinite(self) -> bool:
        """NaN or +inf in either path (an infinite k3 or KL from a trainer -inf is a divergence)."""
        return self.nonfinite_trainer > 0 or self.nonfinite_rollout > 0 or math.isnan(self.k3_kl)


def fired(div: Divergence, threshold: float) -> str:
    """Which of the verdict's two means is above the threshold: "k3", "kl", "k3+kl" or "".

    "k3" is the expected k3 (`k3_expected`: exact over the vocabulary, what the mean k3 of a large
    batch converges to), or a sampled token the trainer excludes (`k3_kl` = +inf). The mean k3 of
    the case's own few sampled tokens is reported but not judged: on a case of a handful of tokens
    it is a noisy estimate, and a search that keeps what crosses the line finds the unlucky draws
    (an aligned pair with KL 2e-4 crossed it on a two-token case). Without an expected k3 (NaN),
    the sampled mean is judged. The means are over the batch, or the worst sequence's own
    (`div.verdict_over`; see `judged_means`).
    """
    k3, kl = judged_means(div)
    names = [name for name, v in (("k3", k3), ("kl", kl)) if v > threshold]
    return "+".join(names)


def judged_means(metrics: Any) -> tuple[float, float]:
    """(k3, KL) as the verdict compares them with the threshold, from a `Divergence` or a metrics dict
    (a repro's, a worker's): the judged k3 (`judged_k3`) and the exact KL, each a mean over every
    token of the case, or with `verdict_over` "sequence" the largest of the sequences' own means
    (`k3_expected_seq_max` or, without an expected k3, `k3_seq_max`; `kl_seq_max`): a bug that
    touches one sample of a batch (a prefix-cache hit, one request's kernel) is not diluted by the
    clean ones, as a sequence-level rejection in an RL step would see it."""
    get = metrics.get if isinstance(metrics, dict) else lambda k, d=None: getattr(metrics, k, d)
    if get("verdict_over", "batch") == "sequence":
        k3 = judged_k3(get("k3_expected_seq_max", math.nan), get("k3_seq_max", math.nan))
        if _num(get("k3_kl", math.nan)) == math.inf:  # a sampled token the trainer excludes: its sequence's k3
            k3 = math.inf
        return k3, _num(get("kl_seq_max", math.nan))
    return judged_k3(get("k3_expected", math.nan), get("k3_kl", math.nan)), _num(get("kl", math.nan))


def judged_k3(k3_expected: Any, k3_kl: Any) -> float:
    """The k3 a verdict judges: the expected k3, the sampled mean without it, +inf when a sampled
    token is one the trainer excludes."""
    k3e = _num(k3_expected)
    k3 = k3e if not math.isnan(k3e) else _num(k3_kl)
    return math.inf if _num(k3_kl) == math.inf else k3


def verdict_mean(metrics: Any) -> tuple[str, float]:
    """The mean a verdict read, from a case's metrics (`Divergence.as_dict()` and "fired", as
    repros, payloads and MLflow hold them): ("kl", the mean exact KL) when only the KL crossed the
    threshold or it is the larger of the two that did, else ("k3", `judged_k3`). This is the number
    to show beside a finding: an exact KL of 3e-3 can fire on a case whose few sampled tokens give a
    mean k3 of 5e-6."""
    get = metrics.get if isinstance(metrics, dict) else lambda k, d=None: getattr(metrics, k, d)
    k3, kl = judged_means(metrics)
    names = str(get("fired", "") or "").split("+")
    if "kl" in names and ("k3" not in names or kl > k3):
        return "kl", kl
    return "k3", k3


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def k3_of(d: np.ndarray) -> np.ndarray:
    """k3 = expm1(d) - d for float64 log-ratios d, to ~1e-14 relative for every d (its Taylor series
    where |d| is small: there the direct form cancels, losing ~log2(1/|d|) bits)."""
    d = np.asarray(d, dtype=np.float64)
    with np.errstate(all="ignore"):
        s = np.full_like(d, _K3_SERIES[-1])
        for c in _K3_SERIES[-2::-1]:  # Horner, over every d (T values: cheaper than selecting)
            s = s * d + c
        # (d = +inf, a sampled token its rollout reports at log 0: k3 = r - 1 - log r grows without bound)
        return np.where(np.abs(d) < _K3_SERIES_BELOW, s * d * d, np.where(d == math.inf, math.inf, np.expm1(d) - d))


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


def multinomial_tokens(logp_rollout: Any, generator: Any) -> Any:
    """The schema-1 draw: one token per row by `torch.multinomial` on float64 probabilities on the
    CPU (rows that are not distributions: uniform). Kept bit-for-bit for upgraded schema-1 repros;
    it holds the whole (T, V) in float64, so new cases use the chunked inverse CDF instead."""
    import torch

    with np.errstate(all="ignore"):
        p = torch.from_numpy(np.exp(logp_rollout.detach().to(torch.float64).cpu().numpy()))  # (T, V)
    p = torch.nan_to_num(p, nan=0.0, posinf=0.0, neginf=0.0)
    bad = p.sum(-1) <= 0
    if bool(bad.any()):
        p[bad] = 1.0
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


def _inverse_cdf(p: Any, u: Any, out: Any, positive: bool = False) -> Any:
    """(n, V) float64 probabilities (finite, >= 0) and (n,) float64 uniforms in [0, 1) -> (n,) token
    ids: the first token whose cumulative mass exceeds u * total (`out`: an (n, V) float64 buffer
    for the cumulative sums). Never a zero-probability token; a row with no mass gives its argmax.
    `positive`: every p is > 0 (nothing to step over; the check is skipped)."""
    import torch

    c = torch.cumsum(p, dim=-1, out=out)  # (n, V)
    target = u[:, None] * c[:, -1:]  # (n, 1)
    idx = torch.searchsorted(c, target, right=True).squeeze(-1)  # (n,)
    idx = torch.clamp_(idx, max=p.shape[-1] - 1)
    if positive:
        return idx
    zero = p.gather(-1, idx[:, None]).squeeze(-1) <= 0
    if bool(zero.any()):
        idx = torch.where(zero, p.argmax(-1), idx)
    return idx


def _finish(sums: Any, plain: bool = False) -> tuple[Any, Any, Any, Any]:
    """(n, 6) float64 row sums [sum p*(lr-lt) over kept tokens, sum p*lr, Z_r = sum p, Z_t = sum p_t,
    sum p over tokens the trainer excludes, sum p_t over the rollout's support] -> (KL, entropy,
    excluded mass, expected k3), each (n,), with both distributions normalised for the KL (the
    trainer's over its support, the rollout's over the tokens the trainer keeps: mass Z_r - e); the
    expected k3 is that of the log-probabilities as reported.
    `plain`: every row's sums are finite, Z_r and Z_t > 0 and nothing is excluded (e = 0, Z_t over
    the support = Z_t), so the same values come without the error-state guard and the e terms
    ((Z_r - 0) / Z_r is exactly 1)."""
    a, b, zr, zt, e, zts = (sums[:, i] for i in range(6))
    # (a KL and an expected k3 are >= 0: the normalisers' last bits leave ~1e-14 of either sign for equal
    # distributions, and a table that shows -2e-14 reads as a bug; NaN and +inf stay)
    if plain:
        log_zr = np.log(zr)
        return (np.maximum(a / zr - (log_zr - np.log(zt)), 0.0), -(b / zr - log_zr), np.zeros(len(zr)),
                np.maximum((zt - zr + a) / zr, 0.0))
    with np.errstate(all="ignore"):
        log_zr, log_zt = np.log(zr), np.log(zt)
        # over the tokens the trainer keeps, the rollout's distribution renormalised there (mass zk):
        # a KL (>= 0) of two distributions on one support; the mass it leaves out is `excluded`.
        # All of the rollout's mass on excluded tokens: no common support, +inf.
        zk = zr - e
        kl = np.where(zk > 0, np.maximum(a / zk - (np.log(zk) - log_zt), 0.0), np.where(zr > 0, math.inf, math.nan))
        ent = -(b / zr - log_zr)
        excluded = e / zr
        # E_{x ~ p_r / Z_r}[k3] over kept tokens = (1/Z_r) sum p * (exp(-d) - 1 + d), with p * exp(-d) = p_t
        k3 = np.maximum((zts - (zr - e) + a) / zr, 0.0)  # (>= 0 too, as the KL: NaN stays)
    return kl, ent, excluded, k3


def _exact_rows(lt: Any, lr: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The definition, masked, in float64, for a few rows: (KL, entropy, excluded, expected k3,
    trainer bad, rollout bad)."""
    import torch

    lt64, lr64 = lt.to(torch.float64), lr.to(torch.float64)  # (n, V)
    bad_t = ~(lt64.amax(-1) < math.inf)  # NaN (amax propagates it) or +inf somewhere in the row
    bad_r = ~(lr64.amax(-1) < math.inf)
    p = torch.exp(torch.where(lr64 <= LOG_ZERO, -math.inf, lr64))  # p at or below e^-650: 0
    pt = torch.exp(torch.where(lt64 <= LOG_ZERO, -math.inf, lt64))
    mass, kept = p > 0, lt64 > LOG_ZERO  # 0 * log 0 terms are 0, not NaN
    both = mass & kept
    zero = torch.zeros((), dtype=torch.float64, device=p.device)
    sums = torch.stack([torch.where(both, p * (lr64 - lt64), zero).sum(-1), torch.where(mass, p * lr64, zero).sum(-1),
                        p.sum(-1), pt.sum(-1), torch.where(mass & ~kept, p, zero).sum(-1),
                        torch.where(mass, pt, zero).sum(-1)], 1)  # (n, 6)
    kl, ent, excluded, k3 = _finish(_np(sums))
    bt, br = _np(bad_t), _np(bad_r) | ~(_np(sums[:, 2]) > 0)  # a rollout row with no mass is no distribution
    kl = np.where(bt | br, math.nan, kl)
    k3 = np.where(bt | br, math.nan, k3)
    ent = np.where(br, math.nan, ent)
    excluded = np.where(bt | br, math.nan, excluded)
    return kl, ent, excluded, k3, bt, br


_LOCAL = threading.local()


def _on_host(dev: Any) -> bool:
    """Whether `dev` is the CPU, where the metrics take their host-only shortcuts (a kept workspace
    and its views, numpy's exp, numpy indexing). Everything else takes the accelerator branches; a
    test runs those on CPU tensors by patching this to False (tests/unit/test_metrics_reference.py),
    so they are checked against the float64 reference on a machine without a GPU."""
    return dev.type == "cpu"


def _workspace(n: int, dev: Any) -> Any:
    """n float64 elements of scratch on `dev`. On a CPU one buffer per thread is kept and grown, not
    allocated per call: a fresh multi-MiB allocation is fresh pages, and faulting them in cost more
    than the metrics on small cases. Accelerators' caching allocators already reuse memory."""
    import torch

    if not _on_host(dev):
        return torch.empty(n, dtype=torch.float64, device=dev)
    buf = getattr(_LOCAL, "workspace", None)
    if buf is None or buf.numel() < n:
        buf = _LOCAL.workspace = torch.empty(n, dtype=torch.float64)
        _LOCAL.views = {}
    return buf[:n]


def _exp(x: Any, out: Any) -> None:
    """out = exp(x), float64. On a CPU numpy's exp: its SIMD exp takes about half torch's time per
    element on one thread here, and exp is most of the metrics' time at a real vocabulary (both are
    within an ulp of exp, not bit-equal to each other). numpy's runs on one thread. With two torch
    threads, `harness bench metrics --vocab 32768,151936 --tokens 256,1024 --threads 2` (CPU time of
    both threads) gave compare 2.5-3.0x the log_softmax with numpy's exp and 2.3-9.7x with torch's
    (its threads spin); with many threads torch's would split a chunk's wall time and numpy's does
    not (not measured: this machine has two cores). One exp whatever the thread count keeps the
    values independent of it. Elsewhere torch's."""
    if _on_host(out.device):
        with np.errstate(all="ignore"):  # overflow to inf, as torch's
            np.exp(x.numpy(), out=out.numpy())
    else:
        import torch

        torch.exp(x, out=out)


def _chunk_views(rows: int, v: int, n: int, draw: bool, dev: Any) -> tuple:
    """The views of one chunk of n rows (of at most `rows`) into the workspace: the (n, 6, V) buffer,
    its six (n, V) slots [d, logp_r, p_r, p_t, p_t on the support, p_r where the trainer excludes],
    and the (n, V) cumulative sums (None without a draw). On a CPU they are made once per shape and
    reused: a small case's metrics are a few dozen tensor calls, and making views is a sixth of them."""
    ws = _workspace(rows * v * (7 if draw else 6), dev)  # a new CPU workspace empties the cache
    cache = _LOCAL.views if _on_host(dev) else {}
    key = (rows, v, n, draw)
    if key not in cache:
        if len(cache) > 64:
            cache.clear()
        x = ws[:6 * rows * v].view(rows, 6, v)[:n]
        cache[key] = (x, *x.unbind(1), ws[6 * rows * v:].view(rows, v)[:n] if draw else None)
    return cache[key]



def row_stats(trainer_lp: Any, rollout_lp: Any, uniforms: Any = None,
              chunk_elems: int | None = None) -> dict[str, Any]:
    """Sums over the vocabulary of two (T, V) log-probability tensors, in chunks of rows.

    Returns (T,) numpy arrays `kl` (exact KL(rollout || trainer) of the normalised distributions
    over the tokens the trainer keeps, float64), `excluded` (rollout mass on tokens the trainer
    gives -inf), `entropy` (of the rollout, float64), `bad_trainer` / `bad_rollout` (bool: NaN or
    +inf in the row), and `tokens` (an int64 tensor on the rollout's device: inverse-CDF draws on
    `uniforms`; None without them).
    """
    import torch

    with torch.inference_mode():  # (as `compare`: the workspace is only touched in inference mode)
        return _row_stats(trainer_lp, rollout_lp, uniforms, chunk_elems)


def _row_stats(trainer_lp: Any, rollout_lp: Any, uniforms: Any = None,
               chunk_elems: int | None = None) -> dict[str, Any]:
    import torch

    n_rows, v = rollout_lp.shape
    dev = rollout_lp.device
    f64 = torch.float64
    if chunk_elems is None:
        chunk_elems = CHUNK_ELEMS_CPU if _on_host(dev) else CHUNK_ELEMS_DEVICE
    rows = max(1, min(n_rows, chunk_elems // max(v, 1)))
    if uniforms is not None:
        uniforms = uniforms.to(device=dev, dtype=f64)
    # per row: [d, logp_r, p_r, p_t, p_t where p_r > 0, p_r where the trainer excludes]; d and logp_r
    # become p*d and p*logp_r, then one reduction sums them all (>= 4 outputs per row: one thread
    # sums a row, in order); a plain chunk needs only the first four
    # Small inputs (one chunk) that are the same tensor values on both sides (an aligned pair whose
    # paths agree bit for bit) skip the trainer's exp: p_t = p_r, d = 0, the same values either way.
    # (the one tensor when the trainer's readout reused the rollout's: `execute.finalize`)
    same = n_rows <= rows and (trainer_lp is rollout_lp or (
        trainer_lp.dtype == rollout_lp.dtype and bool(torch.equal(trainer_lp.to(dev), rollout_lp))))
    zero = None  # a float64 0 on the device, made for the first chunk that masks
    sums, drawn, redone = [], [], []
    all_plain = True
    for a in range(0, n_rows, rows):
        b = min(a + rows, n_rows)
        n = b - a
        lr, lt = rollout_lp[a:b], trainer_lp[a:b].to(dev)  # (n, V) each, their own dtype
        x, d, l, p, pt, pts, ex, cbuf = _chunk_views(rows, v, n, uniforms is not None, dev)  # (n, 6, V), (n, V) each
        # Plain chunks (every log-probability on both sides above e^-650: no -inf, NaN or tiny
        # value) skip the thresholds; the values are the same either way (each step is elementwise).
        plain = float(lr.amin()) > LOG_ZERO and (same or float(lt.amin()) > LOG_ZERO)  # NaN: not plain
        all_plain = all_plain and plain
        if not plain and zero is None:
            zero = torch.zeros((), dtype=f64, device=dev)
        # float64 inputs in a plain chunk are read in place (every step below is elementwise, so the
        # values are those of the copies); otherwise they are copied into the buffer first
        direct = plain and lr.dtype == f64 and lt.dtype == f64
        if direct:
            src_r, src_t = lr, lt
        else:
            src_r, src_t = l.copy_(lr), pt
            if not plain:
                torch.nn.functional.threshold_(l, LOG_ZERO, _EXP_FLOOR)
        _exp(src_r, p)
        if not plain:
            # lr <= -650 (-inf too) went in as -700 (a CPU's exp is slow on -inf and subnormal
            # results) and comes out as exactly 0
            torch.nn.functional.threshold_(p, _P_ZERO, 0.0)
        if same and plain:
            # d = 0 and p_t = p: sum p*d is 0 and Z_t is Z_r exactly (a row with +inf in it has Z_r = inf:
            # not finite either way, it is redone below), so only sum p*logp_r and Z_r are summed
            torch.mul(src_r, p, out=l)  # p * logp_r
            s = np.zeros((n, 6))
            s[:, 1:3] = x[:, 1:3].sum(-1).cpu().numpy()
            s[:, 3] = s[:, 5] = s[:, 2]
        else:
            if same:
                d.zero_()
                pt.copy_(p)
            else:
                if not direct:
                    pt.copy_(lt)
                if not plain:
                    # a trainer log-probability at or below e^-650 (log 0: -inf, or a finite -1e4 fill) becomes
                    # -inf, so d = +inf -> max there and p*d >= e^-650*max > 1e8 where the rollout has mass
                    torch.nn.functional.threshold_(pt, LOG_ZERO, -math.inf)
                torch.sub(src_r, src_t, out=d)  # logp_r - logp_t in float64
                if not plain:
                    d.clamp_(max=_F64_MAX)
                    torch.nn.functional.threshold_(pt, LOG_ZERO, _EXP_FLOOR)
                _exp(src_t, pt)  # (n, V) p_t, for its normaliser
                if not plain:
                    torch.nn.functional.threshold_(pt, _P_ZERO, 0.0)
            if not plain:
                torch.where(p > 0, pt, zero, out=pts)  # p_t on the rollout's support
            d.mul_(p)  # p * (logp_r - logp_t)
            torch.mul(src_r, p, out=l)  # p * logp_r
            s = np.zeros((n, 6))
            if plain:  # sum p*d, sum p*logp_r, Z_r, Z_t; p > 0 everywhere: the support's p_t sum is Z_t
                s[:, 0:4] = x[:, :4].sum(-1).cpu().numpy()
                s[:, 5] = s[:, 3]
            else:  # ... and the sum of p_t where p > 0
                s[:, [0, 1, 2, 3, 5]] = x[:, :5].sum(-1).cpu().numpy()
                # A token the trainer excludes where the rollout has mass adds > 1e8 to its row's first sum
                # (the rest of a KL sum is >= -1/e for distributions; overflow: +inf), so only a chunk with
                # a row above 1 can hold one. There such tokens' terms leave that sum and their rollout mass
                # gets its own (the other rows have no such token: their values stay the same).
                if bool(((s[:, 0] > _KL_CHECK) & (s[:, 0] <= math.inf)).any()):
                    cut = pt == 0  # p_t is 0 exactly where the trainer excludes
                    torch.where(cut, p, zero, out=ex)
                    d.masked_fill_(cut, 0.0)
                    s[:, [0, 4]] = x[:, ::5].sum(-1).cpu().numpy()  # slots 0 and 5: sum p*d, the excluded mass
        sums.append(s)
        finite = np.isfinite(s).all(-1) & (s[:, 2] > 0)  # (n,)
        all_finite = bool(finite.all())
        if not all_finite:  # NaN or +inf, or no mass: the masked definition
            i = torch.from_numpy(np.flatnonzero(~finite)).to(dev)
            redone.append((a + _np(i), *_exact_rows(lt[i], lr[i])))
            p[i] = torch.nan_to_num(p[i], nan=0.0, posinf=0.0, neginf=0.0)  # not a distribution
        if uniforms is not None:
            # a plain chunk has p > e^-650 everywhere: no zero-probability token to step over
            drawn.append(_inverse_cdf(p, uniforms[a:b], out=cbuf, positive=plain and all_finite))
    s = sums[0] if len(sums) == 1 else np.concatenate(sums)  # (T, 6)
    kl, ent, excl, k3 = _finish(s, plain=all_plain and not redone)
    bad_t, bad_r = np.zeros(n_rows, dtype=bool), np.zeros(n_rows, dtype=bool)
    for i, kl_i, ent_i, ex_i, k3_i, bt_i, br_i in redone:
        kl[i], ent[i], excl[i], k3[i], bad_t[i], bad_r[i] = kl_i, ent_i, ex_i, k3_i, bt_i, br_i
    tokens = None if uniforms is None else drawn[0] if len(drawn) == 1 else torch.cat(drawn)
    return {"kl": kl, "entropy": ent, "excluded": excl, "k3": k3, "bad_trainer": bad_t, "bad_rollout": bad_r,
            "tokens": tokens}


def draw_tokens_for(case: Any) -> dict[str, Any]:
    """How `compare` draws the tokens of a case whose rollout returned none: keyword arguments."""
    if getattr(case, "streams", "single") == "single":
        return {"generator": case.generator(TOKEN_SALT)}
    return {"uniforms": case.token_uniforms(TOKEN_SALT)}


def compare(trainer: Any, rollout: Any, seq_lens: tuple[int, ...], tokens: Any = None,
            generator: Any = None, *, uniforms: Any = None, case: Any = None,
            chunk_elems: int | None = None) -> Divergence:
    """Compare two (T, V) log-probability tensors at (T,) tokens; rows in case order.

    With `tokens=None` one token per row is drawn from the rollout distribution: by inverse CDF on
    `uniforms` ((T,) in [0, 1)), by the schema-1 multinomial on `generator`, or as the `case` says
    (`draw_tokens_for`). Computed on the rollout outcome's device (see the module note), in
    inference mode: no autograd bookkeeping on its few dozen tensor calls (8% of a small case's
    metrics), and the per-thread workspace is only ever touched there (an inference tensor cannot be
    updated in place outside it).
    """
    import torch

    with torch.inference_mode():
        return _compare(trainer, rollout, seq_lens, tokens, generator, uniforms, case, chunk_elems)


def _compare(trainer: Any, rollout: Any, seq_lens: tuple[int, ...], tokens: Any, generator: Any, uniforms: Any,
             case: Any, chunk_elems: int | None) -> Divergence:
    import torch

    lt_all, lr_all = trainer.logprobs.detach(), rollout.logprobs.detach()  # (T, V) each
    if lt_all.shape != lr_all.shape:
        raise ValueError(f"trainer logprobs {tuple(lt_all.shape)} and rollout logprobs "
                         f"{tuple(lr_all.shape)} differ in shape")
    n = sum(seq_lens)
    if lt_all.shape[0] != n:
        raise ValueError(f"logprobs have {lt_all.shape[0]} rows but the case has {n} tokens")
    if tokens is None and uniforms is None and generator is None:
        if case is None:
            raise ValueError("compare needs tokens, or uniforms / a generator / the case to draw them")
        draw = draw_tokens_for(case)
        uniforms, generator = draw.get("uniforms"), draw.get("generator")
    if tokens is None and uniforms is None:
        tokens = multinomial_tokens(lr_all, generator)
    stats = _row_stats(lt_all, lr_all, uniforms if tokens is None else None, chunk_elems)
    drawn = tokens is None  # (then drawn by `_inverse_cdf`: in range)
    if drawn:
        tokens = stats["tokens"]
    dev = lr_all.device
    tok = _np(torch.as_tensor(tokens)).astype(np.int64, copy=False).reshape(n)  # (T,)
    if n and not drawn and (int(tok.min()) < 0 or int(tok.max()) >= lr_all.shape[1]):
        raise ValueError(f"the rollout's sampled token ids must lie in [0, {lr_all.shape[1]}) (the vocabulary of its "
                         f"logprobs); got ids from {int(tok.min())} to {int(tok.max())}")
    floats = (torch.float32, torch.float64)
    if _on_host(dev) and _on_host(lt_all.device) and lt_all.dtype in floats and lr_all.dtype in floats and n:
        rows = np.arange(n)  # numpy indexing on CPU: a dozen tensor calls fewer, the same values
        lt = lt_all.numpy()[rows, tok].astype(np.float64)  # (T,) each
        lr = lr_all.numpy()[rows, tok].astype(np.float64)
    else:
        tok_d = torch.as_tensor(tokens, device=dev).to(torch.int64).reshape(n, 1)  # (T, 1)
        picked = torch.cat([lt_all.to(dev).gather(1, tok_d).to(torch.float64),
                            lr_all.gather(1, tok_d).to(torch.float64)], 1).cpu().numpy()  # (T, 2)
        lt, lr = np.ascontiguousarray(picked.T)  # (T,) each
    kl, entropy, bad_t, bad_r = stats["kl"], stats["entropy"], stats["bad_trainer"], stats["bad_rollout"]
    excluded, k3_rows = stats["excluded"], stats["k3"]
    with np.errstate(all="ignore"):
        d = lt - lr  # (T,) log r
        # Both paths gave every sampled token the same log-probability (an aligned pair agreeing bit for
        # bit): every log-ratio is +0.0 (NaN is not), and the values below are those of zeros, without
        # their dozens of calls.
        equal = not d.any()
        k3 = np.zeros(n) if equal else k3_of(d)  # (T,)
        b = len(seq_lens)
        seg = np.repeat(np.arange(b), seq_lens)  # (T,)
        counts = np.asarray(seq_lens, dtype=np.float64)
        if equal:
            k3_seq = d_seq = np.zeros(b)
        else:
            k3_seq = np.bincount(seg, weights=k3, minlength=b) / counts
            d_seq = np.bincount(seg, weights=d, minlength=b) / counts
        # the worst sequence's own means of the exact per-row values (a verdict over sequences judges them;
        # one sequence: the batch means themselves; rows all +0.0, as an aligned pair's: 0)
        k3e_mean, kl_mean = _mean(k3_rows), _mean(kl)
        worst = 0
        if b == 1:
            k3e_seq_max, kl_seq_max = k3e_mean, kl_mean
        elif not k3_rows.any() and not kl.any():  # (NaN is truthy: such rows take the sums)
            k3e_seq_max = kl_seq_max = 0.0
        else:
            k3e_seq = np.bincount(seg, weights=k3_rows, minlength=b) / counts
            kl_seq = np.bincount(seg, weights=kl, minlength=b) / counts
            k3e_seq_max, kl_seq_max = float(k3e_seq.max()), float(kl_seq.max())
            both = np.fmax(k3e_seq, kl_seq)  # (NaN only where both are)
            top = both.max()  # (NaN when any is: then the largest of the others, as nanargmax)
            worst = int(both.argmax()) if top == top else 0 if np.isnan(both).all() else int(np.nanargmax(both))
        pt = np.exp(lt)
        pr = pt if equal else np.exp(lr)
        ct, cr = pt - _mean(pt), pr - _mean(pr)
        vt, vr = ct @ ct, cr @ cr
        pearson = float(np.clip((ct @ cr) / math.sqrt(vt * vr), -1.0, 1.0)) if n >= 2 and vt > 0 and vr > 0 \
            else math.nan
        return Divergence(
            k3_kl=_mean(k3),
            k3_seq_max=float(k3_seq.max()),
            kl=kl_mean,
            k3_expected=k3e_mean,
            k3_expected_seq_max=k3e_seq_max,
            kl_seq_max=kl_seq_max,
            worst_sequence=worst,
            max_abs_dlogp=0.0 if equal else float(np.abs(d).max()),
            probs_diff_max=0.0 if equal else float(np.abs(pt - pr).max()),
            log_ppl_diff=_mean(d_seq),
            ppl_ratio=1.0 if equal and b else _mean(np.exp(d_seq)),
            chi2_token=0.0 if equal and n else _mean(np.exp(2 * d)) - 1,
            pearson=pearson,
            entropy=_mean(entropy),
            kl_excluded=_mean(excluded),
            flip_rate=0.0,
            tie_flip_rate=0.0,
            nonfinite_trainer=int((bad_t | np.isnan(lt) | (lt == math.inf)).sum()),
            # (-inf at its own sampled token is log 0, not a non-finite value: a sampler that drew from another
            # distribution than it reports, and k3 = inf there judges it; with the trainer's -inf too there is
            # no ratio at all)
            nonfinite_rollout=int((bad_r | np.isnan(lr) | (lr == math.inf) | ((lr == -math.inf) & (lt == -math.inf))
                                   ).sum()),
            n_tokens=n,
            per_token={
                "sequence": seg,
                "position": np.arange(n) - (np.cumsum(seq_lens) - seq_lens)[seg] if n else np.zeros(0, int),
                "token": tok,
                "logp_trainer": lt,
                "logp_rollout": lr,
                "k3": k3,
                "kl": kl,
                "k3_expected": k3_rows,
            },
        )


def per_token_judged(div: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """Each token's value as a verdict reads it, from a case's `per_token` table: the larger of its
    expected k3 (its sampled k3 where there is no expectation) and its exact KL, and whether its
    sampled k3 is +inf (a drawn token one path gives probability 0); None without the table."""
    pt = getattr(div, "per_token", None) or {}
    if "k3" not in pt or "kl" not in pt or not len(pt["k3"]):
        return None
    with np.errstate(invalid="ignore"):
        row = np.fmax(np.asarray(pt.get("k3_expected", pt["k3"]), dtype=float), np.asarray(pt["kl"], dtype=float))
        return row, np.asarray(pt["k3"], dtype=float) == math.inf


def rollout_sampled_at_zero(div: Any) -> bool:
    """A case's k3 = inf comes from the rollout reporting log 0 (-inf) for a token it sampled (it
    drew from another distribution than the one it reports), not from the trainer excluding it."""
    lr = (getattr(div, "per_token", None) or {}).get("logp_rollout")
    return lr is not None and bool(np.any(np.asarray(lr) == -math.inf))


def _mean(a: np.ndarray) -> float:
    """`a.mean()` for a 1-D float64 array (the same pairwise sum, then / size), without its overhead."""
    return float(np.add.reduce(a)) / a.size if a.size else math.nan


def with_routing(div: Divergence, trainer: Any, rollout: Any) -> Divergence:
    """Fill the tie-aware flip rates from both outcomes' routing decisions."""
    per_layer = routing_flips(trainer.routing, rollout.routing)
    routed = sum(v["tokens"] for v in per_layer.values())
    if routed:
        div.flip_rate = sum(v["flips"] for v in per_layer.values()) / routed
        div.tie_flip_rate = sum(v["tie_flips"] for v in per_layer.values()) / routed
    div.flips_per_layer = per_layer
    return div
