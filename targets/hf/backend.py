"""The Hugging Face transformers backend: any causal LM transformers builds, run as a trainer and as a
rollout engine at identical weights.

Nothing here imports transformers at import time: `harness list` stays fast (importing
transformers costs ~1 s, a model class ~3.6 s on this CPU). The model is loaded when a pair first
builds a case, then cached per (model, numerics).

A case is an RL batch. Sequence j is `[t0] + prompt_j + response_j`: t0 is a token from the
sequence's own stream (`paths.first_token`), the prompt has `case.prompt_lens[j]` tokens from
`case.prompt_tokens(j, vocab, "prompt")`, the response
`case.seq_lens[j]` tokens, each decoded by the rollout and scored by the trainer. Outcome rows are
the response tokens in case order.

- **Rollout** (`rollout`): the prompts left-padded into one batch, one prefill forward, then a KV-cache
  decode loop of our own (not `generate`, whose default top_k=50 applies even when the generation
  config shows None): each step's logits (float32) go through the case's temperature / top-k /
  top-p, and a token is drawn by inverse CDF from that sequence's own CPU uniforms
  (`case.seq_generator(j, "sample")`), so the tokens are a function of the case alone. The
  log-probabilities reported are those of the distribution sampled from.
- **Trainer** (`trainer`): the full sequences packed into rows (`case.packed_rows()`, packing
  order from the case), position ids restarting at 0 for every sequence, one teacher-forced forward
  with `attention_mask=None` and `use_cache=False`. transformers only builds the block-diagonal
  (per-sequence) mask from restarting positions when no cache exists, and a causal-LM forward builds
  a cache by default even in train mode: leave `use_cache` at its default (`Numerics(use_cache=
  "default")`) and packed sequences attend to each other (packed vs alone differed by 0.54 in
  logits). Padding at the end of a row is its own fake sequence (positions from 0), never attended.
  `Numerics(packing="per_sequence")` gives every sequence a row of its own: models with
  linear-attention layers (Qwen3-Next, MiniMax) carry state across packed sequences in
  transformers' forward, so their packed trainer diverges from the rollout on any multi-sequence
  row, and triage names `packing`.
- **Routers** (MoE models): forward hooks on every router module (`*.mlp.gate`) record, per token
  position, the experts chosen and the router logits (`Outcome.routing["layers.i"]`, for the
  position whose output scores each response token), cast the router's input to its own dtype
  (`Numerics.router`), nudge the router input of a drawn layer so a drawn fraction of positions sit
  at the top-k boundary with the case's gap (near ties; the gap gets a floor of 1e-5, below which
  float32 layout noise breaks exact ties differently), and replay recorded experts (router replay:
  the trainer reuses the rollout's experts at every position, prompt included, and re-weights
  them from its own router logits).

Numerics (`Numerics`, one per path): body dtype (weights and activations), router dtype, LM-head
dtype, attention implementation (eager / sdpa), experts implementation (eager / grouped_mm /
batched_mm), a module patch (`register_patch`: modules of your own swapped into that path's copy
of the model), and, for the trainer only, whether the packed forward passes `use_cache=False`. Each
pair exposes both profiles in the triage protocol (`HFProfiles`), so `harness triage` swaps one
component at a time.

Recorded rollouts (`harness score`): a case may carry a recorded sample in its params (prompt ids,
response ids, the rollout's per-token log-probs, optionally routed experts); the rollout path then
returns the recording instead of decoding, and both paths report two-outcome rows ({the sampled
token, everything else}): k3 and the other per-token metrics are exact, `kl` is the KL of that
coarsening (a lower bound of the exact KL).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from harness.case import NEUTRAL, PENALTIES
from harness.errors import UsageError
from harness.pairs import KEPT_POSITIONS, SAMPLING_AXES
from harness.sampling import process_logits  # (one sampler for every pair)

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("eager", "sdpa")
EXPERTS = ("eager", "grouped_mm", "batched_mm")
USE_CACHE = ("off", "default")
PACKING = ("packed", "per_sequence")
HEAD_ROWS = ("all", "scored")
LOGPROBS = ("processed", "raw")
TIE_FLOOR = 1e-5  # smallest near-tie gap: below it fp32 layout noise breaks ties differently on each path
RECORDED_KEYS = ("rec_prompt", "rec_response", "rec_logprobs")  # case params holding a recorded sample

# name -> module patch: your own modules swapped into a path's model (`register_patch`)
PATCHES: dict[str, Callable[[Any], Any]] = {}
NO_PATCH = "none"
SAMPLERS: dict[str, Callable[..., Any]] = {}
EXACT_SAMPLER = "exact"  # `process_logits`: temperature, then top-k, then top-p, normalised

# component -> what a person calls it (the triage labels)
COMPONENTS = {
    "body": "model dtype (weights, activations, attention, experts)",
    "router": "router precision",
    "lm_head": "LM head precision",
    "attention": "attention implementation",
    "experts": "experts implementation",
    "use_cache": "use_cache in the packed trainer forward (block-diagonal mask)",
    "packing": "trainer packing (sequences packed into shared rows, or one sequence per row)",
    "head_rows": "LM-head rows (every position of the forward, or only those that score response tokens)",
    "patch": "module patch (modules of your own swapped in: register_patch)",
    "sampler": "sampler (the log-probabilities a path reports from its logits: register_sampler)",
    "logprobs": "reported log-probs (of the processed distribution sampled from, or the raw one: vLLM's logprobs_mode)",
}


# the components every HF pair's two paths differ by in layout only (the trainer packs sequences and projects
# every position; the rollout runs each sequence and scores its response): the same values by contract
LAYOUT_COMPONENTS = ("packing", "head_rows")


def register_patch(name: str, fn: Callable[[Any], Any] | None = None) -> Any:
    """Register a module patch under `name`, for `Numerics(patch=name)`; usable as a decorator.

    `fn(model)` receives one path's copy of the model (a transformers causal LM, already on the
    path's device and in its dtypes) and changes it in place (or returns a replacement): swap the MoE
    blocks for your engine's fused kernel, the attention for your own, a module for a quantized one.
    It must be deterministic: every case of the pair runs on that copy, and a repro replays it. Each
    path gets its own copy, so a patch on the rollout leaves the trainer as it was; triage swaps the
    patch off (`none`) like any other component. Routers are hooked after the patch: a patched MoE
    block that keeps its `gate` module keeps its routing (flips, near ties, replay).

        @register_patch("fused_moe")
        def fused_moe(model):
            for layer in model.model.layers:
                layer.mlp.experts = MyFusedExperts(layer.mlp.experts)

        register(hf_pair("mine.fused_moe", CHECKPOINT, FP32, FP32.replace(patch="fused_moe")))
    """
    if not isinstance(name, str) or not name or name == NO_PATCH or not name.replace("_", "a").replace(".", "a").replace(
            "-", "a").isalnum():
        raise UsageError(f"register_patch: {name!r} is not a usable patch name; use letters, digits, '_', '-' or '.' "
                         f"(and not {NO_PATCH!r}, which means no patch).")

    def add(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
        if not callable(f):
            raise UsageError(f"register_patch({name!r}): the patch must be a function taking the model; got "
                             f"{type(f).__name__}.")
        if PATCHES.get(name, f) is not f and _where(PATCHES[name]) != _where(f):  # the same def again: fine
            raise UsageError(f"register_patch: a different patch is already registered as {name!r} "
                             f"({_where(PATCHES[name])}); pick another name.")
        PATCHES[name] = f
        return f

    return add(fn) if fn is not None else add


@dataclass(frozen=True)
class Sampling:
    """A case's sampling parameters (`current_sampling()`): what the rollout samples with, after the
    forward (the penalties first, then temperature, then min-p, then top-k, then top-p;
    `harness.sampling.process_logits`)."""

    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # 1.0: off (penalties: `harness.sampling.penalize`, by each row's history)
    presence_penalty: float = 0.0  # 0.0: off
    frequency_penalty: float = 0.0  # 0.0: off

    @classmethod
    def of(cls, case: Any) -> "Sampling":
        """The sampling parameters of a case (neutral where it has none: an op case of schema 1)."""
        value = {k: getattr(case, k, NEUTRAL[k]) for k in SAMPLING_AXES}
        return cls(float(value["temperature"]), int(value["sample_top_k"]), float(value["top_p"]),
                   **{k: float(value[k]) for k in ("min_p", *PENALTIES)})

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (then the paths need each row's token history)."""
        return any(getattr(self, k) != NEUTRAL[k] for k in PENALTIES)

    def extras(self) -> dict[str, float]:
        """The settings past the four positional ones, by keyword, with their neutral values."""
        return {k: getattr(self, k) for k in ("min_p", *PENALTIES)}


