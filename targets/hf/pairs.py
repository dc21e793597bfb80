"""Pairs from any Hugging Face causal LM: `hf_pair` (one pair) and `hf_pairs` (the standard set).

A user's own model is a handful of lines (README, "Your own Hugging Face model"):

    from harness import register
    from targets.hf import BF16, FP32, hf_pairs
    for pair in hf_pairs("mine", "path/to/checkpoint"):
        register(pair)

`hf_pair(name, model, trainer, rollout, ...)` chooses exactly what differs: each side's `Numerics`
(body / router / LM-head dtype, attention and experts implementation) and router replay. Pairs are
cheap to create: transformers is imported and the model loaded when a case first runs.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from harness import Axes, Outcome, RoutingAxes, TargetPair
from harness.errors import UsageError

from . import paths
from .backend import COMPONENTS, EXACT_SAMPLER, LAYOUT_COMPONENTS, FP32, NO_PATCH, HFModel, Numerics, as_rollout, model_from

MAX_PROMPT = 12  # prompt tokens per sequence (fuzzed 0..MAX_PROMPT)
MAX_RESPONSE = 16  # response tokens per sequence (every one decoded from the KV cache)
# sequences per batch: engines switch kernels (and captured CUDA graphs) at decode batch 8 and 16, and
# a case on the tiny configs costs about the same at any batch (decode steps, not rows, dominate)
MAX_SEQS = 16


def default_axes(model: Any, max_seqs: int = MAX_SEQS, max_prompt: int = MAX_PROMPT,
                 max_response: int = MAX_RESPONSE, max_context: int | None = None,
                 max_tokens: int | None = None) -> Axes:
    """Batch, prompt and response lengths, packing, sampling and (MoE) near-tie axes for a model (an
    `HFModel`, a checkpoint directory or a config, as `hf_pair` takes). A checkpoint directory that is
    not there gets the axes of a model without experts: its pairs cannot run until it is (see
    `hf_pair`), and a plugin widening their axes still registers them.

    max_context: each sequence's prompt + response tokens at most this (`Axes.max_context`). Left
    None, it is the model's max_position_embeddings less the first token where the longest prompt
    and response together would pass it (so long prompts and long responses are both drawn, never
    both at once). max_tokens: the batch's prompt + response tokens at most this (`Axes.max_tokens`:
    a real vocabulary's logits grow with it)."""
    from hypothesis import strategies as st

    gone = _checkpoint_gone(model)
    moe = None if gone else model_from(model).moe()
    if max_context is None and not gone:
        max_pos = int(model_from(model).fields().get("max_position_embeddings") or 0)
        if max_pos and 1 + max_prompt + max_response > max_pos:
            max_context = max_pos - 1
    kw: dict[str, Any] = dict(
        n_seqs=(1, max_seqs), seq_len=(1, max_response), packing=True,
        logit_scale=(1.0, 1.0),  # peakedness comes from the model (realistic init or a trained checkpoint)
        dtypes=("bfloat16",), max_context=max_context, max_tokens=max_tokens,
    )
    extra = {"prompt_len": (0, max_prompt), "pad_sides": ("left",), "temperature": (0.7, 1.0),
             "top_p": (1.0, 1.0), "sample_top_k": (0, 0)}  # top-p: see README (nucleus boundary)
    names = {f.name for f in dataclasses.fields(Axes)}
    kw.update({k: v for k, v in extra.items() if k in names})
    if moe:
        experts, top_k, layers = moe
        if not 1 <= top_k < experts:  # (else the routing axes below refuse it, blaming Axes the user never wrote)
            raise UsageError(f"the model's config routes each token to num_experts_per_tok={top_k} of its {experts} "
                             "experts; it must choose at least 1 and fewer than there are (a top-k over every expert "
                             "has no routing to test): fix the config.")
        kw["routing"] = RoutingAxes(n_experts=(experts, experts), top_k=(top_k, top_k), max_gap=1e-2,
                                    tie_fraction=(0.0, 1.0))
        kw["params"] = {"tie_layer": st.integers(0, layers - 1)}  # the layer whose router sees near ties
    return Axes(**kw)


