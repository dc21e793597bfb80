"""`harness bench metrics`: what `harness.metrics.compare` costs against one `torch.log_softmax`
over the same (T, V) fp32 tensor on the same device, side by side in one run, and its peak memory.

Each size runs in its own subprocess, so a size's peak memory is its own. There the inputs are
built a few rows at a time (no temporaries: the process's footprint is the inputs): rollout
log-probabilities `lr = log_softmax(3 * randn(T, V))` (entropy ~2-8 nats by V) and trainer
`lt = log_softmax(logits + 0.01 * randn)`, both fp32. `log_softmax` runs over `lr` (fp32 logits
like any other: the same cost). Timed in alternating rounds, best of each: the log_softmax; compare
with the tokens given (what a model pair's rollout returns); compare drawing the tokens (what an op
pair gets: inverse CDF on the case's uniforms); compare with the trainer alone truncated to the
rollout's top 50 and renormalised (a truncation bug: rollout mass on tokens the trainer excludes,
in every row); and with both sides truncated (-inf at the same places: what an aligned sampling
pair hands over). Peak memory: the rise of the peak RSS (CPU,
`ru_maxrss`) or of `torch.cuda.max_memory_allocated` (CUDA) over the inputs' footprint, for compare
(first) and for the log_softmax (which allocates one (T, V) output). CPU times are the measuring
process's CPU time (one torch thread by default: on shared cores that is what survives other
processes' load). Sizes whose inputs would not fit in half the memory available are skipped and
listed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from .bench import check_out_file
from .clitypes import FiniteFloat

VOCABS = (512, 32768, 151936)
TOKENS = (64, 256, 1024, 4096)
GOAL = 2.0  # compare within this factor of one log_softmax


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def measure_one(v: int, t: int, device: str, rounds: int, threads: int) -> dict:
    """One size, in this process: times (s, best of `rounds`) and peak memory rises (bytes)."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    from .metrics import compare
    from .pairs import Outcome
    from .sampling import process_logits

    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def peak() -> int:
        return torch.cuda.max_memory_allocated() if cuda else _peak_rss()

    # warm up every code path on a tiny size first (lazy imports and kernels are not the size's cost)
    w = torch.log_softmax(torch.randn(4, 64, device=dev), -1)
    compare(Outcome(logprobs=w), Outcome(logprobs=w), (4,), torch.zeros(4, dtype=torch.long))
    compare(Outcome(logprobs=w), Outcome(logprobs=w), (4,), uniforms=torch.rand(4, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    lr = torch.empty(t, v, device=dev)  # (T, V) rollout log-probs
    lt = torch.empty(t, v, device=dev)  # (T, V) trainer log-probs
    step = max(1, (1 << 16) // v)  # rows per generation step: temporaries far below the inputs
    for a in range(0, t, step):
        x = 3.0 * torch.randn(min(step, t - a), v, generator=g)  # (n, V) logits
        lr[a:a + step] = torch.log_softmax(x, -1).to(dev)
        lt[a:a + step] = torch.log_softmax(x + 0.01 * torch.randn(x.shape, generator=g), -1).to(dev)
    del x
    tokens = torch.randint(0, v, (t,), generator=g).to(dev)
    u = torch.rand(t, generator=g, dtype=torch.float64)
    seq_lens = (t,)
    tr, ro = Outcome(logprobs=lt), Outcome(logprobs=lr)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else _peak_rss()
    compare(tr, ro, seq_lens, tokens)
    sync()
    mem_compare = peak() - base
    out = torch.log_softmax(lr, -1)
    sync()
    mem_ls = peak() - base
    del out

    clock = time.perf_counter if cuda else time.process_time  # CPU: this process's CPU time

    def timed(fn) -> float:
        sync()
        s = clock()
        fn()
        sync()
        return clock() - s

    fns = {
        "log_softmax": lambda: torch.log_softmax(lr, -1),
        "compare": lambda: compare(tr, ro, seq_lens, tokens),
        "compare_draw": lambda: compare(tr, ro, seq_lens, uniforms=u),
    }
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            best[k] = min(best[k], timed(fn))
    # the trainer truncated to the rollout's top 50 and renormalised, in place, the rollout full (a
    # truncation bug: every row has rollout mass on tokens the trainer excludes), then the rollout
    # truncated the same way (an aligned sampling pair: -inf at the same places)
    for a in range(0, t, step):
        cut = process_logits(lr[a:a + step], 1.0, top_k=50) == -math.inf  # (n, V)
        lt[a:a + step] = torch.log_softmax(lt[a:a + step].masked_fill(cut, -math.inf), -1)
    sync()
    best["compare_cut"] = min(timed(lambda: compare(tr, ro, seq_lens, tokens)) for _ in range(rounds))
    for a in range(0, t, step):
        cut = lt[a:a + step] == -math.inf
        lr[a:a + step] = torch.log_softmax(lr[a:a + step].masked_fill(cut, -math.inf), -1)
    best["compare_topk"] = min(timed(lambda: compare(tr, ro, seq_lens, tokens)) for _ in range(rounds))
    return {"vocab": v, "tokens": t, "device": device, "threads": torch.get_num_threads(),
            "seconds": best, "peak_bytes": {"compare": mem_compare, "log_softmax": mem_ls}}


def run(vocabs: tuple[int, ...], tokens: tuple[int, ...], device: str, rounds: int, threads: int,
        max_gb: float | None, timeout: float, echo=click.echo) -> tuple[list[dict], list[str]]:
    rows, skipped = [], []
    budget = max_gb * (1 << 30) if max_gb else 0.5 * _available_bytes()
    for v in vocabs:
        for t in tokens:
            need = 3 * 4 * t * v + (64 << 20)  # lr, lt, the log_softmax output (fp32), + slack
            if device == "cpu" and need > budget:
                skipped.append(f"V={v} T={t} (needs ~{need / (1 << 30):.1f} GiB, budget {budget / (1 << 30):.1f} GiB)")
                echo(f"  skip V={v} T={t}: needs ~{need / (1 << 30):.1f} GiB")
                continue
            n = rounds if t * v >= (1 << 24) else max(rounds, 10)
            if t * v >= (1 << 28):  # (minutes on a CPU: said before, not after a silence)
                echo(f"  V={v} T={t}: measuring ({n} rounds of each variant in a subprocess; minutes on a CPU) ...")
            cmd = [sys.executable, "-m", "harness.bench_metrics", str(v), str(t), device, str(n), str(threads)]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                skipped.append(f"V={v} T={t} (over {timeout:.0f} s)")
                echo(f"  skip V={v} T={t}: over {timeout:.0f} s")
                continue
            if p.returncode != 0:
                why = (p.stderr.strip().splitlines() or ["?"])[-1]
                skipped.append(f"V={v} T={t} (failed: {why[:120]})")
                echo(f"  V={v} T={t} failed: {why}")
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append(r)
            s = r["seconds"]
            echo(f"  V={v} T={t}: log_softmax {s['log_softmax'] * 1e3:.2f} ms, compare {s['compare'] * 1e3:.2f} ms "
                 f"({s['compare'] / s['log_softmax']:.2f}x)")
    return rows, skipped


def table(rows: list[dict]) -> str:
    def mb(b: int) -> str:
        return f"{max(b, 0) / (1 << 20):.0f}"

    out = ["| V | T | log_softmax ms | compare ms | x | compare + draw ms | x | top 50 both ms | x "
           "| trainer cuts to top 50 ms | x | peak extra MiB: compare | log_softmax | one (T,V) fp32 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, m = r["seconds"], r["peak_bytes"]
        ls = s["log_softmax"]
        out.append(f"| {r['vocab']} | {r['tokens']} | {ls * 1e3:.2f} | {s['compare'] * 1e3:.2f} | "
                   f"{s['compare'] / ls:.2f} | {s['compare_draw'] * 1e3:.2f} | {s['compare_draw'] / ls:.2f} | "
                   f"{s['compare_topk'] * 1e3:.2f} | {s['compare_topk'] / ls:.2f} | "
                   f"{s['compare_cut'] * 1e3:.2f} | {s['compare_cut'] / ls:.2f} | {mb(m['compare'])} | "
                   f"{mb(m['log_softmax'])} | {mb(4 * r['tokens'] * r['vocab'])} |")
    return "\n".join(out)


def metrics_bench(vocabs: tuple[int, ...], tokens: tuple[int, ...], device: str, rounds: int, threads: int,
                  max_gb: float | None, out: Path, timeout: float = 600.0) -> str:
    from .bench import machine, write_section

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    rows, skipped = run(vocabs, tokens, device, rounds, threads, max_gb, timeout)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    over = [f"V={r['vocab']} T={r['tokens']} ({r['seconds']['compare'] / r['seconds']['log_softmax']:.2f}x)"
            for r in rows if r["seconds"]["compare"] > GOAL * r["seconds"]["log_softmax"]]
    cmd = "harness bench metrics" + (f" --device {device}" if device != "cpu" else "") + \
        (f" --vocab {','.join(map(str, vocabs))}" if vocabs != VOCABS else "") + \
        (f" --tokens {','.join(map(str, tokens))}" if tokens != TOKENS else "") + \
        (f" --threads {threads}" if threads != 1 else "")
    clock = ("wall time, synchronized" if device == "cuda" else
             f"CPU time of the measuring process, {threads or 'default'} torch thread(s)")
    cores = os.cpu_count() or 1
    loaded = max(load0[0], load1[0]) > cores
    if loaded:  # (CPU time survives some load, not all: at a load of several times the cores, ratios move far either way)
        click.echo(f"warning: load average {max(load0[0], load1[0]):.1f} on {cores} cores: other processes competed for "
                   "these cores (their memory bandwidth and caches too), so these ratios may be off by a few x either "
                   "way; measure on a quiet machine before reading them against the goal.", err=True)
    body = "\n".join([
        "## Metrics cost (`harness bench metrics`)",
        "",
        f"`{cmd}` on {machine(threads or None)}, device {device}; {wall:.0f} s; load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after. Times: {clock}, in alternating rounds, best of each (other processes "
        "share these cores: CPU time of one thread is what survives their load best; the ratios are "
        "the figure to read)."
        + (f" **Measured under load (over {cores} on {cores} cores): the ratios may be off by a few x.**"
           if loaded else ""),
        "",
        "`compare` (every metric: k3, exact KL, entropy, ... in float64 where it matters) against one "
        "`torch.log_softmax` over the same (T, V) fp32 tensor on the same device. Columns: tokens given "
        "(model pairs); tokens drawn by inverse CDF (op pairs); both sides truncated to the rollout's "
        "top 50 (-inf elsewhere, renormalised: an aligned sampling pair); the trainer alone truncated "
        f"to it (a truncation bug: every row has rollout mass on tokens the trainer excludes). Goal: compare <= {GOAL:g}x the log_softmax. Peak extra "
        "memory is the rise over the inputs' footprint (compare measured first; the log_softmax "
        "allocates its (T, V) output).",
        "",
        table(rows),
        "",
        ("Above the goal: " + ", ".join(over) + "." if over else
         f"Every size measured is within {GOAL:g}x the log_softmax (tokens given).") +
        (" Skipped: " + "; ".join(skipped) + "." if skipped else ""),
    ])
    if not rows:  # nothing measured: the figures already in the report stay
        from .errors import UsageError

        raise UsageError("harness bench metrics measured no size (" + "; ".join(skipped) + "); "
                         f"{out} was left as it was. Fix what the lines above say (e.g. --threads, --max-gb).")
    write_section(out, "metrics", body)
    return body


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated positive integers, e.g. 512,32768") from None
    if not vals or min(vals) < 1:
        raise click.BadParameter(f"{text!r}: expected comma-separated positive integers, e.g. 512,32768")
    return vals


@click.command("metrics")
@click.option("--vocab", "vocab", default=",".join(map(str, VOCABS)), show_default=True,
              help="Vocabulary sizes, comma-separated.")
@click.option("--tokens", "tokens", default=",".join(map(str, TOKENS)), show_default=True,
              help="Tokens per case (rows), comma-separated.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True,
              help="Alternating rounds per size (best of each; small sizes run at least 10).")
@click.option("--threads", type=click.IntRange(0, 1024), default=1, show_default=True,
              help="torch threads in the measuring process (0: torch's default).")
@click.option("--max-gb", type=FiniteFloat(0.1), default=None,
              help="Skip sizes whose inputs need more (default: half the memory available now).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("reports/BENCHMARKS.md"), show_default=True,
              callback=check_out_file)
def metrics_command(vocab: str, tokens: str, device: str, rounds: int, threads: int, max_gb: float | None,
                    out: Path) -> None:
    """Metrics time and peak memory against one log_softmax, per vocabulary and token count."""
    from .errors import UsageError

    vocabs, toks = _ints(vocab), _ints(tokens)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available on this machine; run with --device cpu.")
    click.echo(metrics_bench(vocabs, toks, device, rounds, threads, max_gb, out))


if __name__ == "__main__":  # one size, in a fresh process: python -m harness.bench_metrics V T DEVICE ROUNDS THREADS
    _v, _t, _dev, _rounds, _threads = sys.argv[1:6]
    print(json.dumps(measure_one(int(_v), int(_t), _dev, int(_rounds), int(_threads))))
