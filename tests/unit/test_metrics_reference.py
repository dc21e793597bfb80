"""`harness.metrics.compare` against a straightforward float64 reference kept here.

The reference is the definition written plainly: per row, masked sums over the vocabulary in float64
added with `math.fsum` (exactly rounded), and k3 = expm1(d) - d evaluated with 40 significant
digits. compare must agree to a relative 1e-9 on k3 (per token and its mean) and on the exact KL
(per position and its mean), and on the expected k3 (the exact mean of k3 over the rollout's distribution),
over random tensors of several shapes (peaked, truncated with -inf,
bf16-rounded) and over every repro in corpora/, replayed. Chunking must not change the values.
"""

from __future__ import annotations

import math
from pathlib import Path

import mpmath
import numpy as np
import pytest
import torch

from harness.case import Case
from harness.corpus import iter_corpus, load_plugin_for, load_repro
from harness.execute import run_paths
from harness.metrics import LOG_ZERO, compare
from harness.pairs import REGISTRY, Outcome
from harness.sampling import process_logits, sample_rows

REL = 1e-9
CORPUS = Path(__file__).resolve().parents[2] / "corpora"
FILES = iter_corpus(CORPUS)


def k3_exact(d: float) -> float:
    if math.isnan(d) or d == math.inf:
        return math.nan
    if d == -math.inf:
        return math.inf
    with mpmath.workdps(40):
        x = mpmath.mpf(d)
        return float(mpmath.expm1(x) - x)


def reference(lt: torch.Tensor, lr: torch.Tensor, tokens) -> dict[str, np.ndarray | float]:
    """The definition, plainly: float64, masked, fsum; each side normalised, the rollout over the
    tokens the trainer keeps (the KL runs over those; +inf when the rollout has no mass there); NaN
    rows where either path has NaN or +inf; a probability at or below e^-650 is 0."""
    lt = lt.detach().to(torch.float64).cpu().numpy()
    lr = lr.detach().to(torch.float64).cpu().numpy()
    tok = np.asarray(tokens, dtype=np.int64)
    n = lt.shape[0]
    kl, ent, ek3 = np.empty(n), np.empty(n), np.empty(n)
    with np.errstate(all="ignore"):
        for i in range(n):
            bad_t, bad_r = not (lt[i] < math.inf).all(), not (lr[i] < math.inf).all()
            p = np.exp(np.where(lr[i] <= LOG_ZERO, -np.inf, lr[i]))  # at or below e^-650: 0
            pt = np.exp(np.where(lt[i] <= LOG_ZERO, -np.inf, lt[i]))
            log_zr, log_zt = math.log(math.fsum(p)), math.log(math.fsum(pt)) if not bad_t else math.nan
            q = p / math.exp(log_zr)  # the normalised rollout distribution
            m = (q > 0) & (lt[i] > LOG_ZERO)  # 0 * log 0 = 0; tokens the trainer excludes: reported apart
            zk = math.fsum(p[m])  # the rollout's mass on the tokens the trainer keeps
            qk = p[m] / zk if zk > 0 else p[m]
            kl[i] = (math.nan if bad_t or bad_r else math.inf if zk == 0
                     else math.fsum(qk * ((lr[i][m] - math.log(zk)) - (lt[i][m] - log_zt))))
            ent[i] = math.nan if bad_r else -math.fsum(q[q > 0] * (lr[i][q > 0] - log_zr))
            # the expected k3 of a token drawn from the rollout: of the log-probabilities as reported
            dm = lt[i][m] - lr[i][m]
            ek3[i] = math.nan if bad_t or bad_r else math.fsum(q[m] * (np.expm1(dm) - dm))
        rows = np.arange(n)
        d = lt[rows, tok] - lr[rows, tok]
    k3 = np.array([k3_exact(float(x)) for x in d])
    mean = (lambda a: math.fsum(a) / len(a) if np.isfinite(a).all() else float(np.mean(a)))
    return {"k3": k3, "kl_rows": kl, "entropy_rows": ent, "k3_kl": mean(k3), "kl": mean(kl),
            "entropy": mean(ent), "k3_expected_rows": ek3, "k3_expected": mean(ek3)}


# The KL of normalised distributions depends on each side's log-normaliser, which float64 knows to
# ~1e-16 absolute (fp32 log-softmax rows sum to 1 only within ~1e-7): below that no method is exact,
# and a KL of 1e-14 is 11 decades under the threshold.
KL_ABS = 1e-14