NEUTRAL_SAMPLING = Sampling(1.0, 0, 1.0)  # (the head check's forwards: no case)
EXTRA_NEUTRAL = NEUTRAL_SAMPLING.extras()
# sampler name -> the keywords past (logits, temperature, top_k, top_p) it takes: min_p, the penalties and their
# history (`seen`, `counts`); None: any (**kwargs)
SAMPLER_KEYWORDS: dict[str, frozenset | None] = {}
HISTORY_KEYWORDS = ("seen", "counts")


def _keywords(f: Callable[..., Any]) -> frozenset | None:
    import inspect

    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):  # (a builtin without a signature: the four positional arguments only)
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.name in (*EXTRA_NEUTRAL, *HISTORY_KEYWORDS))


def register_sampler(name: str, fn: Callable[..., Any] | None = None) -> Any:
    """Register a sampler under `name`, for `Numerics(sampler=name)`; usable as a decorator.

    `fn(logits, temperature, top_k, top_p)` receives a path's float32 (N, V) logits and the case's
    sampling parameters (`top_k` 0 and `top_p` 1.0: off) and returns the (N, V) log-probabilities
    the path reports: an engine's own sampler (its temperature, top-k and top-p code, its
    normalisation), where the default (`exact`, `process_logits`) applies the penalties, then
    temperature, then min-p, then top-k, then top-p, and normalises. A sampler with keyword
    parameters `min_p`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `seen`, `counts`
    (or `**kwargs`) gets those it names: the case's min-p and penalties (neutral: 0.0, 1.0, 0.0, 0.0)
    and, where a penalty is on, each row's token history (`harness.sampling.history`: `seen` (N, V)
    bool, the prompt's and the output's tokens so far; `counts` (N, V), the output's). One without
    a keyword runs only the cases where its setting is neutral (a pair whose axes draw it fails such
    a case saying what to add). The rollout draws its tokens from what it returns (normalised for the
    draw); the trainer scores with it. It must be deterministic, and -inf marks a token it excludes.
    Triage swaps the sampler back to `exact` like any other component.

        @register_sampler("temperature_after_softmax")
        def late_temperature(logits, temperature, top_k, top_p):
            return torch.log_softmax(logits, -1) / temperature   # an engine that scales the log-probs

        register(hf_pair("mine.sampler", CHECKPOINT, FP32, FP32.replace(sampler="temperature_after_softmax")))
    """
    if not isinstance(name, str) or not name or name == EXACT_SAMPLER or not name.replace("_", "a").replace(
            ".", "a").replace("-", "a").isalnum():
        raise UsageError(f"register_sampler: {name!r} is not a usable sampler name; use letters, digits, '_', '-' or "
                         f"'.' (and not {EXACT_SAMPLER!r}, which means the harness's own).")

    def add(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise UsageError(f"register_sampler({name!r}): the sampler must be a function (logits, temperature, top_k, "
                             f"top_p) -> log-probabilities; got {type(f).__name__}.")
        if SAMPLERS.get(name, f) is not f and _where(SAMPLERS[name]) != _where(f):
            raise UsageError(f"register_sampler: a different sampler is already registered as {name!r} "
                             f"({_where(SAMPLERS[name])}); pick another name.")
        SAMPLERS[name] = f
        SAMPLER_KEYWORDS[name] = _keywords(f)
        return f

    return add(fn) if fn is not None else add


def path_logprobs(nx: "Numerics", logits: Any, sampling: Sampling, seen: Any = None, counts: Any = None) -> Any:
    """The (N, V) float32 log-probabilities a path reports from its (N, V) logits: its sampler's.
    `seen`, `counts`: each row's token history (`harness.sampling.history`), where a penalty is on."""
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    extras = sampling.extras()
    history = {"seen": seen, "counts": counts} if sampling.penalized else {}
    if nx.sampler == EXACT_SAMPLER:
        return process_logits(logits, temperature, top_k, top_p, **extras, **history)
    import torch

    fn = SAMPLERS[nx.sampler]
    takes = SAMPLER_KEYWORDS.get(nx.sampler, frozenset())
    given = {k: v for k, v in {**extras, **history}.items() if takes is None or k in takes}
    missing = [k for k, v in extras.items() if v != EXTRA_NEUTRAL[k] and takes is not None and k not in takes]
    missing += [k for k in history if takes is not None and k not in takes]
    if missing:
        on = ", ".join(f"{k} {v:g}" for k, v in extras.items() if v != EXTRA_NEUTRAL[k])
        raise UsageError(f"sampler {nx.sampler!r} ({_where(fn)}) takes no {', '.join(missing)}, and this case samples "
                         f"with {on}: add {', '.join(f'a `{k}=...` parameter' for k in missing)} to it and apply "
                         f"{'them' if len(missing) > 1 else 'it'} (or `**kwargs`: it is given min_p, the penalties "
                         "and, where one is on, each row's token history `seen` and `counts`), or keep the pair's axes "
                         "at their neutral values.")
    out = fn(logits, temperature, top_k, top_p, **given)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(logits.shape) or not out.is_floating_point():
        got = f"a {type(out).__name__}" if not isinstance(out, torch.Tensor) else \
            f"a {out.dtype} tensor of shape {tuple(out.shape)}"
        raise UsageError(f"sampler {nx.sampler!r} ({_where(fn)}) returned {got} for logits of shape "
                         f"{tuple(logits.shape)}; a sampler returns floating-point log-probabilities of the logits' shape "
                         "(one row per row, -inf for a token it excludes).")
    return out.float()


def reported_logprobs(nx: "Numerics", logits: Any, processed: Any) -> Any:
    """What a path reports for rows whose sampling distribution is `processed`: those log-probs, or
    (`Numerics.logprobs="raw"`) the unprocessed logits' float32 log-softmax."""
    if nx.logprobs == "processed":
        return processed
    import torch

    return torch.log_softmax(logits.float(), dim=-1)


def _where(f: Any) -> str:
    """Where a function is defined (its file, or module, name and line): two lambdas of one file differ,
    and one file imported under two module names (a plugin another plugin imports) is the same def."""
    code = getattr(f, "__code__", None)
    where = code.co_filename if code is not None and code.co_filename else getattr(f, "__module__", "?")
    return f"{where}: {getattr(f, '__qualname__', '?')}" + (f" (line {code.co_firstlineno})" if code is not None else "")


@dataclass(frozen=True)
class Numerics:
    """How one path runs the model. Every field is a component triage can swap."""

    body: str = "float32"  # dtype of the weights and activations (DTYPES)
    router: str = "float32"  # dtype the router GEMM runs in (input cast to it; DTYPES)
    lm_head: str = "float32"  # dtype of the LM head GEMM (input cast to it; logits then float32)
    attention: str = "sdpa"  # transformers attention implementation: "eager" or "sdpa"
    experts: str = "eager"  # transformers experts implementation (MoE models): "eager", "grouped_mm", "batched_mm"
    use_cache: str = "off"  # trainer only: "off" passes use_cache=False; "default" leaves it (the packed-mask trap)
    patch: str = NO_PATCH  # a module patch registered with `register_patch`, applied to this path's model copy
    packing: str = "packed"  # trainer only: "packed" (the case's packed rows) or "per_sequence" (one sequence per row)
    # the rows the LM head runs on: "all" (every position of the forward, as a trainer that computes the
    # whole packed batch's logits; a head kernel that changes with the row count is tested), or
    # "scored" (only the positions whose outputs are read, as an engine's prefill, or a trainer with a
    # fused head: (positions, V) logits of long prompts never exist). A rollout is always "scored".
    head_rows: str = "all"
    sampler: str = EXACT_SAMPLER  # the log-probabilities a path reports from its logits (register_sampler)
    # what the path reports: "processed", the log-probabilities of the distribution its sampler returns (and a
    # rollout draws from), or "raw", those of the unprocessed logits (log-softmax, no temperature, cut or penalty:
    # vLLM's default logprobs_mode) while a rollout still draws from its sampler's distribution
    logprobs: str = "processed"

    def __post_init__(self) -> None:
        for name, allowed in (("body", DTYPES), ("router", DTYPES), ("lm_head", DTYPES), ("attention", ATTENTION),
                              ("experts", EXPERTS), ("use_cache", USE_CACHE), ("packing", PACKING),
                              ("head_rows", HEAD_ROWS), ("logprobs", LOGPROBS)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"Numerics.{name}={getattr(self, name)!r} is not one of {allowed}; pick one of those.")
        if self.patch != NO_PATCH and self.patch not in PATCHES:
            known = ", ".join(sorted(PATCHES)) or "none registered"
            raise UsageError(f"Numerics.patch={self.patch!r} is not a registered patch ({known}); register it with "
                             "targets.hf.register_patch(name, fn) before building the Numerics that name it (in a "
                             "plugin: above the hf_pair call), or use patch='none'.")
        if self.sampler != EXACT_SAMPLER and self.sampler not in SAMPLERS:
            known = ", ".join(sorted(SAMPLERS)) or "none registered"
            raise UsageError(f"Numerics.sampler={self.sampler!r} is not a registered sampler ({known}); register it "
                             "with targets.hf.register_sampler(name, fn) before building the Numerics that name it, or "
                             f"use sampler={EXACT_SAMPLER!r}.")

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def replace(self, **changes: str) -> "Numerics":
        return dataclasses.replace(self, **changes)

    @property
    def model_key(self) -> tuple:
        """The fields that change the model object (use_cache, packing and head_rows only change the call)."""
        return tuple(getattr(self, f) for f in MODEL_FIELDS)

    @classmethod
    def from_model_key(cls, key: tuple) -> "Numerics":
        return cls(**dict(zip(MODEL_FIELDS, key)))


MODEL_FIELDS = ("body", "router", "lm_head", "attention", "experts", "patch")  # Numerics.model_key


def as_rollout(nx: Numerics) -> Numerics:
    """A rollout's profile: it runs every sequence in a row of its own (a left-padded batch, KV-cache
    decode) and its LM head only where it samples (each prompt's last position in the prefill, as
    engines do), and its profile says so, so the trainer's packing and head rows are differences
    triage can swap."""
    return nx.replace(packing="per_sequence", head_rows="scored")


FP32 = Numerics()
BF16 = Numerics(body="bfloat16", router="bfloat16", lm_head="bfloat16")  # a bf16 engine


# ---------------------------------------------------------------------------------------------
# Where a model comes from
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _fingerprint(files: tuple[tuple[str, int, int], ...]) -> str:
    """`HFModel.fingerprint` of (path, size, mtime) per file: config.json whole, weights by name,
    size and first and last MiB."""
    h = hashlib.sha256()
    for name, size, _ in files:
        h.update(f"{Path(name).name}:{size}".encode())
        with open(name, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), 2)
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class HFModel:
    """A causal LM: built from a config (with `realistic_init`) or loaded from a local checkpoint
    directory (`from_pretrained(..., local_files_only=True)`: nothing is ever downloaded)."""

    key: str  # stable identity: "config:<sha>" or "path:<absolute path>"
    config_json: str = ""  # the config fields as canonical JSON (config-built models)
    path: str = ""  # checkpoint directory (loaded models)
    init: str = "realistic"  # config-built: "realistic" (configs.realistic_init) or "default" (transformers')
    init_seed: int = 0  # seed of the realistic init

    @classmethod
    def from_config(cls, config: Any, init: str = "realistic", init_seed: int = 0) -> "HFModel":
        """`config`: a dict with `model_type` and config fields, or a transformers config object."""
        fields = config if isinstance(config, Mapping) else config.to_dict()
        fields = {k: v for k, v in dict(fields).items() if not k.startswith("_")}
        if "model_type" not in fields:
            raise UsageError("HFModel.from_config needs a `model_type` (e.g. 'qwen3_moe', 'llama'); add it to the "
                             "config dict or pass a transformers config object.")
        if init not in ("realistic", "default"):
            raise UsageError(f"HFModel init={init!r}: use 'realistic' (peaked outputs) or 'default' (transformers').")
        text = json.dumps(fields, sort_keys=True, default=str)
        return cls(key="config:" + hashlib.sha256(f"{text}|{init}|{init_seed}".encode()).hexdigest()[:16],
                   config_json=text, init=init, init_seed=int(init_seed))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "HFModel":
        """A local checkpoint directory (config.json + weights). Checked now, loaded on first use."""
        p = Path(path).expanduser()
        if p.is_file() and (p.parent / "config.json").is_file():
            raise UsageError(f"{str(path)!r} is a file of a checkpoint; pass its folder, {str(p.parent)!r} (the folder "
                             "`model.save_pretrained(...)` wrote: config.json with the weights beside it).")
        if not (p / "config.json").is_file():
            raise UsageError(f"{str(path)!r} is not a checkpoint directory (no config.json there); pass a folder "
                             "written by `model.save_pretrained(...)` (nothing is downloaded).")
        return cls(key=f"path:{p.resolve()}", path=str(p.resolve()), init="default")

    def fingerprint(self) -> str:
        """16 hex digits naming a checkpoint directory's weights, for telling later whether the folder
        at this path still holds the same model: config.json, and each weight file's name, size and
        first and last MiB (reading every byte of a multi-GB checkpoint would cost more than scoring).
        For a config-built model, the hash of its config, init and init seed (its `key`): a repro of a
        pair whose config was changed under the same name says so at replay, as for a checkpoint."""
        if not self.path:
            return self.key.split(":", 1)[-1]
        root = Path(self.path)
        files = sorted(q for q in root.iterdir() if q.name == "config.json"
                       or q.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        # read again only when a file changed (a score run asks once per sample)
        return _fingerprint(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))

    def save_pretrained(self, path: str | Path) -> "HFModel":
        """Write this model (a config-built one with its init, or a loaded checkpoint) as a checkpoint
        directory (safetensors); returns `HFModel.from_pretrained(path)`, whose pairs compute what this
        model's do (a float32 model's weights are written exactly)."""
        p = Path(path).expanduser()
        base_model(self).save_pretrained(str(p), safe_serialization=True)
        return HFModel.from_pretrained(p)

    def fields(self) -> dict[str, Any]:
        """The config fields, without importing transformers."""
        if self.path:
            return json.loads((Path(self.path) / "config.json").read_text())
        return json.loads(self.config_json)

    @property
    def vocab(self) -> int:
        return int(self.fields()["vocab_size"])

    def moe(self) -> tuple[int, int, int] | None:
        """(experts, top_k, decoder layers) for a MoE model, else None. A field the config leaves out
        is its transformers config class's default, as transformers builds the model (an OLMoE
        config.json without num_experts_per_tok routes 8 experts, not 2); a config with nothing of
        experts in it is dense without importing transformers."""
        f = self.fields()
        keys = ("num_experts", "num_local_experts", "n_routed_experts")
        if not (any(f.get(k) for k in keys) and "num_experts_per_tok" in f and "num_hidden_layers" in f):
            if not any(f.get(k) for k in keys) and not any("expert" in k or k.startswith("moe") for k in f):
                return None
            f = {**_config_defaults(f.get("model_type")), **f}
        experts = next((f[k] for k in keys if f.get(k)), None)
        if not experts:
            return None
        return int(experts), int(f.get("num_experts_per_tok") or 2), int(f.get("num_hidden_layers") or 1)