@dataclass(frozen=True)
class HFProfiles:
    """The triage protocol (`harness.triage`): both paths' numerics, labels, and rebuilding the pair."""

    trainer: Mapping[str, str]
    rollout: Mapping[str, str]
    labels: Mapping[str, str]
    make: Callable[[Numerics, Numerics], TargetPair]
    model: HFModel | None = None  # the model both paths run (None: named by each case, `hf.recorded`)
    replay: bool = False  # the trainer replays the rollout's experts

    def variant(self, trainer: Mapping[str, str], rollout: Mapping[str, str]) -> TargetPair:
        return self.make(Numerics(**trainer), Numerics(**rollout))


def labels(trainer: Numerics, rollout: Numerics) -> dict[str, str]:
    """The triage labels of a pair's components; a module patch is named as the paths have it."""
    out = dict(COMPONENTS)
    rows = {"all": "every position", "scored": "the scored positions only"}
    if trainer.head_rows != rollout.head_rows:
        out["head_rows"] = (f"LM-head rows ({rows[trainer.head_rows]} on the trainer, {rows[rollout.head_rows]} on "
                            "the rollout)")
    t, r = trainer.as_dict()["patch"], rollout.as_dict()["patch"]
    if t != r:
        out["patch"] = f"module patch {r!r} on the rollout vs {t!r} on the trainer (register_patch)"
    elif t != NO_PATCH:
        out["patch"] = f"module patch {t!r} on both paths (register_patch)"
    t, r = trainer.sampler, rollout.sampler
    if t != r:
        out["sampler"] = f"sampler {r!r} on the rollout vs {t!r} on the trainer (register_sampler)"
    elif t != EXACT_SAMPLER:
        out["sampler"] = f"sampler {t!r} on both paths (register_sampler)"
    return out


_warned_missing: set[str] = set()


def _checkpoint_gone(model: Any) -> UsageError | None:
    """Why `model`, a checkpoint path, is no checkpoint directory; None for one that is, or a model
    given otherwise (an `HFModel`, a config)."""
    if not isinstance(model, (str, Path)):
        return None
    try:
        HFModel.from_pretrained(model)
    except UsageError as e:
        if Path(model).expanduser().is_file():  # (a file of the checkpoint: a mistake no mount will fix; said now)
            raise
        return e
    return None


def _missing_checkpoint(name: str, model: Any, expected: str = "aligned", description: str = "",
                        devices: tuple[str, ...] = ("cpu", "cuda"), axes: Axes | None = None,
                        threshold: float | None = None, timeout: float | None = None) -> TargetPair | None:
    """For a checkpoint folder that is not there (a nightly whose checkpoint mount is missing, a step
    an RL run deleted): a pair of that name whose every case cannot run, saying why, so the plugin's
    other pairs still run and this one is CANNOT RUN in the table; None when `model` is no such path."""
    err = _checkpoint_gone(model)
    if err is None:
        return None
    from harness.pairs import WARN_BROKEN_ENTRY_POINTS

    # (once per folder, by the campaign's process: its workers import the plugin too, silently)
    if WARN_BROKEN_ENTRY_POINTS[0] and str(model) not in _warned_missing:
        _warned_missing.add(str(model))
        print(f"warning: {err} Its pairs ({name}...) are registered, and each case of them cannot run until it is "
              "there.", file=sys.stderr)

    def build(case: Any, device: str) -> Any:
        raise UsageError(str(err))

    pair = TargetPair(name=name, kind="model", expected=expected, build=build,
                      trainer=lambda inp, rollout_outcome: Outcome(), rollout=lambda inp: Outcome(),
                      axes=axes or Axes(n_seqs=(1, 1), seq_len=(1, 1)), devices=devices, threshold=threshold,
                      timeout=timeout,
                      description=f"cannot run: no checkpoint at {str(model)!r}" + (f" ({description})" if description else ""))
    object.__setattr__(pair, "cannot_run", str(err))  # (`harness score --pair` says why, not "not a HF pair")
    return pair


def size_marks_of(spec: Any) -> dict[str, int]:
    """The sequence lengths past which a model computes otherwise, from its config: its attention's
    sliding window (where it is on: a Qwen2 config names one and leaves it off, `use_sliding_window`
    false) and a chunked attention's chunk. A campaign whose cases never pass one says so
    (`TargetPair.size_marks`): a window bug needs a sequence longer than the window."""
    try:
        f = spec.fields()
    except Exception:  # noqa: BLE001 - (a checkpoint folder that is gone: its pair cannot run anyway)
        return {}
    out = {}
    for key in ("sliding_window", "attention_chunk_size"):
        v = f.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0 and not (
                key == "sliding_window" and f.get("use_sliding_window") is False):
            out[key] = v
    return out


