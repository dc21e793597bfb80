"""A user's own checkpoint in a <= 20-line plugin (the README's, verbatim), fuzzed via --plugin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the HF backend needs transformers: pip install -e '.[hf]'")

from targets.hf import HFModel  # noqa: E402
from targets.hf.configs import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).with_name("plugin_checkpoint.py")


def test_readme_shows_the_plugin_complete_and_it_is_short():
    text = PLUGIN.read_text()
    assert len(text.splitlines()) <= 20
    assert text.strip() in (ROOT / "README.md").read_text()


def test_plugin_fuzzes_a_saved_checkpoint(tmp_path, harness_cli):
    ckpt = tmp_path / "my-model"
    built = HFModel.from_config(TINY["qwen3_moe"], init_seed=11)
    saved = built.save_pretrained(ckpt)  # the public way to turn a config-built model into a checkpoint
    assert saved.path == str(ckpt.resolve())
    # the checkpoint's pair computes exactly what the config-built model's does
    import torch

    from harness import Case
    from harness.execute import run_paths
    from targets.hf import FP32, hf_pair

    case = Case(seed=5, seq_lens=(3, 2), prompt_lens=(2, 4))
    a = run_paths(hf_pair("t.built", built, FP32, FP32), case, "cpu")
    b = run_paths(hf_pair("t.saved", saved, FP32, FP32), case, "cpu")
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    env = {"MY_CHECKPOINT": str(ckpt)}
    code, out, err = harness_cli("list", "--plugin", str(PLUGIN), env=env)
    assert code == 0 and "mine.bf16_rollout.replay" in out and "mine.bf16_body" in out, err
    code, out, err = harness_cli("fuzz", "mine.aligned", "mine.bf16_rollout", "--plugin", str(PLUGIN),
                                 "--max-examples", "25", "--seed", "1", "--no-tracking", "--corpus",
                                 str(tmp_path / "corpus"), env=env,
                                 timeout=600)
    assert code == 1, out + err  # the bf16 demonstration is caught ...
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("mine.")}
    assert "caught" in lines["mine.bf16_rollout"] and "clean" in lines["mine.aligned"], out
    [repro] = (tmp_path / "corpus" / "mine.bf16_rollout").glob("*.json")
    assert json.loads(repro.read_text())["pair"] == "mine.bf16_rollout"
    # a checkpoint that is not there: its pairs are listed (one warning), and each cannot run (exit 2)
    gone = {"MY_CHECKPOINT": str(tmp_path / "none")}
    code, out, err = harness_cli("list", "--plugin", str(PLUGIN), env=gone)
    assert code == 0 and "mine.aligned" in out and err.count("not a checkpoint directory") == 1, err
    code, out, err = harness_cli("fuzz", "mine.aligned", "--plugin", str(PLUGIN), "--max-examples", "5",
                                 "--no-tracking", "--corpus", str(tmp_path / "corpus2"), env=gone)
    assert code == 2 and "CANNOT RUN" in out and "not a checkpoint directory" in err and "Traceback" not in err, \
        out + err
    assert err.count("are registered, and each case of them cannot run") == 1, err  # (not again by the worker)
    assert not (tmp_path / "corpus2").exists() or not any((tmp_path / "corpus2").rglob("*.json"))
