"""Triage: localize a divergence to the component that causes it, and write a report.

`harness triage FILE` (or `--run-id ID`) replays one repro and answers "which component, which layer?":

1. **Per-module divergence.** Forward hooks on every submodule of both paths' torch modules record
   their outputs, by module name, for each call of the root module (a packed forward, a padded
   prefill, every decode step). Each position is then tied to the case's token row it produced by
   matching the root's output at that position against the row of the path's own outcome (the
   Pearson correlation over the row's 16 largest finite log-probabilities: temperature, the
   log-softmax shift and top-k/top-p truncation leave it at 1; any other position is far from 1).
   No argument is added to the model's call. Modules with the same name are compared over the
   tokens both paths computed (relative L2 error), in the trainer's execution order.
   The *noise floor* of a module is the same comparison in an aligned run of the same modules
   (same numerics profile on both sides: layout noise of packed rows vs padded decode), times
   `FLOOR_FACTOR`, never under `MIN_FLOOR`. The aligned run is the pair with every differing
   component aligned when that explains the divergence; otherwise (a code-level difference) a
   registered `aligned` pair exposing the same modules (the same trainer module object, or the same
   module names), run with the finding's trainer profile on both sides when it has profiles. The
   first module whose error exceeds its floor is where the divergence starts; its layer (the
   module path up to its first numeric index, `layers.3`) is named in the verdict. When the
   minimal set of step 2 is smaller than the set of differing components, the start is the first
   module over its floor whose error is also FLOOR_FACTOR x the error with only the minimal set
   aligned (what the other differing components give alone: a bf16 body rounds the embedding
   already, but a router flip starts where the experts are chosen).
2. **Localization by swapping.** For every component whose setting differs between the two paths,
   the case is rerun with that one component aligned (the rollout takes the trainer's setting, and
   back: the trainer takes the rollout's), then the set of differing components is delta-debugged
   (ddmin) down to a minimal set that, left differing while every other component is aligned, still
   puts k3 above the threshold (or keeps the output non-finite).
3. **Routing.** Expert-selection flips per router layer, split into near-tie flips (the k-th and
   (k+1)-th scores within `NEAR_TIE`, or one step of the scores' own precision, in either path,
   exact ties included), the rest, and flips neither path reported scores for.
4. **Non-finite findings.** The first module, in execution order, whose output holds NaN or inf in
   either path (every position it computed, padding included), and which path.
5. **A report**: `reports/<finding id>/report.md` with PNG plots (per-token k3 along the sequence,
   divergence per module, flips per layer, k3 per swap), attached to the MLflow regression run when
   the repro came from one (`--run-id`) and tracking is on.

Verdicts name the minimal component set and the first divergent layer ("MoE aggregation precision,
from layers.0 (first divergent module layers.0.moe): expected k3 0.0123 -> 0.0000 when aligned"); a
code-level finding (same numerics on both sides, or not explained by them) names the first module
beyond the noise floor; a non-finite finding names the first module with NaN/inf.

The protocol (what a pair provides to get each part; nothing else is model-specific)
-------------------------------------------------------------------------------------
*Localization*: `TargetPair.profiles` is an object with

    trainer: Mapping[str, str]       # component -> setting of the trainer path
    rollout: Mapping[str, str]       # component -> setting of the rollout path (same keys)
    labels:  Mapping[str, str]       # component -> what a person calls it (optional; default the key)
    variant(trainer, rollout) -> TargetPair   # the same pair, its paths running these profiles

*Per-module table*: the inputs `build` returns expose the torch modules each path runs, as
`inputs.extra["modules"]`, `inputs["modules"]` or `inputs.modules`: `{"trainer": module, "rollout":
module}` (the same object for both is fine, or two copies whose submodules have the same names;
`None` for a path that is not torch, e.g. ONNX Runtime). The root module is the one the path calls
once per forward (a packed forward, a prefill, a decode step) with the input ids (or embeddings)
as `input_ids`/`inputs_embeds` or its first (B, S, ...) argument, and whose output holds a
(B, S', V) tensor of the log-probabilities or logits the outcome rows are made from (tuples,
mappings and Hugging Face `ModelOutput`s are searched). A submodule output is filed under the
call's positions when it is (B, S, ...), (B*S, ...) (flattened tokens, e.g. router logits) or, for
a vocabulary-wide output, (B, S', V) covering the last S' positions (`logits_to_keep`), or (N, V)
or (1, N, V) at the N positions the root module names during the call in its attribute
`harness.pairs.KEPT_POSITIONS` (an LM head applied only to the rows a path scores). Each outcome
row is tied to the position that produced it by correlating its largest values with every
position's root output, or, where the path names them (`Outcome.intermediates[ROW_POSITIONS]`: (T,
3) int64 (call, batch row, position) per row), by that: a row cut to top-2 has too few finite
values to be tied by correlation. Pairs without these get the rest of the report.

*Named intermediates* (a path that is not torch: an ONNX Runtime session, an engine's own kernels):
`Outcome.intermediates` maps names to tensors (torch or numpy), the same names and shapes on both
paths; every name both give is compared (relative L2 error over its rows, in the trainer's order)
against FLOOR_FACTOR x its error in a registered `aligned` pair of the same family (name prefix),
at least MIN_FLOOR, and the first over its floor is where the divergence starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import click

from .clitypes import FiniteFloat
from .errors import HarnessError, UsageError
from .metrics import judged_means
from .pairs import KEPT_POSITIONS, ROW_POSITIONS

FLOOR_FACTOR = 10.0  # a module diverges when its error exceeds this multiple of its aligned-run error
MIN_FLOOR = 1e-6  # ... and this absolute relative error (float32 layout noise is ~1e-7)
# A routing flip counts as near-tie when the boundary score gap (k-th vs (k+1)-th) in either path
# is at most NEAR_TIE, or at most one step of that path's score precision at the k-th score
# (`torch.finfo(dtype).eps` x its magnitude: bf16 scores near 4 come in steps of 0.03, so two
# experts one step apart there were a near tie the rounding decided; float32 steps are ~5e-7).
NEAR_TIE = 1e-3
MATCH_TOP = 16  # largest finite log-probabilities of a row that tie a position to it
MATCH_MIN_CORR = 0.999  # correlation over those at or above which a position produced the row
ROOT = "<root>"  # the name the root module's own output is filed under (no submodule can have it)


def module_label(name: str) -> str:
    """A module's name as a person reads it: the root's own output is its code after its last submodule."""
    return "the root module's own code (after its last exposed submodule)" if name == ROOT else name
REFERENCE_CANDIDATES = 12  # registered aligned pairs tried as the noise-floor reference, at most


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
@dataclass
class ModuleRow:
    name: str  # module name, e.g. "layers.0.moe"
    error: float  # relative L2 error trainer vs rollout over the common tokens
    floor: float  # noise floor
    tokens: int  # tokens compared
    rest: float = float("nan")  # the error with only the minimal component set aligned (the other
    #                             differing components left as found), where that is a separate run

    @property
    def exceeds(self) -> bool:
        return self.error > self.floor

    @property
    def starts(self) -> bool:
        """Over its floor and, where the other differing components were measured apart, over
        FLOOR_FACTOR x what they alone give: the minimal set's divergence is under way here."""
        return self.exceeds and not self.error <= FLOOR_FACTOR * self.rest

    @property
    def layer(self) -> str:
        return layer_of(self.name)


@dataclass
class Swap:
    component: str
    label: str
    trainer: str  # the trainer's setting
    rollout: str  # the rollout's setting
    k3_rollout_aligned: float  # k3 with the rollout taking the trainer's setting
    k3_trainer_aligned: float  # k3 with the trainer taking the rollout's setting
    kl_rollout_aligned: float = float("nan")  # exact KL(rollout || trainer), the rollout taking the trainer's
    kl_trainer_aligned: float = float("nan")  # ... the trainer taking the rollout's

    @property
    def best(self) -> float:
        vals = [v for v in (self.k3_rollout_aligned, self.k3_trainer_aligned) if math.isfinite(v)]
        return min(vals) if vals else float("nan")


@dataclass
class Localization:
    differing: list[str]
    swaps: list[Swap]
    minimal: list[str]  # the minimal set of components that keeps the case failing (k3 or KL over the line)
    k3_minimal_only: float  # k3 with only the minimal set differing
    k3_minimal_aligned: float  # k3 with the minimal set aligned too (everything else as found)
    k3_all_aligned: float  # k3 with every component aligned
    runs: int  # cases run to localize
    explained: bool  # aligning the minimal set makes the case pass (k3 and exact KL under the threshold)
    aligned_profiles: tuple[dict, dict] = ({}, {})  # (trainer, rollout) with every component aligned
    minimal_aligned_profiles: tuple[dict, dict] = ({}, {})  # ... with only the minimal set aligned
    kl_minimal_aligned: float = float("nan")  # exact KL with the minimal set aligned
    # each other differing component -> k3 with it aligned too, beside the minimal set (`residual_note`):
    # which of them still move the case; filled where the minimal set leaves well above the all-aligned k3
    residual_by: dict[str, float] = field(default_factory=dict)


@dataclass
class NonFinite:
    module: str  # the first module (execution order) whose output holds NaN/inf
    paths: list[str]  # which paths show it there ("trainer", "rollout")
    positions: int  # positions (token slots of every call) with NaN/inf there, over those paths


@dataclass
class Triage:
    repro: Any
    pair: Any
    k3: float
    threshold: float
    evaluation: Any
    modules: list[ModuleRow] = field(default_factory=list)
    first_module: str | None = None
    floor_from: str = ""  # what the noise floor was measured on
    nonfinite: NonFinite | None = None
    localization: Localization | None = None
    flips: dict[str, dict[str, int]] = field(default_factory=dict)
    verdict: str = ""
    seconds: float = 0.0
    report: Path | None = None
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    first_over: str = ""  # the earliest token over the line (`first_over_line`): where a position bug starts
    # the tensors both outcomes name in `Outcome.intermediates` (`per_intermediate`): the table for a
    # path that is not torch (an ONNX Runtime session, an engine's own kernels), in the trainer's order
    intermediates: list[ModuleRow] = field(default_factory=list)
    first_intermediate: str | None = None
    of_severe: bool = False  # of the repro's severe case (`triage --severe`), not its minimal case
    intermediates_floor_from: str = ""

    @property
    def first_layer(self) -> str | None:
        return layer_of(self.first_module) if self.first_module else None


def missing_table_lines(t: Triage) -> list[str]:
    """Why a triage has no per-module table, for the console (the report says it too; a user who reads
    only the console saw a verdict and nothing on where the table went)."""
    if t.modules:
        return []
    return [f"no {n}" for n in t.notes if n.startswith("per-module table:")]


