"""Full-model target pairs: one small Qwen3-MoE-style decoder run as a trainer and as a rollout engine.

Both paths use the same weights (drawn from the case's seed, cached per (config, seed)) and the same
modules; each runs its own numerics profile (`moe_decoder.Numerics`). The pairs:

- `model.aligned`: float32 on both sides. Not bitwise: the packed forward, the padded prefill and
  the 1..4-row decode GEMMs round differently in the last float32 bits, so k3 is ~1e-13 (median)
  to ~3e-11 (max), far under the threshold. Exact router ties would flip on those bits, which is
  why the near-tie construction keeps gaps >= `paths.TIE_FLOOR`.
- `model.bf16_rollout`: a float32 trainer vs a bf16 engine (activations, router GEMM, MoE
  aggregation, LM head and KV cache in bf16).
- `model.bf16_rollout.replay`: the same, with router replay (the trainer reuses the rollout's
  experts): flips are gone, the aggregation and activation precision gap is not.
- `model.moe_aggregate_bf16`: float32 everywhere except the rollout's MoE aggregation (weighting,
  summing and the residual add in bf16), the seeds' Qwen MoE case.
- `model.packing_positions_bug`: both sides bf16 with bf16 rotary; the trainer's packed rows let
  positions run on across sequences instead of restarting (a planted bug, a `diverges` demonstration).

Every pair exposes its profiles (`ModelProfiles`, the triage protocol of `harness.triage`) so
`harness triage` can swap one component at a time, and its torch modules, so it gets the
per-module table. Backends (`targets/backends/`) reuse `model_pair` with another rollout forward.

On `--device cuda` the pairs run the LARGE config (vocab 151936, hidden 2048, 64 experts top-8, 400
unscored context tokens per sequence: up to ~4k tokens per case); the case's `n_experts`/`top_k`
fields name the CPU config's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from hypothesis import strategies as st

from harness import Axes, Outcome, RoutingAxes, TargetPair, register

from . import paths
from .moe_decoder import BF16_ENGINE, COMPONENTS, FP32, LARGE, TINY, ModelConfig, Numerics, check_numerics, model, \
    weight_seed

CONFIGS: dict[str, ModelConfig] = {"cpu": TINY, "cuda": LARGE}  # device -> model config

AXES = Axes(
    n_seqs=(1, 8),  # batch size
    seq_len=(1, 64),  # response tokens per sequence, each decoded from the KV cache and scored
    prompt_len=(0, 32),  # prompt tokens per sequence (after BOS), prefilled
    packing=True,  # trainer row capacity (prompt + response) and packing order
    pad_sides=("right", "left"),  # the rollout's padding side (left: what engines do)
    routing=RoutingAxes(n_experts=(TINY.experts, TINY.experts), top_k=(TINY.top_k, TINY.top_k), max_gap=1e-2,
                        tie_fraction=(0.0, 1.0)),  # tokens forced to the top-k boundary at a drawn layer
    logit_scale=(1.0, 8.0),  # peakedness: output entropy from ~6 nats down to ~1-2
    temperature=(0.5, 2.0),  # sampling temperature, applied on both paths
    top_p=(0.8, 1.0),  # nucleus sampling (1.0: off)
    sample_top_k=(0, 64),  # sampling top-k (0: off)
    dtypes=("bfloat16",),
    params={
        "tie_layer": st.integers(0, TINY.layers - 1),  # the layer whose router sees the near-tie inputs
    },
)


def build(case: Any, device: str) -> paths.ModelInputs:
    cfg = CONFIGS[device]
    return paths.make_inputs(case, cfg, device, weight_seed(cfg, case.seed))


def torch_forward(inp: paths.ModelInputs) -> Callable:
    """The eager torch model for the case's config and weights (built once per (config, seed))."""
    return model(inp.cfg, inp.weight_seed, inp.device)


@dataclass(frozen=True)
class ModelProfiles:
    """The triage protocol (`harness.Profiles`, with `Numerics`) for a model pair: both paths' numerics
    profiles, the label of every component, and a way to rebuild the pair with other profiles."""

    trainer: Mapping[str, str]  # component -> setting of the trainer path
    rollout: Mapping[str, str]  # component -> setting of the rollout path
    labels: Mapping[str, str]  # component -> the name a person knows it by
    make: Callable[[Numerics, Numerics], TargetPair]  # (trainer numerics, rollout numerics) -> pair

    def variant(self, trainer: Mapping[str, str], rollout: Mapping[str, str]) -> TargetPair:
        return self.make(check_numerics(Numerics(**trainer)), check_numerics(Numerics(**rollout)))


