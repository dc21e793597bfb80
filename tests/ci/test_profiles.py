"""Campaign profiles: the registry, seed policies (fixed, fresh, run-id) and how explicit options win."""

from __future__ import annotations

import pytest

from harness.errors import UsageError
from harness.profiles import (PROFILES, RUN_ID_ENV, SEED_POLICIES, campaign_settings, get_profile, nightly_seed,
                              resolve_seed)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_is_well_formed(name):
    p = PROFILES[name]
    assert p.name == name and p.description
    assert p.max_examples >= 1
    assert p.budget_per_pair is None or p.budget_per_pair > 0
    assert p.seed_policy in SEED_POLICIES
    assert (p.seed is not None) == (p.seed_policy == "fixed")


def test_cli_offers_every_profile():
    from harness.cli import fuzz

    opt = next(o for o in fuzz.params if o.name == "profile")
    assert sorted(opt.type.choices) == sorted(PROFILES)


def test_unknown_profile_names_the_choices():
    with pytest.raises(UsageError, match="dev, ci, nightly"):
        get_profile("weekly")


def test_nightly_seed_is_a_function_of_the_run_id():
    assert nightly_seed("1234") == nightly_seed("1234")
    assert nightly_seed("1234") != nightly_seed("1235")
    assert 0 <= nightly_seed("1234") < 2**32


def test_seed_precedence():
    nightly, ci, dev = get_profile("nightly"), get_profile("ci"), get_profile("dev")
    assert resolve_seed(nightly, explicit=5, run_id="9").seed == 5  # an explicit seed wins
    assert resolve_seed(ci).seed == ci.seed  # fixed
    assert resolve_seed(dev).seed is None  # fresh
    assert resolve_seed(nightly, run_id="9").seed == nightly_seed("9")
    env = {"GITHUB_RUN_ID": "777"}
    choice = resolve_seed(nightly, env=env)
    assert choice.seed == nightly_seed("777") and "GITHUB_RUN_ID" in choice.origin and "--seed" in choice.origin
    assert resolve_seed(nightly, env={"HARNESS_RUN_ID": "1", "GITHUB_RUN_ID": "2"}).seed == nightly_seed("1")
    assert resolve_seed(nightly, env={}).seed is None  # no run id anywhere: fresh, and it says why
    assert set(RUN_ID_ENV) >= {"HARNESS_RUN_ID", "GITHUB_RUN_ID"}


def test_profile_budget_is_per_pair_and_explicit_values_win():
    s = campaign_settings("ci", n_pairs=3, max_examples=None, budget=None, seed=None)
    ci = get_profile("ci")
    assert (s.max_examples, s.budget, s.seed) == (ci.max_examples, ci.budget_per_pair * 3, ci.seed)
    s = campaign_settings("ci", n_pairs=3, max_examples=7, budget=2.0, seed=11)
    assert (s.max_examples, s.budget, s.seed) == (7, 2.0, 11)
    s = campaign_settings(None, n_pairs=3, max_examples=None, budget=None, seed=None)
    assert (s.max_examples, s.budget, s.seed) == (100, None, None)  # no profile: harness fuzz's defaults
    # a budget is filled with rounds unless examples are asked for (explicitly, or by a capping profile)
    assert not s.fill_budget and not get_profile("ci").fill_budget
    assert campaign_settings(None, 3, None, 60.0, None).fill_budget
    assert not campaign_settings(None, 3, 50, 60.0, None).fill_budget
    assert not campaign_settings("ci", 3, None, None, None).fill_budget
    assert campaign_settings("nightly", 3, None, None, None).fill_budget
    assert not campaign_settings("nightly", 3, 20, None, None).fill_budget


def test_cli_fuzz_profile_uses_the_run_id(harness_cli, tmp_path):
    rc, out, err = harness_cli("fuzz", "router_topk.replay", "--profile", "nightly", "--max-examples", "3",
                               "--budget", "20", "--no-tracking", "--corpus", str(tmp_path),
                               env={"HARNESS_RUN_ID": "night-1"})
    seed = nightly_seed("night-1")
    assert rc == 0, err
    assert f"seed {seed} derived from run id night-1 (HARNESS_RUN_ID)" in err
    assert f"campaign seed {seed}" in err and f"seed {seed}." in out