def _check_positions(name: str, case: Any, max_pos: int) -> None:
    """A case (a repro edited by hand, a plugin's own draw) whose longest sequence (a first token,
    its prompt and response) is past the model's max_position_embeddings: a setup error, as the axes
    are refused at registration; it had run positions the model was never built for."""
    if not max_pos:
        return
    prompts = case.prompt_lens or (0,) * len(case.seq_lens)
    longest = max((1 + p + s for p, s in zip(prompts, case.seq_lens)), default=0)
    if longest > max_pos:
        raise UsageError(f"{name}: this case has a sequence of {longest} tokens (a first token, its prompt and "
                         f"response), past the model's max_position_embeddings ({max_pos}): positions beyond it test "
                         "what the model was never built for. Give the case shorter prompt_lens / seq_lens (a repro "
                         "edited by hand?), or raise max_position_embeddings in the config.")


def hf_pair(name: str, model: Any, trainer: Numerics = FP32, rollout: Numerics = FP32, *,
            expected: str = "aligned", replay: bool = False, description: str = "", axes: Axes | None = None,
            devices: tuple[str, ...] = ("cpu", "cuda"), size_marks: dict[str, int] | None = None,
            threshold: float | None = None, timeout: float | None = None) -> TargetPair:
    """A trainer/rollout pair for a causal LM.

    model: an `HFModel`, a local checkpoint directory, or a config (dict with `model_type`, or a
    transformers config; built with `realistic_init`). trainer / rollout: each path's `Numerics`.
    replay: the trainer reuses the rollout's experts at every position (router replay).
    size_marks: sequence lengths (in positions) where your own kernels switch ({"splitkv_chunk": 64}),
    beside those the model's config gives (a sliding window, an attention chunk): a campaign whose
    cases never pass one says so (`TargetPair.size_marks`).
    threshold / timeout: the pair's own line and per-case timeout (`TargetPair.threshold`, `.timeout`;
    None: the campaign's `--threshold` / `--timeout`), e.g. a known, accepted gap judged at its own line.
    """
    gone = _missing_checkpoint(name, model, expected, description, devices, axes=axes, threshold=threshold,
                               timeout=timeout)
    if gone is not None:
        return gone
    spec = model_from(model)
    rollout = as_rollout(rollout)
    if replay and not spec.moe():
        _known_model_type(spec)
        raise UsageError(f"hf_pair {name!r}: replay=True needs a MoE model; this config has no experts.")
    moe_only = ("router", "experts")  # components a model without experts does not have
    # (packing and head rows differ by construction: the trainer packs and computes every position's
    # logits, the rollout runs a row per sequence and its head where it samples)
    differ = [k for k in COMPONENTS if k not in ("packing", "head_rows") and trainer.as_dict()[k] != rollout.as_dict()[k]]
    if differ and not spec.moe() and all(k in moe_only for k in differ):
        _known_model_type(spec)
        raise UsageError(f"hf_pair {name!r}: trainer and rollout differ only in {', '.join(differ)}, which MoE models "
                         "have (a router, experts); this model has no experts, so both paths would run the same "
                         "numerics and the pair would test nothing. Compare a component it has (body, lm_head, "
                         "attention, patch, ...), or give it a MoE model.")
    if not spec.moe():  # (BF16 says router bfloat16: on a dense model a component it does not have, so not a
        # difference its description or triage should show; triage swapping body and lm_head back would
        # otherwise leave a variant differing only there, which the check above refuses)
        rollout = rollout.replace(**{k: trainer.as_dict()[k] for k in moe_only})

    axes = axes or default_axes(spec)
    max_pos = int(spec.fields().get("max_position_embeddings") or 0)
    reach = getattr(axes, "prompt_len", (0, 0))[1] + axes.seq_len[1]  # prompt + response
    if getattr(axes, "max_context", None) is not None:
        reach = min(reach, axes.max_context)
    longest = 1 + reach  # first token + prompt + response
    if max_pos and longest > max_pos:
        raise UsageError(f"hf_pair {name!r}: its axes reach sequences of {longest} tokens (a first token, prompts up "
                         f"to {getattr(axes, 'prompt_len', (0, 0))[1]}, responses up to {axes.seq_len[1]}"
                         f"{'' if getattr(axes, 'max_context', None) is None else f', max_context {axes.max_context}'}"
                         f"), past the model's max_position_embeddings ({max_pos}): positions beyond it test what the "
                         f"model was never built for. Cap each sequence with max_context={max_pos - 1} in "
                         "default_axes(...) or Axes(...), lower max_prompt / max_response, or raise "
                         "max_position_embeddings in the config.")

    def build(case: Any, device: str) -> paths.HFInputs:
        _check_positions(name, case, max_pos)
        inp = paths.make_inputs(case, spec, device)
        expose_modules(inp, trainer, rollout)
        same_routers(name, inp, trainer, rollout, replay)
        return inp

    def run_rollout(inp: paths.HFInputs) -> Outcome:
        return paths.rollout(inp, rollout)

    def run_trainer(inp: paths.HFInputs, rollout_outcome: Outcome) -> Outcome:
        return paths.trainer(inp, rollout_outcome, trainer, replay=replay)

    def remake(t: Numerics, r: Numerics) -> TargetPair:
        return hf_pair(name, spec, t, r, expected=expected, replay=replay, description=description, axes=axes,
                       devices=devices, size_marks=size_marks, threshold=threshold, timeout=timeout)

    # (packing and head rows are the layout every HF pair's two paths differ by, the same values by contract:
    # named apart, so that they do not read as part of what a pair plants)
    diff = [f"{k} {trainer.as_dict()[k]} vs {rollout.as_dict()[k]}" for k in COMPONENTS
            if trainer.as_dict()[k] != rollout.as_dict()[k] and k not in LAYOUT_COMPONENTS]
    layout = [f"{k} {trainer.as_dict()[k]} vs {rollout.as_dict()[k]}" for k in LAYOUT_COMPONENTS
              if trainer.as_dict()[k] != rollout.as_dict()[k]]
    desc = description or ("trainer vs rollout: " + (", ".join(diff) if diff else "same numerics")
                           + (", router replay" if replay else "")
                           + (f" (layout, the same values by contract: {', '.join(layout)})" if layout else ""))
    return TargetPair(
        name=name, kind="model", expected=expected, build=build, trainer=run_trainer, rollout=run_rollout,
        axes=axes, devices=devices, description=desc, threshold=threshold, timeout=timeout,
        # (each sequence starts with a first token: paths.first_token)
        lead_tokens=1, size_marks={**size_marks_of(spec), **(size_marks or {})},
        # (a recording scored by `harness score --pair` is its engine's prompt as recorded: no first token)
        lead_tokens_for=_lead_tokens,
        weights=spec.fingerprint,  # (a checkpoint folder's files; a config-built model's config, init and seed)
        profiles=HFProfiles(trainer=trainer.as_dict(), rollout=rollout.as_dict(), labels=labels(trainer, rollout),
                            make=remake, model=spec, replay=replay),
    )


