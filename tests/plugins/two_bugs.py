"""Two bugs in one rollout: a mild one on every case (its head 3% off: about 1.4x the line on one
token), a severe one where the temperature is not 1 (applied twice: on one token of seed 1887070260,
0.053 at temperature 1.22 and 0.25 at 0.5). Shrinking keeps the simplest trigger over the line, the mild one at temperature 1; the
campaign's severe case (`Finding.severe`) is the temperature bug (tests/unit/test_fuzz.py)."""
import torch

from harness import Axes, Outcome, TargetPair, register

HIDDEN, VOCAB = 32, 128


def build(case, device):
    h = case.token_randn(HIDDEN, "hidden", device=device)
    w = case.randn((HIDDEN, VOCAB), "head", device=device) / HIDDEN**0.5
    noise = case.randn((HIDDEN, VOCAB), "noise", device=device) / HIDDEN**0.5
    return {"h": h, "w": w, "noise": noise, "t": case.temperature}


def trainer(inp):
    return Outcome(logprobs=torch.log_softmax(3.0 * (inp["h"] @ inp["w"]) / inp["t"], -1))


def rollout(inp):
    logits = 3.0 * (inp["h"] @ (inp["w"] + 0.03 * inp["noise"]))  # mild: the head a little off
    t = inp["t"]
    return Outcome(logprobs=torch.log_softmax(logits / (t * t if t != 1.0 else t), -1))  # severe: t applied twice


register(TargetPair(name="user.two_bugs", kind="op", expected="aligned", build=build, trainer=trainer, rollout=rollout,
                    axes=Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 1.0), pad_sides=("right",),
                              temperature=(0.5, 1.5)),
                    description="a head a little off, and the temperature applied twice"))


def rollout_rare(inp):  # the same mild bug; the severe one only in batches of exactly 5 sequences
    logits = 3.0 * (inp["h"] @ (inp["w"] + 0.03 * inp["noise"]))
    if inp["n"] == 5:  # (a kernel's batch-size bucket)
        logits = logits * 1.5
    return Outcome(logprobs=torch.log_softmax(logits, -1))


def build_rare(case, device):
    return {**build(case, device), "t": 1.0, "n": case.batch_size}


register(TargetPair(name="user.two_bugs_rare", kind="op", expected="aligned", build=build_rare, trainer=trainer,
                    rollout=rollout_rare,
                    axes=Axes(n_seqs=(1, 8), seq_len=(1, 16), logit_scale=(1.0, 1.0), pad_sides=("right",)),
                    description="a head a little off, and logits 1.5x too large in batches of 5 sequences"))
