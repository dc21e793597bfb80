"""Detection quality of the op target library: every demonstration is caught and shrunk well, and
every aligned pair stays clean.

One generic test over the registry's op pairs of the library's families: a `diverges` pair must be
caught by a campaign with a fixed seed within 200 examples; an `aligned` pair must run 300 examples
without a finding. Then short specific tests that each demonstration's repro is minimal along the
axes its bug needs (checked directly: removing any sequence, or shortening any sequence by one,
no longer diverges).
"""

from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path

import pytest
import torch

from harness import REGISTRY, Case
from harness.execute import DEFAULT_THRESHOLD, Symptom, run_case
from harness.fuzz import CampaignConfig, PairResult, run_campaign
from harness.tracking import NullTracker

FAMILIES = ("linear", "rmsnorm", "rotary", "attention", "lm_head", "router", "router_topk", "moe_aggregate",
            "tp_reduce")
SEED = 1  # campaign seed of every quality campaign
CAUGHT_WITHIN = 200  # examples a demonstration gets
CLEAN_FOR = 300  # examples an aligned pair must survive

pytestmark = pytest.mark.slow


def op_pairs():
    return [p for p in REGISTRY.all() if p.kind == "op" and p.name.split(".")[0] in FAMILIES]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread per test process: with xdist on 2 cores, more threads only spin."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@functools.lru_cache(maxsize=None)
def campaign(name: str, max_examples: int) -> PairResult:
    pair = REGISTRY.get(name)
    with tempfile.TemporaryDirectory() as corpus:
        cfg = CampaignConfig(pairs=[pair], seed=SEED, max_examples=max_examples, corpus=Path(corpus), device="cpu")
        return run_campaign(cfg, NullTracker(), log=lambda msg: None).results[0]


def finding_case(name: str) -> Case:
    result = campaign(name, CAUGHT_WITHIN)
    assert result.verdict == "caught", f"{name}: {result.verdict}"
    return result.findings[0].case


def diverges(name: str, case: Case) -> bool:
    return run_case(REGISTRY.get(name), case, "cpu").symptom is Symptom.DIVERGENCE


def smaller_neighbours(case: Case) -> list[Case]:
    """Each case with one sequence removed, and each with one sequence shortened by one token."""
    out = []
    n = case.batch_size
    for i in range(n):
        if n > 1:
            lens = case.seq_lens[:i] + case.seq_lens[i + 1:]
            order = tuple(j - (j > i) for j in case.packing_order if j != i)
            cap = case.row_capacity if case.row_capacity >= max(lens) else 0
            out.append(case.replace(seq_lens=lens, probe=min(case.probe, n - 2),
                                    order=() if order == tuple(range(n - 1)) else order, row_capacity=cap))
        if case.seq_lens[i] > 1:
            lens = tuple(m - (j == i) for j, m in enumerate(case.seq_lens))
            out.append(case.replace(seq_lens=lens))
    return out


def assert_locally_minimal(name: str, case: Case) -> None:
    assert diverges(name, case)
    still = [c.one_line() for c in smaller_neighbours(case) if diverges(name, c)]
    assert not still, f"{name}: smaller cases still diverge: {still}"


# ---------------------------------------------------------------------------------------------
# The generic test over the registry
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [p.name for p in op_pairs()])
def test_op_pair_verdict(name):
    pair = REGISTRY.get(name)
    if "cpu" not in pair.devices:
        pytest.skip(f"{name} runs only on {pair.devices}")
    if pair.expected == "diverges":
        result = campaign(name, CAUGHT_WITHIN)
        assert result.verdict == "caught", f"{name}: {result.verdict} in {result.examples} examples"
        assert all(f.symptom is Symptom.DIVERGENCE and f.shrink_complete for f in result.findings)
    else:
        result = campaign(name, CLEAN_FOR)
        assert result.verdict == "clean", [f"{f.symptom.value} k3={f.k3:.3g} {f.case.one_line()}" for f in result.findings]
        assert result.examples >= 0.9 * CLEAN_FOR  # Hypothesis skips a few duplicates, no more
        assert result.max_k3 <= DEFAULT_THRESHOLD


