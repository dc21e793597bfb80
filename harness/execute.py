"""One case through one pair: build, rollout, trainer, readout, compare. Failures are values.

`run_case` never raises for what a target does: an exception inside build/rollout/trainer becomes
an `Evaluation` with symptom `error` and the traceback kept; NaN/inf output becomes symptom
`nonfinite`; a mean k3 or a mean exact KL above the threshold becomes symptom `divergence`.
"""

from __future__ import annotations

import enum
import functools
import math
import traceback
import time
from dataclasses import dataclass
from typing import Any

from .case import Case
from .metrics import Divergence, _num, compare, fired, judged_k3, judged_means, verdict_mean, with_routing
from .pairs import Outcome, TargetPair

DEFAULT_THRESHOLD = 1e-3  # mean k3 (or mean exact KL) above which two paths are not equivalent


class Symptom(str, enum.Enum):
    NONE = "none"  # under the threshold
    DIVERGENCE = "divergence"  # mean k3 or mean exact KL above the threshold
    NONFINITE = "nonfinite"  # NaN or +inf in either path's log-probabilities (-inf is log 0, not this)
    ERROR = "error"  # the target raised
    TIMEOUT = "timeout"  # the case ran past the per-case timeout (isolated runs: harness.worker)
    CRASH = "crash"  # the worker process died running the case: a signal (segfault, abort, OOM kill) or exit


@dataclass
class Evaluation:
    pair: str
    case: Case
    symptom: Symptom
    divergence: Divergence | None = None
    error: dict[str, str] | None = None  # {"type", "message", "traceback", "where"}
    trainer: Outcome | None = None
    rollout: Outcome | None = None
    # versions of the backend libraries the process that ran the case had imported (a worker's:
    # the campaign itself may never import transformers); filled for failing cases only
    backends: dict[str, str] | None = None
    # the pair raised a harness error (`harness.errors.HarnessError`: a checkpoint folder that is gone,
    # a setting it refuses): it could not run here, which says nothing of the paths (not recorded)
    setup: bool = False
    threads: int | None = None  # torch threads of the process that ran the case (a repro replays with them)
    seconds: float | None = None  # how long its build, paths and metrics took, where it ran (`run_case`)

    @property
    def k3(self) -> float:
        return self.divergence.k3_kl if self.divergence is not None else float("nan")

    @property
    def failed(self) -> bool:
        return self.symptom is not Symptom.NONE

    @property
    def score(self) -> float:
        """What the verdict compares with the threshold: the larger of the judged k3 (the expected k3,
        `metrics.judged_k3`) and the mean exact KL (the worst sequence's, for a pair judged over
        sequences: `metrics.judged_means`); NaN without metrics. A campaign climbs it."""
        d = self.divergence
        if d is None:
            return math.nan
        vals = [v for v in judged_means(d) if not math.isnan(v)]
        return max(vals) if vals else math.nan

    @property
    def headline(self) -> str:
        """What to print beside the symptom: the mean the verdict read (`kl=0.003` when the exact KL
        fired on a case whose sampled k3 is small), or the error's type and first line."""
        return headline(self.divergence, self.error)

    def headline_like(self, recorded: Any) -> str:
        """`headline`, for a case that no longer fails, in the mean its recorded metrics fired on
        (`kl=2e-10` for a repro recorded at kl=0.007, not its k3)."""
        return headline(self.divergence, self.error, like=recorded)