def layer_of(name: str) -> str:
    """The layer a module belongs to: its path up to the first numeric index ("model.layers.3.mlp"
    -> "model.layers.3"); a module outside the numbered layers is its own ("lm_head")."""
    parts = name.split("[")[0].split(".")  # (an extra output's row, `name[i]`, is its module's layer)
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return name


# ---------------------------------------------------------------------------------------------
# 1. Per-module divergence: hooks, positions tied to outcome rows, errors against a noise floor
# ---------------------------------------------------------------------------------------------
def _modules_entry(inputs: Any) -> Any:
    extra = getattr(inputs, "extra", None)
    mods = None
    if isinstance(extra, dict):
        mods = extra.get("modules")
    if mods is None and isinstance(inputs, dict):
        mods = inputs.get("modules")
    if mods is None:
        mods = getattr(inputs, "modules", None)
    return mods


def exposed_modules(inputs: Any) -> dict[str, Any] | None:
    mods = _modules_entry(inputs)
    if not isinstance(mods, dict) or mods.get("trainer") is None or mods.get("rollout") is None:
        return None
    return mods


def half_exposed(inputs: Any) -> str | None:
    """Why a `modules` entry the pair's inputs hold is not used, when it is incomplete (a rollout
    engine that is not a torch module exposes only the trainer's), else None."""
    mods = _modules_entry(inputs)
    if mods is None or exposed_modules(inputs) is not None:
        return None
    if not isinstance(mods, dict):
        return f"its inputs' `modules` is a {type(mods).__name__}, not a dict {{'trainer': module, 'rollout': module}}"
    missing = [k for k in ("trainer", "rollout") if mods.get(k) is None]
    return (f"its inputs' `modules` has no {' and no '.join(repr(k) for k in missing)} torch module, so there is no "
            "per-module table: it compares the same module names on both paths (a rollout engine that is not a torch "
            "module has none to compare; its numerics profiles, if any, still localize it)")


def _tensors(out: Any) -> list[Any]:
    """The tensors directly inside a module output: itself, a tuple/list's items, a mapping's values
    (a Hugging Face ModelOutput is a mapping)."""
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        items = list(out.values())
    elif isinstance(out, (tuple, list)):
        items = list(out)
    else:
        return []
    return [t for t in items if isinstance(t, torch.Tensor)]


@dataclass
class _Call:
    """One call of a path's root module: its (B, S) and what every module returned in it."""

    batch: int
    seq: int
    raw: dict[str, Any] = field(default_factory=dict)  # module name -> its first floating output tensor
    root: list[Any] = field(default_factory=list)  # the root's floating output tensors
    kept: Any = None  # (N,) flattened positions of a vocabulary-wide output's rows (`KEPT_POSITIONS`), if set