def model_pair(name: str, expected: str, trainer_nx: Numerics, rollout_nx: Numerics, description: str,
               replay: bool = False, axes: Axes = AXES,
               rollout_forward: Callable[[paths.ModelInputs, Numerics], Callable] | None = None,
               devices: tuple[str, ...] = ("cpu", "cuda")) -> TargetPair:
    """A model pair: the torch trainer (packed, teacher-forced) vs a rollout (padded, KV-cache decode).

    `rollout_forward(inputs, numerics)` returns the forward the rollout drives (default: the eager
    torch model); backends pass their own. The pair's `profiles` rebuild it with other numerics.
    """
    check_numerics(trainer_nx)
    check_numerics(rollout_nx)

    def get_forward(inp: paths.ModelInputs) -> Callable:
        return rollout_forward(inp, rollout_nx) if rollout_forward else torch_forward(inp)

    def rollout(inp: paths.ModelInputs) -> Outcome:
        return paths.rollout(inp, get_forward(inp), rollout_nx)

    def trainer(inp: paths.ModelInputs, rollout_outcome: Outcome) -> Outcome:
        return paths.trainer(inp, rollout_outcome.tokens, torch_forward(inp), trainer_nx,
                             replay=rollout_outcome.routing if replay else None)

    def build_pair(case: Any, device: str) -> paths.ModelInputs:
        inp = build(case, device)
        m = torch_forward(inp)
        inp.extra["modules"] = {"trainer": m, "rollout": None if rollout_forward else m}
        return inp

    def remake(t: Numerics, r: Numerics) -> TargetPair:
        return model_pair(name, expected, t, r, description, replay, axes, rollout_forward, devices)

    return TargetPair(
        name=name, kind="model", expected=expected, build=build_pair, trainer=trainer, rollout=rollout, axes=axes,
        devices=devices, description=description,
        profiles=ModelProfiles(trainer=trainer_nx.as_dict(), rollout=rollout_nx.as_dict(),
                               labels={c: label for c, (_, label) in COMPONENTS.items()}, make=remake),
    )


ROPE_BF16 = FP32.replace(rotary="bfloat16")  # float32 except the rotary tables and rotation

# Left-padding position bugs need long prompts: bf16 rotary rounding differs visibly only when the pad
# shifts positions by ~100 (k3 ~1e-4 at a shift of 64, up to 0.15 at 128); responses stay short.
AXES_LONG_PROMPTS = dataclasses.replace(AXES, n_seqs=(1, 4), seq_len=(1, 16), prompt_len=(0, 128),
                                        logit_scale=(1.0, 16.0))

PAIRS = [
    model_pair("model.aligned", "aligned", FP32, FP32,
               description="float32 on both sides: packed teacher-forced trainer vs padded KV-cache rollout"),
    model_pair("model.bf16_rollout", "diverges", FP32, BF16_ENGINE,
               description="float32 trainer vs bf16 rollout engine (activations, router, MoE aggregation, "
                           "LM head, KV cache)"),
    model_pair("model.bf16_rollout.replay", "diverges", FP32, BF16_ENGINE, replay=True,
               description="router replay (trainer reuses the rollout's experts) does not close the bf16 "
                           "aggregation/activation gap"),
    model_pair("model.moe_aggregate_bf16", "diverges", FP32, FP32.replace(moe_aggregate="bfloat16"),
               description="only the MoE aggregation differs: expert outputs weighted and summed in bf16 "
                           "(rollout) vs float32 (trainer)"),
    model_pair("model.packing_positions_bug", "diverges", ROPE_BF16.replace(positions="run_on"), ROPE_BF16,
               description="planted bug: packed positions run on across sequences (bf16 rotary makes it "
                           "visible; the fixed twin is model.rotary_bf16)"),
    model_pair("model.kv_cache_late_fp8", "diverges", FP32, FP32.replace(kv_late="float8_e5m2"),
               description="planted bug: the rollout's KV cache stores keys and values of positions >= 32 in "
                           "fp8 e5m2 (the fixed twin is model.aligned)"),
    model_pair("model.sampling_top_k_default", "diverges", FP32, FP32.replace(sampling="top_k_50"),
               description="the rollout samples from a top-k 50 truncated distribution (an engine default) while "
                           "the trainer scores the full one"),
    model_pair("model.temperature_twice", "diverges", FP32, FP32.replace(sampling="temperature_twice"),
               description="planted bug: the rollout divides the logits by the temperature twice"),
    model_pair("model.rotary_bf16", "aligned", ROPE_BF16, ROPE_BF16,
               axes=AXES_LONG_PROMPTS,
               description="float32 model with bf16 rotary tables on both sides, positions from each "
                           "sequence's first token (the fixed twin of model.left_pad_positions)"),
    model_pair("model.left_pad_positions", "diverges", ROPE_BF16, ROPE_BF16.replace(positions="pad_start"),
               axes=AXES_LONG_PROMPTS,
               description="planted bug: left-padded rollout rows count rotary positions from the pad start "
                           "instead of the first real token (bf16 rotary makes it visible)"),
]
for _pair in PAIRS:
    register(_pair)
