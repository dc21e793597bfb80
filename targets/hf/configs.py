"""Built-in tiny model configs for the Hugging Face backend, and the initialization that makes a
random model behave like a trained one.

Configs are plain dicts (model type + config fields) so this module imports without transformers;
`make_config` turns one into a transformers config when a pair first runs.

Why an initialization of our own
--------------------------------
transformers initializes weights with N(0, 0.02): on a tiny random model the output distribution is
near-uniform (entropy ~ log(vocab)), and k3 between a float32 and a bf16 path shrinks with the
entropy: a bf16 rollout of a default-initialized Qwen3-MoE stayed under k3 2.1e-4 in 100 cases and
was never caught. A trained LM is peaked (1-3 nats) with a logit range of ~15-30. `realistic_init`
gives a random model that shape of output:

- embeddings N(0, 1) (the input embedding, found by identity, whatever its name); biases 0; norm
  weights and other 1-D parameters as the model initializes them (1 for a norm weight);
- every input projection (q/k/v, gate/up, the experts' gate_up) N(0, 1/fan_in): activations keep
  unit scale through the stack, attention logits are O(1), not ~0 (so attention is not uniform);
- output projections (o_proj, down_proj, the experts' down) N(0, OUT_GAIN^2 / (2 * layers * fan_in)):
  the layers, not the token embedding, dominate the residual stream, as in a trained model (with
  gain 1 the output is mostly a bigram of the input token and a bf16 engine stays at k3 ~4e-4 on
  the dense config; with gain 4 the mean k3 of fp32 vs bf16 is ~9e-4, at the line, as reported
  for real models);
- router weights N(0, ROUTER_STD^2 / hidden): router logits with standard deviation ~ROUTER_STD,
  so the top-k has clear winners on most tokens and close calls on some, as trained routers do;
- a sigmoid router's selection bias (`e_score_correction_bias`, a buffer the model initializes to
  0) N(0, CORRECTION_BIAS_STD^2): a trained model's load balancing leaves it non-zero, and at 0 a
  rollout that selects experts without it (or weights them with it) runs exactly the trainer's
  experts. At 0.1, a third of the sigmoid scores' spread over the experts (0.315), it changes the
  top-2 of a tiny DeepSeek-V3 router on 28% of 4000 unit-RMS inputs (0.03: 10%, 0.3: 56%;
  `python reports/scripts/selection_bias.py`);
- LM head N(0, LOGIT_STD^2 / hidden): after the final RMSNorm (unit-RMS rows) the logits have
  standard deviation ~LOGIT_STD; with a 512-token vocabulary that gives a mean output entropy of
  about 1-3 nats on sampled continuations (measured in tests/hf/test_hf_backend.py). A model whose
  config scales its logits (GraniteMoE's `logits_scaling`) has its untied head rescaled to that
  standard deviation, measured on one forward (`_calibrate_head`); config multipliers of the
  embeddings' output (`embedding_multiplier`, `scale_emb`) and of each layer's output before the
  residual add (`residual_multiplier`) are divided out of the embedding's and the output
  projections' standard deviations, so the layers still dominate the residual stream;
- a head tied to the embedding is that matrix drawn at the head's scale, and the output projections
  are raised until the model stops predicting the token it is given (`_calibrate_tied`).

Weights are drawn from a fixed generator seeded by `init_seed`, so a model is a pure function of
(config, init_seed), like a checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

LOGIT_STD = 5.0  # target standard deviation of the LM-head logits (peakedness)
ROUTER_STD = 2.0  # target standard deviation of the router logits
# standard deviation of a sigmoid router's selection bias (`e_score_correction_bias`: DeepSeek-V3, GLM-4.5)
CORRECTION_BIAS_STD = 0.1
OUT_GAIN = 4.0  # gain of the output projections: the layers, not the embedding, dominate the residual stream

VOCAB = 512

# model type -> config fields. Small enough for ~50-200 cases/s on two CPU cores.
TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(  # Qwen3-MoE style: QK-norm, 8 experts top-2, renormalized top-k, no shared expert
        model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6,
    ),
    "mixtral": dict(  # Mixtral style: 8 experts top-2, softmax over the top-k
        model_type="mixtral", vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
    ),
    "qwen3": dict(  # dense Llama/Qwen style: GQA, SwiGLU, QK-norm
        model_type="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6,
    ),
}


def make_config(fields: dict[str, Any]) -> Any:
    """A transformers config from a dict holding `model_type` and config fields."""
    from transformers import AutoConfig

    from .backend import check_model_type

    fields = dict(fields)
    check_model_type(fields.get("model_type"))
    check_config_keys(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def check_config_keys(fields: dict[str, Any]) -> None:
    """UsageError for a config key that is a near-miss of a field of its transformers config class
    (`num_local_expert` for `num_local_experts`): transformers keeps an unknown key as an unused
    attribute and builds the model with the field's default (8 experts, not the 6 meant), silently. A
    key close to none (a field of a newer transformers, one's own) is left alone."""
    import difflib

    from .backend import _config_defaults

    defaults = _config_defaults(fields.get("model_type"))
    if not defaults:
        return
    for key in sorted(k for k in fields if k not in defaults and k != "model_type"):
        close = [c for c in difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.85) if c not in fields]
        if close:
            from harness.errors import UsageError

            raise UsageError(f"config key {key!r} is not a field of transformers' {fields['model_type']!r} config "
                             f"(did you mean {close[0]!r}?): transformers would keep it as an unused attribute and build "
                             f"the model with its default {close[0]}={defaults[close[0]]!r}. Fix the key in the config.")