def headline(metrics: Any, error: dict | None, like: Any = None) -> str:
    """`Evaluation.headline` from a divergence or a metrics dict (a repro's, a worker's report) and
    an error dict; with `like` (recorded metrics), a case that fires on neither mean shows the one
    those fired on."""
    if error:
        lines = str(error.get("message", "")).strip().splitlines()
        first = lines[0] if lines else ""
        if len(first) > 200:  # cut at a word near the limit (else at the limit), and say so
            head = first[:200]
            at = head.rfind(" ")
            first = (head[:at].rstrip(" ,;:(") if at >= 160 else head) + " ..."
        return f"{error.get('type', '?')}: {first}".rstrip(": ")
    if not metrics:  # (a repro file whose metrics were cut or never written: say so, not "k3=nan")
        return "no metrics" if isinstance(metrics, dict) else "k3=nan"
    get = metrics.get if isinstance(metrics, dict) else lambda k, d=None: getattr(metrics, k, d)
    bad = [f"{role} {int(n)} token(s)" for role in ("trainer", "rollout")
           if isinstance(n := get(f"nonfinite_{role}", 0), (int, float)) and n > 0]
    if bad:  # NaN or +inf out of a path: the means say nothing, where it came from does
        return "NaN/inf from the " + " and the ".join(bad)
    name, value = verdict_mean(metrics)
    if like and not get("fired", "") and verdict_mean(like)[0] != name:
        name, value = verdict_mean(like)[0], judged_means(metrics)[1]  # (verdict_mean's other name: "kl")
    if name == "k3" and value == math.inf:
        # fired by one draw landing where the trainer gives probability 0, not by the exact means:
        # say so, and what those are (under the line when that draw made the finding)
        k3e, kl, excl = (_num(get(k, math.nan)) for k in ("k3_expected", "kl", "kl_excluded"))
        if not math.isnan(k3e) and k3e != math.inf:
            if excl == 0:  # the trainer excludes nothing the rollout gives mass to: the rollout's own token
                return (f"k3=inf (the rollout sampled a token its own reported distribution gives probability 0: "
                        f"it samples from another distribution than it reports; expected k3 {k3e:.3g}, kl {kl:.3g})")
            return (f"k3=inf (a sampled token the trainer excludes: rollout mass there {excl:.3g}; "
                    f"expected k3 {k3e:.3g} over the tokens the trainer keeps, kl {kl:.3g})")
    if get("verdict_over", "batch") == "sequence":  # the worst sequence's mean, and the batch's beside it
        batch = _num(get("kl", math.nan)) if name == "kl" else judged_k3(get("k3_expected", math.nan),
                                                                            get("k3_kl", math.nan))
        worst = get("worst_sequence", None)
        which = f" {int(worst)}" if isinstance(worst, (int, float)) and worst == worst else ""
        return f"{name}={mean_text(value)} (worst sequence{which}; batch mean {mean_text(batch)})"
    return f"{name}={mean_text(value)}"


def boundary_swap_note(metrics: Any) -> str:
    """A line for a finding whose exact KL is about the rollout mass the trainer excludes while the
    expected k3 stays far below it: the pattern of two paths that cut at a top-k/top-p boundary and
    rank a near-tied pair of tokens there the other way round (each keeps one the other cuts), where
    a user reads "KL = excluded mass" as the reported-not-judged mass. "" otherwise."""
    get = metrics.get if isinstance(metrics, dict) else lambda k, d=None: getattr(metrics, k, d)
    kl, excl, k3e = (_num(get(k, math.nan)) for k in ("kl", "kl_excluded", "k3_expected"))
    if not (excl > 0 and math.isfinite(kl) and kl > 0 and 1 / 3 <= kl / excl <= 3 and k3e < kl / 10):
        return ""
    return (f"truncation boundary: the rollout keeps tokens the trainer cuts (their rollout mass {excl:.3g}: "
            f"reported, not judged) and the KL {kl:.3g} over the tokens the trainer keeps is about that mass, with "
            f"an expected k3 of only {k3e:.3g}: what two paths that cut at a top-k/top-p boundary give when they "
            "rank a near-tied pair of tokens there the other way round (each keeps one the other cuts). It is a "
            "real mismatch for RL (a token one path cannot sample), made by any difference of the logits before the "
            "cut at a near tie: compare the paths' logits there")


