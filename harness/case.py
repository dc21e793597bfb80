"""The `Case`: one fuzz input, as pure data.

A case is everything a target pair needs to rebuild its tensors: a seed and the layout knobs
the fuzzer draws (batch layout, packing, near-tie routing, peakedness, dtype, free parameters).
It holds no tensors. `pair.build(case, device)` draws every tensor from `case.seed` through
`case.generator(...)`, so a repro file is a few hundred bytes of JSON and replays bit-for-bit.

What "smaller" means (the order Hypothesis shrinks toward, and why a minimal case is minimal):
fewer sequences, then shorter sequences, then a probe nearer the front, a packing that keeps the
given order in as few rows as the longest sequence allows, right padding, fewer experts and a
smaller top-k, fewer tokens forced to the router boundary, a boundary gap nearer the exact tie
(0.0), a smaller logit scale, the first listed dtype, and free parameters at their strategy's
simplest value. Hypothesis shrinks the choices behind these fields (see `strategies`), so each
field moves toward its simplest value only while the case still diverges.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

SCHEMA_VERSION = 1

DTYPES = ("float32", "bfloat16", "float16", "float64")
PAD_SIDES = ("right", "left")
MAX_TIE_GAP = 1.0  # a gap above this is no longer "near" a tie for any score scale we fuzz

ParamValue = int | float | str | bool


class CaseError(ValueError):
    """A case field breaks a rule. The message names the field, the value and the rule."""


def _fail(name: str, value: Any, rule: str) -> None:
    raise CaseError(f"case field '{name}' = {value!r} is invalid: {rule}.")


@dataclass(frozen=True)
class Case:
    # --- identity -----------------------------------------------------------------------------
    seed: int  # every tensor of the case is drawn from this (0 <= seed < 2**63)
    # --- batch layout -------------------------------------------------------------------------
    seq_lens: tuple[int, ...] = (8,)  # tokens per sequence; the batch size is len(seq_lens)
    probe: int = 0  # index of the probe sequence: the one whose placement in the batch is fuzzed
    # --- packing ------------------------------------------------------------------------------
    row_capacity: int = 0  # trainer: tokens per packed row; 0 = one row holding every sequence
    order: tuple[int, ...] = ()  # trainer: order sequences are packed in; () = as given
    pad_side: str = "right"  # rollout: side padding goes on in the padded batch
    # --- near-tie routing ---------------------------------------------------------------------
    n_experts: int = 8  # experts in the router
    top_k: int = 2  # experts chosen per token
    tie_fraction: float = 0.0  # fraction of tokens forced to sit at the top-k boundary
    tie_gap: float = 0.0  # score gap between the k-th and (k+1)-th expert of a forced token
    # --- output distribution ------------------------------------------------------------------
    logit_scale: float = 1.0  # peakedness: logits are scaled by this (larger = lower entropy)
    dtype: str = "bfloat16"  # the low-precision dtype of the rollout path, where a pair fuzzes it
    # --- free per-pair parameters -------------------------------------------------------------
    params: Mapping[str, ParamValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", tuple(self.seq_lens))
        object.__setattr__(self, "order", tuple(self.order))
        object.__setattr__(self, "params", dict(self.params))
        self.validate()

    # ------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def n_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def packing_order(self) -> tuple[int, ...]:
        """The trainer's packing order, with the default (as given) made explicit."""
        return self.order or tuple(range(self.batch_size))

    @property
    def capacity(self) -> int:
        """The trainer's row capacity, with the default (one row) made explicit."""
        return self.row_capacity or self.n_tokens

    def packed_rows(self) -> list[list[int]]:
        """Sequences per trainer row: first-fit in packing order, a new row when one is full."""
        rows: list[list[int]] = [[]]
        used = 0
        for i in self.packing_order:
            if rows[-1] and used + self.seq_lens[i] > self.capacity:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += self.seq_lens[i]
        return rows

    def validate(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            _fail("seed", self.seed, "must be an integer in [0, 2**63)")
        if not self.seq_lens:
            _fail("seq_lens", self.seq_lens, "must hold at least one sequence length")
        for n in self.seq_lens:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                _fail("seq_lens", self.seq_lens, "every length must be an integer >= 1")
        if not isinstance(self.probe, int) or not 0 <= self.probe < self.batch_size:
            _fail("probe", self.probe, f"must index a sequence, 0 <= probe < {self.batch_size}")
        if not isinstance(self.row_capacity, int) or self.row_capacity < 0:
            _fail("row_capacity", self.row_capacity, "must be an integer >= 0 (0 = one row)")
        if self.row_capacity and self.row_capacity < max(self.seq_lens):
            _fail("row_capacity", self.row_capacity,
                  f"must be 0 or at least the longest sequence ({max(self.seq_lens)})")
        if self.order and sorted(self.order) != list(range(self.batch_size)):
            _fail("order", self.order, f"must be empty or a permutation of 0..{self.batch_size - 1}")
        if self.pad_side not in PAD_SIDES:
            _fail("pad_side", self.pad_side, f"must be one of {PAD_SIDES}")
        if not isinstance(self.n_experts, int) or self.n_experts < 1:
            _fail("n_experts", self.n_experts, "must be an integer >= 1")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
            _fail("top_k", self.top_k, f"must be an integer with 1 <= top_k <= n_experts ({self.n_experts})")
        if not _finite(self.tie_fraction) or not 0.0 <= self.tie_fraction <= 1.0:
            _fail("tie_fraction", self.tie_fraction, "must be a number in [0, 1]")
        if not _finite(self.tie_gap) or not 0.0 <= self.tie_gap <= MAX_TIE_GAP:
            _fail("tie_gap", self.tie_gap, f"must be a number in [0, {MAX_TIE_GAP}] (0 = exact tie)")
        if not _finite(self.logit_scale) or self.logit_scale <= 0:
            _fail("logit_scale", self.logit_scale, "must be a finite number > 0")
        if self.dtype not in DTYPES:
            _fail("dtype", self.dtype, f"must be one of {DTYPES}")
        for key, value in self.params.items():
            if not isinstance(key, str) or not key:
                _fail("params", key, "keys must be non-empty strings")
            if not isinstance(value, (int, float, str, bool)) or (
                isinstance(value, float) and not math.isfinite(value)
            ):
                _fail(f"params.{key}", value, "values must be finite numbers, strings or booleans")

    # --- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["seq_lens"] = list(self.seq_lens)
        out["order"] = list(self.order)
        out["params"] = dict(sorted(self.params.items()))
        return {"schema": SCHEMA_VERSION, **out}

    @classmethod
    def from_json(cls, data: Any) -> "Case":
        if not isinstance(data, dict):
            raise CaseError(f"a case must be a JSON object, got {type(data).__name__}.")
        schema = data.get("schema", SCHEMA_VERSION)
        if schema != SCHEMA_VERSION:
            raise CaseError(
                f"case schema {schema!r} is not supported (this harness reads schema {SCHEMA_VERSION}); "
                "re-record the repro with this version of the harness."
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"schema"})
        if unknown:
            raise CaseError(f"case has unknown field(s) {unknown}; known fields are {sorted(names)}.")
        if "seed" not in data:
            raise CaseError("case field 'seed' is missing; every case needs the seed its tensors come from.")
        kwargs = {k: v for k, v in data.items() if k != "schema"}
        for seq_field in ("seq_lens", "order"):
            if seq_field in kwargs and not isinstance(kwargs[seq_field], (list, tuple)):
                _fail(seq_field, kwargs[seq_field], "must be a list of integers")
        if "params" in kwargs and not isinstance(kwargs["params"], dict):
            _fail("params", kwargs["params"], "must be a JSON object")
        try:
            return cls(**kwargs)
        except TypeError as e:  # pragma: no cover - guarded by the checks above
            raise CaseError(f"case could not be built: {e}.") from None

    def key(self) -> str:
        """A canonical string for the case: equal cases have equal keys."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def one_line(self) -> str:
        """The case in one line, only the fields that differ from the defaults."""
        default = Case(seed=0)
        parts = [f"seed={self.seed}", f"seq_lens={list(self.seq_lens)}"]
        for f in dataclasses.fields(self):
            if f.name in ("seed", "seq_lens"):
                continue
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                parts.append(f"{f.name}={list(value) if isinstance(value, tuple) else value!r}")
        return " ".join(parts)

    # --- randomness ---------------------------------------------------------------------------
    def derived_seed(self, *salt: Any) -> int:
        """A stable 63-bit seed for one named stream of this case's randomness."""
        text = "/".join([str(self.seed), *map(str, salt)])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def generator(self, *salt: Any):
        """A CPU torch.Generator for one named stream (draw on CPU, then move: same on every device)."""
        import torch

        g = torch.Generator(device="cpu")
        g.manual_seed(self.derived_seed(*salt))
        return g

    def randn(self, shape: tuple[int, ...], *salt: Any, device: str = "cpu"):
        """A float32 standard-normal tensor from one named stream, drawn on CPU then moved."""
        import torch

        return torch.randn(*shape, generator=self.generator(*salt)).to(device)

    def smaller_neighbours(self) -> list["Case"]:
        """The cases one removal away: one sequence (batch row) dropped, or one token dropped from
        the end of one sequence, all else equal. A minimal repro diverges and none of these does."""
        out: list[Case] = []
        n = self.batch_size
        for i in range(n if n > 1 else 0):
            lens = self.seq_lens[:i] + self.seq_lens[i + 1:]
            order = tuple(j - (j > i) for j in self.order if j != i)
            probe = self.probe - (self.probe > i) if self.probe != i else 0
            cap = self.row_capacity if self.row_capacity < sum(lens) else 0
            out.append(self.replace(seq_lens=lens, order=order, probe=probe, row_capacity=cap))
        for i, m in enumerate(self.seq_lens):
            if m > 1:
                lens = self.seq_lens[:i] + (m - 1,) + self.seq_lens[i + 1:]
                cap = self.row_capacity if max(lens) <= self.row_capacity < sum(lens) else 0
                out.append(self.replace(seq_lens=lens, row_capacity=cap))
        return out

    def replace(self, **changes: Any) -> "Case":
        return dataclasses.replace(self, **changes)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
