"""The detection benchmark runs end to end on a few planted classes: the table and the plot are
written, the planted bugs are found by the harness, the fixed twins stay clean, and the planted
pairs never reach the global registry."""

from __future__ import annotations

import random

import pytest

from harness import REGISTRY
from harness.bench_detection import ClassSummary, Trial, censored_median, detection
from harness.bench_detection.planted import CLASSES, planted_classes
from harness.execute import run_case
from harness.strategies import uniform_cases

CLASSES_RUN = ("batch_switch", "temperature_twice", "exact_tie_order")


@pytest.mark.slow
def test_bench_writes_table_and_finds_the_planted_bugs(tmp_path):
    out, plot = tmp_path / "BENCHMARKS.md", tmp_path / "detection.png"
    out.write_text("# Benchmarks\n\n<!-- bench:other -->\nkept\n<!-- /bench:other -->\n")
    summaries = detection(CLASSES_RUN, seeds=1, cap=80, twin_cases=40, out=out, plot_path=plot)
    text = out.read_text()
    assert "<!-- bench:other -->\nkept" in text  # other sections are left alone
    assert "<!-- bench:detection -->" in text and "<!-- /bench:detection -->" in text
    for name in CLASSES_RUN:
        assert f"| {name}" in text
    assert plot.exists() and plot.stat().st_size > 1000
    for s in summaries:
        (t,) = s.trials
        assert t.harness is not None and t.harness <= 80, f"{s.pc.name}: not found by the harness"
        assert t.repro is not None and run_case(s.pc.buggy, t.repro).failed, f"{s.pc.name}: repro does not fail"
        assert t.twin_cases > 0 and t.twin_findings == 0, f"{s.pc.name}: its fixed twin has findings"
    ties = next(s for s in summaries if s.pc.name == "exact_tie_order")
    assert ties.trials[0].random is None  # uniform gaps never land on an exact tie in 80 cases


def test_every_class_has_a_bug_its_twin_does_not():
    """On a case with the class's trigger, the buggy pair fails and its twin passes."""
    assert len(CLASSES) >= 10
    for pc in planted_classes():
        rng = random.Random(0)
        hit = None
        for _ in range(400):
            case = uniform_cases(pc.buggy.axes, rng)
            if pc.ties:
                case = case.replace(tie_fraction=1.0, tie_gap=0.0)
            if run_case(pc.buggy, case).failed:
                hit = case
                break
        if hit is None and pc.name == "truncated_sampling":
            hit = uniform_cases(pc.buggy.axes, random.Random(0)).replace(sample_top_k=0, temperature=1.0,
                                                                          top_p=1.0, logit_scale=1.0)
        assert hit is not None and run_case(pc.buggy, hit).failed, f"{pc.name}: no failing case found"
        assert not run_case(pc.fixed, hit).failed, f"{pc.name}: the fixed twin fails on {hit.one_line()}"


def test_planted_pairs_stay_out_of_the_registry():
    names = {p.name for p in REGISTRY.all()}
    bench = {pair.name for pc in planted_classes() for pair in (pc.buggy, pc.fixed)}
    assert bench and not bench & names  # (test plugins elsewhere may register pairs of their own)


def test_censored_median_and_ratio():
    assert censored_median([3, None, 5]) == 5
    assert censored_median([None, None, 5]) == float("inf")
    pc = planted_classes(["exact_tie_order"])[0]
    s = ClassSummary(pc, [Trial(pc.name, 1, harness=6, random=None), Trial(pc.name, 2, harness=10, random=None),
                          Trial(pc.name, 3, harness=8, random=None)], cap=300)
    assert s.ratio() == "<0.027" and s.ratio_ok  # 8 cases against more than 300: >= 10x fewer
    slow = ClassSummary(pc, [Trial(pc.name, 1, harness=60, random=None)], cap=300)
    assert not slow.ratio_ok  # 60 x 10 > 300: not shown to be 10x better


def test_twins_not_run_are_not_reported_clean():
    """`--twin-cases 0` runs no fixed twin: the table and the goal say so, not "yes" and "met"."""
    from harness.bench_detection import goals, table

    pc = planted_classes(["exact_tie_order"])[0]
    s = ClassSummary(pc, [Trial(pc.name, 1, harness=6, random=None)], cap=300)
    assert table([s], 300, 0)[-1].endswith("| not run |")
    assert goals([s], 0)[-1] == "- fixed twins with 0 findings: not run (--twin-cases 0)"
    assert goals([s], 100)[-1].startswith("- fixed twins with 0 findings: 1/1: met")
