"""Module patches: a user's own modules (an engine's MoE kernel) swapped into one path of a real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the HF backend needs transformers: pip install -e '.[hf]'")

from harness.errors import UsageError  # noqa: E402
from targets.hf import FP32, HFModel, Numerics, register_patch  # noqa: E402
from targets.hf.backend import PATCHES, base_model, path_model  # noqa: E402
from targets.hf.configs import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).with_name("plugin_patch.py")


def test_readme_shows_the_patch_plugin_complete():
    assert PLUGIN.read_text().strip() in (ROOT / "README.md").read_text()


def test_a_patch_must_be_registered_before_numerics_name_it_and_names_are_checked():
    with pytest.raises(UsageError, match="not a registered patch.*register_patch"):
        Numerics(patch="never_registered")
    for bad in ("", "none", "has space", "a/b"):
        with pytest.raises(UsageError, match="not a usable patch name"):
            register_patch(bad, lambda m: m)
    with pytest.raises(UsageError, match="must be a function"):
        register_patch("not_callable", 3)

    def first(model):
        return model

    def second(model):
        return model

    try:
        register_patch("test_conflict", first)
        register_patch("test_conflict", first)  # the same function again (a plugin imported twice): fine
        with pytest.raises(UsageError, match="already registered"):
            register_patch("test_conflict", second)
        assert Numerics(patch="test_conflict").model_key[-1] == "test_conflict"
    finally:
        PATCHES.pop("test_conflict", None)


def test_the_patch_changes_only_its_own_paths_copy_and_the_routers_stay_hooked():
    seen = []

    def mark(model):
        seen.append(model)
        model.patched_by_test = True

    register_patch("test_mark", mark)
    try:
        spec = HFModel.from_config(TINY["qwen3_moe"], init_seed=5)
        patched = path_model(spec, FP32.replace(patch="test_mark").model_key, "cpu")
        plain = path_model(spec, FP32.model_key, "cpu")
        assert seen == [patched.model] and getattr(patched.model, "patched_by_test", False)
        assert not hasattr(plain.model, "patched_by_test") and not hasattr(base_model(spec), "patched_by_test")
        assert len(patched.gates) == len(plain.gates) == TINY["qwen3_moe"]["num_hidden_layers"]
    finally:
        PATCHES.pop("test_mark", None)


def test_an_engine_kernel_patched_into_the_rollout_is_caught_and_triage_names_the_patch(tmp_path, harness_cli):
    """The README's plugin, in isolated workers (the default): the worker imports the plugin, which
    registers the patches before its pairs name them."""
    code, out, err = harness_cli("fuzz", "patched.*", "--plugin", str(PLUGIN), "--max-examples", "30", "--seed", "1",
                                 "--no-tracking", "--corpus", str(tmp_path / "corpus"), timeout=600)
    assert code == 1, out + err  # a finding (the demonstration's) ...
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("patched.")}
    assert "caught" in lines["patched.bf16_combine"] and "clean" in lines["patched.reference"], out  # ... only
    [repro] = (tmp_path / "corpus" / "patched.bf16_combine").glob("*.json")
    code, out, err = harness_cli("replay", "--plugin", str(PLUGIN), str(repro))
    assert code == 1 and "bit-for-bit yes" in out, out + err
    code, out, err = harness_cli("triage", "--plugin", str(PLUGIN), str(repro), "--no-tracking", "--json",
                                 "--reports", str(tmp_path / "reports"), timeout=600)
    assert code == 0, out + err
    result = json.loads(out[out.index("{"):])
    text = json.dumps(result)
    assert "module patch" in text and "mlp.experts" in text, text[:3000]
