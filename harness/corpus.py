"""The repro format, atomic writes, loading with clear errors and bounds, and replay.

A repro is one JSON file, `corpora/<pair>/<id>.json` (id = the first 12 hex digits of the
finding's signature, see `harness.fuzz`). It holds the minimal case (a few hundred bytes: tensors
are rebuilt from the case's seed), the metrics measured when it was found (non-finite values as the
strings "nan", "inf", "-inf"), the environment (versions of torch, the harness and every backend
library the pair had imported), how the pair was loaded (`loader`, below), and a triage status:

- `open`: a regression nobody has fixed yet (tests mark it as an expected failure, showing its k3);
- `fixed`: must replay under the threshold (a test fails if it diverges again);
- `expected`: a demonstration pair's divergence that must keep being caught;
- `wontfix`: accepted; replayed and reported, never failing a test.

Loading is strict, because a repro is input from outside: every field is type- and range-checked
before anything runs, and a case's size is bounded (`LIMITS`: tokens, sequences, experts,
vocabulary, free parameters; each can be raised with its environment variable). Nothing in a repro
is imported or executed, with one exception a person can see: `loader` may name a plugin file, and
the harness loads it only when it is a `.py` file inside the repository the corpus lives in (code
the test suite runs anyway). A module, or a file elsewhere, must be given with `--plugin`.

Files are written atomically (temporary file `.<name>.<pid>.<rand>.tmp` in the same folder, fsync,
rename) with the mode the umask gives new files: a campaign killed mid-write leaves the old file or
the new one, never half of one, and the next write there removes temporary files of dead writers.
A corpus file that does not load where a finding is to be written is never replaced: it is moved
aside, unchanged, with a JSON sidecar saying what it was and why (`record_finding`, `move_aside`).
Nothing is unpickled.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .case import Case, CaseError
from .env import BIT_FOR_BIT_KEYS, METRICS_ON, is_thread_count, recorded_threads, threads_as
from .errors import CannotEvaluate, UsageError
from .execute import DEFAULT_THRESHOLD, Evaluation, Symptom, run_case
from .metrics import METRIC_KEYS

REPRO_SCHEMA = "harness.repro/1"
STATUSES = ("open", "fixed", "expected", "wontfix")
NONFINITE = ("nan", "inf", "-inf")
LOADER_KINDS = ("builtin", "plugin_file", "module", "entry_point")
# backend libraries a pair may use: their versions are recorded when the process has imported them
BACKEND_LIBRARIES = ("transformers", "onnxruntime", "onnx", "accelerate", "safetensors", "triton", "vllm",
                     "sglang", "flash_attn")


# ---------------------------------------------------------------------------------------------
# Bounds on what a repro may ask for (the environment variable raises one)
# ---------------------------------------------------------------------------------------------
class LimitError(UsageError):
    """A repro refused by a size limit (`LIMITS`) or by a limit variable that is not a number: about
    this process's settings, not about the file, which is left as it is."""


def check_limits() -> None:
    """Every limit variable set is a number >= 1 (a campaign checks them before it starts)."""
    for lim in LIMITS.values():
        lim.value()


@dataclass(frozen=True)
class Limit:
    name: str  # what is bounded, as a person says it
    env: str  # the environment variable that raises it
    default: int  # the bound when the variable is not set

    def value(self) -> int:
        raw = os.environ.get(self.env)
        if raw is None or raw.strip() == "":
            return self.default
        try:
            v = int(raw)
        except ValueError:
            raise LimitError(f"${self.env}={raw!r} is not an integer; set it to the largest {self.name} a repro "
                             f"may ask for (default {self.default}).") from None
        if v < 1:
            raise LimitError(f"${self.env}={raw!r} must be >= 1 (the largest {self.name} a repro may ask for).")
        return v


LIMITS = {
    "bytes": Limit("repro file size in bytes", "HARNESS_MAX_REPRO_BYTES", 16 * 2**20),
    "tokens": Limit("total tokens of a case (prompt + response, all sequences)", "HARNESS_MAX_TOKENS", 65536),
    "sequences": Limit("number of sequences of a case", "HARNESS_MAX_SEQUENCES", 4096),
    "experts": Limit("number of router experts", "HARNESS_MAX_EXPERTS", 4096),
    "vocab": Limit("vocabulary size", "HARNESS_MAX_VOCAB", 1 << 20),
    "params": Limit("number of free case parameters", "HARNESS_MAX_PARAMS", 64),
    # a recorded rollout's repro carries its token ids, log-probs and routed experts as strings: ~25
    # characters per token for the log-probs alone, so 1024 tokens need ~26k (the file limit bounds all)
    "param_len": Limit("length of a string case parameter", "HARNESS_MAX_PARAM_LEN", 4 * 2**20),
    "param_int": Limit("magnitude of an integer case parameter", "HARNESS_MAX_PARAM_INT", 1 << 20),
}