@functools.lru_cache(maxsize=None)
def _config_defaults(model_type: Any) -> dict[str, Any]:
    """The default fields of transformers' config class for `model_type` ({} when it has none)."""
    try:
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[model_type]().to_dict()
    except Exception:  # noqa: BLE001 - an unknown model_type is said where the model is built
        return {}


def check_model_type(model_type: Any) -> None:
    """UsageError, with the closest names, when transformers has no config class for `model_type`
    (called where the config is built, in the process that runs the pair: importing transformers at
    registration would cost every campaign ~0.8 s; a UsageError there makes the pair CANNOT RUN, not
    a regression of it)."""
    import difflib

    import transformers
    from transformers import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if isinstance(model_type, str) and model_type in known:
        return
    close = difflib.get_close_matches(str(model_type), known, n=4, cutoff=0.6)
    raise UsageError(f"config model_type {model_type!r} is not a model type transformers {transformers.__version__} "
                     "knows" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
                     + "; fix the `model_type` of the config dict (`transformers.CONFIG_MAPPING` lists them), or "
                     "upgrade transformers for a newer model.")


def model_from(source: Any) -> HFModel:
    """An HFModel from an HFModel, a checkpoint path (str/Path) or a config (dict / transformers config)."""
    if isinstance(source, HFModel):
        return source
    if isinstance(source, (str, Path)):
        return HFModel.from_pretrained(source)
    return HFModel.from_config(source)


