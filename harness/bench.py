"""Benchmarks that write figures to reports/BENCHMARKS.md, one section each.

`harness bench overhead`: the harness's cost per case against bare calls of the same pair on the
same inputs, measured side by side in one run (rounds alternate bare and harness so machine noise
hits both). Bare = `build` + `rollout` + `trainer`. Harness = drawing the case with Hypothesis +
`run_case` (the same calls, plus readout, token sampling, metrics and the verdict).
"""

from __future__ import annotations

import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import click


def write_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) the section `name` of a markdown file, between marker comments."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n\nFigures written by `harness bench ...`; " \
        "each section says the command that produced it.\n"
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def machine() -> str:
    import os

    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, python {platform.python_version()}")


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def overhead(pair_names: tuple[str, ...], n_cases: int, out: Path, rounds: int = 5) -> str:
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hseed

    from .conformance import sample_cases
    from .execute import run_case
    from .pairs import REGISTRY
    from .strategies import cases as case_strategy

    rows = []
    for pair in REGISTRY.select(pair_names):
        if "cpu" not in pair.devices:
            continue
        cases = sample_cases(pair, n_cases, seed=0)

        def bare() -> None:
            import torch

            with torch.inference_mode():
                for c in cases:
                    inputs = pair.build(c, "cpu")
                    r = pair.rollout(inputs)
                    pair.trainer(inputs, r) if pair.trainer_reads_rollout else pair.trainer(inputs)

        def harness() -> None:
            for c in cases:
                run_case(pair, c, "cpu")

        @settings(max_examples=len(cases), database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
        @hseed(0)
        @given(case_strategy(pair.axes))
        def draw_only(case: Any) -> None:
            pass

        bare()
        harness()  # warm up both
        t_bare, t_harness, t_draw = [], [], []
        for _ in range(rounds):
            t_bare.append(_time(bare) / len(cases))
            t_harness.append(_time(harness) / len(cases))
            t_draw.append(_time(draw_only) / len(cases))
        b, h, d = statistics.median(t_bare), statistics.median(t_harness), statistics.median(t_draw)
        rows.append((pair.name, len(cases), b * 1e3, (h + d) * 1e3, (h + d) / b))
    body = [
        "## Harness overhead per case",
        "",
        f"Command: `harness bench overhead --cases {n_cases}` ({machine()}). Median of {rounds} alternating rounds.",
        "Bare = build + rollout + trainer; harness = Hypothesis draw + run_case (same calls + readout, token",
        "sampling, float64 metrics, verdict). Goal: ratio <= 1.10 where the bare paths take >= 10 ms per case.",
        "",
        "| pair | cases | bare ms/case | harness ms/case | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    body += [f"| {n} | {c} | {b:.2f} | {h:.2f} | {r:.3f} |" for n, c, b, h, r in rows]
    text = "\n".join(body)
    write_section(out, "overhead", text)
    return text + f"\n\nwritten to {out}"


@click.command("overhead")
@click.argument("pair_names", nargs=-1)
@click.option("--cases", type=click.IntRange(5), default=40, show_default=True, help="Cases per pair.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("reports/BENCHMARKS.md"), show_default=True)
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE", help="Load pairs from a plugin.")
def overhead_command(pair_names: tuple[str, ...], cases: int, out: Path, plugins: tuple[str, ...]) -> None:
    """Harness time per case vs bare calls of the same pair on the same inputs."""
    from .cli import load_plugins

    load_plugins(plugins)
    click.echo(overhead(pair_names, cases, out))