def mean_text(value: float) -> str:
    """3 significant digits, or as many as it takes (up to 6) for a value just over a round line not
    to print as the line itself (k3 0.0010016 read `k3=0.001` against the threshold 0.001)."""
    text = f"{value:.3g}"
    if value > 0 and math.isfinite(value) and float(text) != value and math.log10(float(text)).is_integer():
        for digits in (4, 5, 6):
            text = f"{value:.{digits}g}"
            if not math.log10(float(text)).is_integer():
                break
    return text


def finalize(pair: TargetPair, case: Case, out: Outcome, role: str, twin: Outcome | None = None) -> Outcome:
    """Apply the pair's readout to a path that returned hidden states; check the shape. With `twin`
    (the other path, finalized) holding the same hidden states bit for bit, its log-probabilities are
    reused: the readout is deterministic, so they are the values it would compute."""
    if out is None or not isinstance(out, Outcome):
        raise TypeError(f"{pair.name}: {role} must return a harness.Outcome, got {type(out).__name__}")
    import torch

    if out.logprobs is None:
        if out.hidden is None:
            raise TypeError(f"{pair.name}: {role} returned an Outcome with neither logprobs nor hidden")
        if pair.readout is None:
            raise TypeError(f"{pair.name}: {role} returned hidden states but the pair declares no readout")
        h, th = out.hidden, twin.hidden if twin is not None else None
        if isinstance(h, torch.Tensor) and (h.dim() != 2 or h.shape[0] != case.n_tokens):
            raise ValueError(f"{pair.name}: {role} hidden states have shape {tuple(h.shape)}, expected "
                             f"({case.n_tokens}, hidden): one row per token of the case, in case order (the readout "
                             "projects each row to the vocabulary)")
        if isinstance(h, torch.Tensor) and isinstance(th, torch.Tensor) and th.dim() == 2 and h.shape[1] != th.shape[1]:
            raise ValueError(f"{pair.name}: the trainer's hidden states are {h.shape[1]} wide and the rollout's "
                             f"{th.shape[1]}: both paths must return the same hidden width (the readout draws its "
                             "head by width, so the two would be read through two unrelated heads)")
        if (th is not None and twin.logprobs is not None and isinstance(h, torch.Tensor) and isinstance(th, torch.Tensor)
                and h.dtype == th.dtype and h.device == th.device and torch.equal(h, th)):
            out.logprobs = twin.logprobs
        else:
            out.logprobs = pair.readout.apply(out.hidden, case)
    lp = out.logprobs
    if not isinstance(lp, torch.Tensor):
        raise TypeError(f"{pair.name}: {role} logprobs must be a torch.Tensor, got {type(lp).__name__} "
                        "(convert with torch.as_tensor)")
    if not lp.is_floating_point():
        raise TypeError(f"{pair.name}: {role} logprobs have dtype {lp.dtype}; log-probabilities are floating point")
    if lp.device.type == "meta":
        raise TypeError(f"{pair.name}: {role} logprobs are on the meta device (no values): compute them on a real one")
    tok = out.tokens
    if tok is not None and (not isinstance(tok, torch.Tensor) or tok.is_floating_point() or tok.is_complex()
                            or tok.dtype == torch.bool):
        raise TypeError(f"{pair.name}: {role} tokens must be an integer torch.Tensor of token ids, got "
                        f"{getattr(tok, 'dtype', type(tok).__name__)}")
    if out.logprobs.dim() != 2 or out.logprobs.shape[0] != case.n_tokens:
        raise ValueError(f"{pair.name}: {role} logprobs have shape {tuple(out.logprobs.shape)}, expected "
                         f"({case.n_tokens}, vocab): one row per token of the case, in case order")
    if tok is not None and (tok.numel() != case.n_tokens or not (tok.dim() == 1 or (tok.dim() == 2 and 1 in tok.shape))):
        raise ValueError(f"{pair.name}: {role} tokens have shape {tuple(tok.shape)}, expected ({case.n_tokens},) (or "
                         f"({case.n_tokens}, 1), (1, {case.n_tokens})): one "
                         "sampled token id per row of its logprobs, in case order (or tokens=None: the harness draws them)")
    recorded = out.recorded if twin is None else twin.recorded
    if recorded and out.logprobs.shape[1] != 2:
        raise ValueError(f"{pair.name}: {role} logprobs have shape {tuple(out.logprobs.shape)}, but the rollout is a "
                         f"recording (Outcome.recorded): both paths give ({case.n_tokens}, 2) two-outcome rows, column 0 "
                         "the recorded token's log-probability and column 1 log(1 - p) (targets.hf.paths.two_outcome)")
    if recorded and twin is None and out.tokens is None:
        raise ValueError(f"{pair.name}: the rollout's outcome holds its tokens' log-probabilities only "
                         "(Outcome.recorded, `harness.token_outcome`) but not the tokens: pass "
                         "token_outcome(logp, tokens=sampled_ids), one id per row in case order")
    if out.routing is None:  # (no router: as the default, an empty dict)
        out.routing = {}
    if out.routing:
        _check_routing(pair.name, role, out.routing, twin.routing if twin is not None else None)
    if twin is not None and twin.logprobs.shape[1] != out.logprobs.shape[1]:
        raise ValueError(f"{pair.name}: the trainer's logprobs have {out.logprobs.shape[1]} vocabulary entries per row "
                         f"and the rollout's {twin.logprobs.shape[1]}: both paths must score one vocabulary (an engine "
                         "that pads its vocabulary, 151936 -> 152064 say, must slice the padding off: "
                         "logprobs[:, :vocab])"
                         + ("; two entries per row are a path that reports its sampled tokens' log-probs only "
                            "(`token_outcome`): cut the other path the same way, or wrap a full-row pair in "
                            "`harness.sampled_tokens_only(pair)`, which cuts both"
                            if 2 in (out.logprobs.shape[1], twin.logprobs.shape[1]) else ""))
    return out