def check_case_size(case: Case, where: str) -> None:
    """Raise UsageError when the case asks for more than LIMITS allow (before anything is built)."""

    def over(key: str, got: int, what: str) -> None:
        lim = LIMITS[key]
        raise LimitError(f"{where} asks for {what} = {got}, above the limit of {lim.value()} ({lim.name}); a repro "
                         f"this large is refused before anything runs. If it is genuine, raise the limit: "
                         f"{lim.env}={got} harness ... (environment variable).")

    prompts = tuple(getattr(case, "prompt_lens", ()) or ())
    tokens = sum(case.seq_lens) + sum(int(x) for x in prompts if isinstance(x, int))
    if len(case.seq_lens) > LIMITS["sequences"].value():
        over("sequences", len(case.seq_lens), "sequences")
    if tokens > LIMITS["tokens"].value():
        over("tokens", tokens, "total tokens")
    if case.n_experts > LIMITS["experts"].value():
        over("experts", case.n_experts, "n_experts")
    if len(case.params) > LIMITS["params"].value():
        over("params", len(case.params), "free parameters")
    for key, value in case.params.items():
        if len(key) > LIMITS["param_len"].value():
            over("param_len", len(key), "a parameter name of length")
        if isinstance(value, str) and len(value) > LIMITS["param_len"].value():
            over("param_len", len(value), f"params.{key} of length")
        if isinstance(value, int) and not isinstance(value, bool):
            if "vocab" in key.lower() and value > LIMITS["vocab"].value():
                over("vocab", value, f"params.{key}")
            if abs(value) > LIMITS["param_int"].value() and "vocab" not in key.lower():
                over("param_int", abs(value), f"|params.{key}|")


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------
def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def encode_float(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def encode_tree(x: Any) -> Any:
    """`encode_float` through dicts and lists (a history entry's replaced metrics, say): JSON has no
    NaN or inf, and `json.dumps(allow_nan=False)` refuses them."""
    if isinstance(x, dict):
        return {k: encode_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode_tree(v) for v in x]
    return encode_float(x)


def decode_float(x: Any) -> Any:
    return float(x) if x in NONFINITE else x


FIRED = ("", "k3", "kl", "k3+kl")  # `metrics.fired`: which mean crossed the threshold (see metrics.fired)


def metrics_json(ev: Evaluation) -> dict[str, Any]:
    """The metrics of an evaluation as JSON: every METRIC_KEYS number (non-finite ones as strings)
    and `fired`, the string saying which of the verdict's means crossed the threshold; `verdict_over`
    and `rows` where they are not the default (`Divergence`)."""
    if ev.divergence is None:
        return {}
    out: dict[str, Any] = {k: encode_float(v) for k, v in ev.divergence.as_dict().items()}
    out["fired"] = str(getattr(ev.divergence, "fired", "") or "")
    if getattr(ev.divergence, "verdict_over", "batch") != "batch":  # (a batch verdict: the key left out, as before it)
        out["verdict_over"] = ev.divergence.verdict_over
    if getattr(ev.divergence, "rows", "full") != "full":  # (two-outcome rows: its kl and entropy are of that split)
        out["rows"] = ev.divergence.rows
    return out


def _new_file_mode() -> int:
    """The mode a new file gets under the current umask (0o666 & ~umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


# `.<name>.json.<pid>.<rand>.tmp`; older harness versions wrote `.<name>.json.<rand>.tmp` (no pid)
TMP_RE = re.compile(r"^\.(?P<name>.+\.json)\.(?:(?P<pid>\d+)\.)?[^.]+\.tmp$")
STALE_TMP_SECONDS = 3600.0  # a temporary file this old is removed even when its writer's pid is alive


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temps(folder: Path) -> list[Path]:
    """Remove `.<name>.<pid>.<rand>.tmp` files left by killed writers (dead pid, or over an hour old)."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    now = time.time()
    for p in entries:
        m = TMP_RE.match(p.name)
        if not m:
            continue
        try:
            old = now - p.stat().st_mtime > STALE_TMP_SECONDS
            pid = int(m.group("pid")) if m.group("pid") else None
            if old or (pid is not None and pid != os.getpid() and not _pid_alive(pid)):
                p.unlink()
                removed.append(p)
        except OSError:
            continue
    return removed


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to `path` atomically; an existing file keeps its mode, a new one gets the umask's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        mode = _new_file_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=False, allow_nan=False)
            fh.write("\n")
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ---------------------------------------------------------------------------------------------
# How a pair was loaded, and where the repository is
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _git_toplevel(folder: str) -> str | None:
    try:
        proc = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=folder, capture_output=True, text=True,
                              timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    top = proc.stdout.strip()
    return top if proc.returncode == 0 and top else None


def git_root(near: str | Path | None = None) -> Path | None:
    """The git checkout holding `near` (a file or folder), else the one holding the working
    directory (a repro copied out of the tree, as for `git bisect run`), else None."""
    p = Path(near).resolve() if near is not None else Path.cwd().resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    folder = p if p.is_dir() else p.parent
    top = _git_toplevel(str(folder)) or _git_toplevel(str(Path.cwd().resolve()))
    return Path(top).resolve() if top else None


def repo_root(near: str | Path | None = None) -> Path:
    """`git_root(near)`, else the working directory (what plugin paths are recorded relative to)."""
    return git_root(near) or Path.cwd().resolve()


def builtin_extra_missing(pair: str) -> str | None:
    """Why a built-in pair is not registered when the reason is an optional dependency this environment
    lacks (the `hf.*` pairs register only with transformers installed), else None."""
    if pair.startswith("hf."):
        try:
            from targets.hf import AVAILABLE
        except Exception:  # noqa: BLE001 - no targets package: not this checkout's pairs
            return None
        if not AVAILABLE:
            return (f"its pair {pair!r} is one of the Hugging Face pairs, which register only with transformers "
                    "installed; install the hf extra (pip install -e '.[hf]') to replay it")
    return None


def entry_point_package(name: str) -> str | None:
    """"<distribution> <version>" of the installed package providing the `harness.targets` entry point
    `name` (which version of a backend found a bug: a repro replayed after an upgrade says so), else None."""
    from importlib.metadata import entry_points

    from .pairs import ENTRY_POINT_GROUP

    try:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            if ep.name == name and dist is not None:
                return f"{dist.metadata['Name'] or dist.name} {dist.version}"
    except Exception:  # noqa: BLE001 - a package's metadata that does not read: nothing to record
        return None
    return None


def loader_of(source: str, root: Path) -> dict[str, str]:
    """What a pair's `source` (filled in by the registry) says about how to load it again."""
    if not source or source.startswith("targets.") or source == "targets":
        return {"kind": "builtin"}
    if source.startswith("entry point "):
        name = source[len("entry point "):]
        package = entry_point_package(name)
        return {"kind": "entry_point", "name": name, **({"package": package} if package else {})}
    if source.endswith(".py") or os.sep in source or "/" in source:
        path = Path(source).resolve()
        try:
            return {"kind": "plugin_file", "path": path.relative_to(root).as_posix()}
        except ValueError:
            return {"kind": "plugin_file", "path": str(path), "outside_repository": "true"}
    return {"kind": "module", "module": source}


def pair_loader(pair_name: str, root: Path, registry: Any = None) -> dict[str, str]:
    from .pairs import REGISTRY

    registry = registry or REGISTRY
    try:
        pair = registry.get(pair_name)
    except Exception:  # noqa: BLE001 - an unknown pair: nothing to say about its loader
        return {"kind": "unknown"}
    return loader_of(getattr(pair, "source", "") or "", root)


def backend_versions() -> dict[str, str]:
    """Versions of the backend libraries this process has imported (what the pairs ran on; a worker
    shared by several pairs lists what any of them imported)."""
    return dict(_versions(tuple(name for name in BACKEND_LIBRARIES if name in sys.modules)))


@functools.lru_cache(maxsize=32)
def _versions(names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(name, version) of imported libraries: read once per set (a worker asks on every failing
    case, shrinking included; package metadata lookups cost milliseconds)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in names:
        try:
            out.append((name, version(name.replace("_", "-"))))
        except PackageNotFoundError:
            out.append((name, str(getattr(sys.modules[name], "__version__", "unknown"))))
    return tuple(out)


def _display(path: Path) -> str:
    """A path as a person types it from the working directory (relative when under it), quoted where
    a shell needs it (a space, a quote)."""
    import shlex

    return shlex.quote(_shown(path))


def plugin_spec_of(loader: dict[str, str], near: str | Path | None) -> str | None:
    """The `--plugin` value a loader needs (None: built in or an entry point): a plugin file as a
    path from the working directory, a module by name."""
    kind = loader.get("kind")
    if kind == "plugin_file":
        p = Path(loader.get("path", ""))
        if not p.is_absolute():
            p = repo_root(near) / p
        return _shown(p)
    if kind == "module":
        return loader.get("module")
    return None


def _shown(path: Path) -> str:
    """A path as a person types it from the working directory (relative when under it), unquoted (a
    value the printed commands quote where they use it: `_display`)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def format_replay(spec: str | None, path: Any) -> str:
    return f"harness replay{plugin_flags([spec] if spec else ())} {_display(Path(path)) if path else 'FILE'}"


def replay_command_for(pair_name: str, path: str | Path | None, registry: Any = None) -> str:
    """The replay command of a corpus file of `pair_name`, with `--plugin` when its pair needs one."""
    loader = pair_loader(pair_name, repo_root(path), registry)
    return format_replay(plugin_spec_of(loader, path), path)


def shrink_command_for(pair_name: str, path: str | Path, tracking_uri: str | None = None,
                       tracking: bool = True) -> str:
    """`harness shrink` of a corpus file of `pair_name`, with the `--plugin` its pair needs and the
    `--tracking-uri` of a store other than the one a command finds by default (its regression run
    gets the shrunk case), or `--no-tracking` for a finding of a campaign that ran without MLflow
    (the default store may hold a run of the same bug, found into another corpus)."""
    from .mlflow_tracking.payload import store_flag

    spec = plugin_spec_of(pair_loader(pair_name, repo_root(path)), path)
    store = store_flag(tracking_uri) if tracking else " --no-tracking"
    return f"harness shrink{plugin_flags([spec] if spec else ())}{store} {_display(Path(path))}"


# ---------------------------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------------------------
def new_corpus_note(folder: Any, option: str = "--corpus") -> str:
    """A line for a campaign whose corpus folder is not there (a typo in the option, a first run): it
    is created with the first finding, so every finding will read as new; "" when it exists."""
    path = Path(folder).expanduser()
    if path.is_dir():
        return ""
    return (f"note: corpus folder {path} does not exist yet: it is created with the first finding, and every finding "
            f"is new to it (a known repro elsewhere is not seen); check {option} if you meant another folder")


def plugin_flags(given: Any) -> str:
    """The --plugin flags of a printed harness command for these plugin specs (quoted where a shell
    needs it); "" for none."""
    import shlex

    return "".join(f" --plugin {shlex.quote(str(p))}" for p in given or ())


# what the printed close commands add in words: the flags a person may need that the repro cannot know
CLOSE_FLAGS_HINT = ("with --tracking-uri where its campaign logged to a store other than the default, --no-tracking "
                    "for a corpus kept without MLflow")


@dataclass
class Repro:
    path: Path | None
    id: str
    pair: str
    symptom: str
    signature: str
    status: str
    threshold: float
    case: Case
    metrics: dict[str, Any]
    error: dict[str, Any] | None = None
    # what was found (pair, symptom and, for an error or crash, where): the same as `signature` unless
    # an earlier repro of it no longer failed when this one was found, a different bug with the same
    # symptom, whose signature then also names its minimal case (see `record_finding`)
    base_signature: str = ""
    environment: dict[str, Any] = field(default_factory=dict)
    found: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    tracking: dict[str, Any] = field(default_factory=dict)
    loader: dict[str, str] = field(default_factory=dict)  # how the pair was loaded (see loader_of)
    extra: dict[str, Any] = field(default_factory=dict)  # fields this version does not read, kept as they are
    # `case_fingerprint` of the case the metrics were recorded with ("" in files written before it
    # existed), and whether the file's case no longer matches it (edited by hand since): its
    # recorded metrics are another case's, so a replay does not compare them
    case_fingerprint: str = ""
    case_edited: bool = False
    # the case's simpler neighbours as shrinking ran them, each {"change", "judged", "symptom"}
    # (`shrink.neighbours_of`): where the failure starts; empty when shrinking did not finish
    neighbours: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out = {
            "schema": REPRO_SCHEMA,
            "id": self.id,
            "pair": self.pair,
            "symptom": self.symptom,
            "signature": self.signature,
            **({"base_signature": self.base_signature}
               if self.base_signature and self.base_signature != self.signature else {}),
            "status": self.status,
            "threshold": self.threshold,
            "case": (case := self.case.to_json()),
            # (an edited case keeps the fingerprint of the one its metrics are of, until rerecorded)
            "case_fingerprint": self.case_fingerprint if self.case_edited else case_fingerprint(case),
            "metrics": {k: encode_float(v) for k, v in self.metrics.items()},
            "error": self.error,
            "environment": self.environment,
            "loader": self.loader,
            "found": self.found,
            **({"neighbours": encode_tree(self.neighbours)} if self.neighbours else {}),
            "history": encode_tree(self.history),  # (replaced metrics are kept as they were held: floats)
            "tracking": self.tracking,
        }
        for k, v in self.extra.items():
            out.setdefault(k, v)
        return out

    def take_smaller_case(self, case: Case, ev: Evaluation, complete: bool, device: str, threads: int,
                          deterministic: bool | None = None, neighbours: list | None = None, **why: Any) -> None:
        """Replace the case (and its metrics and error) with a smaller one that fails the same way:
        the replaced ones go into the history ("shrunk further", with `why`: the campaign seed, or a
        note), and `found.shrink_complete` says whether this shrinking finished. The new metrics were
        computed here, on `device` with `threads` torch threads: `environment.metrics_recorded_on`
        says so (`env.record_metrics_machine`), beside the environment the bug was found in."""
        from .env import record_metrics_machine

        was_on = self.environment.get(METRICS_ON)  # (where the replaced metrics were computed, if said)
        self.history.append({"at": now_iso(), "event": "shrunk further", **why, "replaced_case": self.case.to_json(),
                             "replaced_metrics": self.metrics,
                             **({"replaced_metrics_recorded_on": was_on} if was_on is not None else {}),
                             # a case edited by hand: the replaced metrics are those of the case before the edit
                             **({"replaced_case_edited_by_hand": True} if self.case_edited else {})})
        self.environment = record_metrics_machine(self.environment, device, threads)
        self.case, self.metrics, self.error = case, metrics_json(ev), ev.error
        if deterministic is not None:  # (a campaign ran the new case twice; `harness shrink` keeps the pair's flag)
            self.found = {k: v for k, v in self.found.items() if k != "deterministic"}
            if not deterministic:
                self.found["deterministic"] = False
        self.case_edited = False  # (metrics and case agree again: a fresh fingerprint)
        self.found = {**self.found, "shrink_complete": bool(complete)}
        self.neighbours = list(neighbours or [])  # (the old case's neighbours say nothing of this one)

    def save(self, path: Path | None = None) -> Path:
        path = Path(path or self.path)
        write_json_atomic(path, self.to_json())
        self.path = path
        return path

    # --- loading the pair again -------------------------------------------------------------
    def plugin_spec(self) -> str | None:
        """What `--plugin` needs to be for this repro's pair (None: built in or an entry point)."""
        return plugin_spec_of(self.loader, self.path)

    def plugin_flags(self) -> str:
        """` --plugin SPEC` (quoted where a shell needs it) for a printed command that loads this repro's
        pair; "" for a pair built in or from an entry point."""
        spec = self.plugin_spec()
        return plugin_flags([spec] if spec else ())

    def replay_command(self, path: Any = None) -> str:
        """The command that replays this repro as printed, with `--plugin` when its pair needs one."""
        return format_replay(self.plugin_spec(), path or self.path)

    def close_command(self, path: Any = None, given_flags: str | None = None) -> str:
        """The command that closes this repro as fixed, as printed (`given_flags`: the --plugin flags the
        calling command was given, `plugin_flags`, else this repro's own; the MLflow server its run was
        logged to where the repro records one: a local store's file is not recorded, since it means
        nothing elsewhere)."""
        import shlex

        flags = given_flags if given_flags is not None else self.plugin_flags()
        uri = (self.tracking or {}).get("uri")
        if isinstance(uri, str) and uri:
            flags += f" --tracking-uri {shlex.quote(uri)}"
        path = path or self.path
        return (f"harness regressions close {self.id} --status fixed{flags}"
                + (f" --corpus-file {_display(Path(path))}" if path else "") + " --note 'fixed by ...'")

    def auto_plugin(self, flag: str = "--plugin") -> tuple[str | None, str | None]:
        """(a plugin file this harness may load for the repro by itself, or why it may not).

        Only a `.py` file inside the git checkout that holds the repro (or the working directory;
        no `..` escape, symlinks resolved) is loaded without being asked for: the repro never makes the harness import code
        the person did not choose."""
        kind = self.loader.get("kind")
        if kind != "plugin_file":
            if kind == "module":
                return None, (f"its pair {self.pair!r} comes from the module {self.loader.get('module')!r}; "
                              f"pass {flag}={shlex.quote(str(self.loader.get('module')))} to load it")
            if kind == "entry_point":
                from .pairs import REGISTRY

                broken = REGISTRY.broken_entry_points.get(self.loader.get("name"))
                return None, (f"its pair {self.pair!r} comes from the entry point {self.loader.get('name')!r}; "
                              + (broken if broken else "install the package that provides it"))
            if kind == "builtin":
                extra = builtin_extra_missing(self.pair)
                if extra:
                    return None, extra
                return None, (f"its pair {self.pair!r} was built in (targets/) when it was recorded and is not "
                              "registered now: renamed or removed since? Rename the repro's pair (and its folder) "
                              "to the pair's new name, or close it (`harness regressions close`) if the pair is gone")
            return None, None
        root = git_root(self.path)
        rel = Path(self.loader.get("path", ""))
        if root is None:
            return None, (f"its pair {self.pair!r} comes from the plugin file {str(rel)!r}, and neither the repro nor "
                          f"the working directory is in a git checkout to find it in; pass "
                          f"{flag}={shlex.quote(str(rel)) if rel.is_absolute() else 'PATH'} to load it")
        full = (rel if rel.is_absolute() else root / rel).resolve()
        try:
            full.relative_to(root)
        except ValueError:
            return None, (f"its pair {self.pair!r} comes from the plugin file {str(full)!r}, outside this repository; "
                          f"pass {flag}={shlex.quote(str(full))} to load it")
        if full.suffix != ".py" or not full.is_file():
            return None, (f"its pair {self.pair!r} comes from the plugin file {str(rel)!r}, which is not in this "
                          f"checkout; restore it, or pass {flag}=PATH to where it lives")
        return str(full), None


def evaluated_threads(ev: Any) -> int:
    """The torch thread count the evaluation's metrics were computed with (`Evaluation.threads`, set
    where the case ran: in a worker process, the worker's), else this process's."""
    n = getattr(ev, "threads", None)
    if isinstance(n, int) and n >= 1:
        return n
    import torch

    return torch.get_num_threads()


def finding_to_repro(finding: Any, threshold: float, campaign_seed: int, device: str,
                     corpus_dir: str | Path | None = None) -> Repro:
    from .env import environment

    ev = finding.evaluation
    env = environment(device)
    env["torch_threads"] = evaluated_threads(ev)  # where the case ran (a worker may run another count)
    env.update(backend_versions())
    env.update(getattr(ev, "backends", None) or {})  # what the worker that ran the case had imported
    weights = pair_weights(finding.pair)
    if weights:
        env["pair_weights"] = weights
    root = repo_root(corpus_dir) if corpus_dir is not None else repo_root()
    return Repro(
        path=None, id=finding.id, pair=finding.pair, symptom=finding.symptom.value,
        signature=finding.signature, base_signature=getattr(finding, "base_signature", "") or finding.signature,
        status=finding.status, threshold=threshold, case=finding.case,
        metrics=metrics_json(ev), error=ev.error, environment=env, loader=pair_loader(finding.pair, root),
        found=found_json(finding, campaign_seed), neighbours=list(getattr(finding, "neighbours", None) or []),
    )


def pair_weights(name: str, registry: Any = None) -> str:
    """The fingerprint of the weights a registered pair runs (`TargetPair.weights`), "" when it does
    not say or cannot read them now."""
    from .pairs import REGISTRY

    pair = (registry or REGISTRY).get_loaded(name)
    fn = getattr(pair, "weights", None)
    if fn is None:
        return ""
    try:
        return str(fn() or "")
    except Exception:  # noqa: BLE001 - a fingerprint that cannot be taken is not a finding's problem
        return ""


def weights_note(repro: "Repro", registry: Any = None) -> str:
    """A warning when the pair now runs other weights than the repro was recorded with ("" if not)."""
    then = str(repro.environment.get("pair_weights") or "")
    if not then:
        return ""
    now = pair_weights(repro.pair, registry)
    if not now or now == then:
        return ""
    return (f"pair {repro.pair} now runs other weights than this repro was recorded with (fingerprint {then} then, "
            f"{now} now: its checkpoint was overwritten, or the config it is built from changed?), so its values "
            "differ for that reason alone; restore those weights to judge the repro")


def found_json(finding: Any, campaign_seed: int) -> dict[str, Any]:
    """How a finding was found: when, by which seed, after how many cases and seconds of its pair's
    stream (`cases_to_first`, `seconds_to_first`), how long shrinking took (`shrink_seconds`:
    Hypothesis's shrink and the polish pass), the cases the stream ran in all (`cases_total`; also
    `examples`, its older name) and whether shrinking finished. The first three are left out when
    the finding does not know them (0 cases: made outside a campaign's stream)."""
    out: dict[str, Any] = {"at": now_iso(), "campaign_seed": campaign_seed}
    first = int(getattr(finding, "cases_to_first", 0) or 0)
    if first > 0:
        out.update(cases_to_first=first,
                   seconds_to_first=round(float(getattr(finding, "seconds_to_first", 0.0) or 0.0), 3),
                   shrink_seconds=round(float(getattr(finding, "shrink_seconds", 0.0) or 0.0), 3))
    out.update(cases_total=int(finding.examples), examples=int(finding.examples),
               shrink_complete=bool(finding.shrink_complete))
    stream, streams = getattr(finding, "stream", (0, 1))
    if streams > 1:  # (one of the pair's streams: its counts are that stream's; a rerun with --streams N runs it)
        out.update(stream=int(stream), streams=int(streams))
    if getattr(finding, "deterministic", True) is False:  # its case, run again, gave other values
        out["deterministic"] = False
    by = getattr(finding, "recorded_by", "")  # a case given by hand (`harness record`): no campaign found it
    if by:
        out["by"] = str(by)
    if getattr(finding, "severe", None):
        out["severe"] = finding.severe.to_json()
    return out


@dataclass
class Severe:
    """A finding's severe case (`Finding.severe`, a repro's `found.severe`): the campaign's worst case
    of the signature, shrunk keeping its judged mean over `bar` (`harness.fuzz.SEVERE_FACTOR`), what it
    judged then, and the campaign's peak it was shrunk from. `judged`, `bar` and `peak` are inf where
    a sampled token is one the trainer excludes."""

    case: Case
    judged: float
    headline: str  # the evaluation's headline ("k3=0.0533")
    bar: float
    peak: float
    complete: bool  # its shrinking finished

    @property
    def keeping(self) -> str:
        """What its shrink kept: 'it over 0.0324', or a sampled token the trainer excludes."""
        return "a sampled token the trainer excludes (k3 inf)" if self.bar == math.inf else f"it over {self.bar:.3g}"

    def to_json(self) -> dict[str, Any]:
        return {"case": self.case.to_json(), "judged": encode_float(float(self.judged)), "headline": self.headline,
                "bar": encode_float(float(self.bar)), "peak": encode_float(float(self.peak)),
                "shrink_complete": bool(self.complete)}

    @classmethod
    def from_json(cls, data: Any) -> "Severe | None":
        """The severe case a repro or a worker's result holds, or None (none, or edited past reading)."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(Case.from_json(data["case"]), float(decode_float(data["judged"])),
                       str(data.get("headline", "")), float(decode_float(data["bar"])),
                       float(decode_float(data["peak"])), bool(data.get("shrink_complete", True)))
        except Exception:  # noqa: BLE001 - a hand-edited severe case is named where it is used
            return None


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def record_finding(finding: Any, corpus_dir: Path, threshold: float, campaign_seed: int, device: str,
                   log: Callable[[str], None] | None = None,
                   reproduces: Callable[[Case], bool] | None = None) -> Path:
    """Write a finding to `corpus_dir/<pair>/<id>.json`, unless the corpus already has it.

    An existing file is left as it is, except a `fixed` one, which is reopened: its status becomes
    `open` and the recurrence, with the new minimal case, is appended to its history. An existing
    file that does not load (edited by hand, damaged) is never replaced silently: it is moved aside,
    unchanged, to `<id>.json.broken-<time>` with a JSON sidecar `<id>.json.broken-<time>.why` (its
    original path, when and why it was moved, what could be read of it) and one warning line saying
    where it went and how to restore it (`move_aside`); the new repro written in its place starts
    its history with the old file's history entries that could be read and an entry naming the
    file aside, the reason and what was read of it (its `found`, `tracking`, status, signature).

    A divergence (or NaN/inf) signature says only which pair and which symptom: every divergence of
    a pair shares it. With `reproduces(case)` (whether a case fails now with the finding's symptom;
    the campaign evaluates it), a repro of the same signature counts as this finding only if its own
    case still fails. When none does, the bug those repros hold is gone and this is another one: it
    gets a signature of its own (the base signature and its minimal case) and a file of its own,
    and is new (a nightly item fails on it; the old repro replays clean and says to close it).
    An existing repro whose shrinking was cut short (`found.shrink_complete` false) is given the
    finding's case when that is smaller or fully shrunk; its status and history stay.
    """
    log = log or _stderr
    moved: list[MovedAside] = []
    try:
        return _record_finding(finding, corpus_dir, threshold, campaign_seed, device, log, reproduces, moved)
    finally:  # (also when the new repro could not be written: the old file was moved all the same)
        for m in moved:
            log(m.line(finding.path))


def _record_finding(finding: Any, corpus_dir: Path, threshold: float, campaign_seed: int, device: str,
                    log: Callable[[str], None], reproduces: Callable[[Case], bool] | None,
                    moved: list["MovedAside"]) -> Path:
    base = getattr(finding, "base_signature", "") or finding.signature
    folder = Path(corpus_dir) / finding.pair
    path = folder / f"{finding.id}.json"
    finding.path = path
    clean_stale_temps(folder)
    candidates: list[tuple[Path, Repro]] = []
    blocked = False  # the file is there but refused by this process's limits: left as it is
    if path.exists():
        try:
            candidates.append((path, load_repro(path)))
        except LimitError as e:
            blocked = True
            log(f"warning: corpus file {path} is left as it is: {e}")
        except UsageError as e:
            m = move_aside(path, str(e), finding.signature)
            if m is not None:
                moved.append(m)
    if reproduces is not None and finding.symptom in (Symptom.DIVERGENCE, Symptom.NONFINITE):
        candidates += [(p, r) for p, r in _repros_of(folder) if p != path and r.base_signature == base]
        gone, edited = [], []
        same = next(((p, old) for p, old in candidates if old.case == finding.case), None)
        if same is not None:
            return _known(finding, *same, campaign_seed, device)
        # (a repro whose case was edited by hand is tried last: its case may not be its bug's any more)
        for p, old in sorted(candidates, key=lambda c: c[1].case_edited):
            if reproduces(old.case):
                return _known(finding, p, old, campaign_seed, device)
            (edited if old.case_edited else gone).append(p)
        if gone or edited or blocked:  # every repro of this signature replays clean now: another bug
            path = _own_signature(finding, base, folder)
            if gone:
                status = {p: old.status for p, old in candidates}
                still = [p for p in gone if status.get(p) != "fixed"]  # (a closed one needs nothing done)
                log(f"  {finding.pair}: this {finding.symptom.value} is not the one in {', '.join(map(str, gone))} "
                    + ("(that case no longer fails: if its bug is fixed, `harness regressions close` "
                       + (f"{', '.join(p.stem for p in still)}" if len(still) < len(gone) else "it") + "); "
                       if still else "(closed as fixed, and its case passes); ")
                    + f"recorded as a new repro, {path}")
            if edited:  # not "fixed": its case is no longer the one it was recorded with
                log(f"  {finding.pair}: the case of {', '.join(map(str, edited))} was edited by hand since it was "
                    f"recorded and passes now, so it cannot tell whether this {finding.symptom.value} is its bug; "
                    f"recorded as a new repro, {path}. Restore that case from git (or `harness rerecord` it) so "
                    "campaigns can compare again")
            if path.exists():  # (only if that case failed in the campaign and passed just now: flaky)
                try:
                    return _known(finding, path, load_repro(path), campaign_seed, device)
                except UsageError:
                    pass
    elif candidates:
        return _known(finding, path, candidates[0][1], campaign_seed, device)
    elif finding.symptom is Symptom.ERROR and finding.evaluation.error:  # a repro named before message classes
        adopted = _legacy_error_repro(finding, folder)
        if adopted is not None:
            return _known(finding, *adopted, campaign_seed, device)
    elif blocked:  # (no way to tell whether it is the same bug: keep both)
        path = _own_signature(finding, base, folder)
    finding.new = True
    repro = finding_to_repro(finding, threshold, campaign_seed, device, corpus_dir)
    replaced = [m for m in moved if m.original == path]  # in the place of a file moved aside: what could
    for m in replaced:  # be read of it goes on in the new repro's history
        repro.history = m.carried_history() + repro.history
    repro.save(path)
    for m in replaced:
        m.carried = True
    return path


ASIDE_WHY = ".why"  # `<id>.json.broken-<time>.why`: the sidecar of a file moved aside (JSON; not `.json`,
# so that replaying a folder, or the corpus test, never takes it for a repro)
RECOVERED_FIELDS = ("id", "pair", "symptom", "signature", "base_signature", "status", "found", "tracking")
RECOVERED_MAX_CHARS = 65536  # a recovered field larger than this (as JSON) stays in the file aside only


@dataclass
class MovedAside:
    """A corpus file that did not load, moved aside (`move_aside`)."""
    original: Path  # where it was
    aside: Path  # where it is now: the file as it was, byte for byte
    sidecar: Path  # `<aside>.why`: what it was and why it was moved (JSON)
    reason: str  # why it did not load (the loader's message)
    at: str  # when it was moved (ISO time, UTC)
    recovered: dict[str, Any]  # what could still be read of it (`RECOVERED_FIELDS`, `history_entries`)
    history: list[dict[str, Any]]  # its history entries that could be read (objects only)
    carried: bool = False  # carried into the history of the new repro written at `original`

    def carried_history(self) -> list[dict[str, Any]]:
        """Its history, then one entry saying where it went and what was read of it."""
        return [*self.history, {"at": self.at, "event": "took the place of a corrupted file",
                                "moved_to": self.aside.name, "reason": self.reason, "recovered": self.recovered}]

    def line(self, now_at: Any) -> str:
        """The one line that tells a person where the file went and how to restore it."""
        n = self.recovered.get("history_entries", 0)
        read = ", ".join(k if k != "history_entries" else f"{n} history entr{'y' if n == 1 else 'ies'}"
                         for k in self.recovered)
        kept = ("nothing of it could be read as a repro's JSON object" if not read else
                f"what could be read of it ({read}) is kept in the history of the new repro written there"
                if self.carried else f"what could be read of it: {read}")
        taken = "over the new repro now there, " if self.carried or str(now_at) == str(self.original) else ""
        return (f"warning: corpus file {self.original} does not load ({self.reason}); it was moved aside, unchanged, "
                f"to {self.aside} (what it was, when and why it was moved: {self.sidecar}; {kept}). To restore it, "
                f"fix what the reason names in that file and `mv {self.aside} {self.original}` ({taken}merging the "
                "two by hand if both matter).")


def _readable_parts(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What can still be read of a repro file that does not load: its identity, triage status, `found`
    and `tracking` (each only if small and of its type) and its history entries that are objects.
    JSON only, within the repro size limit; a file that is not a JSON object gives nothing."""
    try:
        if path.stat().st_size > LIMITS["bytes"].value():
            return {}, []
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError, UsageError):  # (UnicodeDecodeError is a ValueError)
        return {}, []
    if not isinstance(data, dict):
        return {}, []
    recovered: dict[str, Any] = {}
    for k in RECOVERED_FIELDS:
        v = data.get(k)
        kind = dict if k in ("found", "tracking") else str
        if isinstance(v, kind) and v:
            try:
                fits = len(json.dumps(encode_tree(v), allow_nan=False)) <= RECOVERED_MAX_CHARS
            except (ValueError, TypeError, RecursionError):
                fits = False
            if fits:
                recovered[k] = encode_tree(v)
    hist = data.get("history")
    history = [encode_tree(h) for h in hist if isinstance(h, dict)] if isinstance(hist, list) else []
    if history:
        recovered["history_entries"] = len(history)
    return recovered, history


def move_aside(path: Path, reason: str, replaced_by: str = "") -> MovedAside | None:
    """Move a corpus file that does not load out of the way of a new repro, losing nothing: the file,
    unchanged, to `<id>.json.broken-<time>` (`-2`, `-3`, ... when that name is taken: never over another),
    and beside it a JSON sidecar `<that>.why` with its original path, when and why it was moved, what
    could be read of it and the signature of the finding written in its place (`replaced_by`). Its
    contents are only parsed as JSON. None when the file is gone already (another process moved it)."""
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    recovered, history = _readable_parts(path)
    for n in range(1, 10000):
        aside = path.with_name(f"{path.name}.broken-{stamp}" + (f"-{n}" if n > 1 else ""))
        sidecar = aside.with_name(aside.name + ASIDE_WHY)
        if aside.exists():
            continue
        try:
            with open(sidecar, "x"):  # claims the name (another process moving a file aside takes the next)
                pass
        except FileExistsError:
            continue
        break
    else:  # (never in practice: ten thousand files of this id moved aside within one second)
        raise OSError(f"no free name to move {path} aside to ({path.name}.broken-{stamp}-N are all taken)")
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # moved by another process meanwhile: its line says where
        sidecar.unlink(missing_ok=True)
        return None
    except BaseException:
        sidecar.unlink(missing_ok=True)
        raise
    m = MovedAside(original=path, aside=aside, sidecar=sidecar, reason=reason, at=now_iso(), recovered=recovered,
                   history=history)
    why = {"what": "a corpus file that did not load, moved aside (unchanged) when a finding was written to its path",
           "original_path": str(path), "moved_to": str(aside), "moved_at": m.at, "id": path.stem,
           "pair": path.parent.name, "reason": reason, "replaced_by": replaced_by, "recovered": recovered,
           "restore": f"fix what the reason names in {aside}, then `mv {aside} {path}` (over any repro written "
                      "there since: merge the two by hand if both matter)"}
    try:
        write_json_atomic(sidecar, why)
    except OSError as e:  # (the file is moved all the same: the line says where, and why)
        m.reason = f"{reason}; its sidecar could not be written: {e.strerror or e}"
    return m


def _legacy_error_repro(finding: Any, folder: Path) -> tuple[Path, "Repro"] | None:
    """An error repro written when an error's signature was its type and raising frame only, whose
    message is of the finding's class: the same bug under its old id (kept, so its MLflow
    regression and history go on)."""
    from .fuzz import legacy_error_signature, message_class

    err = finding.evaluation.error
    legacy = legacy_error_signature(finding.pair, err)
    path = folder / f"{legacy[:12]}.json"
    if not path.exists():
        return None
    try:
        old = load_repro(path)
    except UsageError:
        return None
    same = (old.signature == legacy and old.error is not None
            and message_class(old.error.get("message")) == message_class(err.get("message")))
    return (path, old) if same else None


def _own_signature(finding: Any, base: str, folder: Path) -> Path:
    """Give the finding a signature of its own (the base signature and its minimal case); its path."""
    finding.signature = hashlib.sha256(f"{base}|{finding.case.key()}".encode()).hexdigest()
    finding.base_signature = base
    finding.path = folder / f"{finding.id}.json"
    return finding.path


def _repros_of(folder: Path) -> list[tuple[Path, "Repro"]]:
    """The repros in one pair's corpus folder that load, in name order (others are skipped)."""
    out = []
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            out.append((p, load_repro(p)))
        except UsageError:
            continue
    return out


def _known(finding: Any, path: Path, old: "Repro", campaign_seed: int, device: str) -> Path:
    """The finding is the bug the repro at `path` holds: point the finding at it; reopen a fixed repro
    (a recurrence); give a repro whose shrinking was cut short the finding's case when that is
    smaller or fully shrunk."""
    finding.new = False
    finding.path = path
    finding.signature = old.signature or finding.signature
    changed = False
    if old.status == "fixed":
        finding.recurrence = True
        old.status = "open"
        old.history.append({"at": now_iso(), "event": "recurred", "campaign_seed": campaign_seed,
                            "case": finding.case.to_json(), "metrics": metrics_json(finding.evaluation)})
        changed = True
    finding.corpus_status = old.status  # (what the corpus says of it: a summary shows `wontfix`, not `open`)
    cut_short = old.found.get("shrink_complete") is False
    size = lambda c: (c.batch_size, c.n_tokens)  # noqa: E731
    # a repro whose shrinking was cut short takes a smaller or fully shrunk case; a fully shrunk one takes
    # a fully shrunk case with fewer sequences or tokens (another campaign's shrink reached a smaller
    # minimum of the same bug: the smaller repro is the one a person reads)
    if old.case != finding.case and (
            (cut_short and (size(finding.case) < size(old.case)
                            or (finding.shrink_complete and size(finding.case) <= size(old.case))))
            or (finding.shrink_complete and size(finding.case) < size(old.case))):
        finding.updated = "a smaller case"
        old.take_smaller_case(finding.case, finding.evaluation, finding.shrink_complete, device,
                              evaluated_threads(finding.evaluation), deterministic=getattr(finding, "deterministic", True),
                              neighbours=getattr(finding, "neighbours", None), campaign_seed=campaign_seed)
        changed = True
    sev, had = getattr(finding, "severe", None), Severe.from_json(old.found.get("severe"))
    if sev and (had is None or sev.judged > had.judged):
        old.found["severe"] = sev.to_json()  # (the most severe a campaign of it has seen)
        changed = True
        finding.updated = "a worse severe case"
    if changed:
        old.save(path)
    return path


# ---------------------------------------------------------------------------------------------
# Loading: every field checked before anything runs
# ---------------------------------------------------------------------------------------------
def _symptoms() -> tuple[str, ...]:
    return tuple(s.value for s in Symptom if s is not Symptom.NONE)


def _is_number(x: Any) -> bool:
    """An int or float a float can hold (JSON may hold an int too large for one: not a number here)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def validate_repro_json(data: Any, where: str) -> None:
    """Type- and range-check every field of a repro's JSON; UsageError names the field and the fix."""
    fix = "Restore the file from git, or re-record it with `harness fuzz`."

    def bad(name: str, value: Any, rule: str) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise UsageError(f"{where}: field {name!r} = {shown} is invalid: {rule}. {fix}")

    if not isinstance(data, dict):
        raise UsageError(f"{where} holds a JSON {type(data).__name__}, not an object; a repro is a JSON object. {fix}")
    if data.get("schema") != REPRO_SCHEMA:
        raise UsageError(f"{where} has top-level \"schema\": {json.dumps(data.get('schema'))}, but this harness "
                         f"reads repros with \"schema\": \"{REPRO_SCHEMA}\" (the case's own \"schema\" number is another "
                         "field); pass a "
                         f"repro file written by `harness fuzz` (corpora/<pair>/<id>.json), or re-record it with this "
                         "version of the harness.")
    missing = [k for k in ("pair", "case", "status") if k not in data]
    if missing:
        raise UsageError(f"{where} lacks the field(s) {missing}; every repro needs pair, case and status. {fix}")
    pair = data["pair"]
    if not isinstance(pair, str) or not pair or len(pair) > 200 or not re.fullmatch(r"[\w.\-:/]+", pair):
        bad("pair", pair, "must be a registered pair's name (letters, digits, '_', '.', '-')")
    if data["status"] not in STATUSES:
        bad("status", data["status"], f"must be one of {STATUSES} (use `harness regressions close` to change it)")
    if "id" in data and (not isinstance(data["id"], str) or not re.fullmatch(r"[A-Za-z0-9_\-]{1,128}", data["id"])):
        bad("id", data["id"], "must be a string of letters, digits, '_' or '-' (the file's stem)")
    if "symptom" in data and data["symptom"] not in _symptoms():
        bad("symptom", data["symptom"], f"must be one of {_symptoms()}")
    for name in ("signature", "base_signature"):
        if name in data and (not isinstance(data[name], str) or len(data[name]) > 256):
            bad(name, data[name], "must be a string (the finding's hex signature)")
    fp = data.get("case_fingerprint")
    if fp is not None and (not isinstance(fp, str) or not re.fullmatch(r"[0-9a-f]{0,64}", fp)):
        bad("case_fingerprint", fp, "must be the hex fingerprint the harness wrote (or leave it out)")
    if "threshold" in data:
        t = data["threshold"]
        if not _is_number(t) or not math.isfinite(t) or t <= 0:
            bad("threshold", t, "must be a finite number > 0 (the mean k3 above which a case diverges)")
    metrics = data.get("metrics")
    if metrics is not None:
        if not isinstance(metrics, dict):
            bad("metrics", metrics, "must be an object of metric name -> number (or \"nan\", \"inf\", \"-inf\")")
        for k, v in metrics.items():
            if k == "fired":
                if v not in FIRED:
                    bad("metrics.fired", v, f"must be one of {FIRED} (which mean crossed the threshold)")
            elif k == "verdict_over":
                from .pairs import VERDICT_OVER

                if v not in VERDICT_OVER:
                    bad("metrics.verdict_over", v, f"must be one of {VERDICT_OVER} (what the verdict's means are over)")
            elif k == "rows":
                if v not in ("full", "two_outcome"):
                    bad("metrics.rows", v, "must be \"full\" or \"two_outcome\" (what a row of log-probabilities holds)")
            elif not isinstance(k, str) or not (_is_number(v) or v in NONFINITE):
                bad(f"metrics.{k}", v, "must be a number or one of \"nan\", \"inf\", \"-inf\"")
    err = data.get("error")
    if err is not None and (not isinstance(err, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str) or _is_number(v)) for k, v in err.items())):
        bad("error", err, "must be null or an object of strings (type, message, where, traceback)")
    for name in ("environment", "found", "tracking", "loader"):
        if data.get(name) is not None and not isinstance(data[name], dict):
            bad(name, data[name], "must be an object")
    nb = data.get("neighbours")
    if nb is not None and not (isinstance(nb, list) and all(
            isinstance(r, dict) and isinstance(r.get("change"), str) and isinstance(r.get("symptom", ""), str)
            and (_is_number(r.get("judged")) or r.get("judged") in NONFINITE) for r in nb)):
        bad("neighbours", nb, 'must be a list of {"change": text, "judged": number, "symptom": text} (or leave it out)')
    env = data.get("environment") or {}
    on = env.get(METRICS_ON)
    if on is not None and not isinstance(on, dict):
        bad(f"environment.{METRICS_ON}", on, "must be an object (where the metrics were computed)")
    for name, holder in (("environment", env), (f"environment.{METRICS_ON}", on or {})):
        for k in BIT_FOR_BIT_KEYS:
            if holder.get(k) is not None and not isinstance(holder[k], str):
                bad(f"{name}.{k}", holder[k], "must be a string (what the repro was recorded on) or absent")
        if holder.get("torch_threads") is not None and not is_thread_count(holder["torch_threads"]):
            bad(f"{name}.torch_threads", holder["torch_threads"],
                "must be a whole number of torch threads from 1 to 1024 (or absent)")
    found = data.get("found") or {}
    for k in ("shrink_complete", "deterministic"):
        if found.get(k) is not None and not isinstance(found[k], bool):
            bad(f"found.{k}", found[k], "must be true or false (or absent)")
    for k in ("cases_to_first", "cases_total", "examples", "seconds_to_first", "shrink_seconds", "stream", "streams"):
        v = found.get(k)
        if v is not None and (not _is_number(v) or not math.isfinite(v) or v < 0
                              or (k.startswith(("cases", "examples", "stream")) and not isinstance(v, int))):
            bad(f"found.{k}", v, "must be a " + ("whole number" if k.startswith(("cases", "examples", "stream"))
                                                  else "finite number of seconds") + " >= 0")
    loader = data.get("loader") or {}
    if loader:
        if loader.get("kind") not in LOADER_KINDS + ("unknown",):
            bad("loader.kind", loader.get("kind"), f"must be one of {LOADER_KINDS}")
        for k, v in loader.items():
            if not isinstance(v, str) or len(v) > 1000:
                bad(f"loader.{k}", v, "must be a string")
    hist = data.get("history")
    if hist is not None and (not isinstance(hist, list) or not all(isinstance(h, dict) for h in hist)):
        bad("history", hist, "must be a list of objects")


