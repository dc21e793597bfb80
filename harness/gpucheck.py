"""The one-command GPU check: every CUDA test, then a short campaign of every CUDA pair, one table.

    harness gpucheck                     # or: python -m harness.gpucheck
    harness gpucheck --budget 200 --pairs 'model.*'

On a machine where torch sees no CUDA device it prints why it skipped and exits 0 (CI runs it that
way on every push). With CUDA it

1. runs the CUDA tests (every test marked `gpu`: `pytest tests -m gpu` in a subprocess, under
   `--tests-timeout`);
2. runs a short campaign of every registered pair that declares `cuda` (the model pairs run their
   real-size config on CUDA: `targets.models.moe_decoder.LARGE`): at most `--max-examples` Hypothesis
   examples (each followed by the pair's uniform cases: 3 for op pairs, 1 for model pairs);
   `--budget` seconds are shared out over the pairs (each gets an equal share of what is left when
   it starts, half for its campaign, half for the timings below; its first case, which pays the
   cold start, is not counted against it);
3. times the pair's own calls on exactly the cases its campaign evaluated (`build` + `rollout` +
   `trainer`, CUDA synchronised, the first case left out of both sides), and the metrics step
   (`execute.judge`: k3, exact KL and the rest on the outcomes' device) on the largest of them;
4. prints one table: pair, cases, cases/s, harness/bare (campaign wall time per case over bare
   calls per case), metrics ms, verdict (`clean`, `caught`, `MISSED` for a demonstration a short
   campaign did not catch, `REGRESSION` for an aligned pair that diverged, `BROKEN` for a pair that
   raised or returned NaN/inf, `CANNOT RUN` for one that raised a harness error: a checkpoint that is
   gone, a setting it refuses), `NOT ON GPU` for a pair that declares `cuda` but whose case ran
   without it: no torch CUDA memory allocated while both paths ran and the outcomes on the CPU (a
   `build` that ignores its `device`: such a pair would otherwise pass the check on the CPU).

Exit: 0 when the tests pass and no pair is a REGRESSION, BROKEN, CANNOT RUN or NOT ON GPU (a MISSED demonstration is
reported, not failed: the campaigns are short), 1 otherwise, 2 for a usage error. Nothing is written
to the corpus or MLflow. `--device cpu` runs steps 2-4 on the CPU (to try the check anywhere).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click

from .clitypes import FiniteFloat
from .errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"  # the CUDA tests are the ones marked `gpu` (pyproject's markers)
DEFAULT_BUDGET = 200.0  # seconds for all the campaigns, their bare calls and metrics together (cold starts aside)
DEFAULT_TESTS_TIMEOUT = 210.0  # seconds for the CUDA tests
DEFAULT_MAX_EXAMPLES = 30  # Hypothesis examples per pair at most (each with its uniform cases)


@dataclass
class PairCheck:
    pair: str
    expected: str
    cases: int = 0  # cases the campaign evaluated (shrinking included)
    rate: float = float("nan")  # cases per second of the campaign, cold start excluded
    harness_ms: float = float("nan")  # campaign wall time per case, cold start excluded
    bare_ms: float = float("nan")  # build + rollout + trainer per case on the same cases
    metrics_ms: float = float("nan")  # the metrics step on the largest case's outcomes
    verdict: str = "not run"
    warmup_s: float = 0.0  # the first case (cold start: weights, compilation, exports)
    note: str = ""  # what went wrong, for a BROKEN pair or a step that could not be timed

    @property
    def ratio(self) -> float:
        return self.harness_ms / self.bare_ms if self.bare_ms > 0 else float("nan")

    @property
    def failed(self) -> bool:
        return self.verdict in ("REGRESSION", "BROKEN", "CANNOT RUN", "NOT ON GPU")


@dataclass
class TestRun:
    ran: bool
    code: int = 0
    summary: str = ""  # pytest's last line
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.ran or self.code in (0, 5)  # 5: nothing collected


def cuda_status() -> tuple[bool, str]:
    """(CUDA usable, why not / which device)."""
    import torch

    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (a CPU build of torch)"
        return False, f"torch {torch.__version__} sees no CUDA device (CUDA build: {build})"
    return True, f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# 1. The CUDA tests
# ---------------------------------------------------------------------------------------------
def visible_device(index: int) -> str:
    """What CUDA_VISIBLE_DEVICES must say for the tests' process to see this process's cuda:index: the
    index-th entry of an inherited CUDA_VISIBLE_DEVICES (a scheduler's allocation: `4,5` makes cuda:1
    the physical GPU 5, or a GPU UUID), else the index itself."""
    inherited = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return inherited[index] if 0 <= index < len(inherited) else str(index)


def run_tests(timeout: float, index: int | None = None) -> TestRun:
    if not (TESTS / "gpu").is_dir():
        return TestRun(True, 4, f"{TESTS} not found: run the check from a checkout of the repository", 0.0)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", str(TESTS), "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    try:
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": visible_device(index)} if index is not None else {})}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return TestRun(True, 124, f"the CUDA tests ran past {timeout:.0f} s", time.monotonic() - start)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    if proc.returncode not in (0, 5):
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-2000:])
    return TestRun(True, proc.returncode, lines[-1] if lines else proc.stderr.strip()[-300:],
                   time.monotonic() - start)


# ---------------------------------------------------------------------------------------------
# 2-3. A short campaign per pair, its bare calls and its metrics
# ---------------------------------------------------------------------------------------------
def bare_seconds(pair: Any, cases: list, device: str) -> float:
    """Wall seconds of the pair's own calls on the cases (build, rollout, trainer), synchronised."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        for c in cases:
            inputs = pair.build(c, device)
            r = pair.rollout(inputs)
            pair.trainer(inputs, r) if pair.trainer_reads_rollout else pair.trainer(inputs)
    _sync(device)
    return time.perf_counter() - start


