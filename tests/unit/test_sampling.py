"""`harness.sampling.process_logits`: the nucleus (top-p) filter sorts only the head of each row;
it keeps the tokens its definition keeps over a full sort of the row."""

from __future__ import annotations

import math

import pytest
import torch

from harness.sampling import process_logits


def full_sort_drop(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition over a full sort of each (R, V) row: the softmax's float32 probabilities in
    descending order of the logits; a token is dropped when the running sum strictly before it
    reaches top_p."""
    p = torch.softmax(x, dim=-1)
    sx, idx = torch.sort(x, dim=-1, descending=True)
    sp = p.gather(-1, idx)
    c = torch.cumsum(sp, dim=-1)
    before = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], dim=-1)
    return torch.zeros_like(x, dtype=torch.bool).scatter(-1, idx, before >= top_p)


def cut_ties(x: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """(R,) rows whose last kept token ties with a dropped one (which of them stays is the sort's
    choice, and a full sort and a partial one may choose differently)."""
    last_kept = x.masked_fill(drop, math.inf).amin(-1)
    first_out = x.masked_fill(~drop, -math.inf).amax(-1)
    return (last_kept == first_out) & torch.isfinite(last_kept)


@pytest.mark.parametrize("v", [7, 64, 300, 5000])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])  # flat (the head must grow), peaked, one token
def test_nucleus_keeps_the_tokens_of_a_full_sort(v, top_p, scale):
    g = torch.Generator().manual_seed(v + int(1000 * top_p) + int(scale))
    logits = scale * torch.randn(40, v, generator=g)
    lp = process_logits(logits, 1.0, top_p=top_p)
    drop = lp == -math.inf
    want = full_sort_drop(logits, top_p)
    ok = ~cut_ties(logits, want)
    assert ok.sum() >= 36
    assert torch.equal(drop[ok], want[ok])
    assert (~drop).any(-1).all()  # the most likely token always stays
    # what is kept is the head of the row, its mass reaches top_p, and not without its last token
    p = torch.softmax(logits.double(), -1)
    kept_mass = p.masked_fill(drop, 0).sum(-1)
    last = p.masked_fill(drop, math.inf).amin(-1)
    assert (kept_mass >= top_p - 1e-4).all() and (kept_mass - last < top_p + 1e-4).all()
    assert (logits.masked_fill(drop, math.inf).amin(-1) >= logits.masked_fill(~drop, -math.inf).amax(-1)).all()
    assert torch.allclose(torch.exp(lp).sum(-1), torch.ones(40), atol=1e-5)  # renormalised over the kept


def test_nucleus_after_top_k_and_temperature_on_a_batch_of_any_shape():
    g = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(2, 3, 1000, generator=g)
    lp = process_logits(logits, 0.7, top_k=50, top_p=0.8)
    assert lp.shape == logits.shape
    x = logits / 0.7
    kth = torch.topk(x, 50, dim=-1).values[..., -1:]
    x = x.masked_fill(x < kth, -math.inf).reshape(6, 1000)
    assert torch.equal((lp == -math.inf).reshape(6, 1000), full_sort_drop(x, 0.8))
    assert ((lp > -math.inf).sum(-1) <= 50).all()


def test_rows_that_are_not_distributions_stay_as_they_are():
    x = torch.tensor([[math.nan, 0.0, 1.0], [-math.inf, -math.inf, -math.inf], [0.0, 0.0, 0.0]])
    lp = process_logits(x, 1.0, top_p=0.5)
    assert torch.isnan(lp[0]).all() and torch.isnan(lp[1]).all()  # NaN in, NaN out; no mass at all
    assert (lp[2] > -math.inf).sum() == 2  # three equal tokens: two reach 0.5 (mass before: 0, 1/3, 2/3)


def test_a_real_vocabulary_batch():
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(8, 151936, generator=g)
    lp = process_logits(logits, 1.0, top_p=0.9)
    kept = (lp > -math.inf).sum(-1)
    assert (kept >= 1).all() and (kept < 151936).all()
    want = full_sort_drop(logits, 0.9)
    ok = ~cut_ties(logits, want)
    assert torch.equal((lp == -math.inf)[ok], want[ok])