def _is_router(name: str, module: Any) -> bool:
    cls = type(module).__name__.lower()
    return "router" in cls or name.endswith(".gate") and hasattr(module, "top_k")


# output projections (their outputs add into the residual stream), by the names model families use
_OUT_PROJ = ("o_proj", "down_proj", "w2", "out_proj", "c_proj", "fc2", "dense_4h_to_h", "attention.dense", "wo")


def realistic_init(model: Any, init_seed: int, logit_std: float = LOGIT_STD, router_std: float = ROUTER_STD) -> Any:
    """Re-draw every weight matrix of `model` in place (see the module docstring); returns the model.

    The input embedding and the LM head are found by identity (`get_input_embeddings`,
    `get_output_embeddings`), not by name. Biases become 0; other 1-D parameters (norm weights, and
    the decay and step parameters of linear-attention and state-space layers) keep the model's own
    initialization, which is what they mean (a norm weight of 1, or 0 where a norm scales by
    1 + weight; a LayerNorm named `ln_f` set to 0 made a model's output uniform)."""
    import torch

    cfg = model.config
    layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
    hidden = int(cfg.hidden_size)
    g = torch.Generator().manual_seed(int(init_seed))
    routers = {n for n, m in model.named_modules() if n and _is_router(n, m)}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed_w = getattr(embed, "weight", None)
    head_w = getattr(head, "weight", None)
    # config multipliers some families apply to the embeddings' output and to each layer's output
    # before the residual add (Granite's embedding_multiplier and residual_multiplier, MiniCPM's
    # scale_emb): drawn without them in mind, the embedding dominates the residual stream
    # (a head tied to the embedding is that matrix too: dividing it would shrink the logits with it)
    embed_scale = _multiplier(cfg, "embedding_multiplier", "scale_emb") if head_w is not embed_w else 1.0
    residual_scale = _multiplier(cfg, "residual_multiplier")
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            owner = name.rsplit(".", 1)[0]
            if p.dim() == 1:
                if name.endswith("bias"):
                    p.zero_()
                continue
            if p is embed_w and p is not head_w:
                std = 1.0 / embed_scale  # (the model multiplies its embeddings back by that factor)
            elif p is head_w:
                std = logit_std / math.sqrt(hidden)
            elif owner in routers:
                std = router_std / math.sqrt(hidden)
            else:
                fan_in = p.shape[-1]
                std = 1.0 / math.sqrt(fan_in)
                if any(k in name for k in _OUT_PROJ):
                    std *= OUT_GAIN / math.sqrt(2 * layers) / residual_scale
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # (after every parameter: their draws stay the same)
                b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float32).to(b.dtype) * CORRECTION_BIAS_STD)
        if head_w is not None and head_w.dim() == 2:
            _calibrate_head(model, head_w, logit_std, init_seed)
            if head_w is embed_w:
                _calibrate_tied(model, init_seed)
    return model


def _multiplier(cfg: Any, *names: str) -> float:
    """The first of the config fields `names` that is a finite number > 0, else 1."""
    from harness.case import finite_number

    return next((float(v) for v in (getattr(cfg, n, None) for n in names) if finite_number(v) and v > 0), 1.0)


def _probe_logits(model: Any, ids: Any) -> Any:
    """(n, V) float32 logits of one forward on `ids` ((n,) token ids, `_probe_ids`), in
    eval mode and on a forked generator (nothing drawn from, or left changed in, the process's random
    state); None for a model that needs other inputs."""
    import torch

    training = model.training
    try:
        model.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            return model(input_ids=ids[None]).logits.float()[0]
    except Exception:  # noqa: BLE001 - a model that needs other inputs: left as drawn
        return None
    finally:
        model.train(training)


