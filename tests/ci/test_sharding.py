"""Sharding: N shards of one campaign cover what one unsharded run covers, with no overlap.

What one unsharded run covers (harness.fuzz.shard_pairs): for campaign seed S, one Hypothesis
stream per selected pair, seeded pair_seed(S, pair). These tests check it on the real engine: the
cases every pair evaluates, unsharded, equal the cases it evaluates in whichever shard runs it,
and each pair runs in exactly one shard."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from harness import REGISTRY
from harness import fuzz
from harness.fuzz import CampaignConfig, run_campaign, shard_pairs


def _names(pairs):
    return [p.name for p in pairs]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 40])
def test_shards_partition_the_pairs(n):
    pairs = REGISTRY.all()
    shards = [_names(shard_pairs(pairs, (i, n))) for i in range(1, n + 1)]
    flat = [name for s in shards for name in s]
    assert sorted(flat) == sorted(_names(pairs))  # covered
    assert len(flat) == len(set(flat))  # no overlap
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # balanced
    # deterministic: independent of the order the pairs come in
    assert shards == [_names(shard_pairs(list(reversed(pairs)), (i, n))) for i in range(1, n + 1)]


def test_bad_shard_is_rejected():
    with pytest.raises(ValueError):
        shard_pairs(REGISTRY.all(), (3, 2))


@pytest.mark.slow
def test_two_shards_evaluate_exactly_the_cases_of_one_unsharded_run(monkeypatch, tmp_path):
    evaluated: list[tuple[str, str]] = []
    real = fuzz.run_case

    def spy(pair, case, *args, **kwargs):
        evaluated.append((pair.name, case.key()))
        return real(pair, case, *args, **kwargs)

    monkeypatch.setattr(fuzz, "run_case", spy)
    pairs = REGISTRY.select(["router_topk.*", "rmsnorm.aligned"])

    def campaign(shard):
        evaluated.clear()
        cfg = CampaignConfig(pairs=pairs, seed=3, max_examples=10, shard=shard, corpus=tmp_path / str(shard),
                             write_corpus=False)
        result = run_campaign(cfg, log=lambda msg: None)
        return Counter(evaluated), {r.pair for r in result.results}

    whole, whole_pairs = campaign(None)
    one, pairs_one = campaign((1, 2))
    two, pairs_two = campaign((2, 2))
    assert whole_pairs == set(_names(pairs)) and pairs_one and pairs_two
    assert not pairs_one & pairs_two  # no pair in both shards
    assert not set(one) & set(two)  # so no case evaluated twice
    assert one + two == whole  # and together exactly the unsharded run's cases


def test_plugin_shards_collect_disjoint_items(tmp_path):
    from tests.ci.test_pytest_plugin import run_pytest

    items = []
    for i in (1, 2):
        rc, out = run_pytest(["--harness-fuzz", "--collect-only", "-q", "--shard", f"{i}/2", "--harness-no-tracking",
                              "--harness-out", str(tmp_path)])
        assert rc == 0, out
        items.append(set(re.findall(r"harness-fuzz::([\w.]+)", out)))
    assert items[0] and items[1] and not items[0] & items[1]
    # the subprocesses see the built-in pairs only (this process may hold plugins other tests loaded)
    builtin = [p for p in REGISTRY.all() if p.source.startswith("targets.")]
    assert items[0] | items[1] == set(_names(builtin))


def test_shards_sharing_an_output_folder_keep_each_its_own_summary(tmp_path):
    from tests.ci.test_pytest_plugin import run_pytest

    for i in (1, 2):
        rc, out = run_pytest(["--harness-fuzz", "-q", "--shard", f"{i}/2", "--harness-no-tracking",
                              "--harness-pairs", "rmsnorm.aligned", "--harness-pairs", "rotary.aligned",
                              "--harness-max-examples", "3", "--harness-out", str(tmp_path / "out"),
                              "--harness-corpus", str(tmp_path / "corpus")])
        assert rc == 0, out
        assert f"summary: {tmp_path / 'out' / f'summary.shard{i}of2.md'}" in out, out
    names = sorted(p.name for p in (tmp_path / "out").glob("summary*"))
    assert names == ["summary.shard1of2.json", "summary.shard1of2.md", "summary.shard2of2.json",
                     "summary.shard2of2.md"], names


def test_a_shard_that_runs_some_streams_of_a_demonstration_does_not_call_it_missed(tmp_path, harness_cli):
    """Its other streams are other shards': not caught here is not MISSED (exit 0, said as such)."""
    code, out, err = harness_cli("fuzz", "router.topk_softmax", "--seed", "7", "--max-examples", "10", "--streams", "2",
                                 "--shard", "1/2", "--no-tracking", "--corpus", str(tmp_path / "c"))
    assert code == 0, err
    assert "not caught by this shard's streams (1/2): router.topk_softmax" in out and "missed demonstration" not in out
    assert "warning: demonstration pair(s) not caught" not in err
    assert "MISSED" not in out and "not caught by this shard's streams (1 of 2)" in out  # the table says so too (a
    # CI log grep for MISSED found it)
    assert "fresh seed" not in err  # (a given seed: the shards split one campaign)