def missing_repro(path: Path) -> str:
    """The message for a repro path that is not there (a dangling symbolic link says so)."""
    return f"repro file {str(path)!r} " + (
        "is a symbolic link to nothing (a loop, or its target was moved): point it at" if path.is_symlink()
        else "does not exist; pass") + " a repro file written by `harness fuzz` (corpora/<pair>/<id>.json)."


def load_repro(path: str | Path) -> Repro:
    path = Path(path)
    fix = "pass a repro file written by `harness fuzz` (corpora/<pair>/<id>.json)"
    where = f"repro file {str(path)!r}"
    if not path.exists():
        raise UsageError(missing_repro(path))
    if path.is_dir():
        try:
            os.listdir(path)
        except OSError as e:  # (iter_corpus lists such a folder: its repros would be left out unsaid)
            raise UsageError(f"the corpus folder {str(path)!r} cannot be read ({e.strerror or e}), so its repros are "
                             "not replayed; make it readable (chmod u+rx) and run again.") from None
        raise UsageError(f"{str(path)!r} is a folder, not a repro file; {fix}, or list the folder's *.json files.")
    if not path.is_file():  # a FIFO would block the read, a device would never end
        raise UsageError(f"{where} is not a regular file (a pipe, socket or device); {fix}.")
    try:
        size = path.stat().st_size
        if size > LIMITS["bytes"].value():
            lim = LIMITS["bytes"]
            raise UsageError(f"{where} is {size} bytes, above the limit of {lim.value()} ({lim.name}); a repro is "
                             f"a few kB. If it is genuine, raise the limit: {lim.env}={size} harness ...")
        data = json.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"{where} cannot be read ({e.strerror or e}); check its permissions.") from None
    except UnicodeDecodeError:
        raise UsageError(f"{where} is not text (JSON expected); {fix}.") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and int() of a number of > 4300 digits
        # (json's "Unterminated string starting at" names the place itself: no second "at")
        detail = f"{e.msg.removesuffix(' at')} at line {e.lineno}, column {e.colno}" if isinstance(
            e, json.JSONDecodeError) else \
            "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise UsageError(f"{where} is not valid JSON ({detail}); restore it from git or re-run the campaign that "
                         "found it.") from None
    return repro_from_json(data, where, path)


