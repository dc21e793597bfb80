"""The RL-batch case model end to end: the README's prompt/decode/sampling plugin is fuzzed over
prompts, responses and sampling knobs; its aligned pair stays clean and its planted engine default
(top-k 20 sampling reported as the distribution) is caught and shrunk to the simplest trigger."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from harness import REGISTRY
from harness.fuzz import CampaignConfig, run_campaign
from harness.tracking import NullTracker

PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "decode_sampling.py"

pytestmark = pytest.mark.slow


def campaign(name: str, max_examples: int):
    REGISTRY.load_plugin(str(PLUGIN))
    with tempfile.TemporaryDirectory() as corpus:
        cfg = CampaignConfig(pairs=[REGISTRY.get(name)], seed=1, max_examples=max_examples, corpus=Path(corpus),
                             device="cpu", write_corpus=False, isolation=False)  # (as isolated: test_fuzz.py)
        return run_campaign(cfg, NullTracker(), log=lambda msg: None).results[0]


def test_aligned_decode_pair_stays_clean_over_prompts_responses_and_sampling():
    result = campaign("example.decode", 40)
    assert result.verdict == "clean" and result.examples >= 20, result.verdict


def test_truncated_sampling_is_caught_and_shrunk_to_its_simplest_trigger():
    result = campaign("example.decode_topk_default", 100)
    assert result.verdict == "caught"
    (finding,) = result.findings
    case = finding.case
    assert case.batch_size == 1 and case.prompt_lens == ()
    assert case.temperature == 1.0 and case.top_p == 1.0 and case.sample_top_k == 0  # neutral knobs
    assert finding.evaluation.divergence.kl > 10 * 1e-3  # the exact KL sees the truncation