def _lead_tokens(case: Any) -> int:
    """An HF pair's tokens before each prompt: its first token (`paths.first_token`), except in a
    recorded rollout's case, whose prompt is used as recorded (`paths.make_inputs`)."""
    return 0 if paths.is_recorded(case) else 1


def _known_model_type(spec: Any) -> None:
    """Before saying a model has no experts: a config whose model_type transformers does not know
    reads as dense (nothing of experts in it is known), and that unknown type is the error to say."""
    from .backend import check_model_type

    check_model_type(spec.fields().get("model_type"))


def expose_modules(inp: paths.HFInputs, trainer: Numerics, rollout: Numerics) -> None:
    """The torch modules each path runs, for triage's per-module table (no rollout module when the
    rollout is a recording)."""
    from .backend import path_model

    inp.extra["modules"] = {
        "trainer": path_model(inp.spec, trainer.model_key, inp.device).model,
        "rollout": None if inp.recorded is not None else path_model(inp.spec, rollout.model_key, inp.device).model,
    }


_warned_routers: set[str] = set()


def same_routers(name: str, inp: paths.HFInputs, trainer: Numerics, rollout: Numerics, replay: bool) -> None:
    """The near-tie nudge and the tie floor change a router's input through the hooks on it
    (`backend.Runner`): on a path whose copy of the model has no router there to hook (a module patch
    that fused the MoE block and dropped its `gate`), they would change the other path's input
    alone, a divergence the harness made. Where the two copies' hooked routers differ, neither path's
    input is changed (said once per pair); router replay then has no rollout experts to replay, an error."""
    if inp.recorded is not None:  # (the rollout is a recording: no model of its own)
        return
    from .backend import path_model

    t = [layer for layer, _ in path_model(inp.spec, trainer.model_key, inp.device).gates]
    r = [layer for layer, _ in path_model(inp.spec, rollout.model_key, inp.device).gates]
    if t == r:  # (none on either: replay says so itself, naming the model class: paths.trainer)
        return
    what = (f"the trainer's copy of the model has hooked routers at {', '.join(t) or 'no layer'} and the rollout's at "
            f"{', '.join(r) or 'no layer'}")
    if replay and not r:  # (the pair's own definition: it cannot run, it is not a finding)
        raise UsageError(f"{name}: router replay: {what}, so the rollout records no experts to replay (a module patch "
                         "that replaces the MoE block must keep its router as a `gate` module with `top_k` and an "
                         "(experts, hidden) `weight` returning (logits, weights, experts)); run it without replay "
                         "(hf_pair(..., replay=False)).")
    inp.forced, inp.tie_layer, inp.tie_floor = None, -1, False
    if name not in _warned_routers:
        _warned_routers.add(name)
        print(f"warning: {name}: {what} (a module patch replaced some): near-tie inputs and the tie floor are off on "
              "both paths, so that neither path's router sees inputs the other's does not; flips are counted where "
              "both record a layer. Keep a patched MoE block's router as a `gate` module (`top_k`, an (experts, "
              "hidden) `weight`, returning (logits, weights, experts)) to have them.", file=sys.stderr, flush=True)