def _check_routing(name: str, role: str, routing: Any, twin: Any) -> None:
    """`Outcome.routing` as the flip counts read it: {layer: Routing}, experts (rows, k) integer ids
    (a row per token in case order; a recorded rollout's include its prompt's) and scores (rows, E)
    with E >= k, and the same shape as the other path's layer of that name. (Wrong shapes otherwise
    came out as numpy broadcast errors of the metrics, or as flip rates over the wrong tokens.)"""
    import torch

    from .pairs import Routing

    if not isinstance(routing, dict):
        raise TypeError(f"{name}: {role} routing must be a dict {{router layer name: harness.Routing(experts=..., "
                        f"scores=...)}}, got {type(routing).__name__}")
    for layer, r in routing.items():
        where = f"{name}: {role} routing[{layer!r}]"
        if not isinstance(r, Routing):
            raise TypeError(f"{where} must be a harness.Routing, got {type(r).__name__}")
        ex = r.experts  # (a torch tensor, or a numpy array: the flip counts read either)
        kind = ("i" if not (ex.is_floating_point() or ex.is_complex() or ex.dtype == torch.bool) else "f") \
            if isinstance(ex, torch.Tensor) else getattr(getattr(ex, "dtype", None), "kind", "")
        if kind not in ("i", "u"):
            raise TypeError(f"{where}.experts must be an integer tensor of expert ids, got "
                            f"{getattr(ex, 'dtype', type(ex).__name__)}")
        if len(ex.shape) != 2:
            raise ValueError(f"{where}.experts has shape {tuple(ex.shape)}, expected (tokens, k): the k experts chosen "
                             "for each token of the case, in case order")
        sc = r.scores
        if sc is not None and (len(getattr(sc, "shape", ())) != 2 or sc.shape[0] != ex.shape[0]
                               or sc.shape[1] < ex.shape[1]):
            raise ValueError(f"{where}.scores has shape {tuple(getattr(sc, 'shape', ()))}, expected "
                             f"({ex.shape[0]}, E) with E >= k = {ex.shape[1]}: every expert's score for each row of "
                             "its experts (or scores=None)")
        other = twin.get(layer) if isinstance(twin, dict) else None
        if isinstance(other, Routing) and hasattr(other.experts, "shape") \
                and tuple(other.experts.shape) != tuple(ex.shape):
            raise ValueError(f"{where}.experts has shape {tuple(ex.shape)} and the rollout's layer of that name "
                             f"{tuple(other.experts.shape)}: both paths must route the same tokens with the same "
                             "top-k, one row per token in case order (a layer the other path routes differently "
                             "needs a name of its own)")


