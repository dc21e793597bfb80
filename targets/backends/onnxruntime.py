"""ONNX Runtime as the rollout engine of the small MoE decoder: `model.onnxruntime`.

The model (`targets.models.moe_decoder`) is exported once per (config, numerics profile) with the
legacy TorchScript exporter (`dynamo=False`; the dynamo exporter needs onnxscript) and dynamic
batch, sequence and cache axes, so one graph serves the prefill and every decode step of every
case. The weights are graph inputs (`export_params=False`): they change with each case's seed
without re-exporting. The rollout loop, sampling and KV-cache bookkeeping are the shared
`targets.models.paths.rollout`; only the forward runs in ONNX Runtime.

Execution providers: the CPU EP here; on `--device cuda` the CUDA EP with TF32 explicitly off
(`use_tf32=0`), so a float32 graph computes in float32 as the torch trainer does.

The trainer is the torch model in float32, packed and teacher-forced, as in `model.aligned`.
`onnxruntime` is imported inside the functions that need it: importing the registry stays cheap.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
from typing import Any, Callable

import torch

from harness import register
from targets.models import pairs as model_pairs
from targets.models.moe_decoder import FP32, ModelConfig, MoEDecoder, Numerics, model

INPUTS = ["ids", "pos", "mask", "past_k", "past_v", "tie", "forced", "gap", "scale", "replay", "replay_on"]
OUTPUTS = ["logprobs", "k_new", "v_new", "experts", "scores"]
DYNAMIC = {  # name -> {axis: label}: batch, new tokens, cache length
    "ids": {0: "B", 1: "S"}, "pos": {0: "B", 1: "S"}, "mask": {0: "B", 2: "S", 3: "PS"},
    "past_k": {1: "B", 3: "P"}, "past_v": {1: "B", 3: "P"}, "forced": {0: "B", 1: "S"},
    "replay": {1: "B", 2: "S"}, "replay_on": {0: "B", 1: "S"},
    "logprobs": {0: "B", 1: "S"}, "k_new": {1: "B", 3: "S"}, "v_new": {1: "B", 3: "S"},
    "experts": {1: "B", 2: "S"}, "scores": {1: "B", 2: "S"},
}
OPSET = 17


class _Fixed(torch.nn.Module):
    """The decoder with its numerics profile baked in (what the exporter traces)."""

    def __init__(self, m: MoEDecoder, nx: Numerics) -> None:
        super().__init__()
        self.m, self.nx = m, nx

    def forward(self, ids, pos, mask, past_k, past_v, tie, forced, gap, scale, replay, replay_on):
        return self.m(ids, pos, mask, past_k, past_v, tie, forced, gap, scale, replay, replay_on, nx=self.nx)


def _example_inputs(cfg: ModelConfig) -> tuple:
    b, s, p = 2, 3, 2
    past = torch.zeros(cfg.layers, b, cfg.kv_heads, p, cfg.head_dim)
    return (torch.full((b, s), 2, dtype=torch.long), torch.arange(s).repeat(b, 1),
            torch.ones(b, 1, s, p + s, dtype=torch.bool), past, past.clone(),
            torch.tensor([True] + [False] * (cfg.layers - 1)), torch.ones(b, s, dtype=torch.bool),
            torch.tensor(0.0), torch.tensor(1.0), torch.zeros(cfg.layers, b, s, cfg.top_k, dtype=torch.long),
            torch.zeros(b, s, dtype=torch.bool))


@functools.lru_cache(maxsize=None)
def exported(cfg: ModelConfig, nx: Numerics) -> tuple[bytes, tuple[str, ...]]:
    """Export the model once per (config, profile): the serialized .onnx graph and its weight input
    names. The graph carries no weights (`export_params=False`: each is a graph input, fed with the
    case's values), so its size does not grow with the model's: a real-size config (5 GB of float32
    weights) stays far under protobuf's 2 GB limit and needs no external-data files. The export goes
    through a temporary folder that is removed at once (nothing is left in /tmp, whichever way the
    process ends later)."""
    m = MoEDecoder(cfg).eval()  # traced with any distinct values (equal ones could be merged)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for prm in m.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g))
    names = tuple(n for n, _ in m.named_parameters())
    with tempfile.TemporaryDirectory(prefix="harness-onnx-") as folder:
        path = os.path.join(folder, "moe_decoder.onnx")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter is chosen on purpose
            torch.onnx.export(_Fixed(m, nx), _example_inputs(cfg), path, dynamo=False, export_params=False,
                              keep_initializers_as_inputs=True, do_constant_folding=False,
                              input_names=INPUTS, output_names=OUTPUTS,
                              dynamic_axes=DYNAMIC, opset_version=OPSET)
        with open(path, "rb") as fh:
            model = fh.read()
    return model, names


def providers(device: str) -> list:
    if device == "cuda":
        return [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


@functools.lru_cache(maxsize=None)
def session(cfg: ModelConfig, nx: Numerics, device: str) -> Any:
    import onnxruntime as ort

    model, _ = exported(cfg, nx)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, torch.get_num_threads())
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(model, sess_options=opts, providers=providers(device))


def ort_forward(inp: Any, nx: Numerics) -> Callable:
    """A forward with the signature of MoEDecoder.forward that runs the exported graph."""
    sess = session(inp.cfg, nx, inp.device)
    _, names = exported(inp.cfg, nx)
    wanted = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    params = dict(model(inp.cfg, inp.weight_seed, "cpu").named_parameters())
    feed_w = {f"m.{n}": params[n].detach().numpy() for n in names if f"m.{n}" in wanted}

    def forward(ids, pos, mask, past_k, past_v, tie, forced, gap, scale, replay, replay_on, nx=None, rows=None):
        args = dict(zip(INPUTS, (ids, pos, mask, past_k, past_v, tie, forced, gap, scale, replay, replay_on)))
        feed = {k: v.detach().cpu().float().numpy() if v.is_floating_point() else v.detach().cpu().numpy()
                for k, v in args.items() if k in wanted}
        out = sess.run(OUTPUTS, {**feed, **feed_w})
        return tuple(torch.from_numpy(o).to(inp.device) for o in out)

    return forward


register(model_pairs.model_pair(
    "model.onnxruntime", "aligned", FP32, FP32, rollout_forward=ort_forward,
    description="float32 torch trainer vs the same model exported to ONNX and decoded in ONNX Runtime",
))
