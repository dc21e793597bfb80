"""Benchmarks that write figures to reports/BENCHMARKS.md, one section each.

`harness bench overhead`: the harness's cost per case against bare calls of the same pair on the
same inputs, measured side by side in one run (rounds alternate bare and harness so machine noise
hits both). Harness = a real campaign of the pair, wall time per case it evaluated; bare = `build`
+ `rollout` + `trainer` called directly on exactly the cases that campaign evaluated.
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


def bare_calls(pair: Any, cases: list, device: str = "cpu") -> None:
    """The pair's own functions on the cases, nothing of the harness: build, rollout, trainer."""
    import torch

    with torch.inference_mode():
        for c in cases:
            inputs = pair.build(c, device)
            r = pair.rollout(inputs)
            pair.trainer(inputs, r) if pair.trainer_reads_rollout else pair.trainer(inputs)


def overhead(pair_names: tuple[str, ...], n_cases: int, out: Path, rounds: int = 3) -> str:
    import dataclasses

    from .fuzz import CampaignConfig, fuzz_pair, pair_seed
    from .pairs import REGISTRY

    rows = []
    for pair in REGISTRY.select(pair_names):
        if "cpu" not in pair.devices:
            continue
        seen: list = []

        def recording_build(case, device, _build=pair.build):
            seen.append(case)
            return _build(case, device)

        recorded = dataclasses.replace(pair, build=recording_build)
        cfg = CampaignConfig(pairs=[recorded], seed=0, max_examples=n_cases, write_corpus=False)

        def campaign() -> int:
            seen.clear()
            r = fuzz_pair(recorded, cfg, pair_seed(0, pair.name), deadline=None)
            return r.examples

        def bare() -> None:
            bare_calls(pair, cases)

        campaign()  # warm up (compilation, exports, caches), and record the cases
        cases = list(seen)
        bare()
        t_bare, t_harness = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            n = campaign()
            t_harness.append((time.perf_counter() - t) / n)
            t_bare.append(_time(bare) / len(cases))
        b, h = statistics.median(t_bare), statistics.median(t_harness)
        rows.append((pair.name, len(cases), b * 1e3, h * 1e3, h / b))
    body = [
        "## Harness overhead per case",
        "",
        "Command: `" + " ".join(["OMP_NUM_THREADS=1 harness bench overhead --cases", str(n_cases),
                                 *(f"'{p}'" for p in pair_names)])
        + f"` ({machine()}). Median of {rounds} alternating rounds.",
        "Harness = a real campaign of the pair (`fuzz_pair`: Hypothesis generation, targeting and shrinking,",
        "readout, token sampling, float64 metrics, verdicts), wall time per case it evaluated; bare = build +",
        "rollout + trainer called directly on exactly those cases. Goal: ratio <= 1.10 where the bare paths",
        "take >= 10 ms per case (full-model pairs: <= 1.05).",
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
@click.option("--cases", type=click.IntRange(5), default=100, show_default=True,
              help="max_examples of each pair's campaign.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("reports/BENCHMARKS.md"), show_default=True)
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE", help="Load pairs from a plugin.")
def overhead_command(pair_names: tuple[str, ...], cases: int, out: Path, plugins: tuple[str, ...]) -> None:
    """Harness time per case vs bare calls of the same pair on the same inputs."""
    from .cli import load_plugins

    load_plugins(plugins)
    click.echo(overhead(pair_names, cases, out))