_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, _TORCH_DTYPES[name])


@functools.lru_cache(maxsize=8)
def base_model(spec: HFModel) -> Any:
    """The model (eval mode), built (float32) or loaded (in the checkpoint's dtype) once per process."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # "Loading weights" bars in every worker's output
    from transformers import AutoModelForCausalLM

    from .configs import make_config, realistic_init

    report: list[str] = []  # (transformers' load report of a checkpoint)
    try:  # a config transformers refuses (heads that do not divide the hidden size), a damaged checkpoint:
        # a pair that cannot run (a setup error), not a regression of every case written to the corpus
        if spec.path:
            # in the checkpoint's own dtype: each path's copy is cast to its numerics (a bf16 checkpoint
            # upcast to float32 is exact, so the values are those of loading it in float32), and a bf16
            # base holds half the host memory of a float32 one
            with _load_report() as report:
                model = AutoModelForCausalLM.from_pretrained(spec.path, local_files_only=True, dtype="auto")
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.init_seed)
                model = AutoModelForCausalLM.from_config(make_config(json.loads(spec.config_json)),
                                                         dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, there is no model to run
        inner = e
        for _ in range(8):  # (the reason, under validation wrappers)
            nxt = inner.__cause__ or (None if inner.__suppress_context__ else inner.__context__)
            if nxt is None:
                break
            inner = nxt
        what = f"the checkpoint {spec.path!r}" if spec.path else "the model of this config"
        why = f"{type(e).__name__}: {_first_sentence(e).rstrip(':.')}" + (
            f" ({type(inner).__name__}: {_first_sentence(inner).rstrip('.')})" if inner is not e else "")
        misfits = _mismatches(report) if spec.path else []
        if misfits:  # (transformers says "look at the above report", which its logging level hides)
            why += (f": its tensors do not fit the model its config.json describes ({'; '.join(misfits[:3])}"
                    + (f"; {len(misfits) - 3} more" if len(misfits) > 3 else "") + "): a config field missing or "
                    "wrong (a field left out is transformers' default for the model type, e.g. its number of experts)")
        raise UsageError(f"{what} cannot be built by transformers: {why}. Fix the "
                         + ("checkpoint folder" if spec.path else "config") + "; no case of this pair can say anything "
                         "about the two paths.") from None
    if not spec.path:
        if spec.init == "realistic":
            realistic_init(model, spec.init_seed, logit_std=_logit_std())
    model.eval()
    model.requires_grad_(False)
    _smoke(model, spec)
    return model


CAUSAL_TOL = 1e-4  # relative change of earlier positions' logits a causal model's own forward may show


def _smoke(model: Any, spec: "HFModel") -> None:
    """The model's own plain forward on 4 tokens, once per process, twice (the last token changed): a
    config the model cannot run (a DeepSeek-V3 `n_group` that does not divide its experts) or a model
    that is not causal (an encoder) is a pair that cannot run, named as such, not a regression of
    every case written to the corpus. (The base model, before any path's patch: a rollout patch that
    leaks attention is a finding, not this.)"""
    import torch

    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if vocab <= 0:
        return
    what = f"the checkpoint {spec.path!r}" if spec.path else "the model built from this config"
    ids = torch.arange(4).remainder(vocab)[None]  # (input ids only: every causal LM takes them)
    try:
        with torch.inference_mode():
            first = model(input_ids=ids).logits[0, :3].float()
            later = model(input_ids=torch.cat([ids[:, :3], (ids[:, 3:] + 1) % vocab], 1)).logits[0, :3].float()
    except Exception as e:  # noqa: BLE001 - whatever the model raises, its own forward does not run
        raise UsageError(f"{what} ({type(model).__name__}) fails its own plain forward on 4 tokens, before "
                         f"either path runs: {type(e).__name__}: {str(e).strip()[:300]}. Its config is inconsistent "
                         "(for example a router's n_group that does not divide n_routed_experts): fix the config; "
                         "no case of this pair can say anything about the two paths.") from None
    # Causal: the first three positions' logits do not depend on the fourth token. An encoder that
    # transformers also builds as a causal LM (BERT's BertLMHeadModel without is_decoder) attends to
    # later tokens; a rollout path would then differ from the trainer on every case by construction.
    moved = float((first - later).abs().max())
    if not moved <= CAUSAL_TOL * (1.0 + float(first.abs().max())):
        arch = getattr(model.config, "model_type", "?")
        raise UsageError(f"{what} ({type(model).__name__}, model_type {arch!r}) is not a causal language model: "
                         f"changing the 4th token of its own plain forward moved the logits of the first three "
                         f"positions by up to {moved:.3g}, so its tokens attend to later ones (an encoder such as "
                         "BERT; a decoder config with is_decoder=False). A rollout generates left to right, so "
                         "every case would diverge by construction: use a decoder-only model (or set "
                         "is_decoder=True in its config if it is meant as one).")


class _load_report:
    """`with _load_report() as lines:` transformers' warnings while loading a checkpoint, kept (not printed):
    its load report names the tensors whose shapes do not fit, where its error only points at it."""

    def __enter__(self) -> list[str]:
        import logging

        import transformers

        self.lines: list[str] = []
        keep = self.lines

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                keep.append(record.getMessage())

        self.handler, self.logger = _Keep(level=logging.WARNING), logging.getLogger("transformers")
        transformers.logging.disable_default_handler()
        transformers.logging.set_verbosity_warning()
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc: Any) -> None:
        import transformers

        self.logger.removeHandler(self.handler)
        transformers.logging.set_verbosity_error()
        transformers.logging.enable_default_handler()


def _mismatches(report: list[str]) -> list[str]:
    """'name: checkpoint [a, b] vs model [c, d]' for each MISMATCH row of a transformers load report."""
    import re

    rows = re.findall(r"^(\S+)\s*\|\s*MISMATCH\s*\|.*?ckpt:\s*torch\.Size\((\[[^\]]*\])\)\s*vs\s*model:\s*"
                      r"torch\.Size\((\[[^\]]*\])\)", "\n".join(report), flags=re.M)
    return [f"{name}: checkpoint {ckpt} vs model {model}" for name, ckpt, model in rows]


def _first_sentence(e: BaseException) -> str:
    """An error's first sentence, whole (transformers' messages run on with URLs a cut would break)."""
    text = str(e).strip().split("\n", 1)[0] or type(e).__name__
    end = text.find(". ")
    return text[:end + 1] if 0 < end < 400 else text[:400]


@functools.lru_cache(maxsize=32)
def path_model(spec: HFModel, model_key: tuple, device: str) -> "Runner":
    """The model as one path runs it (a copy of the base converted to its numerics) with hooks. Made
    outside inference mode (a pair's build runs in it): the copy's parameters are then ordinary
    tensors, whose count of in-place writes tells a patch that wrote them (a weight sync loading the
    values it was given) from one that changed nothing (`_visible_state`)."""
    import torch

    with torch.inference_mode(False):
        return _path_model(spec, model_key, device)


def _path_model(spec: HFModel, model_key: tuple, device: str) -> "Runner":
    import torch

    nx = Numerics.from_model_key(model_key)
    model = copy.deepcopy(base_model(spec))
    model.to(device=device, dtype=_dtype(nx.body))
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(nx.attention)
        except (ValueError, ImportError) as e:  # e.g. a model class with no sdpa attention in this transformers
            raise UsageError(
                f"{type(model).__name__} cannot run attention={nx.attention!r} here ({_first_sentence(e)}); "
                "give both paths another attention: hf_pairs(prefix, model, base=FP32.replace(attention='eager')) "
                "for the standard set, or hf_pair(..., FP32.replace(attention='eager'), "
                "BF16.replace(attention='eager')). Such models' packed forward may also leak across sequences "
                "(gpt-oss's does in transformers: an aligned pair then diverges on two-sequence cases, and triage "
                "names `packing`); if your trainer does not pack, add packing='per_sequence' to the base: "
                "FP32.replace(attention='eager', packing='per_sequence').") from None
    gates = router_modules(model)
    if gates and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(nx.experts)
    for _, g in gates:
        g.to(_dtype(nx.router))
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if nx.lm_head != nx.body and embed is not None and head.weight is embed.weight:
        # tied embeddings (tie_word_embeddings): the head gets its own copy, else casting the head
        # would cast the input embedding with it (and a bf16 body with a float32 head would fail)
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    head.to(_dtype(nx.lm_head))
    if nx.patch != NO_PATCH:  # the user's modules, then the routers and head of the patched model
        fn = PATCHES[nx.patch]
        before = _visible_state(model)
        try:
            patched = fn(model)
        except Exception as e:  # the pair's own definition is broken: a setup error, not a finding
            raise UsageError(f"module patch {nx.patch!r} ({_where(fn)}) raised {type(e).__name__}: {e} when applied to "
                             f"a copy of the {type(model).__name__}; the pair cannot run until the patch is fixed "
                             "(print(model) shows the module names it can reach).") from e
        if patched is not None and not isinstance(patched, torch.nn.Module):
            raise UsageError(f"module patch {nx.patch!r} ({_where(fn)}) returned a {type(patched).__name__}; a patch "
                             "changes the model in place and returns None, or returns a replacement torch.nn.Module.")
        if (patched is None or patched is model) and _visible_state(model) == before and nx.patch not in _said_idle:
            _said_idle.add(nx.patch)
            print(f"warning: module patch {nx.patch!r} ({_where(fn)}) changed nothing the harness can see in the "
                  f"{type(model).__name__}: no module replaced, no forward overridden, no hook registered, no "
                  "attribute, parameter, buffer or config value changed or written. Its path runs the unpatched model, so a pair comparing it is aligned by "
                  "construction; check what the patch selects (a typo in a module or attribute name?).",
                  file=sys.stderr, flush=True)
        model = model if patched is None else patched
        model.eval()
        model.requires_grad_(False)
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        if not isinstance(head, torch.nn.Module):
            raise UsageError(f"module patch {nx.patch!r} ({_where(fn)}) returned a {type(model).__name__} whose "
                             "get_output_embeddings() gives no LM head module: the harness hooks the head (its dtype, "
                             "the rows it runs on). Change the model in place and return None, or return a "
                             "transformers model (a PreTrainedModel) whose get_output_embeddings() is its head.")
        gates = router_modules(model)
    return Runner(model, gates, head, nx)


_said_idle: set[str] = set()  # patches already reported as changing nothing (once per process)


def _visible_state(model: Any) -> tuple:
    """What a module patch can change that the harness sees: each module's object, class, its class's
    forward (a monkeypatched class method), its own attributes (a forward set on it, a scaling factor,
    a flag, private ones too) and the hooks registered on it (forward, pre-forward, backward), each
    parameter's and buffer's object, the sum of its values (a patch that quantises weights in place)
    and its count of in-place writes (a weight sync that loads the same values: a round trip through
    an engine's layout is a patch that writes them, whatever they come out as), the global module
    hooks, and the config's values. (A change to a module-level function of
    the modelling code is not seen.)"""
    import torch
    from torch.nn.modules import module as torch_module

    def total(t: Any) -> float:
        return float(t.detach().double().sum()) if isinstance(t, torch.Tensor) and t.numel() else 0.0

    def version(t: Any) -> int:  # in-place writes (a weight sync's load_state_dict of equal values) count
        try:
            return int(t._version) if isinstance(t, torch.Tensor) else -1
        except RuntimeError:  # (an inference tensor keeps no version counter)
            return -1

    def attrs(m: Any) -> tuple:  # its own attributes (a scaling factor, a flag its forward reads, a new method)
        return tuple(sorted((k, v if isinstance(v, (int, float, str, bool, type(None))) else id(v))
                            for k, v in m.__dict__.items()))

    def hooks(owner: Any, names: tuple[str, ...]) -> tuple:  # (a hook dict is the same object after a patch adds to it)
        return tuple((n, tuple((k, id(f)) for k, f in getattr(owner, n, {}).items())) for n in names)

    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    mods = tuple((name, id(m), type(m), getattr(type(m), "forward", None), attrs(m), hooks(m, kinds),
                  tuple((k, id(v), total(v), version(v)) for k, v in m._parameters.items()),
                  tuple((k, id(v), total(v), version(v)) for k, v in m._buffers.items()))
                 for name, m in model.named_modules())
    global_hooks = hooks(torch_module, ("_global_forward_hooks", "_global_forward_pre_hooks",
                                        "_global_backward_hooks", "_global_backward_pre_hooks"))
    config = getattr(model, "config", None)
    try:
        cfg = repr(sorted(config.to_dict().items())) if config is not None else ""
    except Exception:  # noqa: BLE001 - a config that does not serialise: not compared
        cfg = ""
    return mods, global_hooks, cfg


def router_modules(model: Any) -> list[tuple[str, Any]]:
    """(layer name, router module) in layer order: every router that picks top-k experts and returns
    (logits, weights, experts), as transformers' MoE models do: a `mlp.gate` (Qwen-MoE, Mixtral,
    OLMoE, DeepSeek, GLM-4.5, ERNIE) or a `*TopKRouter` module (gpt-oss's `mlp.router`, GraniteMoE's
    `block_sparse_moe.router`), with `top_k` and an (experts, hidden) `weight`."""
    out = []
    for name, mod in model.named_modules():
        kind = type(mod).__name__.lower()
        if ((name.endswith("mlp.gate") or kind.endswith("topkrouter")) and hasattr(mod, "top_k")
                and getattr(getattr(mod, "weight", None), "dim", lambda: 0)() == 2):
            idx = name.split("layers.")[1].split(".")[0] if "layers." in name else str(len(out))
            out.append((f"layers.{idx}", mod))
    return out


# ---------------------------------------------------------------------------------------------
# Hooks: router capture, replay, near ties, dtype casts
# ---------------------------------------------------------------------------------------------
@dataclass
class CallContext:
    """What the hooks need to know about the forward being run."""

    keys: Any = None  # (N,) int64: for each flattened (batch, position) row, j * stride + position; -1 = padding
    forced: Any = None  # (n_keys,) bool: positions whose router input is nudged to the boundary
    tie_layer: int = -1  # layer index whose router sees near-tie inputs (-1: none)
    gap: float = 0.0  # boundary gap of forced positions
    replay: dict[str, Any] | None = None  # layer -> (n_keys, k) int64 experts to impose (-1 = none recorded)
    floor: bool = False  # natural boundary gaps under TIE_FLOOR are raised to it (not for recorded rollouts)
    # where the floor applies: None = where this path's own gap is under it (the rollout, which records
    # them in `raised`); else {("group" | "expert", layer): keys} the rollout raised, mirrored by the
    # trainer (each path deciding from its own gap, a gap within layout noise of the floor was raised
    # on one path alone, its higher expert leading there: an aligned float32 pair flipped on it)
    floor_at: dict[tuple[str, str], Any] | None = None
    raised: dict[tuple[str, str], list] = field(default_factory=dict)  # (kind, layer) -> [keys, ...] raised here
    # the expert pairs each tie nudge's rounds moved between, by position: recorded by the rollout
    # (`pairs_at` None: {(kind, layer): [(keys (n,), pairs (rounds, n, 2)), ...]}) and followed by the
    # trainer (`pairs_at`: {(kind, layer): (keys (m,), pairs (rounds, m, 2))}): which pair a row's
    # nudge moves is a choice among its router's ranked experts, and two paths whose routers differ
    # slightly (a stale weight copy) chose differently on near-equal ranks and moved it far apart
    pairs: dict[tuple[str, str], list] = field(default_factory=dict)
    pairs_at: dict[tuple[str, str], tuple] | None = None
    captured: dict[str, list] = field(default_factory=dict)  # layer -> [(keys, experts, logits), ...]
    phase: str = ""  # "prefill", "decode", "trainer" or "check": what `current_phase()` says during the forward
    # the rows the LM head computes: None = every position; else an int64 index into the forward's
    # flattened (batch * seq) positions, whose shape + (hidden,) is what the head is given (prompt
    # positions of a long prefill or packed row cost (positions, V) logits nobody reads)
    keep: Any = None
    kept: bool = False  # the head was given `keep`'s rows (set by its hook; else the model bypassed it)
    sampling: "Sampling | None" = None  # the case's sampling parameters: what `current_sampling()` says


class Runner:
    """A model converted to one path's numerics, with its router and LM-head hooks installed."""

    def __init__(self, model: Any, gates: list[tuple[str, Any]], head: Any, nx: Numerics) -> None:
        self.model, self.gates, self.head, self.nx = model, gates, head, nx
        self.ctx = CallContext()
        self.body = _dtype(nx.body)
        for i, (layer, g) in enumerate(gates):
            g.register_forward_pre_hook(self._router_in(i, layer, g))
            g.register_forward_hook(self._router_out(layer, g))
        self.keeps = True  # the head may be given only the rows a path reads (`_keep_rows`; see `_check_keep`)
        head.register_forward_pre_hook(self._keep_rows)  # (first: the cast below then casts the kept rows only)
        if nx.lm_head != nx.body:  # (the dtype by name: a head a module patch wrapped has no `weight` of its own)
            head_dtype = _dtype(nx.lm_head)
            head.register_forward_pre_hook(lambda m, args: (args[0].to(head_dtype), *args[1:]))
            head.register_forward_hook(lambda m, args, out: out.float())
        self.keeps = self._check_keep()

    def _check_keep(self) -> bool:
        """Whether the model's forward takes the head's rows cut (`_keep_rows`): a forward of 6 tokens
        with 2 rows kept must run and give 2 rows of logits. Code after the head that reshapes its
        output to (B, S, V) or slices positions from it, in a model or a module patch, fails that (or
        raises): such a path computes every position, with a warning, and the rows are picked after,
        as for a model whose forward bypasses its output embeddings. (Shapes only: the values of 2
        rows may rightly differ from those of 6 in a head whose kernel depends on the row count,
        which is what the cut is there to show.)"""
        import torch

        embed = self.model.get_input_embeddings()
        weight = getattr(embed, "weight", None)
        if weight is None:
            return True  # (no (vocab, hidden) embedding to draw ids for: the cases will tell)
        ids = torch.arange(6, device=weight.device).remainder(weight.shape[0])[None]
        keys = torch.arange(6, device=weight.device)
        ctx = CallContext(keys=keys, keep=torch.tensor([[2, 5]]), phase="check", sampling=NEUTRAL_SAMPLING)
        try:
            with torch.inference_mode():
                part = self(ctx, input_ids=ids, use_cache=False).logits
            ok = not ctx.kept or part.shape[:-1].numel() == 2
            why = f"its forward returns logits of shape {tuple(part.shape)} for 2 rows kept of 6"
        except Exception as e:  # noqa: BLE001 - its forward fails with the rows cut ...
            try:
                with torch.inference_mode():
                    self(CallContext(keys=keys, phase="check", sampling=NEUTRAL_SAMPLING), input_ids=ids,
                         use_cache=False)
            except Exception:  # noqa: BLE001 - ... or without: not this check's to say (the cases will)
                return True
            ok, why = False, f"its forward raised {type(e).__name__} with 2 rows kept of 6"
        if not ok:
            print(f"warning: the LM head of this path ({type(self.model).__name__}, patch {self.nx.patch!r}) cannot "
                  f"be given only the rows read ({why}): it computes every position, and its rows are picked "
                  "after (head_rows 'scored' does not cut its memory).", file=sys.stderr, flush=True)
        return ok

    def _keep_rows(self, module: Any, args: tuple) -> tuple | None:
        """The head's input cut to `ctx.keep`'s rows, once per forward, when it is the forward's
        (B, S, hidden) hidden states; the model's own code after the head (a logit scale, a soft cap)
        then runs on those rows alone. Triage reads which positions they are (`KEPT_POSITIONS`)."""
        ctx = self.ctx
        h = args[0] if args else None
        if (not self.keeps or ctx.keep is None or ctx.kept or h is None or h.dim() != 3 or ctx.keys is None
                or h.shape[0] * h.shape[1] != ctx.keys.numel()):
            return None
        ctx.kept = True
        keep = ctx.keep.to(h.device)
        setattr(self.model, KEPT_POSITIONS, keep.reshape(-1))
        return (h.reshape(-1, h.shape[-1])[keep], *args[1:])

    def _router_in(self, i: int, layer: str, gate: Any):
        def floored(kind: str, under: Any) -> Any:
            """(N,) bool: the rows to raise to the floor: this path's own gaps under it (recorded),
            or the rows the rollout raised (`ctx.floor_at`)."""
            ctx = self.ctx
            valid = ctx.keys >= 0
            if ctx.floor_at is None:
                close = valid & under()
                if bool(close.any()):
                    ctx.raised.setdefault((kind, layer), []).append(ctx.keys[close].cpu())
                return close
            import torch

            at = ctx.floor_at.get((kind, layer))
            if at is None or at.numel() == 0:
                return torch.zeros_like(valid)
            return valid & torch.isin(ctx.keys, at.to(ctx.keys.device))

        def pre(module: Any, args: tuple) -> tuple:
            x = args[0].reshape(-1, module.weight.shape[-1])  # (N, H)
            ctx = self.ctx
            k, w, bias = int(module.top_k), module.weight, getattr(module, "bias", None)
            force = None
            if ctx.tie_layer == i and ctx.forced is not None and ctx.keys is not None:
                valid = ctx.keys >= 0  # (N,) real positions
                force = valid.clone()
                force[valid] = ctx.forced.to(valid.device)[ctx.keys[valid]]
                if bool(force.any()):
                    x = nudge("forced", x, force, ctx.gap, module)
            if ctx.floor and ctx.keys is not None and _groups(module) != (1, 1):
                # a group-limited router's kept groups: a near tie between the last kept and the first
                # dropped group is decided by layout noise too (an aligned float32 pair of a DeepSeek-V3
                # checkpoint flipped experts this way). A forced nudge often ends at one: its Newton steps
                # on the expert boundary converge to the kink where the kept groups change. Raised to
                # the floor, the higher group leading (a forced row may then sit off its exact gap)
                close = floored("group", lambda: group_gap(x, w, bias, module) < TIE_FLOOR)
                if bool(close.any()):
                    x = group_nudge(x, w, close, TIE_FLOOR, bias, router=module)
            if ctx.floor and ctx.keys is not None:
                # a natural near tie closer than the floor is decided by layout noise (a float32
                # eager/sdpa pair flipped an expert this way): raised to the floor, the higher expert
                # id leading, as forced ties are, so both paths choose alike; a bf16 router still flips
                close = floored("expert", lambda: boundary_gap(x, w, k, bias, module) < TIE_FLOOR)
                if force is not None:
                    close &= ~force
                if bool(close.any()):
                    x = nudge("expert", x, close, TIE_FLOOR, module)
            return (x.to(module.weight.dtype),)

        def nudge(kind: str, x: Any, rows: Any, gap: float, module: Any) -> Any:
            """`tie_nudge` of these rows, moving between the expert pairs the rollout's nudge chose at
            the same positions (`CallContext.pairs`), which the rollout records."""
            import torch

            ctx = self.ctx
            w, k, bias = module.weight, int(module.top_k), getattr(module, "bias", None)
            given = None
            at = ctx.pairs_at.get((kind, layer)) if ctx.pairs_at is not None else None
            if at is not None:
                given = follow_pairs(ctx.keys, rows, *at)
            record: list = []
            out = tie_nudge(x, w, rows, gap, k, bias, router=module, pairs=given, record=record)
            if ctx.pairs_at is None and record:
                ctx.pairs.setdefault((kind, layer), []).append(
                    (ctx.keys[rows].cpu(), torch.stack(record)[:, rows].cpu()))
            return out

        return pre

    def _router_out(self, layer: str, gate: Any):
        def post(module: Any, args: tuple, out: tuple) -> tuple:
            import torch

            ctx = self.ctx
            if not (isinstance(out, tuple) and len(out) == 3):  # not (logits, weights, experts): not ours to read
                if ctx.replay is not None:
                    raise ReplayError(f"router replay: {type(module).__name__} ({layer}) does not return (logits, "
                                      "weights, experts), so its experts cannot be replaced; run this model without "
                                      "replay (hf_pair(..., replay=False)).")
                return out
            logits, scores, idx = out  # (N, E), (N, k), (N, k)
            keys = ctx.keys
            if ctx.replay is not None and layer in ctx.replay and keys is not None:
                table = ctx.replay[layer]  # (n_keys, k)
                valid = keys >= 0
                want = torch.full_like(idx, -1)
                want[valid] = table[keys[valid]].to(idx.device)
                use = (want >= 0).all(-1)  # (N,)
                # where the replayed set is the router's own choice, its own weights stand (exact for
                # every router); elsewhere (a flip) they are recomputed from its logits (`gate_weights`)
                own = (want.sort(-1).values == idx.sort(-1).values).all(-1)
                redo = use & ~own
                if bool(redo.any()):
                    check_gate_weights(module, logits[own], idx[own], scores[own])
                    idx = torch.where(redo[:, None], want, idx)
                    scores = torch.where(redo[:, None], gate_weights(module, logits, idx).to(scores.dtype), scores)
            if keys is not None:
                sel = keys >= 0
                ctx.captured.setdefault(layer, []).append((keys[sel].cpu(), idx[sel].cpu(), logits[sel].detach().cpu()))
            if scores.dtype != self.body and scores.is_floating_point():
                scores = scores.to(self.body)
            return logits, scores, idx

        return post

    def __call__(self, ctx: CallContext, **kwargs: Any) -> Any:
        self.ctx = ctx
        _PHASE.name, _PHASE.sampling = ctx.phase, ctx.sampling
        try:
            return self.model(**kwargs)
        finally:
            if KEPT_POSITIONS in self.model.__dict__:
                delattr(self.model, KEPT_POSITIONS)
            self.ctx = CallContext()
            _PHASE.name, _PHASE.sampling = "", None