def off_device(device: str, outcomes: tuple, allocated: int) -> str:
    """Why a case asked to run on `device` (cuda) did not, or "": torch allocated no CUDA memory
    while its paths ran (`allocated` bytes, the peak over the baseline) and no tensor of its
    outcomes is on the device. A path that runs on the GPU outside torch (ONNX Runtime's CUDA
    provider) and hands back CPU tensors reads the same: it is told to return them on the device."""
    import torch

    if not device.startswith("cuda") or allocated > 0:
        return ""
    held = [t for o in outcomes for t in (o.logprobs, o.hidden, o.tokens) if isinstance(t, torch.Tensor)]
    if any(t.device.type == "cuda" for t in held):
        return ""
    return (f"asked to run on {device}, both paths ran without it: torch allocated no CUDA memory during the case "
            f"and its outcomes came back on {', '.join(sorted({str(t.device) for t in held})) or 'no device'}. "
            "`build(case, device)` must put the inputs and the modules on `device`; a pair that only runs on the "
            "CPU declares devices=('cpu',); a path that runs on the GPU outside torch returns its outcomes on "
            "the device (torch.from_dlpack)")


def metrics_ms(pair: Any, case: Any, device: str, repeats: int = 3, where: list | None = None) -> float:
    """Median wall milliseconds of the metrics step (`execute.judge`) on one case's outcomes; with
    `where`, appends `off_device`'s finding on that case (CUDA only)."""
    from .execute import judge, run_paths

    allocated = 0
    if device.startswith("cuda"):
        import torch

        _sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    trainer, rollout = run_paths(pair, case, device)
    _sync(device)
    if device.startswith("cuda"):
        allocated = torch.cuda.max_memory_allocated() - base
    if where is not None:
        where.append(off_device(device, (trainer, rollout), allocated))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        judge(pair, case, trainer, rollout)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def check_pair_campaign(pair: Any, device: str, seed: int, max_examples: int, seconds: float,
                        corpus: Path) -> PairCheck:
    """A short campaign of one pair (nothing recorded), then its bare calls and its metrics step."""
    from .fuzz import CampaignConfig, fuzz_pair, pair_seed

    out = PairCheck(pair.name, pair.expected)
    seen: list = []

    def recording_build(case: Any, dev: str, _build: Callable = pair.build) -> Any:
        seen.append(case)
        return _build(case, dev)

    recorded = dataclasses.replace(pair, build=recording_build)
    cfg = CampaignConfig(pairs=[recorded], seed=seed, max_examples=max_examples, device=device, corpus=corpus,
                         write_corpus=False)
    try:
        # half the pair's share for the campaign, the rest for timing its bare calls and metrics
        result = fuzz_pair(recorded, cfg, pair_seed(seed, pair.name), deadline=time.monotonic() + seconds / 2)
    except Exception as e:  # noqa: BLE001 - the engine failing on a pair is this pair's row, not the end
        out.verdict, out.note = "BROKEN", f"the campaign raised {type(e).__name__}: {e}"
        return out
    out.verdict, out.cases, out.warmup_s = result.verdict, result.examples, result.warmup
    if result.setup_error:
        from .fuzz import setup_headline

        out.note = setup_headline(result.setup_error)
    broken = [f for f in result.findings if f.symptom.value != "divergence"]
    if broken:
        ev = broken[0].evaluation
        out.note = f"{broken[0].symptom.value}" + (f": {ev.error['type']}: {ev.error['message'][:200]}"
                                                   if ev.error else "")
    timed = seen[1:]  # the first case paid the cold start on both sides
    wall = result.seconds - result.warmup
    if timed and wall > 0:
        out.harness_ms = 1e3 * wall / len(timed)
        out.rate = len(timed) / wall
        try:
            out.bare_ms = 1e3 * bare_seconds(pair, timed, device) / len(timed)
        except Exception as e:  # noqa: BLE001
            out.note = out.note or f"bare calls raised {type(e).__name__}: {e}"
    if seen:
        where: list = []
        try:
            out.metrics_ms = metrics_ms(pair, max(seen, key=lambda c: (c.n_tokens, c.batch_size)), device, where=where)
        except Exception as e:  # noqa: BLE001
            out.note = out.note or f"metrics step raised {type(e).__name__}: {e}"
        if where and where[0] and not out.failed:
            out.verdict, out.note = "NOT ON GPU", where[0]
    return out