class _Recorder:
    """Forward hooks on every module under one path's root, recording each root call's outputs."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.calls: list[_Call] = []
        self.order: list[str] = []
        self.choices: set[str] = set()  # outputs that are ids a module chose (`name[i]`, integer)
        self.handles: list[Any] = []
        self._depth = 0

    def __enter__(self) -> "_Recorder":
        self.handles.append(self.root.register_forward_pre_hook(self._pre, with_kwargs=True))
        for name, mod in self.root.named_modules():
            self.handles.append(mod.register_forward_hook(self._hook(name or ROOT)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        self._depth += 1
        if self._depth > 1:  # the root called inside itself: one call
            return
        shape = (0, 0)
        for t in [kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args, *kwargs.values()]:
            if not isinstance(t, torch.Tensor):
                continue
            if t.dim() == 1 and not t.is_floating_point() and t.dtype != torch.bool and t.numel():
                shape = (1, int(t.shape[0]))  # 1-D token ids (a model without a batch dimension): one row
                break
            if t.dim() >= 2:
                shape = (int(t.shape[0]), int(t.shape[1]))
                break
        self.calls.append(_Call(*shape))

    def _hook(self, name: str) -> Callable:
        def hook(module: Any, args: Any, out: Any) -> None:
            import torch

            if module is self.root:
                self._depth -= 1
                if self._depth > 0:
                    return
            if not self.calls or self.calls[-1].batch == 0 or name in self.calls[-1].raw:
                return  # outside a root call, or a module called twice in one call (the first is kept)
            call = self.calls[-1]
            tensors = [t for t in _tensors(out) if t.is_floating_point() and t.dim() >= 1]
            if module is self.root:
                call.root = [t.detach() for t in tensors]
                kept = getattr(module, KEPT_POSITIONS, None)
                call.kept = kept.detach().reshape(-1).cpu() if isinstance(kept, torch.Tensor) else None
            if tensors:
                call.raw[name] = tensors[0].detach().to(torch.float32, copy=True)
                if name not in self.order:
                    self.order.append(name)
                if module is not self.root:
                    self._other_outputs(call, name, out, tensors[0])

        return hook

    def _other_outputs(self, call: "_Call", name: str, out: Any, first: Any) -> None:
        """A module's outputs besides its first floating one, as `name[i]` (i: the position in its
        output tuple or mapping): a router returns its logits, then the weights and the experts
        chosen from them, and a bug in the choice leaves the logits equal on both paths. Only
        per-token ones ((B, S, ...) or (B*S, ...), up to 3 dimensions): not attention weights, not
        caches. Chosen ids compare as numbers, sorted along their last dimension (the same experts
        in another order are the same choice): any other choice is an error well above the floor."""
        import torch

        items = list(out.values()) if isinstance(out, Mapping) else list(out) if isinstance(out, (tuple, list)) else []
        for i, t in enumerate(items):
            if not isinstance(t, torch.Tensor) or t is first or t.dim() > 3 or t.is_complex():
                continue
            if _fit(call, t, width=-1) is None:  # not per token (width -1: no logits_to_keep slice here)
                continue
            key = f"{name}[{i}]"
            if key in call.raw:
                continue
            t = t.detach()
            if not t.is_floating_point() and t.dtype != torch.bool:
                t = t.sort(-1).values
                self.choices.add(key)
            call.raw[key] = t.to(torch.float32, copy=True)
            if key not in self.order:
                self.order.append(key)


@dataclass
class _Fit:
    """A module output as rows, and which position of the call each row is."""

    rows: Any  # (N, F)
    index: Any  # (B, S) int64: the row of each position, -1 where the output has none

    def positions(self) -> tuple[Any, Any]:
        """(N,) batch index and (N,) position of each row."""
        import torch

        b_of = torch.full((self.rows.shape[0],), -1, dtype=torch.int64)
        s_of = b_of.clone()
        at = torch.nonzero(self.index >= 0)  # (n, 2)
        rows = self.index[at[:, 0], at[:, 1]]
        b_of[rows], s_of[rows] = at[:, 0], at[:, 1]
        return b_of, s_of


def _fit(call: _Call, t: Any, width: int) -> _Fit | None:
    """t as rows of the call's positions, or None when it is not per token: (B, S, ...); (B*S, ...);
    a vocabulary-wide (B, S', width) covering the last S' positions (logits_to_keep); a
    vocabulary-wide (N, width) or (1, N, width) at the call's kept positions (`KEPT_POSITIONS`)."""
    import torch

    b, s = call.batch, call.seq
    index = torch.full((b, s), -1, dtype=torch.int64)
    kept = call.kept
    if (kept is not None and width > 0 and t.shape[-1] == width and t.dim() in (2, 3)
            and t.numel() == kept.numel() * width and (t.dim() == 2 or t.shape[0] == 1)):
        index.view(-1)[kept] = torch.arange(kept.numel())
        return _Fit(t.reshape(-1, width), index)
    if t.dim() >= 2 and ((t.shape[0] == b and t.shape[1] == s) or t.shape[0] == b * s):
        return _Fit(t.reshape(b * s, -1), torch.arange(b * s).view(b, s))
    if t.dim() == 3 and t.shape[0] == b and t.shape[1] < s and t.shape[-1] == width:
        kept_s = int(t.shape[1])
        index[:, s - kept_s:] = torch.arange(b * kept_s).view(b, kept_s)
        return _Fit(t.reshape(b * kept_s, width), index)
    return None


def _named_rows(calls: list[_Call], named: Any, rows: int) -> dict[int, tuple[int, int, int]] | None:
    """Case-order row -> (call, b, s) as the path named them (`harness.pairs.ROW_POSITIONS`), or None
    when it named none, or named them otherwise than the calls recorded (then rows are tied by
    correlation, `_match_rows`)."""
    import torch

    if not isinstance(named, torch.Tensor) or named.dim() != 2 or tuple(named.shape) != (rows, 3):
        return None
    out = {}
    for j, (ci, b, s) in enumerate(named.to(torch.int64).cpu().tolist()):
        if not (0 <= ci < len(calls) and 0 <= b < calls[ci].batch and 0 <= s < calls[ci].seq):
            return None
        out[j] = (ci, b, s)
    return out


def _match_rows(calls: list[_Call], target: Any) -> dict[int, tuple[int, int, int]]:
    """Case-order row -> (call, b, s) of the position whose root output produced it.

    A row's MATCH_TOP largest finite values are correlated (Pearson) with the same entries of every
    position's root output; the best position at or above MATCH_MIN_CORR wins. Affine changes
    within a row (log-softmax shift, temperature) and truncation to -inf leave the true position at
    correlation 1; rows with fewer than 3 finite values are left unmatched."""
    import torch

    y = target.detach().to(torch.float32)
    if y.dim() != 2 or y.shape[0] == 0:
        return {}
    dev, width = y.device, y.shape[1]
    m = min(MATCH_TOP, width)
    neg = torch.tensor(float("-inf"), device=dev)
    vals, idx = torch.topk(torch.where(torch.isfinite(y), y, neg), m, dim=-1)  # (T, m)
    w = torch.isfinite(vals).to(torch.float32)  # (T, m) 1 where the entry is finite
    n = w.sum(-1, keepdim=True).clamp_min(1)  # (T, 1)
    vals = torch.where(w > 0, vals, torch.zeros((), device=dev))
    yc = (vals - (vals * w).sum(-1, keepdim=True) / n) * w  # (T, m) centred on the finite entries
    ynorm = yc.pow(2).sum(-1).sqrt()  # (T,)
    best = torch.full((y.shape[0],), -2.0, device=dev)
    where = torch.full((y.shape[0], 3), -1, dtype=torch.long, device=dev)
    for ci, call in enumerate(calls):
        head = next((f for f in (_fit(call, t, width) for t in call.root if t.shape[-1] == width) if f), None)
        if head is None:
            continue
        flat = head.rows.to(device=dev, dtype=torch.float32)  # (N, W)
        b_of, s_of = head.positions()
        chunk = max(1, 4_000_000 // max(1, flat.shape[0] * m))
        for lo in range(0, y.shape[0], chunk):
            sl = slice(lo, lo + chunk)
            ww = w[sl][None]  # (1, t, m)
            x = torch.where(ww > 0, flat[:, idx[sl]], torch.zeros((), device=dev))  # (N, t, m)
            xc = (x - (x * ww).sum(-1, keepdim=True) / n[sl][None]) * ww
            corr = (xc * yc[sl][None]).sum(-1) / (xc.pow(2).sum(-1).sqrt() * ynorm[sl][None]).clamp_min(1e-30)
            corr = torch.nan_to_num(corr, nan=-2.0, posinf=-2.0, neginf=-2.0)  # (N, t)
            top, pos = corr.max(0)  # (t,)
            better = top > best[sl]
            best[sl] = torch.where(better, top, best[sl])
            cand = torch.stack([torch.full_like(pos, ci), b_of.to(dev)[pos], s_of.to(dev)[pos]], -1)  # (t, 3)
            where[sl] = torch.where(better[:, None], cand, where[sl])
    ok = (best >= MATCH_MIN_CORR) & (w.sum(-1) >= 3)
    return {int(j): (int(where[j, 0]), int(where[j, 1]), int(where[j, 2])) for j in torch.nonzero(ok).flatten()}


@dataclass
class PathCapture:
    rows: dict[str, dict[int, Any]]  # module name -> case-order row -> (F,) float32
    order: list[str]  # module names in execution order
    nonfinite: dict[str, int]  # module name -> positions with NaN/inf (every call, every position)
    matched: int  # outcome rows tied to a position
    tokens: int  # outcome rows a position can be tied to (named by the path, or with at least 3 finite values)
    n_rows: int = 0  # outcome rows
    choices: set[str] = field(default_factory=set)  # outputs that are ids a module chose (`name[i]`)


def _gather(rec: _Recorder, out: Any) -> PathCapture:
    """Module outputs of one path filed under the outcome rows their positions produced."""
    import torch

    target = out.logprobs if out.hidden is None else out.hidden  # what the root's output became
    width = int(target.shape[-1])
    fitted = [{name: _fit(call, t, width) for name, t in call.raw.items()} for call in rec.calls]
    named = _named_rows(rec.calls, (out.intermediates or {}).get(ROW_POSITIONS), int(target.shape[0]))
    where = named if named is not None else _match_rows(rec.calls, target)
    rows: dict[str, dict[int, Any]] = {}
    for j, (ci, b, s) in where.items():
        for name, got in fitted[ci].items():
            if got is not None and int(got.index[b, s]) >= 0:
                rows.setdefault(name, {})[j] = got.rows[int(got.index[b, s])]
    nonfinite: dict[str, int] = {}
    for per_call in fitted:
        for name, got in per_call.items():
            if got is not None:
                # NaN or +inf: -inf is log 0 (a top-k/top-p cut, a masked logit), not a non-finite value
                bad = int((torch.isnan(got.rows) | torch.isposinf(got.rows)).any(-1).sum())
                if bad:
                    nonfinite[name] = nonfinite.get(name, 0) + bad
    # the rows a position can be tied to: every one the path named, else those with 3 finite values
    tiable = len(named) if named is not None else int((torch.isfinite(target).sum(-1) >= 3).sum())
    return PathCapture(rows, list(rec.order), nonfinite, len(where), tiable, int(target.shape[0]), set(rec.choices))


def capture(pair: Any, case: Any, device: str, why: list[str] | None = None
            ) -> tuple[PathCapture, PathCapture] | None:
    """Both paths' module outputs by name and case-order row, or None when the pair exposes no modules
    (with `why`: the reason appended when it exposes only some, `half_exposed`)."""
    import torch

    from .execute import finalize

    with torch.inference_mode():
        inputs = pair.build(case, device)
        mods = exposed_modules(inputs)
        if mods is None:
            reason = half_exposed(inputs) if why is not None else None
            if reason:
                why.append(reason)
            return None
        with _Recorder(mods["rollout"]) as rec_r:
            rollout = finalize(pair, case, pair.rollout(inputs), "rollout")
        with _Recorder(mods["trainer"]) as rec_t:
            out = pair.trainer(inputs, rollout) if pair.trainer_reads_rollout else pair.trainer(inputs)
            trainer = finalize(pair, case, out, "trainer", twin=rollout)
        return _gather(rec_t, trainer), _gather(rec_r, rollout)


def _rel_error(a: list[Any], b: list[Any]) -> float:
    """||A - B|| / ||B|| over rows (float64 accumulation, a few rows at a time), over the entries
    finite on both paths; inf when an entry is non-finite on one path only, or NaN on either (a
    logit cut to -inf on one path, log 0 there and not on the other, is as far apart as values get;
    the same -inf on both is the same cut)."""
    import torch

    num = den = 0.0
    for lo in range(0, len(a), 64):
        ta = torch.stack(a[lo:lo + 64]).to(torch.float64)
        tb = torch.stack(b[lo:lo + 64]).to(torch.float64)
        both = torch.isfinite(ta) & torch.isfinite(tb)
        if not bool(both.all()) and bool((~both & (ta != tb)).any()):  # (NaN != NaN: NaN counts too)
            return math.inf
        num += float((ta - tb).where(both, 0.0).pow(2).sum())
        den += float(tb.where(both, 0.0).pow(2).sum())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def module_errors(trainer: PathCapture, rollout: PathCapture) -> dict[str, tuple[float, int]]:
    """Module name -> (relative L2 error, tokens compared), in the trainer's execution order."""
    out = {}
    for name in trainer.order + [n for n in rollout.order if n not in trainer.order]:
        a, b = trainer.rows.get(name, {}), rollout.rows.get(name, {})
        common = sorted(set(a) & set(b))
        if not common or any(a[i].shape != b[i].shape for i in common[:1]):
            continue
        out[name] = (_rel_error([a[i] for i in common], [b[i] for i in common]), len(common))
    return out


def first_nonfinite(trainer: PathCapture, rollout: PathCapture) -> NonFinite | None:
    order = trainer.order + [n for n in rollout.order if n not in trainer.order]
    for name in order:
        paths = [role for role, cap in (("trainer", trainer), ("rollout", rollout)) if cap.nonfinite.get(name)]
        if paths:
            return NonFinite(name, paths, sum((trainer.nonfinite.get(name, 0), rollout.nonfinite.get(name, 0))))
    return None


def _module_names(mods: Mapping[str, Any]) -> set[str]:
    return {n for n, _ in mods["trainer"].named_modules()}


def aligned_reference(pair: Any, case: Any, device: str, registry: Any, profile: Mapping[str, str] | None
                      ) -> tuple[Any, str] | None:
    """A registered `aligned` pair running the same modules as `pair` (the same trainer module object,
    else the same module names), with `profile` on both sides when it has profiles of the same
    components: the noise floor of a code-level finding, whose own pair carries the bug."""
    import torch

    listing = getattr(registry, "all", None)
    if listing is None:
        return None
    family = pair.name.split(".")[0]

    def components(p: Any) -> Any:
        prof = getattr(p, "profiles", None)
        return sorted(getattr(prof, "trainer", {}) or {}) if prof is not None else None

    def axes(p: Any) -> Any:
        try:
            return p.axes.describe()
        except Exception:  # noqa: BLE001 - (a duck-typed pair without axes)
            return None

    # the likeliest first (the same family, the same triage components, the same axes: a plugin's pair
    # built on a registered model), so that many other aligned pairs (a plugin's, the HF ones) do not
    # crowd the right one out of the candidates tried
    mine_c, mine_a = components(pair), axes(pair)
    candidates = sorted((p for p in listing() if p.expected == "aligned" and p.kind == pair.kind
                         and p.name != pair.name and device in p.devices),
                        key=lambda p: (p.name.split(".")[0] != family, mine_c is None or components(p) != mine_c,
                                       axes(p) != mine_a, p.name))[:REFERENCE_CANDIDATES]
    try:
        with torch.inference_mode():
            mine = exposed_modules(pair.build(case, device))
    except Exception:  # noqa: BLE001 - no reference then; the report says so
        return None
    if mine is None:
        return None
    by_names = None
    for cand in candidates:
        try:
            with torch.inference_mode():
                theirs = exposed_modules(cand.build(case, device))
        except Exception:  # noqa: BLE001 - a pair that cannot build this case is no reference
            continue
        if theirs is None:
            continue
        if theirs["trainer"] is mine["trainer"]:
            by_names = cand
            break
        if by_names is None and _module_names(theirs) == _module_names(mine):
            by_names = cand
    if by_names is None:
        return None
    prof = getattr(by_names, "profiles", None)
    if profile is not None and prof is not None and hasattr(prof, "variant") \
            and set(getattr(prof, "trainer", {})) == set(profile):
        try:
            return prof.variant(dict(profile), dict(profile)), \
                f"{by_names.name} with the finding's trainer numerics on both sides"
        except Exception:  # noqa: BLE001 - a profile the reference does not accept: its own then
            pass
    return by_names, by_names.name


def per_module(pair: Any, case: Any, device: str, reference: Any | None, rest: Any | None = None
               ) -> tuple[list[ModuleRow], str | None, NonFinite | None, list[str]]:
    """The module table (error vs floor), the first module where the divergence starts, the first
    module with NaN/inf, and notes on what could not be compared. `rest` (optional) is the pair with
    only the minimal component set aligned: a module counts as where the divergence starts only when
    its error is also FLOOR_FACTOR x the error the other differing components give there."""
    notes: list[str] = []
    why: list[str] = []
    got = capture(pair, case, device, why)
    if got is None:
        notes += [f"per-module table: {w}" for w in why]
        return [], None, None, notes
    t_cap, r_cap = got
    for role, cap in (("trainer", t_cap), ("rollout", r_cap)):
        if cap.tokens < cap.n_rows:
            notes.append(f"per-module table: {cap.n_rows - cap.tokens} of the {role}'s {cap.n_rows} token rows have fewer "
                         "than 3 finite values (cut to a top-k under 3, or a top-p that keeps 1-2 tokens), so they "
                         "cannot be tied to a position of its root module's output by their values, and the table "
                         f"covers the other rows{' (none)' if not cap.tokens else ''}: a path that names each row's "
                         f"position (`Outcome.intermediates[{ROW_POSITIONS!r}]`, harness/pairs.py) has them all")
        if cap.matched < cap.tokens:
            notes.append(f"per-module table: {cap.tokens - cap.matched} of the {role}'s {cap.tokens} token rows "
                         "could not be tied to a position of its root module's output, so the table covers the "
                         "other rows: a row is tied by correlating its largest log-probabilities with each position's "
                         "logits, and a row with fewer than 3 finite values (top-k/top-p truncated it) or none above "
                         "the correlation bar cannot be (see harness/triage.py `_match_rows`)")
    errs = module_errors(t_cap, r_cap)
    for role, cap, other in (("trainer", t_cap, r_cap), ("rollout", r_cap, t_cap)):
        missing = [n for n in cap.order if n not in errs and n not in other.rows and cap.rows.get(n)]
        only = [n for n in missing if n not in other.order]
        if only:
            notes.append(f"per-module table: {len(only)} module(s) only the {role} runs are not in it (nothing to "
                         f"compare them with): " + ", ".join(only[:6]) + (", ..." if len(only) > 6 else "")
                         + "; the table narrows a divergence down to the modules both paths share")
        untied = [n for n in missing if n in other.order]
        if untied:  # (a module called once per expert, on a different number of rows each time, say)
            other_role = "rollout" if role == "trainer" else "trainer"
            notes.append(f"per-module table: {len(untied)} module(s) both paths run are not in it, the {other_role}'s "
                         "outputs of them not being tied to token rows (called on a subset of the rows, or in another "
                         "layout): " + ", ".join(untied[:6]) + (", ..." if len(untied) > 6 else ""))
    unlike = [n for n in t_cap.order if n not in errs and n in r_cap.rows and t_cap.rows.get(n)]
    if unlike:
        notes.append(f"per-module table: {len(unlike)} module(s) both paths run give outputs of other shapes or "
                     "other token rows, so they are not compared: " + ", ".join(unlike[:6])
                     + (", ..." if len(unlike) > 6 else ""))
    floors: dict[str, float] = {}
    if reference is not None:
        ref = capture(reference, case, device)
        if ref is not None:
            floors = {k: v[0] for k, v in module_errors(*ref).items()}
    others: dict[str, float] = {}
    if rest is not None:
        got_rest = capture(rest, case, device)
        if got_rest is not None:
            others = {k: v[0] for k, v in module_errors(*got_rest).items()}
    rows = [ModuleRow(name, err, max(MIN_FLOOR, FLOOR_FACTOR * floors.get(name, 0.0)), n,
                      others.get(name, float("nan"))) for name, (err, n) in errs.items()]
    first = next((r.name for r in rows if r.starts), None)
    if first is not None and first.endswith("]"):
        # a module whose outputs are values and the ids it chose from them (a router: its weights and
        # experts): where the ids differ too, the choice is where the divergence starts, the values
        # beside it follow from it (a rollout selecting experts without its selection bias)
        base = first[:first.rindex("[")]
        chosen = next((r.name for r in rows if r.starts and r.name.startswith(base + "[")
                       and r.name in t_cap.choices | r_cap.choices), None)
        if chosen is not None and chosen != first:
            notes.append(f"per-module table: {base}'s outputs {first} and {chosen} both differ; {chosen} is the ids "
                         f"it chose, so the divergence is named there: a different choice changes the values beside it")
            first = chosen
    if first is not None:  # (what ran just before it agrees: the difference is in it, or in code no module wraps)
        i = next(k for k, r in enumerate(rows) if r.name == first)
        prev = rows[i - 1] if i else None
        if prev is not None and not prev.exceeds and layer_of(prev.name) == layer_of(first):
            notes.append(f"per-module table: {first} is where the divergence starts, and {prev.name}, whose output "
                         f"came just before it, agrees (error {prev.error:.3g} under its floor {prev.floor:.3g}): the "
                         f"difference arises in {first} itself or in code between the two that no module wraps (a "
                         "functional attention with its mask and positions, RoPE, a cache update)")
    cut = [r.name for r in rows if r.error == math.inf]
    if cut:
        notes.append("per-module table: an error of inf is an output non-finite on one path where the other's is "
                     "finite (-inf: log 0, a logit cut or masked on that path only; or NaN): "
                     + ", ".join(cut[:6]) + (", ..." if len(cut) > 6 else ""))
    return rows, first, first_nonfinite(t_cap, r_cap), notes


def _as_rows(x: Any) -> list[Any] | None:
    """A named intermediate as a list of 1-D float rows (its first dimension; a scalar or 1-D tensor
    is one row), or None when it is no numeric tensor (numpy arrays are taken too)."""
    import numpy as np
    import torch

    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor) or x.dtype == torch.bool or x.is_complex():
        return None
    x = x.detach().to("cpu")
    if x.dim() <= 1 or x.shape[0] == 0:
        return [x.reshape(-1)]
    return list(x.reshape(x.shape[0], -1))


def intermediate_errors(trainer: Any, rollout: Any) -> tuple[dict[str, tuple[float, int]], list[str]]:
    """Name -> (relative L2 error, rows) of the tensors both outcomes name in `intermediates` with one
    shape (`ROW_POSITIONS` aside), in the trainer's order; and what was named but not compared."""
    a = {k: v for k, v in (getattr(trainer, "intermediates", None) or {}).items() if k != ROW_POSITIONS}
    b = {k: v for k, v in (getattr(rollout, "intermediates", None) or {}).items() if k != ROW_POSITIONS}
    out: dict[str, tuple[float, int]] = {}
    unlike, only = [], [k for k in list(a) + list(b) if (k in a) != (k in b)]
    for name in a:
        if name not in b:
            continue
        ra, rb = _as_rows(a[name]), _as_rows(b[name])
        if ra is None or rb is None or tuple(getattr(a[name], "shape", ())) != tuple(getattr(b[name], "shape", ())):
            unlike.append(f"{name} (trainer {tuple(getattr(a[name], 'shape', ()))}, rollout "
                          f"{tuple(getattr(b[name], 'shape', ()))})")
            continue
        out[name] = (_rel_error(ra, rb), len(ra))
    notes = []
    if unlike:
        notes.append("named intermediates: " + ", ".join(unlike[:6]) + (", ..." if len(unlike) > 6 else "")
                     + " differ in shape or are not numeric tensors, so they are not compared (one name, one shape, "
                     "the same meaning on both paths)")
    if only and out:  # (a path's own bookkeeping, with nothing named on both, is not a table left short)
        notes.append("named intermediates: only one path names " + ", ".join(only[:6])
                     + (", ..." if len(only) > 6 else "") + "; nothing to compare them with")
    return out, notes


def intermediates_reference(pair: Any, case: Any, device: str, registry: Any, names: set[str]
                            ) -> tuple[dict[str, float], str]:
    """The errors of the same named intermediates in a registered `aligned` pair of the same family
    (`myort.aligned` for `myort.fp16_logits`) that names some of them: the noise floor of a path
    whose layout or library differs by design. ({}, "") when none does."""
    from .execute import run_case

    listing = getattr(registry, "all", None)
    if listing is None or not names:
        return {}, ""
    family = pair.name.split(".")[0]
    candidates = sorted(p.name for p in listing() if p.expected == "aligned" and p.kind == pair.kind
                        and p.name != pair.name and p.name.split(".")[0] == family and device in p.devices)
    for name in candidates[:REFERENCE_CANDIDATES]:
        try:
            ev = run_case(registry.get(name), case, device, keep_outcomes=True)
        except Exception:  # noqa: BLE001 - a pair that cannot run this case is no reference
            continue
        if ev.trainer is None or ev.rollout is None:
            continue
        errs, _ = intermediate_errors(ev.trainer, ev.rollout)
        if names & set(errs):
            return {k: v[0] for k, v in errs.items()}, name
    return {}, ""


def per_intermediate(pair: Any, ev: Any, device: str, registry: Any, aligned: Any = None
                     ) -> tuple[list[ModuleRow], str | None, str, list[str]]:
    """The named-intermediates table (error vs floor, in the trainer's order), the first one over its
    floor, what the floor was measured on, and notes. `aligned`: the pair with every differing
    component aligned (localization explained the case), whose errors are the floor where it names
    the same intermediates (its own code, its own layout: a finding in a pair registered aligned has no
    other aligned pair to take a floor from); else a registered aligned pair of the same family."""
    from .execute import run_case

    errs, notes = intermediate_errors(ev.trainer, ev.rollout)
    if not errs:
        return [], None, "", notes
    floors, floor_from = {}, ""
    if aligned is not None:
        try:
            ref = run_case(aligned, ev.case, device, keep_outcomes=True)
        except Exception:  # noqa: BLE001 - no floor from it then
            ref = None
        if ref is not None and ref.trainer is not None and ref.rollout is not None:
            theirs, _ = intermediate_errors(ref.trainer, ref.rollout)
            if set(errs) & set(theirs):
                floors, floor_from = {k: v[0] for k, v in theirs.items()}, \
                    "the pair with every differing component aligned"
    if not floors:
        floors, floor_from = intermediates_reference(pair, ev.case, device, registry, set(errs))
    rows = [ModuleRow(name, err, max(MIN_FLOOR, FLOOR_FACTOR * floors.get(name, 0.0)), n)
            for name, (err, n) in errs.items()]
    return rows, next((r.name for r in rows if r.exceeds), None), floor_from, notes


# ---------------------------------------------------------------------------------------------
# 2. Localization by swapping one component at a time, then delta debugging
# ---------------------------------------------------------------------------------------------
def _profiles(pair: Any) -> Any | None:
    p = getattr(pair, "profiles", None)
    if p is None or not hasattr(p, "variant"):
        return None
    if not isinstance(getattr(p, "trainer", None), Mapping) or not isinstance(getattr(p, "rollout", None), Mapping):
        raise UsageError(f"pair {pair.name!r} has profiles without trainer/rollout mappings; see the protocol in "
                         "harness/triage.py (trainer, rollout, labels, variant).")
    return p


def _variant(pair: Any, prof: Any, trainer: Mapping[str, str], rollout: Mapping[str, str]) -> Any:
    """The pair rebuilt with these component settings (`Profiles.make`, through `variant`); a make
    that raises or returns something else is the pair's to fix, said in one paragraph."""
    from .pairs import TargetPair

    what = f"pair {pair.name!r}: its Profiles.make(trainer={dict(trainer)!r}, rollout={dict(rollout)!r})"
    try:
        out = prof.variant(trainer, rollout)
    except HarnessError:
        raise
    except Exception as e:  # noqa: BLE001 - the pair's own code
        raise UsageError(f"{what} raised {type(e).__name__}: {e}. Triage rebuilds the pair with one component "
                         "swapped at a time: make must accept every combination of the settings in trainer and "
                         "rollout (the same keys) and return the TargetPair they describe.") from None
    if not isinstance(out, TargetPair):
        raise UsageError(f"{what} returned {type(out).__name__}, not a TargetPair: make must return the pair "
                         "rebuilt with those settings (e.g. `lambda t, r: my_pair(name, **...)`).")
    if out.verdict_over != pair.verdict_over:  # judged as the finding was, whatever make left at its default
        import dataclasses

        out = dataclasses.replace(out, verdict_over=pair.verdict_over)
    return out


def ddmin(items: list[str], fails: Callable[[list[str]], bool]) -> list[str]:
    """Zeller's ddmin: a 1-minimal subset of `items` for which `fails` holds (it holds for `items`)."""
    n = 2
    while len(items) >= 2:
        chunk = math.ceil(len(items) / n)
        parts = [items[i:i + chunk] for i in range(0, len(items), chunk)]
        reduced = False
        for part in parts:
            if fails(part):
                items, n, reduced = part, 2, True
                break
        if not reduced:
            for part in parts:
                rest = [x for x in items if x not in part]
                if rest and fails(rest):
                    items, n, reduced = rest, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


def profiles_stray(pair: Any, ev: Any, device: str, threshold: float) -> tuple[str, Any]:
    """(why the pair's `Profiles.make` does not rebuild this pair, where it does not: "" where it does,
    or there are no profiles; the variant's evaluation, None without profiles): the variant with the
    pair's own settings on both sides must judge the case as the pair does (the same verdict, the
    judged mean within 2x). A pair made from another
    with `dataclasses.replace(..., trainer=..., rollout=...)` keeps the profiles of the one it
    replaced, whose variants run the other pair's paths: every swap would then be read off them."""
    from .execute import run_case

    prof = _profiles(pair)
    if prof is None:
        return "", None
    base = run_case(_variant(pair, prof, dict(prof.trainer), dict(prof.rollout)), ev.case, device, threshold)
    mine, theirs = judged(ev), judged(base)
    same = base.failed == ev.failed and (
        not (math.isfinite(mine) and math.isfinite(theirs)) or max(mine, theirs) <= 1e-9
        or max(mine, theirs) <= 2 * max(min(mine, theirs), 1e-300))
    if same:
        return "", base
    return (f"not localized: the pair's Profiles.make does not rebuild it. Its variant with the pair's own settings "
            f"judges this case {theirs:.4g} ({'fails' if base.failed else 'passes'}) where the pair judges {mine:.4g} "
            f"({'fails' if ev.failed else 'passes'}), so swapping components through it would measure another pair. "
            "A pair made from another with dataclasses.replace(..., trainer=..., rollout=...) keeps that one's "
            "profiles: give it profiles=None, or Profiles(make=...) that builds it (`sampled_tokens_only` does so "
            "for the pairs it wraps)."), base


def localize(pair: Any, case: Any, device: str, threshold: float, k3_found: float,
             base: Any = None) -> Localization | None:
    """`base`: the evaluation of the variant with the pair's own settings, where one was run already
    (`profiles_stray`): the first of the runs below."""
    from .execute import run_case

    prof = _profiles(pair)
    if prof is None:
        return None
    t0, r0 = dict(prof.trainer), dict(prof.rollout)
    differing = [c for c in t0 if t0.get(c) != r0.get(c)]
    labels = dict(getattr(prof, "labels", {}) or {})
    cache: dict[str, tuple[float, float, bool]] = {}  # profiles -> (k3, exact KL, still a finding)
    if base is not None:
        cache[json.dumps([t0, r0], sort_keys=True)] = (*judged_pair(base), base.failed)

    def run(t: dict, r: dict) -> tuple[float, float, bool]:
        key = json.dumps([t, r], sort_keys=True)
        if key not in cache:
            ev = run_case(_variant(pair, prof, t, r), case, device, threshold)
            cache[key] = (*judged_pair(ev), ev.failed)
        return cache[key]

    def k3(t: dict, r: dict) -> float:
        return run(t, r)[0]

    def score(t: dict, r: dict) -> float:  # what the verdict compares with the threshold
        k, kl, _ = run(t, r)
        return max(k, kl) if math.isfinite(k) and math.isfinite(kl) else float("inf")

    def possible(t: dict, r: dict) -> bool:
        """Whether the pair rebuilt with these settings runs them: a path may keep its own for a
        component (an HF rollout always runs a row per sequence and its head where it samples), and
        such a swap changes nothing."""
        got = _profiles(_variant(pair, prof, t, r))
        return got is None or (dict(got.trainer) == t and dict(got.rollout) == r)

    swaps, nan = [], float("nan")
    fixed = set()  # components the rollout cannot take from the trainer (aligned the other way only)
    for c in differing:
        to_trainer, to_rollout = (t0, {**r0, c: t0[c]}), ({**t0, c: r0[c]}, r0)
        if not possible(*to_trainer):
            fixed.add(c)
        swaps.append(Swap(c, labels.get(c, c), str(t0[c]), str(r0[c]), nan if c in fixed else k3(*to_trainer),
                          k3(*to_rollout), nan if c in fixed else run(*to_trainer)[1], run(*to_rollout)[1]))
    direction = {c: ("trainer" if c in fixed or score({**t0, c: r0[c]}, r0) < score(t0, {**r0, c: t0[c]})
                     else "rollout") for c in differing}

    def aligned(comps: list[str]) -> tuple[dict, dict]:
        t, r = dict(t0), dict(r0)
        for c in comps:
            if direction[c] == "rollout":
                r[c] = t0[c]
            else:
                t[c] = r0[c]
        return t, r

    def fails(keep: list[str]) -> bool:
        return run(*aligned([c for c in differing if c not in keep]))[2]

    minimal = ddmin(list(differing), fails) if differing and fails(list(differing)) else []
    only = k3(*aligned([c for c in differing if c not in minimal])) if minimal else float("nan")
    min_aligned = k3(*aligned(minimal)) if minimal else float("nan")
    all_aligned = k3(*aligned(differing)) if differing else k3_found
    explained = bool(minimal) and not run(*aligned(minimal))[2]
    residual_by = {}
    if explained and _residual_left(min_aligned, all_aligned):
        residual_by = {c: k3(*aligned(minimal + [c])) for c in differing if c not in minimal}
    return Localization(differing, swaps, minimal, only, min_aligned, all_aligned, len(cache), explained,
                        aligned(differing), aligned(minimal),
                        kl_minimal_aligned=run(*aligned(minimal))[1] if minimal else float("nan"),
                        residual_by=residual_by)


def _residual_left(left: float, floor: float) -> bool:
    """Whether aligning the minimal set leaves k3 well above aligning every component (over 10x the
    floor and at least 1e-6): the other differing components still move the case."""
    return math.isfinite(left) and left >= 1e-6 and left >= 10 * max(floor if math.isfinite(floor) else 0.0, 1e-12)


# ---------------------------------------------------------------------------------------------
# 3. Routing flips per layer, near-tie vs other
# ---------------------------------------------------------------------------------------------
def routing_split(trainer: Any, rollout: Any) -> dict[str, dict[str, int]]:
    import torch

    out = {}
    for layer in sorted(set(trainer.routing) & set(rollout.routing)):
        rt, rr = trainer.routing[layer], rollout.routing[layer]
        et = torch.sort(torch.as_tensor(rt.experts).cpu(), -1).values
        er = torch.sort(torch.as_tensor(rr.experts).cpu(), -1).values
        flipped = (et != er).any(-1)
        k = et.shape[-1]
        near = torch.zeros_like(flipped)
        scored = False
        for s in (rt.scores, rr.scores):
            if s is not None and torch.as_tensor(s).shape[-1] > k:
                scored = True
                s = torch.as_tensor(s)
                step = torch.finfo(s.dtype).eps if s.is_floating_point() else 0.0  # the scores' own precision
                top = torch.topk(s.float().cpu(), k + 1, -1).values
                gap, scale = (top[:, k - 1] - top[:, k]).abs(), top[:, k - 1].abs()
                near |= gap <= torch.clamp(step * scale, min=NEAR_TIE)
        n = int(flipped.sum())
        # without scores from either path a flip cannot be told near-tie or not: counted apart
        out[layer] = {"tokens": int(flipped.numel()), "near_tie": int((flipped & near).sum()) if scored else 0,
                      "other": int((flipped & ~near).sum()) if scored else 0, "unscored": 0 if scored else n}
    return out


# ---------------------------------------------------------------------------------------------
# The whole triage
# ---------------------------------------------------------------------------------------------
def _label(loc: Localization, comps: list[str]) -> str:
    labels = {s.component: s.label for s in loc.swaps}
    return " + ".join(labels.get(c, c) for c in comps)


def residual_note(t: "Triage") -> str:
    """What the other differing components leave once the minimal set is aligned, where it is well
    above what aligning every component leaves: each may be a bug of its own, under the line on this
    case (a repro shows its pair's mildest trigger, and the worst bug shows there; another hides
    under it). "" when nothing is left."""
    loc = t.localization
    if loc is None or not loc.explained:
        return ""
    rest = [c for c in loc.differing if c not in loc.minimal]
    left, floor = loc.k3_minimal_aligned, loc.k3_all_aligned
    if not rest or not _residual_left(left, floor):
        return ""
    # a component moves the case when aligning it too takes away a tenth or more of what is left
    moving = [c for c in rest if c in loc.residual_by and loc.residual_by[c] <= 0.9 * left]
    idle = [c for c in rest if c in loc.residual_by and c not in moving]
    if loc.residual_by and not moving:  # (only together, not one by one)
        moving, idle = rest, []
    each = ", ".join(_label(loc, [c]) + (f" (aligning it too: {loc.residual_by[c]:.3g})" if c in loc.residual_by else "")
                     for c in moving)
    return (f"with {_label(loc, loc.minimal)} aligned, k3 {left:.3g} remains (every component aligned: {floor:.3g}): "
            f"{'this' if len(moving) == 1 else 'these'} other differing component{'' if len(moving) == 1 else 's'} "
            f"still move{'s' if len(moving) == 1 else ''} this case, under the line here: {each}"
            + (f" ({_label(loc, idle).replace(' + ', ', ')}: no change on this case)" if idle else "")
            + ". Each may be a bug of its own: fix this one and the next campaign's repro is theirs, or give one a "
            "pair of its own")


def judged(ev: Any) -> float:
    """The k3 the verdict judged on an evaluation: the expected k3 (exact over the vocabulary), the
    sampled tokens' mean without it, +inf when a sampled token is one the trainer excludes (the worst
    sequence's, for a pair judged over sequences)."""
    return judged_pair(ev)[0]


def judged_pair(ev: Any) -> tuple[float, float]:
    """(k3, exact KL) as the verdict judged them on an evaluation (`metrics.judged_means`)."""
    d = ev.divergence
    return judged_means(d) if d is not None else (ev.k3, float("nan"))


def _at(t: Triage) -> str:
    """Where the divergence starts, as the verdict says it."""
    if not t.first_module:
        return ""
    if t.first_module == ROOT:
        return f"in {module_label(ROOT)}"
    layer = t.first_layer
    # the first module output that differs; when it is a child (an output projection), the
    # difference may arise in its parent's own code before it (attention's core is no module)
    parent = t.first_module.rsplit(".", 1)[0] if "." in t.first_module else ""
    inside = f", in {parent}" if parent and layer and parent != layer and parent.startswith(layer + ".") else ""
    return (f"from {layer} (first divergent module {t.first_module}{inside})" if layer != t.first_module
            else f"at {t.first_module} (first divergent module)")


def _intermediate_at(t: Triage) -> str:
    """Where the named intermediates put the divergence, as the verdict says it."""
    floor = t.intermediates_floor_from or f"the absolute minimum {MIN_FLOOR:g}"
    if t.first_intermediate is None:
        return (f"no named intermediate exceeds its noise floor ({floor}); the paths differ after the last one the "
                "outcomes name")
    row = next(r for r in t.intermediates if r.name == t.first_intermediate)
    return (f"divergence starts at the named intermediate {row.name} (relative error {row.error:.3g}; the first over "
            f"its noise floor of the {len(t.intermediates)} compared, floor from {floor})")


def _measure(t: Triage, loc: Localization | None = None) -> str:
    """The verdict's figures: the judged k3 (the expected k3; `judged`), and the exact KL where it
    crossed the line (the case fails when either does), with their values once the minimal set is
    aligned when `loc` is given."""
    d = t.evaluation.divergence
    kl = judged_means(d)[1] if d is not None else float("nan")
    fired = getattr(d, "fired", "") if d is not None else ""
    expected = getattr(d, "k3_expected", float("nan")) if d is not None else float("nan")
    name = "expected k3" if math.isfinite(expected) else "k3"
    if getattr(d, "verdict_over", "batch") == "sequence":
        name = f"worst sequence's {name}"
    parts = [f"{name} {t.k3:.4f}" + (f" -> {loc.k3_minimal_aligned:.4f}" if loc else "")]
    if "kl" in fired:
        parts.append(f"KL {kl:.4f}" + (f" -> {loc.kl_minimal_aligned:.4f}" if loc else ""))
    return ", ".join(parts)


def verdict_line(t: Triage) -> str:
    loc, ev = t.localization, t.evaluation
    symptom = getattr(ev.symptom, "value", str(ev.symptom))
    if ev.error:  # its own message first line, whole: what a person acts on (where: the frame that raised)
        msg = (str(ev.error.get("message") or "").strip().splitlines() or [""])[0]
        what = {"crash": "the worker running this case died: ", "timeout": "this case hung: "}.get(
            symptom, "the case raised ")
        caller = ev.error.get("caller")
        return (f"{what}{ev.error['type']}: {msg} (at {ev.error.get('where', '?')}"
                + (f", called from {caller}" if caller else "") + "); no log-probabilities to "
                "compare, so nothing to localize: fix what the message names (`harness show FILE` prints the "
                "traceback)")
    if symptom == "divergence" and t.k3 == math.inf:  # not a NaN: a sampled token one path gives probability 0
        from .metrics import rollout_sampled_at_zero

        head = ("the rollout sampled a token the trainer's distribution excludes (k3 = inf): the two paths "
                "truncate at different boundaries (their -inf entries differ: top-k, top-p or another cut)")
        if rollout_sampled_at_zero(ev.divergence):
            head = ("the rollout reports probability 0 (log-prob -inf) for a token it sampled (k3 = inf): it samples "
                    "from another distribution than the one it reports (temperature, top-k or top-p applied to the "
                    "draw and not to the reported log-probs, or the reverse)")
        at = _at(t)
        if loc is not None and loc.explained:
            return f"{_label(loc, loc.minimal)}{', ' + at if at else ''}: {head}; aligning it gives k3 {loc.k3_minimal_aligned:.4f}"
        return head + (f"; divergence starts {at}" if at else "")
    if symptom == "nonfinite" or not math.isfinite(t.k3):
        nf = t.nonfinite
        paths = sorted(p for p, n in (("trainer", getattr(ev.divergence, "nonfinite_trainer", 0)),
                                      ("rollout", getattr(ev.divergence, "nonfinite_rollout", 0))) if n)
        head = "non-finite output (NaN/inf)" + (f" in the {' and '.join(paths)} log-probabilities" if paths else "")
        if nf is not None:
            layer = layer_of(nf.module)
            head += (f": first appears at module {nf.module} ({' and '.join(nf.paths)} path"
                     f"{'s' if len(nf.paths) > 1 else ''}" + (f", layer {layer}" if layer != nf.module else "") + ")")
        elif t.modules:
            head += ": no exposed module shows NaN/inf; it arises after the last module (e.g. in the log-softmax)"
        else:
            head += "; the pair exposes no torch modules to trace it further"
        if loc is not None and loc.explained:
            head += f"; aligning {_label(loc, loc.minimal)} removes it (k3 {loc.k3_minimal_aligned:.4f})"
        return head
    if symptom == "none":
        return f"{_measure(t)}: under the threshold {t.threshold:g} now, nothing to localize."
    at = _at(t)
    if loc is not None and loc.explained:
        return f"{_label(loc, loc.minimal)}{', ' + at if at else ''}: {_measure(t, loc)} when aligned"
    if loc is not None and loc.differing:
        base = (f"code-level difference: with every differing numerics component aligned "
                f"({_label(loc, loc.differing)}) k3 stays {loc.k3_all_aligned:.4f}")
    elif loc is not None:
        base = f"code-level difference (both paths run the same numerics profile; {_measure(t)})"
    else:
        base = _measure(t)
    if t.first_module:
        return f"{base}: divergence starts {at}, beyond the noise floor of {t.floor_from or 'the absolute minimum'}"
    if t.intermediates and not t.modules:
        return f"{base}: {_intermediate_at(t)}"
    if t.modules:
        return (f"{base}: no exposed module exceeds its noise floor ({t.floor_from or 'the absolute minimum'}); "
                "the paths differ after the last compared module or outside the exposed modules")
    d = ev.divergence
    if symptom == "divergence" and d is not None and math.isnan(getattr(d, "k3_expected", 0.0)):
        # a recorded rollout (`harness score`): its side is the engine's numbers, no model runs there
        aligned = f" (k3 {loc.k3_all_aligned:.4f} with the trainer's differing settings aligned)" if loc is not None \
            and loc.differing else ""
        return (f"{_measure(t)}{aligned}: the rollout is a recording (the engine's token log-probabilities; no rollout model runs "
                "here), so there are no rollout modules to compare the trainer's with, and the trainer's own "
                "settings do not explain it: the values come from how the engine that recorded them computed them "
                "(fuzz a pair of that engine's numerics, e.g. hf_pair(..., rollout=BF16), to find which component)")
    named = (" (a path that is not torch, an ONNX Runtime session say, names its tensors in "
             "`Outcome.intermediates`, the same names and shapes on both paths, and triage compares them)")
    if loc is not None:
        return f"{base}; the pair exposes no torch modules or named intermediates to find where{named}"
    return f"{base}; the pair exposes neither numerics profiles nor torch modules to localize further{named}"


def noise_reference(pair: Any, case: Any, device: str, registry: Any, loc: Localization | None
                    ) -> tuple[Any | None, str]:
    """The aligned run whose module errors are the noise floor, and what it is."""
    prof = _profiles(pair)
    if loc is not None and loc.explained:
        return _variant(pair, prof, *loc.aligned_profiles), "the pair with every differing component aligned"
    same = dict(loc.aligned_profiles[0]) if loc is not None and loc.differing else \
        (dict(prof.trainer) if prof is not None else None)
    found = aligned_reference(pair, case, device, registry, same)
    if found is not None:
        return found
    return None, ""


def triage(repro: Any, device: str = "cpu", threshold: float | None = None, registry: Any = None) -> Triage:
    from .execute import Symptom, run_case
    from .pairs import REGISTRY

    start = time.monotonic()
    registry = registry or REGISTRY
    pair = registry.get(repro.pair)
    thr = threshold if threshold is not None else repro.threshold
    ev = run_case(pair, repro.case, device, thr, keep_outcomes=True)
    if ev.setup:  # (a harness error: its checkpoint folder is gone, say; as `replay`, not an empty report)
        raise UsageError(f"repro {repro.path or repro.id} cannot be triaged here: its pair {repro.pair!r} could not run: "
                         f"{ev.error['type']}: {ev.error['message']}")
    t = Triage(repro=repro, pair=pair, k3=judged(ev), threshold=thr, evaluation=ev)
    if ev.error:
        t.notes.append(f"the pair raised {ev.error['type']}: {ev.error['message']}")
    prof = _profiles(pair)
    if ev.divergence is not None:
        if ev.trainer is not None and ev.rollout is not None:
            t.flips = routing_split(ev.trainer, ev.rollout)
        if ev.failed:  # k3 or exact KL over the line, or non-finite
            stray, base = profiles_stray(pair, ev, device, thr)
            if stray:
                t.notes.append(stray)
            else:
                t.localization = localize(pair, repro.case, device, thr, t.k3, base)
        reference, t.floor_from = noise_reference(pair, repro.case, device, registry, t.localization)
        loc = t.localization
        rest = _variant(pair, prof, *loc.minimal_aligned_profiles) if loc is not None and loc.explained \
            and set(loc.minimal) != set(loc.differing) else None
        t.modules, t.first_module, t.nonfinite, notes = per_module(pair, repro.case, device, reference, rest)
        t.notes += notes
        if t.modules and reference is None:
            t.notes.append("no aligned run of the same modules was found (a registered `aligned` pair exposing "
                           f"the same modules); the noise floor is the absolute minimum {MIN_FLOOR:g}")
        if ev.trainer is not None and ev.rollout is not None:
            aligned = _variant(pair, prof, *loc.aligned_profiles) if loc is not None and loc.explained else None
            t.intermediates, t.first_intermediate, t.intermediates_floor_from, notes = per_intermediate(
                pair, ev, device, registry, aligned)
            t.notes += notes
    if ev.symptom is Symptom.DIVERGENCE:  # (a NaN finding or a case that now passes: nothing crosses)
        from .pairs import lead_of

        t.first_over = first_over_line(ev.divergence, repro.case, thr, lead_of(pair, repro.case))
    t.verdict = verdict_line(t)
    t.seconds = time.monotonic() - start
    return t


def first_over_line(div: Any, case: Any, threshold: float, lead: int = 0) -> str:
    """Where the per-token divergence first crosses the line: the token with the smallest offset into
    its sequence (prompt tokens before it + its response index) whose expected k3 or exact KL is over
    `threshold` (or whose sampled k3 is +inf), and how many are ("" when none is). A bug from position
    48 shows as offset 48 even when the minimal case keeps clean tokens before it (the verdict is a
    mean over tokens); with `lead` (the pair's `lead_tokens`), also its position in the sequence as the
    model ran it; with several sequences, also the first row over the line in case order (a kernel
    over the batch's rows, chunked by 64 say, first fails at row 64 whatever the sequences there)."""
    from .metrics import per_token_judged

    pt = getattr(div, "per_token", None) or {}
    judged_rows = per_token_judged(div)
    if "sequence" not in pt or judged_rows is None:
        return ""
    import numpy as np

    row, drawn_inf = judged_rows  # (drawn_inf: its sampled token, one path gives it 0)
    with np.errstate(invalid="ignore"):
        over = (row > threshold) | drawn_inf
    if not over.any():  # (a mean over tokens is over the line only if some token is: nothing to point at)
        return ""
    seqs, pos = np.asarray(pt["sequence"]), np.asarray(pt["position"])
    offsets = np.array([case.prompt_len(int(j)) for j in seqs]) + pos
    i = int(np.flatnonzero(over)[np.argmin(offsets[over])])
    j, p, prompt = int(seqs[i]), int(pos[i]), case.prompt_len(int(seqs[i]))
    at = f"sequence {j}, response token {p} (0-based)" + (f" after a {prompt}-token prompt (offset {prompt + p})"
                                                        if prompt else "")
    group = case.group_of(j) if getattr(case, "prompt_ids", None) else [j]
    if len(group) > 1:  # (a GRPO group: where a prefix cache is filled, and where it is read)
        at += (f", sample {group.index(j) + 1} of the {len(group)} sequences {', '.join(map(str, group))} that share "
               "its prompt" + (" (the first in batch order: the one a prefix cache is filled by)" if group[0] == j
                               else f" (sequence {group[0]}, first in batch order, fills a prefix cache)"))
    if lead:  # (the pair's own first tokens: the position its model ran the token at)
        at += f", position {lead + prompt + p} of its sequence ({lead} token(s) the pair puts before each prompt)"
    earlier = int((~over & (seqs == j) & (pos < p)).sum())
    value = (f"sampled k3 inf (expected k3 / KL {row[i]:.3g})" if drawn_inf[i] and not row[i] > threshold
             else f"per-token value {row[i]:.3g}")
    first = int(np.flatnonzero(over)[0])  # (in case order: what a kernel over the batch's rows indexes)
    in_order = ""
    if case.batch_size > 1:
        in_order = f"; in case order (the outcome's rows, {len(over)} in all) the first over it is row {first}" + (
            f" (sequence {int(seqs[first])}, response token {int(pos[first])})" if first != i else " (this one)")
    return (f"first token over the line: {at}, {value}; {int(over.sum())} of {len(over)} tokens "
            f"over it" + (f", the {earlier} before it in that sequence under it" if earlier else "") + in_order)


# ---------------------------------------------------------------------------------------------
# 4. The report
# ---------------------------------------------------------------------------------------------
def _plots(t: Triage, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = []
    div = t.evaluation.divergence
    if div is not None and div.per_token:
        pt = div.per_token
        fig, ax = plt.subplots(figsize=(8, 3))
        x = np.arange(len(pt["k3"]))
        from .metrics import per_token_judged

        judged_rows = per_token_judged(div)  # what the verdict reads per token, as the text counts "over the line"
        if judged_rows is not None:
            ax.scatter(x, np.maximum(judged_rows[0], 1e-18), c=np.asarray(pt["sequence"]) % 10, cmap="tab10",
                       vmin=0, vmax=9, s=16, label="expected k3 / exact KL (judged)")  # (one tab10 colour a sequence)
        ax.scatter(x, np.maximum(pt["k3"], 1e-18), c="0.6", marker="x", s=10, label="k3 of the sampled token")
        ax.axhline(t.threshold, color="red", lw=1, ls="--", label=f"threshold {t.threshold:g}")
        ax.set_yscale("log")
        ax.set_xlabel("token (case order, from 0; colour = sequence)")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # (tokens: no 0.25 ticks)
        ax.set_ylabel("per-token value")
        ax.set_title(f"{t.repro.pair}: per token, the judged value (verdict {t.k3:.3g}) and the sampled k3 "
                     f"(mean {t.evaluation.k3:.3g})", fontsize=9)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        out.append(folder / "k3_per_token.png")
        fig.savefig(out[-1], dpi=110)
        plt.close(fig)
    if t.modules:
        fig, ax = plt.subplots(figsize=(9, max(3, 0.22 * len(t.modules))))
        names = [m.name for m in t.modules]
        y = np.arange(len(names))
        top = max([m.error for m in t.modules if math.isfinite(m.error)] + [1.0]) * 10  # (inf: drawn past the rest)
        ax.barh(y, [min(max(m.error, 1e-18), top) for m in t.modules],
                color=["tab:red" if m.exceeds else "tab:gray" for m in t.modules])
        ax.scatter([m.floor for m in t.modules], y, marker="|", color="black", s=60, label="noise floor")
        ax.set_yticks(y, names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("relative L2 error, trainer vs rollout (execution order, top to bottom)")
        ax.set_title("divergence per layer and component")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        out.append(folder / "modules.png")
        fig.savefig(out[-1], dpi=110)
        plt.close(fig)
    if t.flips:
        fig, ax = plt.subplots(figsize=(6, 3))
        layers = list(t.flips)
        near = [t.flips[l]["near_tie"] for l in layers]
        other = [t.flips[l]["other"] for l in layers]
        unscored = [t.flips[l].get("unscored", 0) for l in layers]
        ax.bar(layers, near, label=f"near-tie (gap <= {NEAR_TIE:g} or one step of the scores)", color="tab:orange")
        ax.bar(layers, other, bottom=near, label="other", color="tab:blue")
        if any(unscored):
            ax.bar(layers, unscored, bottom=[a + b for a, b in zip(near, other)], label="no scores reported",
                   color="tab:gray")
        ax.set_ylabel("tokens whose experts flipped")
        ax.set_title("routing flips per layer")
        ax.legend(fontsize=8)
        fig.tight_layout()
        out.append(folder / "flips.png")
        fig.savefig(out[-1], dpi=110)
        plt.close(fig)
    loc = t.localization
    if loc is not None and loc.swaps:
        fig, ax = plt.subplots(figsize=(8, max(2.5, 0.4 * len(loc.swaps) + 1)))
        y = np.arange(len(loc.swaps))
        ax.barh(y, [max(s.best, 1e-18) for s in loc.swaps], color=["tab:green" if s.component in loc.minimal
                                                                     else "tab:gray" for s in loc.swaps])
        ax.axvline(t.k3, color="black", lw=1, label=f"as found {t.k3:.3g}")
        ax.axvline(t.threshold, color="red", lw=1, ls="--", label="threshold")
        ax.set_yticks(y, [s.label for s in loc.swaps], fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("k3 with this one component aligned")
        ax.set_title("localization by swapping")
        ax.legend(fontsize=8)
        fig.tight_layout()
        out.append(folder / "swaps.png")
        fig.savefig(out[-1], dpi=110)
        plt.close(fig)
    return out


def _replay_command(r: Any) -> str:
    cmd = getattr(r, "replay_command", None)
    return cmd() if callable(cmd) else f"harness replay {r.path or r.id + '.json'}"


def _triage_command(r: Any) -> str:
    from .corpus import _display

    flags = r.plugin_flags() if callable(getattr(r, "plugin_flags", None)) else ""
    target = _display(Path(r.path)) if r.path else "--run-id " + str((r.tracking or {}).get("run_id", "?"))
    return "harness triage" + flags + f" {target}"


def write_report(t: Triage, reports: Path) -> Path:
    folder = Path(reports) / t.repro.id
    folder.mkdir(parents=True, exist_ok=True)
    t.plots = _plots(t, folder)
    r, ev = t.repro, t.evaluation
    expected_k3 = getattr(ev.divergence, "k3_expected", float("nan"))
    judged_what = "expected over the vocabulary" if not math.isnan(expected_k3) else \
        "the recorded tokens' mean: a recorded rollout holds no distribution to take an expectation over"
    if t.k3 == math.inf and not math.isnan(expected_k3) and expected_k3 != math.inf:  # fired by one draw
        from .metrics import rollout_sampled_at_zero

        judged_what = (("a sampled token the rollout reports at probability 0" if rollout_sampled_at_zero(ev.divergence)
                        else "a sampled token the trainer excludes")
                       + f" gives k3 = inf; expected over the tokens the trainer keeps: {expected_k3:.6g}")
    lines = [f"# Triage of {r.id}: {r.pair}", "",
             f"**Verdict:** {t.verdict}", "",
             *([residual, ""] if (residual := residual_note(t)) else []),
             f"- pair: `{r.pair}` ({t.pair.description or t.pair.kind}), expected {t.pair.expected}, status {r.status}",
             f"- case: `{r.case.one_line()}`",
             *([f"- {t.first_over}"] if t.first_over else []),
             f"- replay: `{_replay_command(r)}`"
             + (" (its minimal case); this report is of its severe case (`found.severe`), triage again: "
                f"`{_triage_command(r).replace('harness triage', 'harness triage --severe', 1)}`" if t.of_severe
                else f"; triage again: `{_triage_command(r)}`"),
             f"- judged k3 ({judged_what}) now {t.k3:.6g}, exact KL "
             f"{getattr(ev.divergence, 'kl', float('nan')):.6g} (threshold {t.threshold:g}, either over it fails); "
             f"the sampled tokens' mean k3 {ev.k3:.6g}"
             + ("" if t.of_severe else f" (recorded {r.metrics.get('k3_kl', '-')})") + "; "
             f"triage took {t.seconds:.1f}s", ""]
    if ev.divergence is not None:
        d = ev.divergence
        lines += ["## Metrics", "", "| metric | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in d.as_dict().items()]
        lines.append("")
    loc = t.localization
    if loc is not None:
        if loc.explained:
            found = (f"Minimal set that keeps k3 above the threshold: **{', '.join(loc.minimal) or 'none'}** (k3 with "
                     f"only it differing: {loc.k3_minimal_only:.6g}; with it aligned: {loc.k3_minimal_aligned:.6g}; "
                     f"everything aligned: {loc.k3_all_aligned:.6g}; {loc.runs} cases run).")
        else:  # aligning every differing component leaves it failing: none of them is the cause
            found = (f"**Not explained by these components**: with every one of them aligned the case still fails "
                     f"(k3 {loc.k3_all_aligned:.6g}; {loc.runs} cases run), so the divergence comes from something the "
                     "profiles do not describe (a code-level difference, or a recorded rollout's own values).")
        lines += ["## Localization by swapping", "",
                  f"Differing components: {', '.join(loc.differing) or 'none'}. {found}", "",
                  "| component | trainer | rollout | k3, rollout takes trainer's | k3, trainer takes rollout's "
                  "| KL, rollout takes trainer's | KL, trainer takes rollout's |",
                  "|---|---|---|---:|---:|---:|---:|"]
        def cell(v: float) -> str:  # (nan: a swap the pair does not run, its rollout keeping its own setting)
            return "n/a" if v != v else f"{v:.6g}"

        lines += [f"| {s.label} (`{s.component}`) | {s.trainer} | {s.rollout} | {cell(s.k3_rollout_aligned)} | "
                  f"{cell(s.k3_trainer_aligned)} | {cell(s.kl_rollout_aligned)} | {cell(s.kl_trainer_aligned)} |"
                  for s in loc.swaps]
        if any(s.k3_rollout_aligned != s.k3_rollout_aligned for s in loc.swaps):
            lines += ["", "n/a: the pair rebuilt with the rollout taking the trainer's setting still runs its own "
                      "(an HF rollout always runs a row per sequence and its LM head where it samples); that "
                      "component is aligned by the trainer taking the rollout's."]
        lines.append("")
    if t.nonfinite is not None:
        nf = t.nonfinite
        lines += ["## Non-finite values", "",
                  f"First module (execution order) whose output holds NaN/inf: **{nf.module}** (layer "
                  f"{layer_of(nf.module)}; {' and '.join(nf.paths)} path; {nf.positions} position(s)).", ""]
    if t.modules:
        floor_from = t.floor_from or f"none found, the absolute minimum {MIN_FLOOR:g}"
        rest = any(m.rest == m.rest for m in t.modules)
        minimal = ", ".join(t.localization.minimal) if t.localization else ""
        lines += ["## Divergence per module", "",
                  f"Where the divergence starts: **{t.first_module or 'none'}**"
                  + (f" (layer {t.first_layer})" if t.first_module and t.first_layer != t.first_module else "")
                  + f". Noise floor = {FLOOR_FACTOR:g} x the module's error in an aligned run of the same modules "
                  f"({floor_from}), at least {MIN_FLOOR:g}"
                  + (f"; the start is the first module also over {FLOOR_FACTOR:g} x its error with only {minimal} "
                     "aligned (what the other differing components give alone)" if rest else "") + ".", "",
                  "| module | layer | relative error | noise floor |" + (f" {minimal} aligned |" if rest else "")
                  + " tokens | over floor |",
                  "|---|---|---:|---:|" + ("---:|" if rest else "") + "---:|---|"]
        lines += [f"| {m.name} | {m.layer} | {m.error:.3g} | {m.floor:.3g} | "
                  + (f"{m.rest:.3g} | " if rest else "")
                  + f"{m.tokens} | {'yes' if m.exceeds else ''} |" for m in t.modules]
        lines.append("")
    if t.intermediates:
        floor_from = t.intermediates_floor_from or f"none found, the absolute minimum {MIN_FLOOR:g}"
        lines += ["## Divergence per named intermediate", "",
                  f"The tensors both paths name in `Outcome.intermediates`, in the trainer's order. Where the "
                  f"divergence starts: **{t.first_intermediate or 'none'}**. Noise floor = {FLOOR_FACTOR:g} x the "
                  f"same tensor's error in an aligned run ({floor_from}), at least {MIN_FLOOR:g}.", "",
                  "| intermediate | relative error | noise floor | rows | over floor |", "|---|---:|---:|---:|---|"]
        lines += [f"| {m.name} | {m.error:.3g} | {m.floor:.3g} | {m.tokens} | {'yes' if m.exceeds else ''} |"
                  for m in t.intermediates]
        lines.append("")
    if t.flips:
        lines += ["## Routing flips per layer", "",
                  f"Near-tie: the boundary score gap (k-th vs (k+1)-th) within {NEAR_TIE:g} or one step of the "
                  "scores' own precision in either path; *no scores*: neither path reported `Routing.scores`, so "
                  "the flip cannot be told apart.", "",
                  "| layer | tokens | near-tie flips | other flips | no scores |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {l} | {v['tokens']} | {v['near_tie']} | {v['other']} | {v.get('unscored', 0)} |"
                  for l, v in t.flips.items()]
        lines.append("")
    for note in t.notes:
        lines.append(f"> {note}")
    if t.plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in t.plots]
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n")
    t.report = path
    return path


def attach_to_mlflow(t: Triage, run_id: str, uri: str | None) -> str:
    """Log the report folder to the regression run (artifact dir `triage`). Returns what happened."""
    from .mlflow_tracking import open_store

    try:
        client = open_store(uri).client
        client.log_artifacts(run_id, str(t.report.parent), "triage")
        # the verdict as a tag, so `harness regressions show` and the UI's run table carry it
        client.set_tag(run_id, "harness.triage_verdict", verdict_line(t)[:4000])
        if t.first_module:
            client.set_tag(run_id, "harness.triage_first_module", t.first_module[:500])
    except Exception as e:  # noqa: BLE001 - the report on disk is the record; tracking is a copy
        return f"not attached to MLflow run {run_id}: {type(e).__name__}: {e}"
    return f"attached to MLflow run {run_id} (artifacts/triage; tag harness.triage_verdict)"


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
@click.command("triage")
@click.argument("file", required=False, type=click.Path(path_type=Path))
@click.option("--run-id", default=None, help="Triage the repro of this MLflow regression run instead of FILE.")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI for --run-id.")
@click.option("--no-tracking", is_flag=True, help="Do not attach the report to the MLflow regression run.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--threshold", type=FiniteFloat(0, min_open=True), default=None,
              help="Override the threshold recorded in the repro.")
@click.option("--reports", type=click.Path(file_okay=False, path_type=Path), default=Path("reports"),
              show_default=True, help="The report goes to REPORTS/<finding id>/report.md.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--severe", is_flag=True, help="Triage the repro's severe case instead of its minimal case: the "
              "campaign's worst case, shrunk keeping it far above the minimal case (`found.severe`, shown by "
              "`harness show`). Where its verdict names other components than the minimal case's, the pair has a "
              "second bug. The report goes to REPORTS/<finding id>-severe/; nothing is attached to MLflow.")
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE", help="Load pairs from a plugin.")
def triage_command(file: Path | None, run_id: str | None, tracking_uri: str | None, no_tracking: bool, device: str,
                   threshold: float | None, reports: Path, as_json: bool, severe: bool, plugins: tuple[str, ...]) -> None:
    """Localize a divergence: per-module table, swap-one-component localization, routing flips, report."""
    from .cli import load_plugins
    from .corpus import load_repro
    from .env import resolve_device

    if (file is None) == (run_id is None):
        raise UsageError("triage needs exactly one of FILE (a repro, e.g. corpora/<pair>/<id>.json) or --run-id ID "
                         "(an MLflow regression run); pass one of them.")
    if file is not None:
        repro = load_repro(file)
    else:
        from .tracking import fetch_repro

        repro = fetch_repro(run_id, tracking_uri)
    if repro.symptom in ("crash", "timeout"):
        # triage runs the pair in this process, module by module: a case that kills or hangs its
        # process would take triage with it. What there is to know is in the repro (the signal or
        # the hung worker's stack) and in an isolated replay.
        err = repro.error or {}
        lines = str(err.get("message", "")).strip().splitlines()  # (its headline: the fix below it is another story)
        where = f"{err.get('type', '?')}: {lines[0][:300] if lines else ''}".strip().rstrip(":")
        show = f"harness show{repro.plugin_flags()} {file}" if file else \
            f"harness regressions show {run_id}"
        raise UsageError(f"repro {file or run_id} is a `{repro.symptom}` finding ({where}); triage localizes "
                         f"numerical divergences by running the pair in-process, which such a case would kill or "
                         f"hang. Its recorded traceback/stack is in the {'file' if file else 'run'} (`{show}`); "
                         f"check it still {'crashes' if repro.symptom == 'crash' else 'hangs'} in a worker with "
                         f"`{repro.replay_command()}`.")
    load_plugins(plugins)
    from . import corpus

    if hasattr(corpus, "load_plugin_for"):  # a repro recorded from a plugin file of this repository
        why = corpus.load_plugin_for(repro)
        if why is not None:
            raise UsageError(f"repro {file or run_id} cannot be triaged here: {why}.")
    if severe:
        from .corpus import Severe

        sev = Severe.from_json((repro.found or {}).get("severe"))
        if sev is None:
            why = ("its found.severe cannot be read (edited by hand?)" if (repro.found or {}).get("severe")
                   else "its campaign kept no severe case: no failing case of it reached "
                        "harness.fuzz.SEVERE_FACTOR x the minimal case's judged mean")
            raise UsageError(f"repro {file or run_id} has no severe case to triage: {why}. Triage its minimal "
                             "case without --severe.")
        click.echo(f"severe case of {repro.id}: {sev.case.one_line()} (judged {sev.judged:.3g} when "
                   f"found, shrunk keeping {sev.keeping}; the minimal case's is the repro's)")
        # (the recorded metrics are the minimal case's: not this case's to compare with)
        repro = dataclasses.replace(repro, id=f"{repro.id}-severe", case=sev.case, tracking={}, metrics={})
    t = triage(repro, resolve_device(device), threshold)
    t.of_severe = severe
    write_report(t, reports)
    residual = residual_note(t)
    attached = None
    rid = (repro.tracking or {}).get("run_id") or (None if severe else run_id)  # (also when ID was a finding id)
    if rid and not no_tracking:
        attached = attach_to_mlflow(t, rid, tracking_uri or (repro.tracking or {}).get("uri"))
    if as_json:
        loc = t.localization
        click.echo(json.dumps({
            "id": repro.id, "pair": repro.pair, "k3": t.k3, "verdict": t.verdict, "first_module": t.first_module,
            "first_layer": t.first_layer, "floor_from": t.floor_from,
            "first_nonfinite": t.nonfinite.module if t.nonfinite else None,
            "first_over": t.first_over or None, "first_intermediate": t.first_intermediate,
            "intermediates": {m.name: m.error for m in t.intermediates},
            "minimal": loc.minimal if loc else None, "explained": loc.explained if loc else None,
            "k3_minimal_aligned": loc.k3_minimal_aligned if loc else None, "flips": t.flips,
            "residual": residual or None,
            "report": str(t.report), "plots": [str(p) for p in t.plots], "seconds": t.seconds, "mlflow": attached,
        }, indent=2, default=str))
    else:
        if t.first_module:
            click.echo(f"first divergent module: {module_label(t.first_module)}"
                       + (f" (layer {t.first_layer})" if t.first_module != ROOT and t.first_layer != t.first_module
                          else ""))
        if t.nonfinite:
            click.echo(f"first module with NaN/inf: {t.nonfinite.module} ({' and '.join(t.nonfinite.paths)})")
        if t.intermediates:
            click.echo("named intermediates (relative error, in the trainer's order): " + ", ".join(
                f"{m.name} {m.error:.3g}{' *' if m.exceeds else ''}" for m in t.intermediates[:12])
                + (", ..." if len(t.intermediates) > 12 else "") + " (* over the noise floor)")
        if t.flips:
            unscored = any(v.get("unscored") for v in t.flips.values())
            click.echo(f"routing flips per layer (near-tie/other{'/no scores' if unscored else ''}): " + ", ".join(
                f"{l} {v['near_tie']}/{v['other']}" + (f"/{v.get('unscored', 0)}" if unscored else "")
                for l, v in t.flips.items()))
        click.echo(f"verdict: {t.verdict}")
        if residual:
            click.echo(residual)
        if t.first_over:
            click.echo(t.first_over)
        for line in missing_table_lines(t):
            click.echo(line)
        click.echo(f"report: {t.report} ({len(t.plots)} plot(s)); {t.seconds:.1f}s")
        if attached:
            click.echo(attached, err=True)
    sys.exit(0)
