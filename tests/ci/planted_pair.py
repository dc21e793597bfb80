"""A planted regression for the plugin tests: an `aligned` pair whose rollout adds a bias.

`planted.aligned_bias` claims to be aligned, but its rollout shifts the logits of every token by
BIAS * (a seeded noise vector), so any case diverges: the fuzzer must find it, shrink it and fail
the run. The bias is a named module constant so the bisect test can edit it per commit.
"""
import torch

from harness import Axes, Outcome, TargetPair, register

VOCAB = 64
BIAS = 0.5  # logit noise the rollout adds; 0.0 makes the pair truly aligned


def build(case, device):
    logits = case.randn((case.n_tokens, VOCAB), "logits", device=device)  # (T, V)
    noise = case.randn((case.n_tokens, VOCAB), "noise", device=device)  # (T, V)
    return {"logits": logits, "noise": noise}


def trainer(inp):
    return Outcome(logprobs=torch.log_softmax(inp["logits"], -1))  # (T, V)


def rollout(inp):
    return Outcome(logprobs=torch.log_softmax(inp["logits"] + BIAS * inp["noise"], -1))  # (T, V)


register(TargetPair(
    name="planted.aligned_bias", kind="op", expected="aligned", build=build, trainer=trainer, rollout=rollout,
    axes=Axes(n_seqs=(1, 2), seq_len=(1, 8)), devices=("cpu",),
    description="planted: the rollout adds a seeded logit bias (a regression the plugin must fail on)",
))
