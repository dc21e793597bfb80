"""Sampling as a rollout engine does it, for pairs to share: penalties, temperature, min-p, top-k,
top-p, and seeded token draws that replay bit-for-bit on every device.

An outcome's log-probabilities are those of the distribution its path sampled from (or scores
with): `process_logits` applies the case's sampling parameters in vLLM's order (the repetition,
frequency and presence penalties on the raw logits, then temperature, then min-p, then top-k, then
top-p over what is left; truncated tokens get -inf, and the rest is renormalised). Hugging Face's
`generate` applies min-p last, after top-p: the kept set differs only where both min-p and top-p
cut (top-p then sums over a distribution min-p already renormalised), so an engine and a trainer
that order them differently is a real mismatch a case with both can show. A rollout that samples
from a truncated distribution while the trainer
scores the full one is a real mismatch: the exact KL(rollout || trainer) is -log(kept mass), while
the sampled-token k3 only sees about (1 - kept mass)^2 / 2 of it; the verdict judges both.

Tokens are drawn by inverse CDF from uniforms the case supplies (`case.token_uniforms("sample")`:
one per response token, sequence j's from its own CPU stream), so the draw does not depend on the
device, the batch layout or the other sequences.
"""

from __future__ import annotations

import math
from typing import Any


def process_logits(logits: Any, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0, *, seen: Any = None, counts: Any = None, repetition_penalty: float = 1.0,
                   presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> Any:
    """(..., V) logits -> (..., V) float32 log-probabilities of the sampling distribution.

    Penalties first, on the raw logits, as vLLM applies them (`penalize`; they need each row's token
    history, `seen` and `counts`: `history`); then temperature > 0 divides the logits; min_p > 0
    then cuts every token whose probability is below min_p times the most likely token's (as vLLM
    and Hugging Face do, in log space: a logit more than -log(min_p) below the row's largest; min_p =
    1 keeps the tokens tied at the top); top_k > 0 keeps the k largest (ties at the k-th value are
    all kept, as a threshold filter does); top_p < 1 keeps the smallest set of most likely tokens
    whose mass reaches top_p (at least one), summed over what min-p and top-k left. Everything else
    is -inf.
    """
    import torch

    if not (math.isfinite(float(temperature)) and float(temperature) > 0):
        raise ValueError(f"process_logits: temperature must be a finite number > 0, got {temperature!r} (greedy "
                         "decoding is top_k=1, not temperature 0)")
    if not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"process_logits: top_p must be in (0, 1], got {top_p!r} (1.0 turns it off)")
    if not (0.0 <= float(min_p) <= 1.0):
        raise ValueError(f"process_logits: min_p must be in [0, 1], got {min_p!r} (0.0 turns it off)")
    x = penalize(logits.float(), seen, counts, repetition_penalty, presence_penalty, frequency_penalty)
    x = x / float(temperature)
    v = x.shape[-1]
    if min_p > 0.0:
        floor = x.amax(-1, keepdim=True) + math.log(float(min_p))  # (..., 1)
        x = x.masked_fill(x < floor, float("-inf"))
    if 0 < top_k < v:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        x = x.masked_fill(_nucleus_drop(x, float(top_p)), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def penalize(logits: Any, seen: Any = None, counts: Any = None, repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> Any:
    """(..., V) float logits with an engine's penalties applied, as vLLM applies them (before the
    temperature): the repetition penalty divides the positive logits, and multiplies the others, of
    every token in the row's prompt or output so far (`seen`, (..., V) bool; Hugging Face's
    `repetition_penalty` is the same over its input ids); the frequency penalty subtracts
    frequency_penalty times each token's count in the output so far (`counts`, (..., V)), the presence
    penalty presence_penalty once for each token the output holds. Neutral values (1, 0, 0) leave
    the logits as they are, history or not."""
    import torch

    rp, pp, fp = float(repetition_penalty), float(presence_penalty), float(frequency_penalty)
    if not (math.isfinite(rp) and rp > 0):
        raise ValueError(f"penalize: repetition_penalty must be a finite number > 0, got {repetition_penalty!r} "
                         "(1.0 turns it off)")
    if not (math.isfinite(pp) and math.isfinite(fp)):
        raise ValueError(f"penalize: presence_penalty and frequency_penalty must be finite, got {presence_penalty!r}, "
                         f"{frequency_penalty!r} (0.0 turns them off)")
    if rp == 1.0 and pp == 0.0 and fp == 0.0:
        return logits
    if (rp != 1.0 and seen is None) or ((pp or fp) and counts is None):
        raise ValueError("penalize: penalties need each row's token history: `seen` (the prompt's and output's "
                         "tokens, for the repetition penalty) and `counts` (the output's, for presence and frequency); "
                         "make them with harness.sampling.history")
    x = logits
    if rp != 1.0:
        x = torch.where(seen.to(x.device), torch.where(x > 0, x / rp, x * rp), x)
    if fp:
        x = x - fp * counts.to(device=x.device, dtype=x.dtype)
    if pp:
        x = x - pp * (counts.to(x.device) > 0).to(x.dtype)
    return x


def history(prompt: Any, response: Any, vocab: int, first: int = 0, last: int | None = None,
            device: Any = None) -> tuple[Any, Any]:
    """The token history a penalty reads at response positions first..last-1 of one sequence (all
    by default): (seen, counts), each (rows, V): `seen` the tokens of the prompt and of the response
    before that position (bool), `counts` how often each token occurs in the response before it
    (float32). The rollout's step t and the trainer's row t read the same."""
    import torch

    prompt = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1).cpu()
    response = torch.as_tensor(response, dtype=torch.int64).reshape(-1).cpu()
    last = len(response) if last is None else last
    n = max(0, last - first)
    before = torch.zeros(vocab, dtype=torch.float32)  # counts of response[:first]
    if first:
        before.index_add_(0, response[:first], torch.ones(first))
    steps = torch.zeros(n, vocab, dtype=torch.float32)  # row i adds response[first + i - 1] (row 0: nothing)
    if n > 1:
        steps[torch.arange(1, n), response[first:last - 1]] = 1.0
    counts = before + torch.cumsum(steps, 0)  # (n, V)
    seen = counts > 0
    if len(prompt):
        seen[:, prompt] = True
    return seen.to(device) if device is not None else seen, counts.to(device) if device is not None else counts


def _nucleus_drop(x: Any, top_p: float) -> Any:
    """(..., V) float32 logits -> (..., V) bool: the tokens top-p drops. In descending order of the
    logits, equal logits in ascending token id, a token is dropped when the probability mass strictly
    before it (a running float32 sum of the row's softmax, taken in that order) reaches top_p; the
    first token always stays. Each row's result depends on that row alone.

    Only the head of each row is sorted: the k largest logits (`topk`, k growing 16-fold until every
    row's head holds top_p of its mass), widened to every token tied with the head's last logit (topk
    picks among ties by its own rule, which depends on k, and k on the other rows), then ordered as
    above. At a 152k vocabulary a full sort of every row is most of the cost, and the kept set is a
    small head of the row in practice (a near-flat row ends in a full sort)."""
    import torch

    v = x.shape[-1]
    rows = x.reshape(-1, v)  # (R, V)
    if rows.shape[0] == 0 or v == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    probs = torch.softmax(rows, dim=-1)  # (R, V)
    k = min(v, 64)
    while k < v:
        head_x, idx = torch.topk(rows, k, dim=-1)  # (R, k), descending; ties in no set order
        mass = torch.cumsum(probs.gather(-1, idx), dim=-1)  # (R, k)
        # every token past the head has at least the head's whole mass before it
        if bool((mass[:, -1] >= top_p).all()):
            break
        # the next head: 16 times larger, or the whole row when that, or `need`, is past a quarter of it (a
        # head that large costs about a full sort). need: how many tokens of the head's mean probability
        # reach top_p; the tokens past the head are less likely, so at least that many are kept
        need = k * top_p / max(float(mass[:, -1].nan_to_num(0.0).min()), 1e-30)
        k = 16 * k if max(16 * k, need) <= v // 4 else v
    if k < v:
        # widen the head to every token tied with its last logit (each row's group: the tokens at or
        # above it, a prefix of the canonical order whose mass reaches top_p), then order it canonically:
        # by token id, then (stable) by logit, descending
        # (a -inf boundary, from top-k: the head holds every finite logit, and -inf ones have no mass)
        group = ((rows >= head_x[:, -1:]) & (rows > -math.inf)).sum(-1)  # (R,) >= 1
        if int(group.max()) > k:
            k = int(group.max())
            _, idx = torch.topk(rows, k, dim=-1)
        by_id, _ = torch.sort(idx, dim=-1)
        _, order = torch.sort(rows.gather(-1, by_id), dim=-1, descending=True, stable=True)
        idx = by_id.gather(-1, order)  # (R, k)
        mass = torch.cumsum(probs.gather(-1, idx), dim=-1)  # (R, k): mass up to and including each token
        # (summed in this order the group's mass can fall a last bit short of top_p: then sort it all)
        if not bool((mass.gather(-1, group[:, None] - 1) >= top_p).all()):
            k = v
    if k == v:  # the whole row in the canonical order (a stable sort keeps equal logits in id order)
        _, idx = torch.sort(rows, dim=-1, descending=True, stable=True)
        mass = torch.cumsum(probs.gather(-1, idx), dim=-1)
    before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=-1)  # strictly before
    drop = torch.ones_like(rows, dtype=torch.bool) if k < v else torch.zeros_like(rows, dtype=torch.bool)
    drop.scatter_(-1, idx, before >= top_p)  # (R, V)
    return drop.reshape(x.shape)


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
