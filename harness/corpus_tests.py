"""The corpus replay as pytest tests: every repro under a corpus, the regression tests that grow with each finding.

    pytest --pyargs harness.corpus_tests --harness-corpus=corpora [--harness-plugin=my_pairs.py]

(from any repository: the package ships it; this repository's own `tests/test_corpus.py` runs it on
its `corpora/` by default).

- `fixed`: must replay under the threshold (it failing again is a regression);
- `expected`: a demonstration pair's divergence: must still diverge (the harness still sees it); a
  pair registered aligned cannot have one (the test fails: its divergence is a regression);
- `open`: a known, unfixed regression: an expected failure (xfail) that shows its k3 now;
- `wontfix`: replayed; reported, never failing.
Each replay must also reproduce the recorded metrics bit-for-bit when the machine and software match
(`harness.env.machine_differences`: torch, numpy, platform, CPU model and instruction set), and
elsewhere within last-bit noise: the same symptom and error, metrics within 1% (`beyond_noise`)
(except a `fixed` repro that replays clean: its recorded metrics are the bug's; a repro recorded as
not deterministic, `found.deterministic: false`, is held to its symptom and error only: its metrics,
and which mean fired, were one draw); a repro whose case
was edited by hand since it was recorded fails until it is rerecorded or restored.
`--harness-corpus=DIR` is the corpus replayed (relative to the working directory; a folder that is
not there is an error, not an empty run); without it, the test module's `DEFAULT_CORPUS` when it
sets one (this repository's tests/test_corpus.py: its corpora/), else `corpora` in the working directory.
A repro of a plugin's pair loads that plugin when it is a file inside its repository; a plugin kept
elsewhere is loaded with `pytest --harness-plugin=PATH` (repeatable). One whose pair cannot be
loaded here (a module not given, an uninstalled entry point, a file that is gone) is skipped with
the reason, and the other files still run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.corpus import (CLOSE_FLAGS_HINT, _display, builtin_extra_missing, iter_corpus, load_plugin_for,
                            load_repro, plugin_flags, replay, replay_severe, severe_note)
from harness.env import machine_differences
from harness.errors import CannotEvaluate, HarnessError
from harness.pairs import REGISTRY

def corpus_root(config, default: Path | None = None) -> Path:
    """The corpus these tests replay: `--harness-corpus=DIR` when given (relative to the working
    directory: `--harness-corpus=corpora` from another repository is that repository's), else
    `default` (a test module's `DEFAULT_CORPUS`), else `corpora` in the working directory."""
    given = config.getoption("harness_corpus", default=None)
    if given is None:
        return default if default is not None else Path("corpora").resolve()
    return Path(given).expanduser().resolve()  # (the harness's pytest plugin refused a folder that is not there)


def pytest_generate_tests(metafunc):
    if "path" in metafunc.fixturenames:
        root = corpus_root(metafunc.config, getattr(metafunc.module, "DEFAULT_CORPUS", None))
        files = iter_corpus(root)
        metafunc.parametrize("path", files, ids=[str(p.relative_to(root)) for p in files])


@pytest.fixture
def root(request) -> Path:
    return corpus_root(request.config, getattr(request.module, "DEFAULT_CORPUS", None))


def test_replay(path, root, request):
    try:
        repro = load_repro(path)
    except HarnessError as e:  # a damaged file: its message says what is wrong and how to fix it
        damaged = str(e)
    else:
        damaged = None
    if damaged is not None:  # (failed outside the except: the message once, not again as its context)
        pytest.fail(damaged, pytrace=False)
    if repro.case_edited:  # a committed repro whose metrics are another case's: not a regression test
        pytest.fail(f"{path}: its case was edited by hand since it was recorded (case_fingerprint); rerecord it "
                    f"(`harness rerecord{repro.plugin_flags()} {_display(path)}`, where the edited case "
                    "still fails) or restore its case from git")
    why = load_plugin_for(repro, flag="--harness-plugin")
    if why is not None and repro.loader.get("kind") == "builtin" and not builtin_extra_missing(repro.pair):
        pytest.fail(f"{path.relative_to(root)}: {why}")  # this checkout's own pair is gone: a skip would hide it
    if why is not None and repro.loader.get("kind") == "entry_point" and \
            repro.loader.get("name") in REGISTRY.broken_entry_points:  # installed, but broken: not "not here"
        pytest.fail(f"{path.relative_to(root)}: {why}")
    if why is not None:
        request.node.user_properties.append(("harness_skip", "pair not here"))  # (the session's summary counts them)
        _skip(request.config, f"{path.relative_to(root)}: {why}")
    if repro.status == "expected":
        REGISTRY.load_builtins()
        pair = REGISTRY.get_loaded(repro.pair)  # (a pair not registered: replay says so below)
        if pair is not None and pair.expected != "diverges":  # a regression of an aligned pair would pass as a demonstration
            pytest.fail(f"{path}: status 'expected' is for a demonstration pair (registered expected='diverges'), "
                        f"and {repro.pair} is registered expected={pair.expected!r}: a divergence of it is a "
                        "regression; set the file's status to 'open' (or close it with `harness regressions close "
                        "--status wontfix`)")
    try:
        result = replay(repro)
    except CannotEvaluate as e:  # its pair could not run here (a recorded rollout's checkpoint is elsewhere)
        _skip(request.config, f"{path.relative_to(root)}: {e}")
    ev = result.evaluation
    if repro.status == "fixed" and ev.failed:
        pytest.fail(f"{path}: fixed regression is back: {ev.symptom.value} {ev.headline}", pytrace=False)
    elif repro.status == "expected" and not ev.failed:
        pytest.fail(f"{path}: demonstration no longer diverges ({ev.headline_like(repro.metrics)}): detection power lost", pytrace=False)
    elif repro.status == "open" and not ev.failed:
        try:  # a second bug its severe case holds is not fixed with it: say so before it is closed
            severe = replay_severe(repro)
        except HarnessError:
            severe = None
        pytest.fail(f"{path}: open regression no longer diverges ({ev.headline_like(repro.metrics)}): close it as fixed, "
                    f"`{repro.close_command(path, given_flags=_plugin_flags(request.config))}` ({CLOSE_FLAGS_HINT})"
                    + (f"; but {severe_note(severe)}" if severe is not None and severe.failed else ""), pytrace=False)
    check_recorded_metrics(path, repro, result)  # an open regression too: still the same failure?
    if repro.status == "open":
        pytest.xfail(f"open regression still {'diverges' if ev.divergence is not None else 'fails'}: "
                     f"{ev.symptom.value} {ev.headline}")


def _skip(config, why: str) -> None:
    """Skip a repro that cannot replay here; with --harness-no-skips, fail it (a nightly's gate: a
    replay step run without its --harness-plugin otherwise passes with every repro skipped)."""
    if config.getoption("harness_no_skips", default=False):
        pytest.fail(f"{why} (--harness-no-skips: a repro that cannot replay here fails)", pytrace=False)
    pytest.skip(why)


def _plugin_flags(config) -> str | None:
    """The --harness-plugin values this run was given, as the --plugin flags of a harness command
    (None: none given; a printed command then names the repro's own plugin)."""
    return plugin_flags(config.getoption("harness_plugin", default=None)) or None


def check_recorded_metrics(path, repro, result) -> None:
    """Bit for bit where the machine and software are the recorded ones (`machine_differences`:
    torch, numpy, CPU); elsewhere within last-bit noise (`beyond_noise`: the same symptom and
    error, a k3 within 1%); a fixed repro's metrics are the bug's (not compared)."""
    elsewhere = machine_differences(repro.environment)
    again = f"harness rerecord{repro.plugin_flags()}"
    if result.nondeterministic:  # its pair gave other values on the same case when it was found
        assert not result.failure_mismatches(), (
            f"{path}: replay fails another way than recorded, as (recorded, replayed): "
            f"{result.failure_mismatches()} (a repro recorded as not deterministic is held to its symptom and error only)")
    elif not elsewhere:
        assert result.bit_for_bit, (f"{path}: replay differs from the recorded metrics, as (recorded, replayed): "
                                    f"{result.mismatches}; if the change is expected (a new torch, a metric "
                                    f"computed differently), `{again} {path}` rewrites them")
    else:
        beyond = result.beyond_noise()
        assert not beyond, (f"{path}: replay differs from the recorded metrics beyond another machine's last bits, "
                            f"as (recorded, replayed): {beyond} (recorded on: {'; '.join(elsewhere)}); if the change "
                            f"is expected, `{again} --accept-changes {path}` rewrites them")


def test_corpus_files_are_named_by_signature(root):
    for path in iter_corpus(root):
        try:
            repro = load_repro(path)
        except HarnessError:  # (test_replay fails that file with its message)
            continue
        assert path.parent.name == repro.pair and path.stem == repro.signature[:12]
