"""Linear / matmul batch invariance: the same row of x @ W computed in different batches or splits.

A trainer computes a projection over every packed token at once (large M); a rollout engine in
decode computes it for one token or a few (M = 1..3), and kernels pick different blockings and
reduction orders for different M and K. The pairs here:

- `linear.aligned`: both paths one fp32 product over the whole batch (identical, k3 = 0).
- `linear.batch_rows`: fp32, every row alone (M = 1, decode) vs inside the full batch. On this CPU
  rows of M = 1..3 are not bitwise equal to large-M rows (~1e-5 abs), but the gap is far below the
  k3 threshold (~1e-12), so the pair is `aligned`: it guards that batch variance stays invisible.
- `linear.split_k_fp32`: fp32, K split into `chunks` partial products summed in reverse order vs the
  plain product; again bitwise different and far under the threshold: `aligned`.
- `linear.split_k_bf16`: a split-K kernel that writes its partial products in the output dtype
  (bf16) and reduces them in bf16, in reverse chunk order (rollout) vs one bf16 product that
  accumulates in fp32 and rounds once (trainer). Each extra rounding costs up to half a bf16 ulp
  (2**-9 relative): `diverges` once the readout is peaked enough.
- `linear.tf32` (CUDA only): the trainer's fp32 product with TF32 tensor cores allowed (10-bit
  mantissa inputs) vs strict fp32 (rollout). The global flag is restored in try/finally.

On this CPU bf16 products of M = 1..3 rows were bitwise equal to large-M rows (it has avx512_bf16),
so a bf16 batch-rows pair could not diverge here and is not registered.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from harness import Axes, Outcome, Readout, TargetPair, register

from ._common import ONE_SIDE, cuda_available, low_dtype

K_IN = 64  # reduction dimension (hidden size in)
N_OUT = 32  # output features (hidden size out)


def build(case, device):
    t = case.n_tokens
    x = case.token_randn(K_IN, "x", device=device)  # (T, K)
    w = case.randn((K_IN, N_OUT), "w", device=device) / K_IN**0.5  # (K, N)
    return {"x": x, "w": w, "dtype": low_dtype(case), "chunks": int(case.params.get("chunks", 1))}


# --- paths ----------------------------------------------------------------------------------------
def full_fp32(inp):
    return Outcome(hidden=inp["x"] @ inp["w"])  # (T, N) one large-M product


def rows_alone_fp32(inp):
    rows = [inp["x"][i:i + 1] @ inp["w"] for i in range(inp["x"].shape[0])]  # T products with M = 1
    return Outcome(hidden=torch.cat(rows, 0))  # (T, N)


def split_k(x, w, chunks, dtype):
    """Partial products over K chunks, each rounded to `dtype`, reduced in reverse chunk order in `dtype`."""
    parts = [xc.to(dtype) @ wc.to(dtype) for xc, wc in zip(x.chunk(chunks, -1), w.chunk(chunks, 0))]  # (T, N) each
    acc = parts[-1]
    for p in reversed(parts[:-1]):
        acc = acc + p  # rounds to `dtype` after every add
    return acc


def split_k_fp32(inp):
    return Outcome(hidden=split_k(inp["x"], inp["w"], inp["chunks"], torch.float32))


def full_low(inp):
    dt = inp["dtype"]
    return Outcome(hidden=inp["x"].to(dt) @ inp["w"].to(dt))  # (T, N) fp32 accumulate, one rounding


def split_k_low(inp):
    return Outcome(hidden=split_k(inp["x"], inp["w"], inp["chunks"], inp["dtype"]))


def _matmul(inp, allow_tf32: bool):
    old = torch.backends.cuda.matmul.allow_tf32  # a global flag: always restored
    try:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        return Outcome(hidden=inp["x"] @ inp["w"])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def full_tf32(inp):
    return _matmul(inp, allow_tf32=True)


def full_strict_fp32(inp):
    return _matmul(inp, allow_tf32=False)


# --- pairs ----------------------------------------------------------------------------------------
CHUNKS = st.sampled_from([2, 4, 8])  # split-K factor: K_IN / chunks per partial product
AXES = Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 64.0), pad_sides=ONE_SIDE)
AXES_SPLIT = Axes(n_seqs=(1, 4), seq_len=(1, 16), logit_scale=(1.0, 64.0), params={"chunks": CHUNKS},
                  pad_sides=ONE_SIDE)
READOUT = Readout(vocab=256)

register(TargetPair(
    name="linear.aligned", kind="op", expected="aligned", build=build, trainer=full_fp32,
    rollout=full_fp32, axes=AXES, readout=READOUT,
    description="both paths one fp32 product over the whole batch: must stay exactly equal",
))
register(TargetPair(
    name="linear.batch_rows", kind="op", expected="aligned", build=build, trainer=full_fp32,
    rollout=rows_alone_fp32, axes=AXES, readout=READOUT,
    description="fp32 rows computed alone (decode, M=1) vs inside the batch: bitwise different, far under threshold",
))
register(TargetPair(
    name="linear.split_k_fp32", kind="op", expected="aligned", build=build, trainer=full_fp32,
    rollout=split_k_fp32, axes=AXES_SPLIT, readout=READOUT,
    description="fp32 split-K partial sums in reverse order vs the plain product: reordering stays under threshold",
))
register(TargetPair(
    name="linear.split_k_bf16", kind="op", expected="diverges", build=build, trainer=full_low,
    rollout=split_k_low, axes=AXES_SPLIT, readout=READOUT,
    description="split-K with bf16 partials reduced in bf16 (rollout) vs one bf16 product with fp32 accumulation",
))
if cuda_available():
    register(TargetPair(
        name="linear.tf32", kind="op", expected="diverges", build=build, trainer=full_tf32,
        rollout=full_strict_fp32, axes=AXES, readout=READOUT, devices=("cuda",),
        description="fp32 product with TF32 tensor cores allowed (trainer) vs strict fp32 (rollout); CUDA only",
    ))
