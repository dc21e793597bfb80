"""Named campaign settings: `dev`, `ci` and `nightly`, for `harness fuzz --profile` and
`pytest --harness-fuzz --harness-profile`.

A profile fills in what the command line leaves unset: cases per pair, wall seconds per pair and
where the campaign seed comes from. An option given explicitly always wins over the profile.

These are the harness's own settings, not Hypothesis profiles. Hypothesis loads its built-in `ci`
profile whenever the `CI` environment variable is set (derandomized, no database); the fuzz engine
passes every Hypothesis setting explicitly (`harness.fuzz.fuzz_pair`: seeded, not derandomized, no
database, targeting on k3 in every profile), so `CI=true` changes nothing about what a campaign
draws. The seed policy says where the campaign seed comes from:

- `fixed`: the profile's own seed, the same on every run (pull requests compare like with like);
- `fresh`: a new random seed per run, printed and stored with the campaign;
- `run-id`: derived from a run id (`nightly_seed`), so every shard of one night agrees on the seed
  without talking to each other, each night gets a new one, and any night can be rerun exactly
  from its run id or from the printed seed. The run id is the explicit value if one is given, else
  `$HARNESS_RUN_ID`, `$GITHUB_RUN_ID` or `$SLURM_ARRAY_JOB_ID` / `$SLURM_JOB_ID`; with none of them
  the seed is fresh (and printed).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from .errors import UsageError

SEED_POLICIES = ("fixed", "fresh", "run-id")
RUN_ID_ENV = ("HARNESS_RUN_ID", "GITHUB_RUN_ID", "SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID")


@dataclass(frozen=True)
class Profile:
    name: str  # what --profile / --harness-profile takes
    max_examples: int  # cases per pair before shrinking (a time budget may stop a pair earlier)
    budget_per_pair: float | None  # wall seconds per pair, shrinking included; None = no time limit
    seed_policy: str  # "fixed", "fresh" or "run-id" (see the module docstring)
    seed: int | None  # the seed of a "fixed" profile
    description: str  # one line for --help and the summary
    # run further freshly seeded rounds of max_examples while a pair's time is left (`fuzz.fill_budget`)
    fill_budget: bool = False


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile(name="dev", max_examples=25, budget_per_pair=10.0, seed_policy="fresh", seed=None,
            description="quick local check: a few cases per pair, a fresh seed"),
    Profile(name="ci", max_examples=200, budget_per_pair=30.0, seed_policy="fixed", seed=20240601,
            description="pull requests: a few minutes in all, the same seed on every run"),
    # nightly: rounds of 1000 examples until the budget (one run of a million examples would never
    # reach Hypothesis's target phase, which starts at half of max_examples)
    Profile(name="nightly", max_examples=1000, budget_per_pair=300.0, seed_policy="run-id", seed=None,
            description="nightly: a time budget per pair, filled with rounds, a fresh seed per night derived from "
            "the run id", fill_budget=True),
)}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise UsageError(f"no campaign profile named {name!r}; choose one of {', '.join(PROFILES)} "
                         "(see harness/profiles.py for what each sets).")
    return PROFILES[name]


def nightly_seed(run_id: str) -> int:
    """The campaign seed of a run id: a 32-bit number, the same for every shard of that run."""
    return int.from_bytes(hashlib.sha256(f"harness-nightly/{run_id}".encode()).digest()[:4], "little")


def run_id_from_env(env: dict | None = None) -> tuple[str, str] | None:
    """(run id, the variable it came from), from the first of RUN_ID_ENV that is set and not empty."""
    env = os.environ if env is None else env
    for var in RUN_ID_ENV:
        value = (env.get(var) or "").strip()
        if value:
            return value, var
    return None


@dataclass(frozen=True)
class SeedChoice:
    seed: int | None  # None: fresh (the engine draws one, prints it and stores it)
    origin: str  # one line saying where the seed came from, for the log
    night: str | None = None  # `night_uid` of the run id the seed came from (None: not derived from one)


def resolve_seed(profile: Profile | None, explicit: int | None = None, run_id: str | None = None,
                 env: dict | None = None) -> SeedChoice:
    """The campaign seed: an explicit seed wins; else the profile's policy; else fresh."""
    if explicit is not None:
        return SeedChoice(explicit, f"seed {explicit} (given)")
    if profile is None or profile.seed_policy == "fresh":
        return SeedChoice(None, "fresh seed")
    if profile.seed_policy == "fixed":
        return SeedChoice(profile.seed, f"seed {profile.seed} (fixed by profile {profile.name})")
    found = (run_id, "given") if run_id else run_id_from_env(env)
    if found is None:
        return SeedChoice(None, f"fresh seed (profile {profile.name}: no run id given and none of "
                                f"{', '.join(RUN_ID_ENV)} is set)")
    rid, source = found
    seed = nightly_seed(rid)
    return SeedChoice(seed, f"seed {seed} derived from run id {rid} ({source}); rerun this night with "
                            f"--seed {seed} or HARNESS_RUN_ID={rid}", night=night_uid(rid))