def test_library_covers_eight_families():
    families = {p.name.split(".")[0] for p in op_pairs()}
    assert {"linear", "rmsnorm", "rotary", "attention", "lm_head", "router", "moe_aggregate", "tp_reduce"} <= families
    for fam in families:
        verdicts = {p.expected for p in op_pairs() if p.name.startswith(fam + ".") and "cpu" in p.devices}
        assert verdicts == {"aligned", "diverges"}, f"{fam}: {verdicts}"


# ---------------------------------------------------------------------------------------------
# Minimal repros, along the axes each bug needs
# ---------------------------------------------------------------------------------------------
def test_packed_positions_repro_keeps_two_sequences_in_one_row():
    case = finding_case("rotary.packed_positions")
    assert case.batch_size == 2 and len(case.packed_rows()) == 1
    assert case.params["start"] > 0  # invisible at small positions: the repro names a large one
    assert_locally_minimal("rotary.packed_positions", case)


def test_mask_leak_repro_keeps_two_sequences_in_one_row():
    case = finding_case("attention.mask_leak")
    assert case.batch_size == 2 and len(case.packed_rows()) == 1
    assert_locally_minimal("attention.mask_leak", case)


def test_bf16_angles_repro_is_one_sequence_past_exact_bf16_integers():
    case = finding_case("rotary.bf16_angles")
    assert case.batch_size == 1 and case.params["start"] >= 256  # bf16 integers are exact below 256
    assert_locally_minimal("rotary.bf16_angles", case)


def test_router_topk_bf16_shrinks_to_one_token_within_bf16_rounding():
    case = finding_case("router_topk.bf16")
    assert case.seq_lens == (1,) and case.tie_fraction > 0
    pair = REGISTRY.get("router_topk.bf16")
    inp = pair.build(case, "cpu")
    logits = inp["x"] @ inp["w_router"]  # (1, E) fp32
    level = float(logits.topk(case.top_k, -1).values[0, -1])
    assert case.tie_gap <= torch.finfo(torch.bfloat16).eps * abs(level)  # below one bf16 step


def test_tie_break_repro_is_one_token_at_an_exact_tie():
    case = finding_case("router.tie_break")
    assert case.seq_lens == (1,) and case.tie_gap == 0.0 and case.tie_fraction > 0


def test_single_token_demonstrations():
    for name in ("lm_head.temperature_order", "rmsnorm.eps_placement", "router.no_renorm", "moe_aggregate.no_replay"):
        case = finding_case(name)
        assert case.seq_lens == (1,), f"{name}: {case.one_line()}"
    assert finding_case("lm_head.temperature_order").params["temperature"] != 1.0
    assert finding_case("rmsnorm.eps_placement").params["log10_rms"] < 0  # only small activations show it


def test_replay_fixes_flips_not_gate_precision():
    case = finding_case("router.bf16_scores")
    no_replay = run_case(REGISTRY.get("router.bf16_scores"), case, "cpu").divergence
    replay = run_case(REGISTRY.get("router.replay"), case, "cpu").divergence
    assert no_replay.flip_rate + no_replay.tie_flip_rate > 0 and no_replay.k3_kl > DEFAULT_THRESHOLD
    assert replay.flip_rate == 0 and replay.tie_flip_rate == 0
    assert 0 < replay.k3_kl < DEFAULT_THRESHOLD  # the gate weights still differ in precision
    # ... and in a full MoE combine in bf16, replay does not bring the pair under the threshold
    assert campaign("moe_aggregate.replay", CAUGHT_WITHIN).verdict == "caught"


def test_fp32_twin_of_the_position_bug_is_invisible():
    case = finding_case("rotary.packed_positions")
    k3 = run_case(REGISTRY.get("rotary.packed_positions_fp32"), case, "cpu").k3
    assert math.isfinite(k3) and k3 < DEFAULT_THRESHOLD * 1e-2