def run_campaigns(pairs: list, device: str, seed: int, max_examples: int, budget: float,
                  log: Callable[[str], None]) -> list[PairCheck]:
    import tempfile

    rows = []
    end = time.monotonic() + budget
    with tempfile.TemporaryDirectory(prefix="harness-gpucheck-") as corpus:
        check_pair_campaign(pairs[0], device, seed + 1, 2, 30.0, Path(corpus))  # Hypothesis and imports, warm
        for i, pair in enumerate(pairs):
            share = max(1.0, (end - time.monotonic()) / (len(pairs) - i))
            row = check_pair_campaign(pair, device, seed, max_examples, share, Path(corpus))
            log(f"  {pair.name}: {row.verdict}, {row.cases} cases ({row.warmup_s:.1f} s cold start)"
                + (f"; {row.note}" if row.note else ""))
            rows.append(row)
            if device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# 4. The table
# ---------------------------------------------------------------------------------------------
def _fmt(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)  # NaN -> "-"


def table(rows: list[PairCheck]) -> str:
    head = ("pair", "cases", "cases/s", "harness/bare", "metrics ms", "verdict")
    body = [(r.pair, str(r.cases), _fmt(r.rate, ".1f"), _fmt(r.ratio, ".2f"), _fmt(r.metrics_ms, ".1f"),
             r.verdict + (f" ({r.note})" if r.failed and r.note else "")) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head) - 1)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(head, widths)) + f" | {head[-1]} |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|---|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(x, widths)) + f" | {x[-1]} |" for x in body]
    return "\n".join(lines)


def select_pairs(patterns: tuple[str, ...], device: str) -> list:
    from .pairs import REGISTRY

    kind = "cuda" if device.startswith("cuda") else "cpu"
    return [p for p in REGISTRY.select(patterns) if kind in p.devices]


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
@click.command("gpucheck")
@click.option("--device", default="cuda", show_default=True,
              help="cuda (cuda:N for one device) or cpu (the campaigns and table only, to try the check).")
@click.option("--pairs", "patterns", multiple=True, metavar="GLOB",
              help="Only pairs matching these globs (default: every pair the device runs).")
@click.option("--budget", type=FiniteFloat(1.0), default=DEFAULT_BUDGET, show_default=True,
              help="Seconds for all the campaigns together, shared out over the pairs.")
@click.option("--max-examples", type=click.IntRange(2), default=DEFAULT_MAX_EXAMPLES, show_default=True,
              help="Hypothesis examples per pair at most (each followed by the pair's uniform cases: 3 for op "
              "pairs, 1 for model pairs).")