def assert_rel(got, want, rel=REL, what="", abs_floor=0.0):
    got, want = np.atleast_1d(np.asarray(got, dtype=np.float64)), np.atleast_1d(np.asarray(want, dtype=np.float64))
    same_special = (np.isnan(got) & np.isnan(want)) | (np.isinf(want) & (got == want))
    finite = np.isfinite(want)
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(got - want), 0.0)
    ok = same_special | (finite & (err <= np.maximum(rel * np.abs(want), abs_floor)))
    assert ok.all(), (f"{what}: {int((~ok).sum())} of {ok.size} differ beyond relative {rel}; worst: got "
                      f"{got[~ok][:3]}, want {want[~ok][:3]}")


def check_against_reference(trainer: Outcome, rollout: Outcome, seq_lens, div) -> None:
    ref = reference(trainer.logprobs, rollout.logprobs, div.per_token["token"])
    assert_rel(div.per_token["k3"], ref["k3"], what="k3 per token")
    assert_rel(div.k3_kl, ref["k3_kl"], what="k3_kl")
    assert_rel(div.per_token["kl"], ref["kl_rows"], what="kl per position", abs_floor=KL_ABS)
    assert_rel(div.kl, ref["kl"], what="kl", abs_floor=KL_ABS)
    assert_rel(div.entropy, ref["entropy"], rel=1e-12, what="entropy", abs_floor=KL_ABS)
    # from the row sums (p_t, p, p*d): like the KL, exact to the log-normalisers' ~1e-16
    assert_rel(div.per_token["k3_expected"], ref["k3_expected_rows"], what="expected k3 per position",
               abs_floor=KL_ABS)
    assert_rel(div.k3_expected, ref["k3_expected"], what="k3_expected", abs_floor=KL_ABS)


def perturbed(t: int, v: int, scale: float, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, v, generator=g) * scale  # (T, V) logits
    y = x + noise * torch.randn(t, v, generator=g)
    return torch.log_softmax(y, -1), torch.log_softmax(x, -1)  # trainer, rollout


SHAPES = [(1, 2), (7, 512), (33, 4096), (5, 32768), (3, 151936)]


@pytest.mark.parametrize("t,v", SHAPES)
@pytest.mark.parametrize("scale,noise", [(1.0, 1e-4), (3.0, 1e-2), (30.0, 1e-3), (300.0, 1e-3), (1.0, 1.0)],
                         ids=["near", "mid", "peaked", "extreme", "far"])  # extreme: log-probs far below -708
