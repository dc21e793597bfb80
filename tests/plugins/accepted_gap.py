"""An accepted gap and its regression: a rollout whose logits are off by a fixed small noise (an int8
weight path against a float trainer, say: judged up to about 0.006 over these axes, over the default
line 0.001), judged at a line of its own (`TargetPair(threshold=0.02)`); its regressed twin is off by
10x as much once a case has 6 or more tokens, far past that line. The gap passes, the regression
fails, in one campaign at the default line (tests/unit/test_fuzz.py)."""
import torch

from harness import Axes, Outcome, TargetPair, register

VOCAB = 64


def build(case, device):
    return {"x": case.token_randn(VOCAB, "logits", device=device) * case.logit_scale,
            "noise": case.token_randn(VOCAB, "noise", device=device), "n": case.n_tokens}


def trainer(inp):
    return Outcome(logprobs=torch.log_softmax(inp["x"], -1))


def rollout(inp):
    return Outcome(logprobs=torch.log_softmax(inp["x"] + 0.1 * inp["noise"], -1))


def rollout_regressed(inp):
    scale = 1.0 if inp["n"] >= 6 else 0.1  # the regression: a path taken from 6 tokens on
    return Outcome(logprobs=torch.log_softmax(inp["x"] + scale * inp["noise"], -1))


AXES = Axes(n_seqs=(1, 3), seq_len=(1, 8), logit_scale=(1.0, 2.0), pad_sides=("right",))
register(TargetPair(name="gap.accepted", kind="op", expected="aligned", build=build, trainer=trainer, rollout=rollout,
                    axes=AXES, threshold=0.02, description="a known, accepted gap judged at its own line"))
register(TargetPair(name="gap.regressed", kind="op", expected="aligned", build=build, trainer=trainer,
                    rollout=rollout_regressed, axes=AXES, threshold=0.02,
                    description="the accepted gap, regressed from 6 tokens on"))
