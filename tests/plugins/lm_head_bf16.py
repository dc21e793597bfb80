"""An example backend target: the LM head GEMM in fp32 (trainer) vs bf16 (rollout)."""
import torch

from harness import Axes, Outcome, TargetPair, register

HIDDEN, VOCAB = 64, 256


def build(case, device):
    h = case.token_randn(HIDDEN, "hidden", device=device)  # (T, H): each sequence's rows from its own stream
    w = case.randn((HIDDEN, VOCAB), "head", device=device) / HIDDEN**0.5  # (H, V)
    return {"h": h, "w": w, "scale": case.logit_scale}


def trainer(inp):  # fp32 head, fp32 log-softmax
    return Outcome(logprobs=torch.log_softmax(inp["scale"] * (inp["h"] @ inp["w"]), -1))


def rollout(inp):  # bf16 head, fp32 log-softmax
    logits = inp["scale"] * (inp["h"].bfloat16() @ inp["w"].bfloat16()).float()
    return Outcome(logprobs=torch.log_softmax(logits, -1))


register(TargetPair(
    name="example.lm_head_bf16", kind="op", expected="diverges",
    build=build, trainer=trainer, rollout=rollout,
    axes=Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 16.0), pad_sides=("right",)),  # nothing to pad
    description="LM head GEMM in fp32 (trainer) vs bf16 (rollout)",
))