def test_random_tensors_match_the_reference(t, v, scale, noise):
    lt, lr = perturbed(t, v, scale, noise, seed=t * 7 + v)
    u = torch.rand(t, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    div = compare(Outcome(logprobs=lt), Outcome(logprobs=lr), (t,), uniforms=u)
    assert (div.per_token["token"] == sample_rows(lr, u).numpy()).all()
    check_against_reference(Outcome(logprobs=lt), Outcome(logprobs=lr), (t,), div)


@pytest.mark.parametrize("t,v", [(9, 512), (4, 32768), (2, 151936)])
def test_truncated_and_low_precision_rows_match_the_reference(t, v):
    g = torch.Generator().manual_seed(v)
    logits = 4 * torch.randn(t, v, generator=g)  # (T, V)
    full = torch.log_softmax(logits, -1)
    topk = process_logits(logits, 1.0, top_k=min(50, v // 2))  # -inf outside the 50 largest
    nucleus = process_logits(logits, 0.7, top_p=0.9)
    bf16 = torch.log_softmax(logits.bfloat16().float(), -1)
    u = torch.rand(t, generator=g, dtype=torch.float64)
    cases = {
        "rollout truncated, trainer full": (full, topk),  # the truncated-sampling bug: KL = -log(kept mass)
        "both truncated alike": (topk.clone(), topk),  # -inf at the same places: 0 * log 0 terms
        "both truncated differently": (nucleus, topk),
        "trainer truncated, rollout full": (topk, full),  # KL = +inf: a divergence, not non-finite
        "bf16 trainer": (bf16, full),
    }
    for name, (lt, lr) in cases.items():
        tr, ro = Outcome(logprobs=lt), Outcome(logprobs=lr)
        div = compare(tr, ro, (t,), uniforms=u)
        assert (div.per_token["token"] == sample_rows(lr, u).numpy()).all(), name
        check_against_reference(tr, ro, (t,), div)
        assert div.nonfinite_trainer == div.nonfinite_rollout == 0 and not div.nonfinite, name
    div = compare(Outcome(logprobs=topk), Outcome(logprobs=full), (t,), uniforms=u)
    assert div.kl_excluded > 0.01 and math.isfinite(div.kl)  # the excluded mass is reported, not folded in
    # ... and the rest is the same distribution once the rollout is renormalised over the kept tokens:
    # KL 0, not the partial sum's (1 - excluded) log(1 - excluded) < 0
    assert abs(div.kl) < 1e-6 and (div.per_token["kl"] > -1e-6).all()
    bf = compare(Outcome(logprobs=full), Outcome(logprobs=bf16), (t,), uniforms=u)
    assert bf.kl >= 0  # normalised: rounding of the log-softmax is no first-order KL
    div = compare(Outcome(logprobs=full), Outcome(logprobs=topk), (t,), uniforms=u)
    exact = torch.log_softmax(logits.double(), -1)  # the true distribution, in float64
    kept = torch.logsumexp(exact.masked_fill(topk == -math.inf, -math.inf), -1)  # log kept mass
    assert div.kl == pytest.approx(float(-kept.mean()), rel=1e-6)  # -log Z: normalising removes the fp32 rows' error  # -log Z, up to the fp32 inputs' rounding


def test_nonfinite_rows_match_the_reference():
    lt, lr = perturbed(6, 300, 2.0, 1e-2, seed=3)
    lt[1, 5], lr[2, 7], lt[3, 9], lr[4, 0] = math.nan, math.nan, math.inf, math.inf
    tr, ro = Outcome(logprobs=lt), Outcome(logprobs=lr)
    div = compare(tr, ro, (6,), torch.tensor([0, 1, 2, 3, 4, 5]))
    check_against_reference(tr, ro, (6,), div)
    assert div.nonfinite_trainer == 2 and div.nonfinite_rollout == 2 and div.nonfinite
    assert math.isnan(div.kl) and np.isfinite(div.per_token["kl"][[0, 5]]).all()


@pytest.mark.parametrize("t,v", [(40, 512), (6, 151936)])
def test_chunking_does_not_change_the_values(t, v):
    lt, lr = perturbed(t, v, 3.0, 1e-3, seed=11)
    lr[::3] = process_logits(lr[::3], 1.0, top_k=20)  # some rows through the masked path
    u = torch.rand(t, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tr, ro = Outcome(logprobs=lt), Outcome(logprobs=lr)
    one = compare(tr, ro, (t // 2, t - t // 2), uniforms=u, chunk_elems=1)  # one row per chunk
    big = compare(tr, ro, (t // 2, t - t // 2), uniforms=u, chunk_elems=1 << 30)  # one chunk
    assert (one.per_token["token"] == big.per_token["token"]).all()
    for k in one.as_dict():
        assert_rel(getattr(one, k), getattr(big, k), rel=1e-12, what=k)
    for k in ("k3", "kl", "logp_trainer", "logp_rollout"):
        assert_rel(one.per_token[k], big.per_token[k], rel=1e-12, what=k)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(CORPUS)) for p in FILES])
def test_corpus_replays_match_the_reference(path):
    repro = load_repro(path)
    why = load_plugin_for(repro)
    if why is not None:
        pytest.skip(f"{path.relative_to(CORPUS)}: {why}")
    case = repro.case
    trainer, rollout = run_paths(REGISTRY.get(repro.pair), case, "cpu")
    div = compare(trainer, rollout, case.seq_lens, rollout.tokens, case=case)
    if rollout.tokens is None:
        assert (div.per_token["token"] == expected_draw(case, rollout.logprobs)).all()
    else:
        assert (div.per_token["token"] == rollout.tokens.cpu().numpy()).all()
    check_against_reference(trainer, rollout, case.seq_lens, div)


def expected_draw(case: Case, logprobs: torch.Tensor) -> np.ndarray:
    """Tokens as drawn before metrics moved to torch: the schema-1 multinomial for upgraded repros,
    else inverse CDF on the case's per-sequence uniforms."""
    if case.streams == "single":
        with np.errstate(all="ignore"):
            p = torch.from_numpy(np.exp(logprobs.double().numpy()))
        p = torch.nan_to_num(p, nan=0.0, posinf=0.0, neginf=0.0)
        p[p.sum(-1) <= 0] = 1.0
        return torch.multinomial(p, 1, generator=case.generator("tokens")).squeeze(-1).numpy()
    return sample_rows(logprobs, case.token_uniforms("tokens")).numpy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compare on the outcomes' device)")
def test_on_cuda_matches_the_reference_and_draws_the_cpu_tokens():
    lt, lr = perturbed(300, 32768, 3.0, 1e-2, seed=5)
    lr[::4] = process_logits(lr[::4], 1.0, top_k=40)
    u = torch.rand(300, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cpu = compare(Outcome(logprobs=lt), Outcome(logprobs=lr), (100, 200), uniforms=u)
    gpu = compare(Outcome(logprobs=lt.cuda()), Outcome(logprobs=lr.cuda()), (100, 200), uniforms=u)
    assert (gpu.per_token["token"] == cpu.per_token["token"]).all()
    check_against_reference(Outcome(logprobs=lt), Outcome(logprobs=lr), (100, 200), gpu)


@pytest.mark.parametrize("truncate", [False, True])
def test_equal_outcomes_take_the_shortcut_with_the_same_values(truncate):
    """One chunk with the same values on both sides skips the trainer's exp; several chunks do not."""
    _, lr = perturbed(12, 700, 3.0, 1e-3, seed=5)
    if truncate:
        lr = process_logits(lr, 1.0, top_k=30)
    u = torch.rand(12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    tr, ro = Outcome(logprobs=lr.clone()), Outcome(logprobs=lr)
    short = compare(tr, ro, (5, 7), uniforms=u)
    long = compare(tr, ro, (5, 7), uniforms=u, chunk_elems=700 * 5)  # 3 chunks: the general path
    assert short.k3_kl == short.kl == short.k3_expected == 0.0
    for k in short.as_dict():
        assert_rel(getattr(short, k), getattr(long, k), rel=0.0, what=k)
    assert (short.per_token["token"] == long.per_token["token"]).all()


@pytest.mark.parametrize("chunk_elems", [None, 512 * 3], ids=["one chunk", "chunks of 3 rows"])
def test_accelerator_branches_match_the_reference_on_cpu_tensors(monkeypatch, chunk_elems):
    """The branches a GPU takes (a workspace per call, torch's exp, gather instead of numpy indexing,
    the device chunk size) run here on CPU tensors: the same tokens as the host path and the float64
    reference's values, on plain, truncated, non-finite and equal rows."""
    from harness import metrics

    g = torch.Generator().manual_seed(21)
    logits = 3 * torch.randn(12, 512, generator=g)  # (T, V)
    full = torch.log_softmax(logits, -1)
    topk = process_logits(logits, 1.0, top_k=40)
    nan = full.clone()
    nan[4, 9] = math.nan
    noisy = torch.log_softmax(logits + 1e-2 * torch.randn(12, 512, generator=g), -1)
    u = torch.rand(12, generator=g, dtype=torch.float64)
    inputs = {"plain": (noisy, full), "rollout truncated": (full, topk), "trainer truncated": (topk, full),
              "non-finite": (nan, full), "equal": (full.clone(), full), "bf16": (noisy.bfloat16(), full)}
    host = {k: compare(Outcome(logprobs=lt), Outcome(logprobs=lr), (5, 7), uniforms=u, chunk_elems=chunk_elems)
            for k, (lt, lr) in inputs.items()}
    monkeypatch.setattr(metrics, "_on_host", lambda dev: False)
    for k, (lt, lr) in inputs.items():
        tr, ro = Outcome(logprobs=lt), Outcome(logprobs=lr)
        dev = compare(tr, ro, (5, 7), uniforms=u, chunk_elems=chunk_elems)
        assert (dev.per_token["token"] == host[k].per_token["token"]).all(), k
        for m in dev.as_dict():  # (torch's exp against numpy's: a KL of ~1e-14 differs in its leading digits
            # on some CPUs, as a difference of normalisers known to ~1e-16: `KL_ABS`)
            assert_rel(getattr(dev, m), getattr(host[k], m), rel=1e-12, what=f"{k}: {m}", abs_floor=KL_ABS)
        if k != "non-finite":
            check_against_reference(tr, ro, (5, 7), dev)