_PHASE = threading.local()




def current_sampling() -> Sampling | None:
    """The sampling parameters of the case whose forward is running (every phase, trainer included:
    it scores the distribution the rollout sampled from; neutral ones in the "check" forward), None
    outside one: for a module patch that plants a sampler's bug in the model (a head that divides by
    the temperature, which the sampler then applies again)."""
    return getattr(_PHASE, "sampling", None)


def current_phase() -> str:
    """Which forward of an HF pair is running, for a module patch whose kernel differs by phase (an
    engine's decode kernel): "prefill" (the rollout's prompt, one batched forward), "decode" (each of
    the rollout's KV-cache steps, one token per sequence), "trainer" (the packed teacher-forced
    forward); "check" (a forward of 6 tokens when a path's model is built, `Runner._check_keep`);
    "" outside them. A prefill of one token is still "prefill"."""
    return getattr(_PHASE, "name", "")


def gate_weights(router: Any, logits: Any, idx: Any) -> Any:
    """(N, k) float32 gate weights a transformers router gives experts `idx` (N, k) from its logits
    (N, E), for router replay at positions where the replayed experts are not the router's own choice.

    The router families of transformers' MoE models: sigmoid scores with a selection bias
    (`e_score_correction_bias`: DeepSeek-V3, GLM-4.5, dots1), renormalised when `norm_topk_prob`, then
    x `routed_scaling_factor`; softmax with `topk_method` (DeepSeek-V2): x `routed_scaling_factor`, no
    renormalisation; softmax with `norm_min` (ERNIE 4.5): renormalised, the sum clamped; otherwise
    softmax (Qwen2/3-MoE, Mixtral, OLMoE, MiniMax), renormalised unless `norm_topk_prob` is False.
    `check_gate_weights` verifies the family on positions the router chose itself."""
    import torch

    x = logits.float()
    if _sigmoid_router(router):
        w = x.sigmoid().gather(1, idx)
        if getattr(router, "norm_topk_prob", False):
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    else:
        w = torch.softmax(x, dim=-1).gather(1, idx)
        if hasattr(router, "norm_min"):
            w = w / w.sum(-1, keepdim=True).clamp(min=router.norm_min)
        elif not hasattr(router, "topk_method") and getattr(router, "norm_topk_prob", True):
            w = w / w.sum(-1, keepdim=True)
    return w * float(getattr(router, "routed_scaling_factor", 1.0) or 1.0)


