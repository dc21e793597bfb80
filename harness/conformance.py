"""Conformance check for target pairs: the one line a backend author adds to their own tests.

    def test_my_pair_conforms():
        harness.check_pair(my_pair)          # or check_pair("my.pair") once registered

It draws a few cases from the pair's own axes (seeded, so the check itself is deterministic) and
checks the contract of `harness.pairs`: both paths return an Outcome with one row of
log-probabilities per token in case order over the same vocabulary; running the same case twice
gives bit-for-bit identical outputs (every tensor comes from the case's seed); outputs are finite;
sampled tokens and routing decisions, where present, have the right shapes. It raises
`ConformanceError` listing every violation, and returns the cases it checked.
"""

from __future__ import annotations

from .case import Case
from .execute import run_paths
from .pairs import REGISTRY, TargetPair


class ConformanceError(AssertionError):
    pass


def sample_cases(pair: TargetPair, n: int, seed: int = 0) -> list[Case]:
    """n distinct cases from the pair's axes, the same ones every time for the same seed."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hseed

    from .strategies import cases

    out: list[Case] = []

    @settings(max_examples=n, database=None, derandomize=False, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @hseed(seed)
    @given(cases(pair.axes))
    def collect(case: Case) -> None:
        if case not in out:
            out.append(case)

    collect()
    return out


def check_pair(pair: TargetPair | str, n_cases: int = 8, device: str = "cpu", seed: int = 0) -> list[Case]:
    import torch

    if isinstance(pair, str):
        pair = REGISTRY.get(pair)
    pair.validate()
    problems: list[str] = []
    checked = sample_cases(pair, n_cases, seed)
    for case in checked:
        where = f"case {case.one_line()}"
        try:
            t1, r1 = run_paths(pair, case, device)
            t2, r2 = run_paths(pair, case, device)
        except Exception as e:
            problems.append(f"{where}: the pair raised {type(e).__name__}: {e}")
            continue
        if t1.logprobs.shape != r1.logprobs.shape:
            problems.append(f"{where}: trainer logprobs {tuple(t1.logprobs.shape)} and rollout logprobs "
                            f"{tuple(r1.logprobs.shape)} differ in shape; both must be (tokens, vocab)")
        for role, a, b in (("trainer", t1, t2), ("rollout", r1, r2)):
            if not torch.equal(a.logprobs, b.logprobs):
                problems.append(f"{where}: {role} is not deterministic: two runs of the same case differ. Draw every "
                                "tensor from case.generator(...) and avoid nondeterministic kernels")
            if bool(torch.isnan(a.logprobs).any() or torch.isposinf(a.logprobs).any()):
                problems.append(f"{where}: {role} logprobs contain NaN or +inf (-inf is allowed for masked tokens)")
            for name, rt in a.routing.items():
                ex = torch.as_tensor(rt.experts)
                if ex.dim() != 2 or ex.shape[0] != case.n_tokens:
                    problems.append(f"{where}: {role} routing[{name!r}].experts has shape {tuple(ex.shape)}, "
                                    f"expected ({case.n_tokens}, top_k)")
        for role, out in (("rollout", r1), ("trainer", t1)):
            if out.tokens is not None:
                tok = torch.as_tensor(out.tokens)
                if tok.shape != (case.n_tokens,) or int(tok.min()) < 0 or int(tok.max()) >= out.logprobs.shape[-1]:
                    problems.append(f"{where}: {role} tokens must be ({case.n_tokens},) ids below the vocabulary size")
                elif role == "rollout" and r2.tokens is not None and not torch.equal(tok, torch.as_tensor(r2.tokens)):
                    problems.append(f"{where}: rollout sampled different tokens on two runs; sample with a "
                                    "generator seeded from the case")
    if problems:
        raise ConformanceError(f"target pair {pair.name!r} breaks the contract:\n  - " + "\n  - ".join(problems))
    return checked
