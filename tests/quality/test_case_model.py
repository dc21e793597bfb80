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
PREFIX = PLUGIN.with_name("prefix_cache.py")

pytestmark = pytest.mark.slow


def campaign(name: str, max_examples: int, plugin: Path = PLUGIN):
    REGISTRY.load_plugin(str(plugin))
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


def test_groups_of_samples_of_one_prompt_reach_a_prefix_cache_and_its_bug_shrinks_to_one_group_of_two():
    """GRPO-style groups (`Axes(prompt_group=(1, 4))`): the sequences of a group share their prompt
    bit for bit, a rollout whose prefix cache serves a group's later samples stays aligned, and a
    cache-hit bug is caught and shrunk to the one trigger: two one-token samples of one prompt (the
    first fills the cache, the second hits it; either alone is clean)."""
    clean = campaign("example.prefix_cache", 40, PREFIX)
    assert clean.verdict == "clean" and clean.examples >= 20, clean.verdict
    result = campaign("example.prefix_cache_hit_bug", 60, PREFIX)
    assert result.verdict == "caught"
    (finding,) = result.findings
    case = finding.case
    assert case.seq_lens == (1, 1) and len(set(case.prompt_ids)) == 1, case.one_line()
    from harness.execute import run_case

    pair = REGISTRY.get("example.prefix_cache_hit_bug")
    assert not any(run_case(pair, case.drop_sequence(i)).failed for i in (0, 1))  # either sample alone: clean
    assert run_case(pair, case.replace(prompt_ids=())).failed is False  # two prompts: no hit, clean


def test_a_verdict_over_sequences_catches_a_cache_hit_bug_the_batch_mean_dilutes(tmp_path, harness_cli):
    """`verdict_over="sequence"`: a cache that keeps the prompt state in fp8 puts each later sample of
    a prompt near the line and leaves the first exact. On one group of four samples the batch mean is
    under the line and the worst sequence's over it; a campaign of the pair judged per sequence
    catches it, shrinks it to a group whose worst sequence is a cache hit, and its repro records the
    verdict, replays, and shows which mean it judged."""
    import json

    from harness.case import Case
    from harness.execute import run_case

    REGISTRY.load_plugin(str(PREFIX))
    per_seq, batch = REGISTRY.get("example.prefix_cache_fp8_hit"), REGISTRY.get("example.prefix_cache_fp8_hit.batch")
    case = Case(seed=0, seq_lens=(7, 7, 1, 5), prompt_lens=(10,) * 4, prompt_ids=(0,) * 4, logit_scale=8.0)
    by_seq, by_batch = run_case(per_seq, case), run_case(batch, case)
    d = by_seq.divergence
    assert by_seq.failed and not by_batch.failed, (by_seq.headline, by_batch.headline)
    assert d.k3_expected < 1e-3 < d.k3_expected_seq_max, (d.k3_expected, d.k3_expected_seq_max)
    assert f"worst sequence {d.worst_sequence}; batch mean" in by_seq.headline and d.worst_sequence > 0  # a hit
    k3e = d.per_token["k3_expected"]
    assert k3e[:7].max() < 1e-9  # the first sample filled the cache: exact but for float32 layout noise

    result = campaign("example.prefix_cache_fp8_hit", 60, PREFIX)
    assert result.verdict == "caught"
    (finding,) = result.findings
    small = finding.case
    assert len(set(small.prompt_ids)) == 1 and small.batch_size == 2, small.one_line()  # one fill, one hit
    assert run_case(per_seq, small.drop_sequence(0)).failed is False  # the hit alone is a miss: clean

    # the twin judged over the batch records what its worst sequences reached (a MISSED one's hint reads it)
    twin = campaign("example.prefix_cache_fp8_hit.batch", 20, PREFIX)
    assert twin.max_seq_score >= twin.max_score > 0 and result.max_seq_score == 0.0  # (per sequence: judged)

    corpus = tmp_path / "corpora"
    code, out, err = harness_cli("fuzz", "example.prefix_cache_fp8_hit", "--plugin", str(PREFIX), "--seed", "1",
                                 "--max-examples", "60", "--corpus", str(corpus), "--no-tracking", "--no-isolation")
    assert code == 1, out + err
    (repro,) = corpus.rglob("*.json")
    assert json.loads(repro.read_text())["metrics"]["verdict_over"] == "sequence"
    code, out, err = harness_cli("replay", str(repro), "--plugin", str(PREFIX))
    assert "(worst sequence 1; batch mean" in out and "bit-for-bit yes" in out, out + err  # the hit of two
    code, out, err = harness_cli("show", str(repro), "--plugin", str(PREFIX))
    assert code == 0 and "the worst sequence's mean" in out, out + err