class ReplayError(RuntimeError):
    """Router replay cannot recompute this router's gate weights (a router family `gate_weights` lacks)."""


def check_gate_weights(router: Any, logits: Any, idx: Any, weights: Any) -> None:
    """Raise `ReplayError` when `gate_weights` does not give the weights the router itself gave on
    rows it chose (so a replayed flip would be weighted by a formula this router does not use)."""
    if idx.numel() == 0:
        return
    want = weights.float()
    got = gate_weights(router, logits, idx)
    if not bool(((got - want).abs() <= 1e-2 * want.abs() + 1e-6).all()):
        raise ReplayError(
            f"router replay: the gate weights of {type(router).__name__} are not one of the router families "
            "targets.hf.backend.gate_weights knows (softmax or sigmoid top-k, with or without renormalisation and "
            "routed_scaling_factor), so a replayed expert cannot be weighted as the model would; run this model "
            "without replay (hf_pair(..., replay=False)) or add its family to gate_weights.")


def _sigmoid_router(router: Any) -> bool:
    """DeepSeek-V3 / GLM-4.5 / dots1 routers: experts ranked by sigmoid(logit) + a selection bias."""
    return router is not None and getattr(router, "e_score_correction_bias", None) is not None


def selection_scores(router: Any, logits: Any) -> Any:
    """(N, E) float64 scores a router ranks experts by, from its float64 logits: the logits themselves
    for softmax routers (softmax keeps their order); sigmoid(logit) + `e_score_correction_bias` for
    sigmoid routers, -inf outside the `topk_group` groups it keeps when it limits groups (`num_group`)."""
    import torch

    if not _sigmoid_router(router):
        return logits
    groups, keep = _groups(router)
    s, g, best, _ = _group_scores(router, logits)
    if groups > 1:
        chosen = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(keep, dim=-1).indices, True)
        s = torch.where(chosen[:, :, None].expand_as(g), g, -math.inf).reshape(s.shape)
    return s


