"""`harness bench models`: full-model cases per second per pair, and the harness's overhead.

For the model pairs named (default `model.*`, the built-in ones; any pair of kind "model" that runs on the
CPU may be named, `hf.*` too): a fixed sample of cases from the pair's
own axes (seeded), timed two ways in alternating rounds so machine noise hits both:

- bare: `build` + `rollout` + `trainer` on each case (the two paths, nothing else);
- harness: `run_case` on each case (the same calls, plus token bookkeeping, float64 metrics,
  routing flips and the verdict).

Warm-up runs every case once first (model and weight caches, the ONNX export and session, the
torch.compile compilations), and its time is reported separately: that cost is per process, not
per case. Goal: harness/bare <= 1.05. Written to reports/BENCHMARKS.md, section `models`.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from .bench import check_out_file


def measure(pair, n_cases: int, rounds: int, seed: int = 0) -> dict:
    from .bench import bare_calls
    from .conformance import sample_cases
    from .execute import run_case

    cases = sample_cases(pair, n_cases, seed=seed)

    def bare() -> None:
        bare_calls(pair, cases)

    def harness() -> None:
        for c in cases:
            run_case(pair, c, "cpu")

    t = time.perf_counter()
    harness()
    warm = time.perf_counter() - t
    b, h = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        bare()
        b.append(time.perf_counter() - t)
        t = time.perf_counter()
        harness()
        h.append(time.perf_counter() - t)
    bare_s, harness_s = min(b), min(h)  # the least-disturbed round of each: noise only adds time
    return {"pair": pair.name, "cases": len(cases), "warm": warm, "bare_ms": 1e3 * bare_s / len(cases),
            "harness_ms": 1e3 * harness_s / len(cases), "rate": len(cases) / harness_s, "ratio": harness_s / bare_s}


def models(pair_names: tuple[str, ...], n_cases: int, rounds: int, out: Path) -> str:
    import torch

    from .bench import machine, write_section
    from .pairs import REGISTRY

    pairs = [p for p in REGISTRY.select(pair_names or ("model.*",)) if p.kind == "model" and "cpu" in p.devices]
    if not pairs:  # (an empty table would replace the measured one in the report)
        from .errors import UsageError

        raise UsageError(f"no CPU model pair matches {' '.join(pair_names) or 'model.*'!r}: `harness bench models` "
                         "measures pairs of kind model that run on the CPU (`harness list` shows them); nothing was "
                         "written.")
    rows = [measure(p, n_cases, rounds) for p in pairs]
    cmd = "harness bench models" + (" " + " ".join(pair_names) if pair_names else "") + \
        f" --cases {n_cases} --rounds {rounds}"
    body = [
        "## Full-model pairs: cases per second and harness overhead",
        "",
        f"`{cmd}` on {machine()} (torch threads: {torch.get_num_threads()}).",
        "Cases drawn from each pair's own axes (seed 0); bare = build + rollout (prefill + KV-cache decode) +",
        "trainer (packed forward); harness = `run_case` (the same + metrics + verdict); fastest of the rounds.",
        "Warm-up = first pass over the cases (weight cache, ONNX export + session, torch.compile): once per",
        "process. Goal: ratio <= 1.05.",
        "",
        "| pair | cases | warm-up s | bare ms/case | harness ms/case | cases/s | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    body += [f"| {r['pair']} | {r['cases']} | {r['warm']:.1f} | {r['bare_ms']:.1f} | {r['harness_ms']:.1f} | "
             f"{r['rate']:.1f} | {r['ratio']:.3f} |" for r in rows]
    text = "\n".join(body)
    write_section(out, "models", text)
    return text + f"\n\nwritten to {out}"


@click.command("models")
@click.argument("pair_names", nargs=-1)
@click.option("--cases", type=click.IntRange(3), default=30, show_default=True, help="Cases per pair.")
@click.option("--rounds", type=click.IntRange(1), default=5, show_default=True, help="Alternating timing rounds.")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True,
              help="torch intra-op threads while measuring (restored after).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("reports/BENCHMARKS.md"), show_default=True,
              callback=check_out_file)
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE", help="Load pairs from a plugin.")
def models_command(pair_names: tuple[str, ...], cases: int, rounds: int, threads: int, out: Path,
                   plugins: tuple[str, ...]) -> None:
    """Full-model cases/s per pair and harness overhead vs bare calls of both paths."""
    from .cli import load_plugins
    from .env import threads_as

    load_plugins(plugins)
    with threads_as(threads):
        click.echo(models(pair_names, cases, rounds, out))
