"""A pair that names the weights it runs (`TargetPair.weights`: an HF pair on a checkpoint folder)
keeps their fingerprint in its repros; replayed after the folder was overwritten (RL runs overwrite
checkpoints), replay says the pair now runs other weights instead of a bare "now clean"."""

from __future__ import annotations

import json

PLUGIN = '''
import os
from pathlib import Path

import torch

from harness import Axes, Outcome, TargetPair, register

CKPT = Path(os.environ["WEIGHTS_FILE"])  # stands for a checkpoint folder


def build(case, device):
    scale = float(CKPT.read_text())  # the "weights"
    return {"x": case.randn((case.n_tokens, 16), "x", device=device), "s": scale}


register(TargetPair(name="weighted.engine", kind="op", expected="aligned", build=build,
                    trainer=lambda i: Outcome(logprobs=torch.log_softmax(i["x"], -1)),
                    rollout=lambda i: Outcome(logprobs=torch.log_softmax(i["x"] * i["s"], -1)),
                    axes=Axes(n_seqs=(1, 2), seq_len=(1, 4)), weights=lambda: CKPT.read_text().strip()))
'''


def test_a_repro_replayed_against_other_weights_says_so(tmp_path, harness_cli):
    plugin, weights = tmp_path / "weighted.py", tmp_path / "weights.txt"
    plugin.write_text(PLUGIN)
    weights.write_text("0.5")  # an engine bug that these weights show
    env = {"WEIGHTS_FILE": str(weights)}
    rc, out, err = harness_cli("fuzz", "--plugin", str(plugin), "weighted.engine", "--max-examples", "5", "--seed", "1",
                               "--corpus", str(tmp_path / "corpus"), "--no-tracking", cwd=tmp_path, env=env)
    assert rc == 1, (out, err)
    [repro] = (tmp_path / "corpus").rglob("*.json")
    assert json.loads(repro.read_text())["environment"]["pair_weights"] == "0.5"
    rc, out, err = harness_cli("replay", "--plugin", str(plugin), str(repro), cwd=tmp_path, env=env)
    assert rc == 1 and "other weights" not in out + err, (out, err)  # the same weights: nothing to say
    weights.write_text("1.0")  # the folder overwritten: the divergence is gone with those weights
    rc, out, err = harness_cli("replay", "--plugin", str(plugin), str(repro), "--json", cwd=tmp_path, env=env)
    assert rc == 0, (out, err)
    assert "pair weighted.engine now runs other weights than this repro was recorded with (fingerprint 0.5 then, " \
           "1.0 now" in err
    assert json.loads(out)[0]["weights_changed"] is True
    rc, out, err = harness_cli("replay", "--plugin", str(plugin), str(repro), cwd=tmp_path, env=env)
    assert rc == 0 and (out + err).count("now runs other weights") == 1, (out, err)  # once, on its replay line
    assert "  warning: pair weighted.engine now runs other weights" in out


def test_an_hf_pair_on_a_checkpoint_names_its_weights(tmp_path):
    import pytest

    pytest.importorskip("transformers", reason="the Hugging Face backend needs transformers (the hf extra)")
    from targets.hf import FP32, HFModel, hf_pair
    from targets.hf.backend import base_model
    from targets.hf.configs import TINY

    ckpt = tmp_path / "ckpt"
    base_model(HFModel.from_config(TINY["qwen3_moe"], init_seed=5)).save_pretrained(ckpt)
    assert hf_pair("test.weights.ckpt", str(ckpt), FP32, FP32).weights() == HFModel.from_pretrained(ckpt).fingerprint()
    # a config-built model: its config, init and seed name it, so a config changed under the same pair
    # name is other weights too (a repro of it replayed "now clean" and could be closed as fixed)
    config = hf_pair("test.weights.config", TINY["qwen3_moe"], FP32, FP32).weights()
    assert config == HFModel.from_config(TINY["qwen3_moe"]).fingerprint() and config
    deeper = {**TINY["qwen3_moe"], "num_hidden_layers": TINY["qwen3_moe"]["num_hidden_layers"] + 1}
    assert hf_pair("test.weights.config", deeper, FP32, FP32).weights() != config
    assert hf_pair("test.weights.config", HFModel.from_config(TINY["qwen3_moe"], init_seed=1), FP32,
                   FP32).weights() != config


def test_a_repro_clean_only_on_other_weights_cannot_be_closed_as_fixed(tmp_path, harness_cli, monkeypatch):
    import pytest

    from harness.corpus import load_repro
    from harness.errors import UsageError
    from harness.mlflow_tracking.lifecycle import verify_fixed

    plugin, weights = tmp_path / "weighted.py", tmp_path / "weights.txt"
    plugin.write_text(PLUGIN.replace("weighted.engine", "weighted.close"))
    weights.write_text("0.5")
    env = {"WEIGHTS_FILE": str(weights)}
    rc, out, err = harness_cli("fuzz", "--plugin", str(plugin), "weighted.close", "--max-examples", "5", "--seed", "1",
                               "--corpus", str(tmp_path / "corpus"), "--no-tracking", cwd=tmp_path, env=env)
    assert rc == 1, (out, err)
    [path] = (tmp_path / "corpus").rglob("*.json")
    weights.write_text("1.0")  # clean now, but only because the weights changed
    monkeypatch.setenv("WEIGHTS_FILE", str(weights))
    with pytest.raises(UsageError, match="replays clean here, but pair weighted.close now runs other weights"):
        verify_fixed(load_repro(path), (str(plugin),))


def test_an_hf_pair_on_a_dense_model_that_differs_only_in_moe_components_is_refused():
    """A router or experts setting on a model without experts changes nothing: a pair whose paths
    differ only there would report "clean" while testing nothing."""
    import pytest

    pytest.importorskip("transformers", reason="the Hugging Face backend needs transformers (the hf extra)")
    from harness.errors import UsageError
    from targets.hf import BF16, FP32, hf_pair
    from targets.hf.configs import TINY

    for rollout in (FP32.replace(router="bfloat16"), FP32.replace(experts="grouped_mm")):
        with pytest.raises(UsageError, match="differ only in (router|experts), which MoE models have"):
            hf_pair("dense.moe_only", TINY["qwen3"], FP32, rollout)
    hf_pair("dense.bf16", TINY["qwen3"], FP32, BF16)  # (router too, but the body differs: a real pair)
    hf_pair("moe.router_bf16", TINY["qwen3_moe"], FP32, FP32.replace(router="bfloat16"))  # a MoE model has one