# Where the harness checks what a path returned, as `describe_error` names the raising frame: an error
# raised there is the pair breaking the contract (a wrong shape, dtype or type), not its computation
# (`fuzz.breaks_contract`). Derived from the functions, so a rename cannot silently disable it.
CONTRACT_CHECKS = tuple(f"{__name__.rsplit('.', 1)[-1]}.py:{f.__name__}" for f in (finalize, _check_routing))


def run_paths(pair: TargetPair, case: Case, device: str) -> tuple[Outcome, Outcome]:
    """Run both paths on the case's inputs (rollout first, so the trainer may read its outcome)."""
    import torch

    with torch.inference_mode():
        inputs = pair.build(case, device)
        rollout = finalize(pair, case, pair.rollout(inputs), "rollout")
        trainer_out = pair.trainer(inputs, rollout) if pair.trainer_reads_rollout else pair.trainer(inputs)
        trainer = finalize(pair, case, trainer_out, "trainer", twin=rollout)
    return trainer, rollout


def judge(pair: TargetPair, case: Case, trainer: Outcome, rollout: Outcome,
          threshold: float = DEFAULT_THRESHOLD) -> Evaluation:
    """Metrics and verdict for two finished outcomes: a divergence when the mean k3 or the mean
    exact KL(rollout || trainer) is above the threshold (`Divergence.fired` says which)."""
    import torch

    recorded = getattr(rollout, "recorded", False)
    # a recording's two-outcome rows hold the sampled token in column 0 (targets.hf.paths.two_outcome)
    tokens = torch.zeros(case.n_tokens, dtype=torch.int64) if recorded else rollout.tokens
    div = compare(trainer, rollout, case.seq_lens, tokens, case=case)
    if recorded:  # the tables show the recorded ids; the tokens are the data, not a draw: judge their mean k3
        div.per_token["token"] = rollout.tokens.detach().cpu().to(torch.int64).reshape(-1).numpy()
        div.k3_expected = div.k3_expected_seq_max = math.nan
    div = with_routing(div, trainer, rollout)
    div.verdict_over = getattr(pair, "verdict_over", "batch")
    if recorded:
        div.rows = "two_outcome"
    div.fired = fired(div, threshold)
    if div.nonfinite:
        symptom = Symptom.NONFINITE
    elif div.fired:
        symptom = Symptom.DIVERGENCE
    else:
        symptom = Symptom.NONE
    return Evaluation(pair.name, case, symptom, divergence=div, trainer=trainer, rollout=rollout)


def run_case(pair: TargetPair, case: Case, device: str = "cpu",
             threshold: float = DEFAULT_THRESHOLD, keep_outcomes: bool = False) -> Evaluation:
    state = process_state()
    began = time.perf_counter()
    try:
        trainer, rollout = run_paths(pair, case, device)
        ev = judge(pair, case, trainer, rollout, threshold)
    except KeyboardInterrupt:
        raise
    except SystemExit as e:  # a target that calls sys.exit: a bug of the target, not the end of the campaign
        ev = Evaluation(pair.name, case, Symptom.ERROR, error=describe_error(e))
    except Exception as e:  # a crash inside the target is a finding, not a crash of the engine
        from .errors import HarnessError

        ev = Evaluation(pair.name, case, Symptom.ERROR, error=describe_error(e), setup=isinstance(e, HarnessError))
    finally:
        restore_process_state(pair.name, state)
    ev.threads = state[1]  # (torch.get_num_threads() when the case started)
    ev.seconds = time.perf_counter() - began
    if not keep_outcomes:
        ev.trainer = ev.rollout = None
    return ev