_warned_fingerprints: set[tuple[str, str]] = set()


def _check_fingerprint(spec: HFModel, recorded: Any) -> None:
    """A recording scored against one checkpoint and replayed against the folder's later contents
    (RL runs overwrite checkpoints) compares other weights: say so, once per folder."""
    if not recorded or not spec.path:
        return
    now = spec.fingerprint()
    if now != recorded and (spec.path, now) not in _warned_fingerprints:
        _warned_fingerprints.add((spec.path, now))
        print(f"warning: the checkpoint at {spec.path} is not the one these recordings were scored with (weights "
              f"fingerprint {recorded} then, {now} now): the trainer now runs other weights, so its values differ "
              "from the recorded ones for that reason alone. Restore that checkpoint to replay the finding.",
              file=sys.stderr, flush=True)


def recorded_pair(name: str, fallback: HFModel, trainer: Numerics = FP32.replace(head_rows="scored"),
                  replay: bool = False) -> TargetPair:
    """The pair `harness score --model PATH` scores with: the checkpoint is named by each case
    (`params.rec_model`), the rollout side is the recording the case carries, the trainer runs
    `trainer` numerics (with router replay of the recorded experts when `replay`): by default
    transformers' float32 forward with the LM head at the scored rows only (a recording's prompt of
    thousands of tokens costs no (positions, V) logits; the reference has no row-count kernel to test).

    Fuzzed (a case without a recording), it records `fallback`'s float32 rollout of the case and
    scores that: the record -> score round trip must stay clean (aligned)."""

    def build(case: Any, device: str) -> paths.HFInputs:
        if paths.recorded_sample(case) is not None:
            where = case.params.get("rec_model")
            spec = HFModel.from_pretrained(str(where)) if where else fallback
            _check_fingerprint(spec, case.params.get("rec_model_id"))
            inp = paths.make_inputs(case, spec, device)
            expose_modules(inp, trainer, FP32)
            return inp
        # a fuzz case: record the fallback model's float32 rollout of it, then score that recording
        # (no near-tie nudges: a recording is scored as it is, by the model alone)
        inp = paths.make_inputs(case.replace(tie_fraction=0.0), fallback, device)
        inp.tie_floor = False
        recs = paths.records(inp, paths.rollout(inp, as_rollout(FP32)))
        recorded = case.replace(params={**case.params, **paths.encode_recorded(recs)})
        inp = paths.make_inputs(recorded, fallback, device)
        expose_modules(inp, trainer, FP32)
        return inp

    def run_trainer(inp: paths.HFInputs, rollout_outcome: Outcome) -> Outcome:
        return paths.trainer(inp, rollout_outcome, trainer, replay=replay)

    def remake(t: Numerics, r: Numerics) -> TargetPair:
        return recorded_pair(name, fallback, t, replay)

    return TargetPair(
        name=name, kind="model", expected="aligned", build=build, trainer=run_trainer,
        rollout=lambda inp: paths.rollout(inp, as_rollout(FP32)),
        axes=dataclasses.replace(default_axes(fallback), routing=None, params={}), devices=("cpu", "cuda"),
        description="recorded rollouts (harness score --model PATH): the checkpoint's float32 trainer scores them"
                    + (" with the recorded experts replayed" if replay else ""),
        profiles=HFProfiles(trainer=trainer.as_dict(), rollout=as_rollout(FP32).as_dict(), labels=dict(COMPONENTS),
                            make=remake, model=None, replay=replay),
    )


