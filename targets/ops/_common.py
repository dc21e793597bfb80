"""Helpers shared by the op families: dtypes, batch layouts (padded and packed), CUDA gating.

Layouts follow the contract of `harness.pairs`: whatever a path does inside, it returns one row
per token in *case order* (sequence 0's tokens, then sequence 1's, ...).

- Rollout engines pad: `pad(seqs, case.pad_side)` stacks sequences into (B, L, ...) with padding on
  the side the case draws, and `unpad` takes the real tokens back out in case order.
- Trainers pack: `case.packed_rows()` says which sequences share a row (first-fit in the case's
  packing order); `packed_offsets(case)` gives each sequence's start inside its row, which is what
  a position bug or a leaking mask needs to know.
"""

from __future__ import annotations

from functools import lru_cache

import torch

# The pad sides of an op whose paths never pad a batch (every pair here but the padded attention
# ones): one, so no case is spent on a pad side nothing reads (`harness check` warns of such axes).
ONE_SIDE = ("right",)


def low_dtype(case) -> torch.dtype:
    """The case's low-precision dtype (the rollout's, where a pair fuzzes precision)."""
    return getattr(torch, case.dtype)


@lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Whether CUDA-only variants can be registered (checked once, at import of the families)."""
    try:
        return torch.cuda.is_available()
    except Exception:  # a broken driver is "no CUDA", not an import error of the registry
        return False


def split(x: torch.Tensor, seq_lens) -> list[torch.Tensor]:
    """(T, ...) in case order -> one (n_i, ...) tensor per sequence."""
    return list(torch.split(x, list(seq_lens), dim=0))


def pad(seqs: list[torch.Tensor], pad_side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences (n_i, ...) -> padded batch (B, L, ...) with zeros, and a (B, L) bool mask of real tokens."""
    b, longest = len(seqs), max(s.shape[0] for s in seqs)
    out = seqs[0].new_zeros((b, longest, *seqs[0].shape[1:]))  # (B, L, ...)
    mask = torch.zeros(b, longest, dtype=torch.bool, device=seqs[0].device)  # (B, L)
    for i, s in enumerate(seqs):
        n = s.shape[0]
        sl = slice(0, n) if pad_side == "right" else slice(longest - n, longest)
        out[i, sl] = s
        mask[i, sl] = True
    return out, mask


def unpad(batch: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Padded batch (B, L, ...) -> (T, ...) real tokens in case order (row-major over the mask)."""
    return batch[mask]


def packed_offsets(case) -> list[int]:
    """Per sequence (case order), the index of its first token inside its trainer row."""
    offsets = [0] * case.batch_size
    for row in case.packed_rows():
        used = 0
        for i in row:
            offsets[i] = used
            used += case.seq_lens[i]
    return offsets


def pack(seqs: list[torch.Tensor], case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Sequences -> the trainer's packed rows: per row, the (R, ...) concatenation and an (R,) tensor
    holding the case-order index of the sequence each token belongs to."""
    rows, owners = [], []
    for row in case.packed_rows():
        rows.append(torch.cat([seqs[i] for i in row], 0))
        owners.append(torch.cat([torch.full((case.seq_lens[i],), i, dtype=torch.long) for i in row]))
    return rows, owners


def unpack(rows: list[torch.Tensor], case) -> torch.Tensor:
    """The trainer's packed rows -> (T, ...) in case order."""
    parts: dict[int, torch.Tensor] = {}
    for row_seqs, row in zip(case.packed_rows(), rows):
        start = 0
        for i in row_seqs:
            parts[i] = row[start:start + case.seq_lens[i]]
            start += case.seq_lens[i]
    return torch.cat([parts[i] for i in range(case.batch_size)], 0)


def cuda_only_devices() -> tuple[str, ...]:
    return ("cuda",)