@click.option("--seed", type=click.IntRange(0), default=1, show_default=True, help="Campaign seed.")
@click.option("--tests/--no-tests", default=True, show_default=True,
              help="Run the CUDA tests (tests marked gpu) first.")
@click.option("--tests-timeout", type=FiniteFloat(1.0), default=DEFAULT_TESTS_TIMEOUT, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON after the table.")
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE", help="Load pairs from a plugin.")
def gpucheck_command(device: str, patterns: tuple[str, ...], budget: float, max_examples: int, seed: int, tests: bool,
                     tests_timeout: float, as_json: bool, plugins: tuple[str, ...]) -> None:
    """Every CUDA test and a short campaign of every CUDA pair on one GPU, in one table (skips without CUDA)."""
    sys.exit(gpucheck(device, patterns, budget, max_examples, seed, tests, tests_timeout, as_json, plugins))


def gpucheck(device: str = "cuda", patterns: tuple[str, ...] = (), budget: float = DEFAULT_BUDGET,
             max_examples: int = DEFAULT_MAX_EXAMPLES, seed: int = 1, tests: bool = True,
             tests_timeout: float = DEFAULT_TESTS_TIMEOUT, as_json: bool = False,
             plugins: tuple[str, ...] = ()) -> int:
    from .cli import load_plugins

    if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise UsageError(f"--device {device!r} is not cpu, cuda or cuda:N; pick one.")
    start = time.monotonic()
    index: int | None = None  # cuda:N
    if device.startswith("cuda"):
        ok, what = cuda_status()
        if not ok:
            click.echo(f"gpucheck: skipped: {what}; nothing to check on this machine (run it where "
                       "torch.cuda.is_available() is True).")
            if as_json:  # (the same shape as with rows: none; why is on the line above)
                click.echo("[]")
            return 0
        index = int(device.split(":")[1]) if ":" in device else None
        if index is not None:  # one device: the pairs run on it as the current device, the tests see only it
            import torch

            if index >= torch.cuda.device_count():
                raise UsageError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s); "
                                 "pick one of them (cuda:0 is the first).")
            torch.cuda.set_device(index)
            what = f"{torch.cuda.get_device_name(index)} (cuda:{index})"
            device = "cuda"
        click.echo(f"gpucheck on {what}")
    load_plugins(plugins)
    pairs = select_pairs(patterns, device)
    if not pairs:
        raise UsageError(f"no registered pair runs on {device}" + (f" and matches {list(patterns)}" if patterns else "")
                         + "; run `harness list` to see each pair's devices.")
    test_run = TestRun(False)
    if tests and device == "cuda":
        click.echo("CUDA tests: pytest tests -m gpu ...")
        test_run = run_tests(tests_timeout, index)
        click.echo(f"CUDA tests: {test_run.summary} ({test_run.seconds:.0f} s)")
    click.echo(f"campaigns: {len(pairs)} pair(s), at most {max_examples} examples each (with their uniform cases), "
               f"{budget:.0f} s in all, "
               f"seed {seed}, device {device}")
    rows = run_campaigns(pairs, device, seed, max_examples, budget, lambda m: click.echo(m, err=True))
    click.echo("")
    click.echo(table(rows))
    failed = [r.pair for r in rows if r.failed]
    missed = [r.pair for r in rows if r.verdict == "MISSED"]
    click.echo(f"\n{len(rows)} pair(s) in {time.monotonic() - start:.0f} s"
               + (f"; CUDA tests: {test_run.summary}" if test_run.ran else "")
               + (f"; failed: {', '.join(failed)}" if failed else "")
               + (f"; demonstrations not caught in a short campaign: {', '.join(missed)}" if missed else ""))
    if as_json:
        def plain(x: Any) -> Any:
            return None if isinstance(x, float) and x != x else x  # NaN (not measured) -> null

        click.echo(json.dumps([{k: plain(v) for k, v in {**dataclasses.asdict(r), "ratio": r.ratio}.items()}
                               for r in rows], indent=2))
    return 0 if test_run.ok and not failed else 1


def main() -> None:
    from .cli import main as cli_main

    cli_main(["gpucheck", *sys.argv[1:]])


if __name__ == "__main__":
    main()