def hf_pairs(prefix: str, model: Any, bf16_expected: str = "diverges", axes: Axes | None = None,
             base: Numerics = FP32, size_marks: dict[str, int] | None = None) -> list[TargetPair]:
    """The standard set for one model: `<prefix>.aligned` (float32 both sides),
    `<prefix>.bf16_rollout` (float32 trainer vs bf16 engine), `<prefix>.bf16_rollout.replay` (the same
    with router replay; MoE models only), `<prefix>.eager_vs_sdpa` (attention implementations, float32;
    only where `base` uses sdpa).
    `axes`: every pair's (default: `default_axes(model)`). `base`: the float32 numerics both paths
    start from, for a model that needs other settings: gpt-oss and Gemma 2 have no sdpa attention
    (`FP32.replace(attention="eager")`), and a model whose packed forward leaks across sequences
    needs `packing="per_sequence"` (the trainer's only). `size_marks`: as `hf_pair`'s, for every pair."""
    if _checkpoint_gone(model) is not None:
        # (MoE-ness unknown: the replay pair too, so a MoE model's repros of it say its folder is gone)
        names = ["aligned", "bf16_rollout", "bf16_rollout.replay"] + (["eager_vs_sdpa"] if base.attention == "sdpa"
                                                                      else [])
        return [_missing_checkpoint(f"{prefix}.{n}", model, "aligned" if n in ("aligned", "eager_vs_sdpa") else
                                    bf16_expected, axes=axes) for n in names]
    spec = model_from(model)
    if not isinstance(base, Numerics):
        raise UsageError(f"hf_pairs(base=...) must be a Numerics (e.g. FP32.replace(attention=\"eager\")), got "
                         f"{type(base).__name__}")
    bf16 = base.replace(body="bfloat16", router="bfloat16", lm_head="bfloat16", packing=FP32.packing)
    pairs = [
        hf_pair(f"{prefix}.aligned", spec, base, base.replace(packing=FP32.packing), expected="aligned", axes=axes,
                size_marks=size_marks,
                description="float32 both sides: packed teacher-forced trainer vs KV-cache decode rollout"),
        hf_pair(f"{prefix}.bf16_rollout", spec, base, bf16, expected=bf16_expected, axes=axes,
                size_marks=size_marks, description="float32 trainer vs a bf16 engine (weights, activations, "
                            + ("router, " if spec.moe() else "") + "LM head)"),
    ]
    if base.attention == "sdpa":
        pairs.append(hf_pair(f"{prefix}.eager_vs_sdpa", spec, base.replace(attention="eager"),
                             base.replace(packing=FP32.packing), expected="aligned", axes=axes,
                             size_marks=size_marks, description="eager attention (trainer) vs sdpa (rollout), float32"))
    if spec.moe():
        pairs.append(hf_pair(f"{prefix}.bf16_rollout.replay", spec, base, bf16, replay=True,
                             expected=bf16_expected, axes=axes, size_marks=size_marks,
                             description="bf16 engine with router replay: flips gone, the precision gap remains"))
    return pairs