def repro_from_json(data: Any, where: str, path: Path | None = None) -> Repro:
    """A Repro from parsed JSON, every field checked and the case's size bounded."""
    validate_repro_json(data, where)
    try:
        case = Case.from_json(data["case"])
    except CaseError as e:
        raise UsageError(f"{where} holds an invalid case: {e} Fix the field (or restore the case from git: "
                         "`harness rerecord` needs a case that loads).") from None
    check_case_size(case, where)
    known = {"schema", "id", "pair", "symptom", "signature", "base_signature", "status", "threshold", "case",
             "case_fingerprint", "metrics", "error", "environment", "loader", "found", "history", "tracking",
             "neighbours"}
    recorded_fp = str(data.get("case_fingerprint") or "")
    return Repro(
        path=path, id=str(data.get("id") or (path.stem if path else "")), pair=data["pair"],
        symptom=data.get("symptom", "divergence"), signature=data.get("signature", ""),
        base_signature=data.get("base_signature") or data.get("signature", ""),
        status=data["status"], threshold=float(data.get("threshold", DEFAULT_THRESHOLD)), case=case,
        metrics={k: decode_float(v) for k, v in (data.get("metrics") or {}).items()}, error=data.get("error"),
        environment=data.get("environment") or {}, found=data.get("found") or {},
        history=list(data.get("history") or []), tracking=dict(data.get("tracking") or {}),
        loader=dict(data.get("loader") or {}), extra={k: v for k, v in data.items() if k not in known},
        case_fingerprint=recorded_fp, case_edited=bool(recorded_fp) and recorded_fp != case_fingerprint(data["case"]),
        neighbours=[{**r, "judged": decode_float(r.get("judged"))} for r in data.get("neighbours") or []],
    )