def _probe_ids(model: Any, init_seed: int, vocab: int | None = None) -> Any:
    """(32,) seeded token ids below `vocab` (default: the config's vocab_size), fewer for a model of fewer positions."""
    import torch

    vocab = int(vocab or model.config.vocab_size)
    n = int(min(32, getattr(model.config, "max_position_embeddings", 32) or 32))
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(int(init_seed) + 1))


TIED_MIN_ENTROPY = 0.8  # nats: a tied model's probe forward below it gets its layers' outputs scaled up ...
TIED_MAX_OWN = 0.05  # ... as does one that predicts the token it was given at more than this share of positions


def _calibrate_tied(model: Any, init_seed: int) -> None:
    """Raise the output projections of a model whose LM head is its input embedding until its
    output is no longer near-deterministic.

    With a tied head, the embedding of the current token is in the residual stream and is also its
    own row of the head: after the final norm it scores itself by |e|^2 * sqrt(hidden) / |residual|,
    so a random model repeats its last token (mean entropy 0.08 nats on a 2-layer Llama, 0.001 on
    Gemma 2, which multiplies its embeddings by sqrt(hidden)) and a bf16 rollout of it stays under
    the line. A trained model has learned not to; here the layers' outputs (the output projections)
    are doubled until a probe forward on 32 seeded tokens has a mean entropy of TIED_MIN_ENTROPY or
    more and predicts its input token at no more than TIED_MAX_OWN of the positions (at most 8
    times: 256x), so the current token's embedding no longer dominates the final residual (on
    random input tokens the entropy alone looks fine: it is the model's own continuation that falls
    into repeating). Factors are powers of two: the weights stay exact multiples of the drawn ones.
    A model still there after that warns: one whose output projections are not found by name, or
    whose layers normalise their outputs before the residual add (Gemma 2's post-norms), where
    their scale changes nothing."""
    import warnings

    import torch

    outs = [p for n, p in model.named_parameters() if p.dim() >= 2 and any(k in n for k in _OUT_PROJ)]
    entropy = None
    ids = _probe_ids(model, init_seed, vocab=int(model.get_output_embeddings().weight.shape[0]))
    for step in range(9):
        logits = _probe_logits(model, ids)
        if logits is None:
            return
        lp = torch.log_softmax(logits.double(), -1)
        entropy = float(-(lp.exp() * lp).nan_to_num().sum(-1).mean())
        own = float((logits.argmax(-1) == ids).double().mean())
        done = entropy >= TIED_MIN_ENTROPY and own <= TIED_MAX_OWN
        if not math.isfinite(entropy) or done or not outs or step == 8:
            break
        with torch.no_grad():
            for p in outs:
                p.mul_(2.0)
    if entropy is not None and math.isfinite(entropy) and not done:
        warnings.warn(f"{type(model).__name__}: with its LM head tied to the input embedding this random model "
                      f"predicts the token it is given at {own:.0%} of a probe's positions (mean entropy {entropy:.3g} "
                      "nats): its sampled continuations repeat a token near-deterministically, a precision difference "
                      "between the paths hardly moves them, and bugs go unseen. Build the test model with "
                      "tie_word_embeddings=False, or test a trained checkpoint.", stacklevel=3)


def _calibrate_head(model: Any, head_w: Any, logit_std: float, init_seed: int) -> None:
    """Rescale an LM head whose logits come out far from `logit_std` (outside half to twice it).

    A model family may scale its logits or residual stream with config multipliers (GraniteMoE divides
    the logits by `logits_scaling`, multiplies embeddings by `embedding_multiplier`...): drawn as above,
    such a model's output was near-uniform (entropy 5.5 of log V 6.2 nats) and no bug was caught. One
    forward on 32 seeded tokens (eval mode, a forked generator) measures the logits' standard
    deviation; the factor is rounded to two significant digits, so the last bits of that forward
    (another machine, another thread count) change the weights only at a rounding boundary, and
    models already within range (every built-in config) are left exactly as drawn."""
    logits = _probe_logits(model, _probe_ids(model, init_seed, vocab=int(head_w.shape[0])))
    if logits is None:
        return
    std = float(logits.std())
    if not (math.isfinite(std) and std > 0) or 0.5 * logit_std <= std <= 2.0 * logit_std:
        return
    factor = float(f"{logit_std / std:.2g}")
    head_w.mul_(factor)