def test_a_shard_with_nothing_to_run_says_so_and_one_with_a_fresh_seed_is_warned(tmp_path, harness_cli):
    code, out, err = harness_cli("fuzz", "router.topk_softmax", "--shard", "3/3", "--max-examples", "2", "--no-tracking",
                                 "--corpus", str(tmp_path / "c"))
    assert code == 0 and "shard 3/3 got no pair of this selection (1 pair(s) x 1 stream(s) for 3 shards)" in out, out
    code, out, err = harness_cli("fuzz", "rmsnorm.aligned", "--shard", "1/2", "--max-examples", "1", "--no-tracking",
                                 "--corpus", str(tmp_path / "c"))
    assert code == 0 and "warning: shard 1/2 with a fresh seed: every shard job draws its own" in err, err
    code, out, err = harness_cli("fuzz", "rmsnorm.aligned", "--shard", "1/0", "--no-tracking")
    assert code == 2 and "the number of shards must be at least 1" in err, err


def test_a_shards_campaign_run_lists_the_pairs_its_streams_run(tmp_path):
    """With streams, a shard runs some streams of every pair: its MLflow campaign run names them all
    (it named only the pairs a pair-wise cut gives it)."""
    from mlflow import MlflowClient

    from tests.ci.test_pytest_plugin import run_pytest

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rc, out = run_pytest(["--harness-fuzz", "-q", "--shard", "2/2", "--harness-streams", "2",
                          "--harness-pairs", "rmsnorm.aligned", "--harness-pairs", "rotary.aligned",
                          "--harness-pairs", "linear.aligned", "--harness-max-examples", "2",
                          "--harness-tracking-uri", uri, "--harness-out", str(tmp_path / "out"),
                          "--harness-corpus", str(tmp_path / "corpus")])
    assert rc == 0, out
    client = MlflowClient(uri)
    [camp] = client.search_runs([client.get_experiment_by_name("harness").experiment_id],
                                "tags.`harness.kind` = 'campaign'")
    assert camp.data.params["n_pairs"] == "3", camp.data.params
    assert camp.data.params["pairs"] == "linear.aligned,rmsnorm.aligned,rotary.aligned"


def test_a_repro_found_by_one_of_several_streams_names_its_stream(tmp_path, harness_cli):
    """Its counts are that stream's, not the pair's: `found` says which stream, and `show` too."""
    import json

    code, out, err = harness_cli("fuzz", "moe_aggregate.bf16", "--seed", "1", "--max-examples", "8", "--streams", "2",
                                 "--no-tracking", "--corpus", str(tmp_path / "c"))
    assert code == 1, err  # (a finding: a demonstration caught)
    [path] = sorted((tmp_path / "c").rglob("*.json"))
    found = json.loads(path.read_text())["found"]
    assert found["streams"] == 2 and found["stream"] in (0, 1), found
    code, out, err = harness_cli("show", str(path))
    assert f"(stream {found['stream']} of 2, counted from 0" in out, out