def shard_seed_warning(shard: tuple[int, int] | None, seed: int | None) -> str:
    """One warning line for a shard job whose campaign seed is fresh (""): each job would draw its own, so
    the shards would not be the disjoint split of one campaign that sharding promises."""
    if shard is None or shard[1] < 2 or seed is not None:
        return ""
    return (f"warning: shard {shard[0]}/{shard[1]} with a fresh seed: every shard job draws its own, so together the "
            "shards are not the split of one campaign (each runs its share under a seed of its own, and no night "
            f"judges them together). Give every job the same seed: --seed N (pytest: --harness-seed N), or the nightly "
            f"profile with a run id every job sees ({', '.join(RUN_ID_ENV)}; pytest: --harness-run-id).")


def night_uid(run_id: str) -> str:
    """What a regression counts as seen by (MLflow's `seen_count`) in a campaign whose seed came from a
    run id: the run, not each shard's process, so the N shards of one night count it once."""
    return "run-" + hashlib.sha256(f"harness-night/{run_id}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Settings:
    max_examples: int  # cases per pair
    budget: float | None  # wall seconds for the whole campaign (run_campaign splits it over the pairs)
    seed: int | None  # None: fresh
    origin: str  # where the seed came from, for the log
    fill_budget: bool = False  # spend the budget in rounds (`CampaignConfig.fill_budget`)
    night: str | None = None  # `SeedChoice.night`


def fills_budget(profile: Profile | None, max_examples: int | None, budget: float | None) -> bool:
    """Whether a campaign fills its budget with rounds (`fuzz.CampaignConfig.fill_budget`): it has a
    budget (given, or the profile's) and no number of examples was asked for, explicitly or by a
    profile that caps (a profile says so by its `fill_budget`)."""
    if max_examples is not None:
        return False
    if profile is not None:
        return profile.fill_budget and (budget is not None or profile.budget_per_pair is not None)
    return budget is not None


def campaign_settings(profile_name: str | None, n_pairs: int, max_examples: int | None, budget: float | None,
                      seed: int | None, run_id: str | None = None, default_max_examples: int = 100) -> Settings:
    """What a `harness fuzz` campaign runs with: explicit values (not None) win over the profile.

    The profile's time budget is per pair; a campaign's `--budget` is for the whole campaign, so it
    becomes budget_per_pair x the number of pairs this shard runs.
    """
    profile = get_profile(profile_name) if profile_name else None
    fill = fills_budget(profile, max_examples, budget)
    if max_examples is None:
        max_examples = profile.max_examples if profile else default_max_examples
    if budget is None and profile is not None and profile.budget_per_pair is not None:
        budget = profile.budget_per_pair * max(1, n_pairs)
    choice = resolve_seed(profile, seed, run_id)
    return Settings(max_examples, budget, choice.seed, choice.origin, fill_budget=fill, night=choice.night)