# Process-wide settings a target might change (a kernel library's import, a `set_default_dtype` in a
# forward): every pair of a campaign shares the process (in-process, or its worker), so a change would
# alter how later pairs compute and how every pair is judged. Each is read before a case and put back
# after it, with one warning per pair and setting. (Monkeypatched functions cannot be put back this
# way: see the README's known limits.)
def process_state() -> tuple:
    import os

    import torch

    return (torch.get_default_dtype(), torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_float32_matmul_precision(),
            os.getcwd())


_STATE_NAMES = ("torch default dtype", "torch threads", "torch deterministic algorithms",
                "torch deterministic warn-only", "torch float32 matmul precision", "working directory")
_warned: set[tuple[str, str]] = set()


def restore_process_state(pair: str, before: tuple) -> None:
    after = process_state()
    if after == before:
        return
    import os
    import sys

    import torch

    dtype, threads, det, warn_only, precision, cwd = before
    for name, was, now in zip(_STATE_NAMES, before, after):
        if was != now and (pair, name) not in _warned:
            _warned.add((pair, name))
            print(f"warning: pair {pair} changed the process's {name} ({was} -> {now}) during a case; it was put back "
                  "so the other pairs (and the metrics) compute as before. A target must not change process-wide "
                  "settings: set them inside its paths and restore them.", file=sys.stderr, flush=True)
    torch.set_default_dtype(dtype)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.set_float32_matmul_precision(precision)
    if os.getcwd() != cwd:
        try:
            os.chdir(cwd)
        except OSError:
            pass


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """The standard library's folder and the harness's own."""
    import os
    import sysconfig

    return sysconfig.get_paths()["stdlib"], os.path.dirname(os.path.abspath(__file__)) + os.sep


def _library_file(filename: str) -> bool:
    """A frame of installed or standard-library code, or of the harness itself: not where a pair's
    own code called it (`describe_error`'s `caller`)."""
    import os

    f = os.path.abspath(filename)
    return ("site-packages" in f or "dist-packages" in f or f.startswith(_library_roots())
            or filename.startswith("<"))


def describe_error(e: BaseException) -> dict[str, str]:
    """The error of a case, as a repro keeps it: type, message, `where` (the innermost frame:
    file:function), `caller` (the innermost frame of the pair's own code, when `where` is in a
    library: the call that raised there; see `fuzz.signature`) and the traceback."""
    tb = traceback.extract_tb(e.__traceback__)
    inner = tb[-1] if tb else None
    where = f"{inner.filename.rsplit('/', 1)[-1]}:{inner.name}" if inner else "?"
    own = next((f for f in reversed(tb) if not _library_file(f.filename)), None) if inner is not None \
        and _library_file(inner.filename) else None
    caller = f"{own.filename.rsplit('/', 1)[-1]}:{own.name}" if own is not None else None
    try:  # an exception whose own __str__ raises is still a finding
        message = str(e)
    except Exception as inner_error:  # noqa: BLE001
        message = f"<str() of the {type(e).__name__} raised {type(inner_error).__name__}>"
    try:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    except Exception:  # noqa: BLE001
        text = "".join(traceback.format_list(tb)) + f"{type(e).__name__}: {message}\n"
    if isinstance(e, SystemExit):
        message = f"the target called sys.exit({e.code!r})" + (f": {message}" if message and message != str(e.code) else "")
    return {
        "type": type(e).__name__,
        "message": message[:2000],
        "where": where,
        **({"caller": caller} if caller else {}),
        "traceback": text[-8000:],
    }