def case_fingerprint(case_json: Any) -> str:
    """A short hash of a case as a repro stores it (its JSON object): a hand edit of any field changes it."""
    text = json.dumps(case_json, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def iter_corpus(corpus_dir: str | Path) -> list[Path]:
    """The repro files under a corpus folder, and any folder under it that cannot be read (listed as
    itself: loading it says so, where `rglob` would leave its repros out without a word)."""
    root = Path(corpus_dir)
    if not root.exists():
        return []
    found: list[Path] = []
    for folder, dirs, files in os.walk(root, onerror=lambda e: found.append(Path(e.filename))):
        found += [Path(folder) / n for n in (*files, *dirs) if n.endswith(".json") and not n.startswith(".")]
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    repro: Repro
    evaluation: Evaluation
    mismatches: dict[str, tuple[Any, Any]]  # metric -> (recorded, now), where not bit-for-bit equal
    weights: str = ""  # the pair now runs other weights than the repro was recorded with (`weights_note`)

    @property
    def compared(self) -> bool:
        """Whether the recorded metrics are the ones to reproduce: not for a `fixed` repro that replays
        clean (they are the bug's; the fix is judged by the verdict alone), nor for a case edited by
        hand since it was recorded (they are another case's; `Repro.case_edited`)."""
        return not self.repro.case_edited and not (self.repro.status == "fixed" and not self.evaluation.failed)

    @property
    def bit_for_bit(self) -> bool:
        """The replay reproduced the recorded metrics exactly (True, vacuously, when not `compared`)."""
        return not self.compared or not self.mismatches

    def beyond_noise(self, rel: float = 1e-2, floor: float = 1e-9) -> dict[str, tuple[Any, Any]]:
        """The mismatches another machine's last bits do not explain: every one that is not a number
        within `rel` (relative) or `floor` (absolute) of the recorded one (a symptom, an error type,
        metrics missing, which mean fired, a count, NaN against a number). Between two x86 CPUs
        with the same torch and numpy the corpus's metrics differed by at most 1.6e-5 relative
        (above `floor`); a k3 that doubles, or a new symptom, is beyond it. Empty when not `compared`."""
        if not self.compared:
            return {}
        out = {}
        for k, (a, b) in self.mismatches.items():
            near = (isinstance(a, float) and isinstance(b, float) and math.isfinite(a) and math.isfinite(b)
                    and abs(a - b) <= max(rel * max(abs(a), abs(b)), floor))
            if not near:
                out[k] = (a, b)
        return out

    @property
    def nondeterministic(self) -> bool:
        """The campaign that found it ran its minimal case twice and got other values
        (`found.deterministic: false`): its metrics are one draw of a pair that is not a function of
        its case, so no replay is expected to reproduce them; only the failure is."""
        return self.repro.found.get("deterministic") is False

    def failure_mismatches(self) -> dict[str, tuple[Any, Any]]:
        """The mismatches of the failure itself: the symptom and the error type (what a
        nondeterministic repro is held to; which mean fired is part of its draw; empty when not
        `compared`)."""
        if not self.compared:
            return {}
        return {k: v for k, v in self.mismatches.items() if k in ("symptom", "error")}

    @property
    def diverges(self) -> bool:
        return self.evaluation.failed


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_metrics(repro: Repro, ev: Evaluation) -> dict[str, tuple[Any, Any]]:
    """What differs between the recorded and the replayed result.

    Metrics are compared bit-for-bit over the keys both have (a repro recorded before a metric
    existed, such as `kl_excluded` or `fired`, is compared on the ones it has); a repro without any
    metrics, replayed to some, cannot claim bit-for-bit. A `crash` or `timeout` repro has no metrics:
    it is judged by its symptom and error type."""
    now = {k: decode_float(v) for k, v in metrics_json(ev).items()}
    mismatches: dict[str, tuple[Any, Any]] = {}
    if bool(now) != bool(repro.metrics):
        mismatches["metrics"] = ("recorded", "missing") if repro.metrics else ("missing", "measured")
    for k in (*METRIC_KEYS, "fired"):
        if k in repro.metrics and k in now and not _same(repro.metrics[k], now[k]):
            mismatches[k] = (repro.metrics[k], now[k])
    if repro.metrics and now and repro.metrics.get("verdict_over", "batch") != now.get("verdict_over", "batch"):
        # the pair now judges over the batch where it judged over sequences (or back): another verdict
        mismatches["verdict_over"] = (repro.metrics.get("verdict_over", "batch"), now.get("verdict_over", "batch"))
    if repro.symptom != ev.symptom.value:
        mismatches["symptom"] = (repro.symptom, ev.symptom.value)
    if not now and not repro.metrics and ev.error is not None:  # an error both times: the same error?
        from .fuzz import message_class

        rec = (repro.error or {}).get("type")
        if rec != ev.error.get("type"):
            mismatches["error"] = (rec or "missing", ev.error.get("type"))
        elif repro.symptom == "error" and repro.error and message_class(repro.error.get("message")) != \
                message_class(ev.error.get("message")):  # another error of the same type: another bug
            mismatches["error"] = (f"{rec}: {message_class(repro.error.get('message'))[:120]}",
                                   f"{rec}: {message_class(ev.error.get('message'))[:120]}")
    return mismatches


ISOLATED_SYMPTOMS = ("crash", "timeout")  # repros replayed in a worker process, never in this one


def recorded_timeout(repro: Repro) -> float | None:
    """The per-case timeout a `timeout` repro was found under (None when it does not say)."""
    err = repro.error or {}
    t = err.get("timeout_s")
    if _is_number(t) and math.isfinite(t) and t > 0:
        return float(t)
    m = re.search(r"per-case timeout of ([0-9.eE+]+) s", str(err.get("message") or ""))
    try:
        t = float(m.group(1)) if m else None
    except ValueError:
        return None
    return t if t is not None and math.isfinite(t) and t > 0 else None


def replay(repro: Repro, device: str = "cpu", threshold: float | None = None, registry: Any = None,
           keep_outcomes: bool = False, timeout: float | None = None,
           plugins: tuple[str, ...] | list[str] = (), warn: bool = True) -> ReplayResult:
    """Replay a repro and compare it with what was recorded (`warn`: print the weights warning,
    `ReplayResult.weights`, to stderr; a caller that prints the result itself says False).

    A `crash` or `timeout` repro runs in a supervised worker process (`harness.worker`), as the
    campaign ran it: a case that kills its process or hangs comes back as a `crash` or `timeout`
    Evaluation (judged by symptom and error type) and this process goes on. Its per-case `timeout`
    defaults to the one a `timeout` repro was found under, else the worker's default; its outcomes
    are never kept. Every other repro runs in this process."""
    from .pairs import REGISTRY

    registry = registry or REGISTRY
    check_case_size(repro.case, f"repro {repro.path or repro.id}")
    try:
        pair = registry.get(repro.pair)
    except UsageError as e:
        hint = ""
        spec = repro.plugin_spec()
        if spec:
            hint = f" It was recorded from a plugin: replay it with `{repro.replay_command()}`."
        raise CannotEvaluate(f"repro {repro.path} needs pair {repro.pair!r}, which is not registered here: {e}"
                             f"{hint}") from None
    if threshold is not None and (not math.isfinite(threshold) or threshold <= 0):
        raise UsageError(f"threshold {threshold!r} must be a finite number > 0.")
    if timeout is not None and (not math.isfinite(timeout) or timeout <= 0):
        raise UsageError(f"timeout {timeout!r} must be a finite number of seconds > 0.")
    thr = threshold if threshold is not None else repro.threshold
    threads = recorded_threads(repro.environment)  # the thread count it was found with (GEMM sums split by it)
    if repro.symptom in ISOLATED_SYMPTOMS:
        from .worker import DEFAULT_TIMEOUT, Worker

        limit = timeout or (recorded_timeout(repro) if repro.symptom == "timeout" else None) or DEFAULT_TIMEOUT
        with Worker(device, tuple(plugins), limit, threads=threads) as worker:
            ev = worker.evaluate(pair, repro.case, thr)
    else:
        with threads_as(threads):
            ev = run_case(pair, repro.case, device, thr, keep_outcomes=keep_outcomes)
    if ev.setup:  # e.g. a recorded rollout's checkpoint folder that is gone: not "still failing"
        raise CannotEvaluate(f"repro {repro.path or repro.id} cannot be evaluated here: its pair {repro.pair!r} could "
                             f"not run: {ev.error['type']}: {ev.error['message']}")
    note = weights_note(repro, registry)
    if note and warn:
        _stderr(f"warning: {note}")
    return ReplayResult(repro, ev, compare_metrics(repro, ev), weights=note)


def replay_severe(repro: Repro, device: str = "cpu", registry: Any = None) -> Evaluation | None:
    """The repro's severe case (`found.severe`) run now, as `replay` runs its minimal case; None where
    it keeps none (or one edited past reading). Once the minimal case's bug is fixed, a severe case
    that still fails is a second bug: `severe_note` says so, and `keep_severe` records it."""
    import dataclasses

    sev = Severe.from_json((repro.found or {}).get("severe"))
    if sev is None or repro.symptom in ISOLATED_SYMPTOMS:
        return None
    other = dataclasses.replace(repro, case=sev.case, metrics={}, case_fingerprint="", case_edited=False)
    return replay(other, device, registry=registry, warn=False).evaluation


def severe_note(ev: Evaluation) -> str:
    """What a still-failing severe case of a repro that replays clean means, in one sentence."""
    return (f"its severe case (found.severe) still fails ({ev.symptom.value} {ev.headline}): a second bug its minimal "
            "case does not hold; closing this repro as fixed records that case as an open repro of its own")


def keep_severe(repro: Repro, path: Path, ev: Evaluation, device: str = "cpu", registry: Any = None,
                log: Callable[[str], None] | None = None) -> Any:
    """A repro just closed as fixed (the file at `path`) whose severe case still fails (`ev`, from
    `replay_severe`): that case becomes a repro of its own in the same corpus, as a campaign finding
    it would record it (`record_finding`: the closed repro's case passes, so this is another bug with
    a signature of its own), open, not shrunk further, its `found.by` naming the repro it came from;
    nothing already found is lost with the close. Returns the `Finding` (its `path`; `new` False
    when the corpus already held it)."""
    from .fuzz import PairResult, _finding, reproduces_with
    from .pairs import REGISTRY

    pair = (registry or REGISTRY).get(repro.pair)
    sev = Severe.from_json(repro.found.get("severe"))
    f = _finding(pair, ev, PairResult(pair.name, pair.expected), complete=bool(sev and sev.complete))
    f.recorded_by = f"the severe case of {repro.id}, still failing when {repro.id} was closed as fixed"
    if sev is not None:  # (the campaign's worst case it was shrunk from: how bad this bug got)
        f.peak = sev.peak
    threads = recorded_threads(repro.environment)

    def evaluate(case: Case) -> Evaluation:  # (another repro of the pair's divergences: still its bug?)
        with threads_as(threads):
            return run_case(pair, case, device, repro.threshold)

    record_finding(f, Path(path).parent.parent, repro.threshold, int(repro.found.get("campaign_seed", 0) or 0),
                   device, log=log, reproduces=reproduces_with(evaluate, pair.name, f.base_signature))
    return f


def load_plugin_for(repro: Repro, registry: Any = None, flag: str = "--plugin") -> str | None:
    """Make the repro's pair available: load its plugin file when `auto_plugin` allows it.

    Returns None when the pair is registered afterwards, else why it is not (a skip reason), which
    names the option that loads a plugin where it is read (`flag`: `--harness-plugin` under pytest)."""
    from .pairs import REGISTRY

    registry = registry or REGISTRY
    registry.load_builtins()
    try:
        registry.get(repro.pair)
        return None
    except UsageError:
        pass
    path, why = repro.auto_plugin(flag)
    if path is None and why and repro.loader.get("kind") == "builtin":  # (no plugin registers a built-in pair)
        return why
    if path is None:
        given = list(getattr(registry, "plugins", None) or ())
        if given:  # plugins were loaded (--plugin) and none registers it: that first, then where it came from
            theirs = sorted(p.name for p in registry.all() if p.source in given or
                            any(p.source == str(Path(g)) for g in given))
            recorded = repro.loader.get("path") or repro.loader.get("module") or ""
            if recorded and any(g == recorded or Path(g).name == Path(recorded).name for g in given):
                why = f"it was recorded from {recorded}, which is loaded"  # (not "pass --plugin": it was)
            return (f"its pair {repro.pair!r} is not registered here: the plugin(s) loaded here, {', '.join(given)}, "
                    f"register {', '.join(theirs[:8]) + (' ...' if len(theirs) > 8 else '') or 'no pair'}, not "
                    f"{repro.pair!r} (renamed since the repro was recorded? check the pair name in the repro)"
                    + (f"; the repro says: {why}" if why else f"; pass {flag}=FILE.py|MODULE for the plugin that "
                       "registers it"))
        return why or (f"its pair {repro.pair!r} is not registered here and the repro does not say how it was "
                       f"loaded (recorded before repros said so): if the pair was built in (targets/), it was "
                       f"renamed or removed since; if it comes from a plugin, pass {flag}=FILE.py|MODULE")
    try:
        registry.load_plugin(path)
    except UsageError as e:
        return f"its plugin file {path} failed to load: {e}"
    except Exception as e:  # noqa: BLE001 - a PairError or anything the plugin raises: a skip, with why
        return f"its plugin file {path} failed to load: {type(e).__name__}: {e}"
    try:
        registry.get(repro.pair)
    except UsageError:
        return f"its plugin file {path} loaded but does not register pair {repro.pair!r}"
    return None


@dataclass
class Skipped:
    path: Path | None  # the file, or None for a repro fetched from MLflow
    reason: str  # one paragraph: what is wrong and how to fix it


def load_many_tolerant(paths: Iterable[str | Path]) -> tuple[list[Repro], list[Skipped]]:
    """Repros from files and folders; one that does not load is skipped with its reason, not fatal."""
    out: list[Repro] = []
    skipped: list[Skipped] = []
    for p in paths:
        p = Path(p)
        files = iter_corpus(p) if p.is_dir() else [p]
        for q in files:
            try:
                out.append(load_repro(q))
            except UsageError as e:
                skipped.append(Skipped(q, str(e)))
    return out, skipped


def load_many(paths: Iterable[str | Path]) -> list[Repro]:
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            out.extend(load_repro(q) for q in iter_corpus(p))
        else:
            out.append(load_repro(p))
    return out