def _groups(router: Any) -> tuple[int, int]:
    """(groups, groups kept) of a group-limited sigmoid router; (1, 1) for any other."""
    if not _sigmoid_router(router):
        return 1, 1
    groups, keep = int(getattr(router, "num_group", 1) or 1), int(getattr(router, "topk_group", 1) or 1)
    return (groups, keep) if 1 < groups and keep < groups else (1, 1)


def _group_scores(router: Any, logits: Any) -> tuple[Any, Any, Any, Any]:
    """A sigmoid router's float64 selection scores from its logits: (s (N, E) = sigmoid(logit) + bias,
    the same by group (N, G, E/G), group scores (N, G) = a group's two best, and those two experts'
    indices within their group (N, G, 2)); one group when the router does not limit groups."""
    import torch

    groups, _ = _groups(router)
    s = logits.sigmoid() + router.e_score_correction_bias.to(torch.float64)
    g = s.view(s.shape[0], groups, -1)
    top2 = g.topk(min(2, g.shape[-1]), dim=-1)
    return s, g, top2.values.sum(-1), top2.indices


def _group_boundary(router: Any, logits: Any) -> tuple[Any, Any, Any, Any]:
    """For a group-limited router's float64 logits (N, E): the group scores (N, G) (a group's two best
    sigmoid(logit) + bias), and per row the boundary pair of groups, the last kept and the first
    dropped, as (winner, runner-up), the higher group index the winner; and every group's two best
    experts (their indices within the group, (N, G, 2)). Returns (scores, win, run, top2)."""
    import torch

    _, keep = _groups(router)
    _, _, gs, top2 = _group_scores(router, logits)
    order = gs.topk(keep + 1, dim=-1).indices  # (N, keep+1)
    a, b = order[:, keep - 1], order[:, keep]
    return gs, torch.maximum(a, b), torch.minimum(a, b), top2


