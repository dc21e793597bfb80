"""Batch-size-dependent kernels: a rollout GEMM whose reduction changes with the batch size.

GEMM libraries choose a kernel per problem shape: above some batch size, or when the batch is a
power of two that fills a tile, a split-K kernel reduces partial products in another order and
sometimes another precision (partials written in the output dtype). A trainer that computes the
same projection in one pass then disagrees with the rollout only for some batch sizes, which is
why the batch size is fuzzed over boundary values (2^k - 1, 2^k, 2^k + 1) and not only small ones.

The op is the LM head of every token of the batch, hidden states (T, H) -> logits (T, V) ->
log-probabilities; the batch size is the number of sequences (in decode, the rows of one step's
GEMM). Logits have standard deviation `case.logit_scale`.

- `batch_switch.split_k_gt8`: above 8 sequences the rollout kernel switches to split-K with bf16
  partials reduced in bf16, writing bf16 logits that the log-softmax then reads in bf16; at 8 or
  fewer it runs the trainer's fp32 kernel (bitwise equal). Minimal: 9 sequences of one token.
- `batch_switch.split_k_pow2`: the same switch when the batch is a power of two of at least 16
  (a tile-filling heuristic). Minimal: exactly 16 sequences; 15 and 17 stay clean.
- `batch_switch.split_k_fp32`: the fixed twin: the kernel still switches above 8 sequences, but
  its partials and log-softmax stay fp32 (a batch-invariant precision): reordered only, far under
  the threshold.
"""

from __future__ import annotations

import torch

from harness import Axes, Outcome, TargetPair, register

from ._common import ONE_SIDE

HIDDEN = 64  # reduction dimension
VOCAB = 512  # output features
CHUNKS = 4  # split-K factor of the switched kernel


def build(case, device):
    x = case.token_randn(HIDDEN, "hidden", device=device)  # (T, H) one row per token, per-sequence streams
    w = case.randn((HIDDEN, VOCAB), "lm_head", device=device) * (case.logit_scale / HIDDEN**0.5)  # (H, V)
    return {"x": x, "w": w, "batch": case.batch_size}


def split_k(x, w, dtype):
    """Partial products over CHUNKS slices of K, each rounded to `dtype`, reduced in reverse order in `dtype`."""
    parts = [xc.to(dtype) @ wc.to(dtype) for xc, wc in zip(x.chunk(CHUNKS, -1), w.chunk(CHUNKS, 0))]  # (T, N)
    acc = parts[-1]
    for p in reversed(parts[:-1]):
        acc = acc + p  # rounds to `dtype` after every add
    return acc


def above_eight(batch: int) -> bool:
    return batch > 8


def power_of_two_from_16(batch: int) -> bool:
    return batch >= 16 and batch & (batch - 1) == 0


# --- paths ----------------------------------------------------------------------------------------
def one_pass_fp32(inp):
    return Outcome(logprobs=torch.log_softmax(inp["x"] @ inp["w"], -1))  # (T, V)


def switching(heuristic, dtype):
    def rollout(inp):
        if heuristic(inp["batch"]):  # the switched kernel: split-K partials and log-softmax in `dtype`
            return Outcome(logprobs=torch.log_softmax(split_k(inp["x"], inp["w"], dtype), -1))
        return one_pass_fp32(inp)
    rollout.__name__ = f"switch_{heuristic.__name__}_{str(dtype).split('.')[-1]}"
    return rollout


# --- pairs ----------------------------------------------------------------------------------------
AXES = Axes(n_seqs=(1, 32), seq_len=(1, 4), logit_scale=(1.0, 32.0), pad_sides=ONE_SIDE)

register(TargetPair(
    name="batch_switch.split_k_gt8", kind="op", expected="diverges", build=build, trainer=one_pass_fp32,
    rollout=switching(above_eight, torch.bfloat16), axes=AXES,
    description="rollout GEMM switches to split-K with bf16 partials above 8 sequences; trainer one fp32 pass",
))
register(TargetPair(
    name="batch_switch.split_k_pow2", kind="op", expected="diverges", build=build, trainer=one_pass_fp32,
    rollout=switching(power_of_two_from_16, torch.bfloat16), axes=AXES,
    description="rollout GEMM switches to split-K with bf16 partials at power-of-two batches >= 16",
))
register(TargetPair(
    name="batch_switch.split_k_fp32", kind="op", expected="aligned", build=build, trainer=one_pass_fp32,
    rollout=switching(above_eight, torch.float32), axes=AXES,
    description="fixed twin: the kernel still switches above 8 sequences but keeps fp32 partials",
))