def group_gap(x: Any, w: Any, bias: Any = None, router: Any = None) -> Any:
    """(N,) float64 gap between the last group a group-limited router keeps and the first it drops
    (group score: its two best selection scores); +inf for routers that do not limit groups. A gap
    under float32 noise decides which groups are kept, and with them which experts, by layout noise."""
    import torch

    if _groups(router) == (1, 1):
        return torch.full((x.shape[0],), math.inf, dtype=torch.float64, device=x.device)
    logits = x.to(torch.float64) @ w.to(torch.float64).T + (bias.to(torch.float64) if bias is not None else 0.0)
    gs, win, run, _ = _group_boundary(router, logits)
    return (gs.gather(1, win[:, None]) - gs.gather(1, run[:, None])).abs().squeeze(1)


def group_nudge(x: Any, w: Any, rows: Any, gap: float, bias: Any = None, router: Any = None,
                rounds: int = 4) -> Any:
    """Router input x (N, H) moved, for `rows`, so that a group-limited router's boundary groups
    (the last kept, the first dropped) are `gap` apart, the higher group index leading, as
    `tie_nudge` does for the expert boundary: Newton steps along the difference of the two group
    scores' gradients (each the sigmoid slopes of its two best experts times their weight rows)."""
    import torch

    xs, wf = x.to(torch.float64), w.to(torch.float64)
    bf = bias.to(torch.float64) if bias is not None else 0.0
    groups, _ = _groups(router)
    per = wf.shape[0] // groups
    for _ in range(rounds):
        logits = xs @ wf.T + bf  # (N, E)
        gs, win, run, top2 = _group_boundary(router, logits)
        slope = torch.sigmoid(logits) * torch.sigmoid(-logits)  # (N, E)

        def grad(grp: Any) -> Any:  # (N, H): d(group score)/dx of group grp per row
            ids = top2.gather(1, grp[:, None, None].expand(-1, 1, top2.shape[-1])).squeeze(1) + grp[:, None] * per
            return (slope.gather(1, ids)[:, :, None] * wf[ids]).sum(1)

        d = grad(win) - grad(run)  # (N, H)
        now = gs.gather(1, win[:, None]) - gs.gather(1, run[:, None])  # (N, 1)
        alpha = (gap - now) / (d * d).sum(-1, keepdim=True).clamp_min(1e-30)
        xs = torch.where(rows[:, None], xs + alpha * d, xs)
    return xs.to(x.dtype)


def boundary_gap(x: Any, w: Any, k: int, bias: Any = None, router: Any = None) -> Any:
    """(N,) float64 gap between the k-th and (k+1)-th largest selection scores (`selection_scores`)
    of the router logits x @ w.T (+ bias); +inf where no (k+1)-th expert competes."""
    import torch

    logits = x.to(torch.float64) @ w.to(torch.float64).T  # (N, E)
    if bias is not None:
        logits = logits + bias.to(torch.float64)
    top = torch.topk(selection_scores(router, logits), k + 1, dim=-1).values  # (N, k+1)
    return torch.nan_to_num(top[:, k - 1] - top[:, k], nan=math.inf)


def follow_pairs(keys: Any, rows: Any, rec_keys: Any, rec_pairs: Any) -> Any:
    """(rounds, N, 2) int64: for each of the N rows (`keys`) among `rows`, the expert pairs recorded
    at its position (`rec_keys` (m,), `rec_pairs` (rounds, m, 2)); -1 where none was recorded."""
    import torch

    dev = keys.device
    out = torch.full((rec_pairs.shape[0], keys.numel(), 2), -1, dtype=torch.int64, device=dev)
    if rec_keys.numel() == 0:
        return out
    order = torch.argsort(rec_keys)
    sk = rec_keys[order].to(dev)
    at = torch.searchsorted(sk, keys).clamp_max(sk.numel() - 1)  # (N,)
    hit = rows & (sk[at] == keys)
    if bool(hit.any()):
        src = order.to(dev)[at[hit]]
        out[:, hit] = rec_pairs.to(dev)[:, src]
    return out


def tie_nudge(x: Any, w: Any, forced: Any, gap: float, k: int, bias: Any = None, rounds: int | None = None,
              router: Any = None, pairs: Any = None, record: list | None = None) -> Any:
    """Router input x (N, H) moved, for forced rows, so that the router's selection scores
    (`selection_scores` of x @ w.T (+ bias): the logits of a softmax router) have their top-k boundary
    (k-th vs (k+1)-th expert) at exactly `gap` in float64 (the higher expert id leads): the move is
    along w[a] - w[b], the one direction that changes that gap and nothing else of the pair (a
    Newton step per round, the sigmoid's slope included for a sigmoid router; 3 rounds, 8 for a
    sigmoid router; a row whose move changes which expert group a group-limited router keeps may end
    off the boundary).
    Row-wise, so a position gets the same nudge whichever batch it runs in (`harness.strategies.
    near_tie_hidden` picks its rows from a stream over the whole tensor; here rows are positions keyed
    per sequence, and a forward sees a different set of them on each path).
    `pairs` ((rounds, N, 2) int64, -1 = choose): the (leading, trailing) expert pair each round
    moves a row between, another path's choice (`follow_pairs`); `record`: a list each round's
    (N, 2) pairs are appended to."""
    import torch

    xs, wf = x.to(torch.float64), w.to(torch.float64)  # (N, H), (E, H)
    bf = bias.to(torch.float64) if bias is not None else 0.0  # (E,): gpt-oss's router has one
    sigmoid = _sigmoid_router(router)
    for i in range(rounds if rounds is not None else 8 if sigmoid else 3):
        logits = xs @ wf.T + bf  # (N, E)
        scores = selection_scores(router, logits) if sigmoid else logits
        top = torch.topk(scores, k + 1, dim=-1).indices  # (N, k+1)
        a, b = top[:, k - 1], top[:, k]
        win, run = torch.maximum(a, b), torch.minimum(a, b)
        if pairs is not None and i < pairs.shape[0]:
            given = pairs[i].to(win.device)  # (N, 2)
            win = torch.where(given[:, 0] >= 0, given[:, 0], win)
            run = torch.where(given[:, 1] >= 0, given[:, 1], run)
        if record is not None:
            record.append(torch.stack([win, run], -1))
        d = wf[win] - wf[run]  # (N, H)
        now = scores.gather(1, win[:, None]) - scores.gather(1, run[:, None])  # (N, 1)
        if sigmoid:  # d(score_win - score_run)/d(alpha) along d
            lw, lr = logits.gather(1, win[:, None]), logits.gather(1, run[:, None])
            slope = (torch.sigmoid(lw) * torch.sigmoid(-lw) * (d * wf[win]).sum(-1, keepdim=True)
                     - torch.sigmoid(lr) * torch.sigmoid(-lr) * (d * wf[run]).sum(-1, keepdim=True))
            ok = torch.isfinite(now) & (slope > 0)  # a competitor in a kept group, and a usable slope
            alpha = torch.where(ok, (gap - now) / slope.clamp_min(1e-30), torch.zeros_like(now))
        else:
            alpha = (gap - now) / (d * d).sum(-1, keepdim=True).clamp_min(1e-30)
        xs = torch.where(forced[:, None], xs + alpha * d, xs)
    return xs.to(x.dtype)


def _logit_std() -> float:
    from .configs import LOGIT_STD

    return LOGIT_STD
