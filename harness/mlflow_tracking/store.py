"""Where the store is, the lock that serialises writers of a sqlite store, safe first creation
(and repair of a store an interrupted creation left half migrated), and the connected `Store`."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

from ..errors import UsageError

# MLflow's SQLAlchemy store configures a loader strategy SQLAlchemy 2 deprecates; the warning is
# MLflow's to fix, and printed on every command it says nothing a user of this harness can act on.
warnings.filterwarnings("ignore", message=r"The ``noload`` loader strategy is deprecated")

DEFAULT_EXPERIMENT = "harness"
EXPERIMENT_ENV = "HARNESS_MLFLOW_EXPERIMENT"
DEFAULT_DB = Path("reports") / "mlflow.db"  # relative to the working directory, resolved
DEFAULT_ARTIFACTS = "mlartifacts"  # beside a sqlite store's file
DEFAULT_SPOOL = Path("reports") / "pending"  # relative to the working directory, resolved
PENDING_SCHEMA = "harness.pending/1"

# MLflow reads these on every request. Its defaults (7 retries with backoff, 120 s timeout) wait
# about four minutes on a dead server; these fail within ~10 s. A value already set in the
# environment wins.
HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",  # one retry after the first failure
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # ~1 s before that retry
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",  # at most 0.5 s added to it
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "4",  # seconds per request: 4 + ~1 + 4 s in all on a silent server
}
PROBE_TIMEOUT = 3.0  # seconds for the TCP connect that tells a reachable server from a dead one

# Severity from the magnitude of the mean k3 relative to the threshold (first match wins).
SEVERITIES = (
    # (name, symptoms it applies to, smallest k3 / threshold)
    # NaN/inf out of a path, a path that raises, or one that kills its process (a segfault in a kernel)
    ("critical", ("nonfinite", "error", "crash"), 0.0),
    ("high", ("timeout",), 0.0),  # a path that hangs: a stalled rollout or training step
    ("high", ("divergence",), 100.0),  # k3 >= 100 x threshold: ratios far off, training is biased
    ("medium", ("divergence",), 10.0),  # k3 >= 10 x threshold
    ("low", ("divergence",), 0.0),  # above the threshold, within 10 x of it
)

TRIAGE_STATUSES = ("fixed", "wontfix")  # what `harness regressions close` may set
REGRESSION = "regression"
REPRO_ARTIFACTS = "repro"  # artifact folder of a regression run's repro JSON (`repro/<id>.json`)
CAMPAIGN = "campaign"



# ---------------------------------------------------------------------------------------------
# Where: store, experiment, spool
# ---------------------------------------------------------------------------------------------
def default_uri() -> str:
    return "sqlite:///" + str((Path.cwd() / DEFAULT_DB).resolve())


# schemes MLflow's tracking stores take (a plugin's come from its `mlflow.tracking_store` entry point)
KNOWN_SCHEMES = {"", "file", "sqlite", "http", "https", "databricks", "databricks-uc", "uc", "postgresql", "mysql",
                 "mssql", "oracle"}


def check_scheme(uri: str, uri_flag: str = "--tracking-uri", off_flag: str = "--no-tracking") -> None:
    """UsageError for a URI no MLflow tracking store takes (`bogus://x`): not an outage to wait out."""
    import re as _re

    m = _re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    if m is None or len(m.group(1)) == 1:  # a plain path (C:\... too)
        return
    scheme = m.group(1).lower().split("+")[0]
    if scheme in KNOWN_SCHEMES:
        return
    from importlib.metadata import entry_points

    if scheme in {ep.name for ep in entry_points(group="mlflow.tracking_store")}:
        return
    raise UsageError(f"tracking URI {uri!r}: no MLflow tracking store takes the scheme {scheme!r} (these do: "
                     f"{', '.join(sorted(s for s in KNOWN_SCHEMES if s))}, or an installed MLflow plugin's); fix "
                     f"{uri_flag} or $MLFLOW_TRACKING_URI, or pass {off_flag}.")


def resolve_uri(uri: str | None = None) -> str:
    """`uri`, else $MLFLOW_TRACKING_URI, else the embedded store under ./reports (absolute)."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri()
    check_scheme(uri)
    path = sqlite_path(uri)
    if path is not None:  # make a relative sqlite path absolute, so it means one file wherever
        return "sqlite:///" + str(path)
    return uri


def default_spool() -> Path:
    return (Path.cwd() / DEFAULT_SPOOL).resolve()


def experiment_name() -> str:
    return os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT


def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:// URI (absolute), None for any other store."""
    if not uri.startswith("sqlite:"):
        return None
    rest = uri[len("sqlite:"):]
    if rest.startswith("///"):
        rest = rest[3:]
    elif rest.startswith("//"):
        rest = rest[2:]
    rest = rest.split("?", 1)[0]
    if not rest or rest == ":memory:":
        return None
    return Path(rest if rest.startswith("/") else Path.cwd() / rest).resolve()


def bound_http() -> None:
    """Bound MLflow's HTTP retries and timeouts (see HTTP_LIMITS) before any request is made."""
    for key, value in HTTP_LIMITS.items():
        os.environ.setdefault(key, value)


def probe(uri: str) -> str | None:
    """Why the store cannot be reached, or None when it can (a TCP connect for http(s) stores)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        host = parsed.hostname or "localhost"
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT):
                return None
        except OSError as e:
            return f"cannot connect to {host}:{port} ({e.strerror or e})"
    return None


def _make_parent(db: Path) -> None:
    """Create the folder of a sqlite store, or say in one line why it cannot be (a file in the way,
    no permission) instead of an errno."""
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in [db.parent, *db.parent.parents] if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is not a folder" if blocker is not None else f"{type(e).__name__}: {e.strerror or e}"
        raise UsageError(f"the folder of the MLflow store {db} cannot be created ({why}); pass a tracking URI "
                         "whose sqlite file sits in a folder you can write, e.g. sqlite:///reports/mlflow.db") from None


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Exclusive across processes for a sqlite store (an flock on `<db>.lock`); no-op otherwise."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    import fcntl

    _make_parent(path)
    with open(str(path) + ".lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _marker(db: Path) -> Path:
    return Path(str(db) + ".initialised")


def _marker_text(db: Path) -> str:
    import mlflow

    return f"{os.stat(db).st_ino} {mlflow.__version__}"


def _initialised(db: Path | None) -> bool:
    """True when `db` was created and migrated by this MLflow version (per its marker file)."""
    if db is None or not db.exists():
        return False
    try:
        return _marker(db).read_text() == _marker_text(db)
    except OSError:
        return False


def _mark_initialised(db: Path) -> None:
    tmp = _marker(db).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(_marker_text(db))
    os.replace(tmp, _marker(db))


def _tables(db: Path) -> set[str]:
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        con.close()


def _count_runs(db: Path) -> int:
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return int(con.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
    except sqlite3.DatabaseError:
        return 0
    finally:
        con.close()


def _half_migrated(db: Path) -> str | None:
    """Why `db` looks like a schema migration that was interrupted (None when it does not)."""
    import sqlite3

    try:
        tables = _tables(db)
    except sqlite3.DatabaseError as e:
        return f"it is not a readable sqlite database ({e})"
    tmp = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    if tmp:
        return f"a schema migration was interrupted (leftover table(s) {', '.join(tmp)})"
    if tables and "alembic_version" not in tables:
        return "it has tables but no schema version"
    return None


def _migrate(uri: str) -> None:
    """Create or upgrade the schema of a sqlite store (MLflow does it on first access), then close
    the connections MLflow keeps for it."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    client.search_experiments(max_results=1)
    engine = getattr(getattr(getattr(client, "_tracking_client", None), "store", None), "engine", None)
    if engine is not None:
        engine.dispose()


def _creating_name(db: Path) -> str:
    return f".{db.name}.creating."


def _remove_dead_creations(db: Path) -> None:
    """Temporary databases of creations whose process is gone (killed mid-creation)."""
    from ..corpus import _pid_alive

    prefix = _creating_name(db)
    for p in db.parent.glob(prefix + "*"):
        pid = p.name[len(prefix):].split(".", 1)[0].split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
            with contextlib.suppress(OSError):
                p.unlink()


def _create_fresh(db: Path) -> None:
    """A new store: the schema is built in a temporary file beside `db`, then moved into place, so
    a process killed during creation leaves no half-built store behind."""
    _remove_dead_creations(db)
    tmp = db.parent / f"{_creating_name(db)}{os.getpid()}"
    try:
        _migrate("sqlite:///" + str(tmp))
        os.replace(tmp, db)
    finally:
        for leftover in (tmp, Path(str(tmp) + "-journal"), Path(str(tmp) + "-wal"), Path(str(tmp) + "-shm")):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def ensure_sqlite_store(db: Path, log: Callable[[str], None]) -> None:
    """Make `db` a store whose schema this MLflow version has built (call under the store lock).

    A missing file is created safely (`_create_fresh`). An existing one is upgraded in place; one
    left half-migrated by an interrupted migration has its leftover tables dropped and the
    migration retried, and when that fails too (or the file is no database) it is moved aside to
    `<db>.broken-<time>` (never deleted) and a fresh store created, with a warning naming both."""
    import sqlite3

    _make_parent(db)
    if not db.exists():
        _create_fresh(db)
        _mark_initialised(db)
        return
    uri = "sqlite:///" + str(db)
    why = _half_migrated(db)
    if why is None:
        try:
            _migrate(uri)
            _mark_initialised(db)
            return
        except Exception as e:  # noqa: BLE001 - any failure: repaired below
            why = f"its schema could not be upgraded ({type(e).__name__}: {_short(e)})"
    if "_alembic_tmp_" in why and _count_runs(db) > 0:
        try:
            con = sqlite3.connect(str(db), timeout=30)
            try:
                for t in sorted(x for x in _tables(db) if x.startswith("_alembic_tmp_")):
                    con.execute(f'DROP TABLE "{t}"')
                con.commit()
            finally:
                con.close()
            _migrate(uri)
            _mark_initialised(db)
            log(f"warning: MLflow store {db} was left half-migrated ({why}); repaired (leftover tables dropped, "
                "migration completed).")
            return
        except Exception as e:  # noqa: BLE001
            why += f"; dropping the leftovers and migrating again failed too ({type(e).__name__}: {_short(e)})"
    import datetime as _dt

    aside = db.with_name(f"{db.name}.broken-{_dt.datetime.now():%Y%m%dT%H%M%S}")
    os.replace(db, aside)
    _create_fresh(db)
    _mark_initialised(db)
    log(f"warning: MLflow store {db} was unusable: {why}. It was moved aside to {aside} (nothing deleted) and a "
        "fresh store created in its place; the corpus holds every finding, and `harness sync` or the next "
        "campaign logs them again.")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _quiet_mlflow_logs() -> None:
    for name in ("mlflow.store.db.utils", "alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


def now_iso() -> str:
    from ..corpus import now_iso as _now

    return _now()


# ---------------------------------------------------------------------------------------------
# The store: a connected client and the experiment
# ---------------------------------------------------------------------------------------------
class StoreUnavailable(Exception):
    """The tracking store cannot be reached or refused a call."""


class Store:
    """An MlflowClient on one tracking URI and the harness experiment in it."""

    def __init__(self, uri: str | None = None, create: bool = True,
                 log: Callable[[str], None] | None = None) -> None:
        self.uri = resolve_uri(uri)
        bound_http()
        _quiet_mlflow_logs()
        why = probe(self.uri)
        if why:
            raise StoreUnavailable(f"MLflow store {self.uri} is unreachable: {why}")
        db = sqlite_path(self.uri)
        if db is not None and not create and not db.exists():
            raise StoreUnavailable(f"MLflow store {self.uri} does not exist (no file {db})")
        # a new store where none was: said, since a mistyped path would split the findings over two stores
        self.created = db is not None and not db.exists()
        try:
            from mlflow import MlflowClient

            # the first access of a sqlite file builds or upgrades its schema: serialised, built in a
            # temporary file and moved into place, and skipped when this file was already
            # initialised by this MLflow version (a marker beside it says so)
            if db is not None and not _initialised(db):
                with self.lock():
                    if not _initialised(db):
                        ensure_sqlite_store(db, log or _stderr)
            self.client = MlflowClient(tracking_uri=self.uri)
            with self.lock():
                self.experiment_id = self._experiment(create)
        except StoreUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the store is "unavailable" here
            raise StoreUnavailable(f"MLflow store {self.uri} failed: {type(e).__name__}: {_short(e)}") from e

    def lock(self) -> contextlib.AbstractContextManager:
        return store_lock(self.uri)

    def _experiment(self, create: bool) -> str | None:
        name = experiment_name()
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        if not create:
            return None
        db = sqlite_path(self.uri)
        location = (db.parent / DEFAULT_ARTIFACTS).as_uri() if db is not None else None
        try:
            return self.client.create_experiment(name, artifact_location=location,
                                                 tags={"harness.purpose": "trainer/rollout regressions"})
        except Exception:  # another process created it between our get and create
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    # --- searches --------------------------------------------------------------------------
    def search(self, filter_string: str, order_by: list[str] | None = None, max_pages: int = 100) -> list:
        if self.experiment_id is None:
            return []
        runs, token = [], None
        for _ in range(max_pages):
            page = self.client.search_runs([self.experiment_id], filter_string, max_results=1000,
                                           order_by=order_by, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
        return runs

    def regressions_with_signature(self, signature: str) -> list:
        return self.search(f"tags.`harness.kind` = '{REGRESSION}' AND tags.`harness.signature` = "
                           f"'{_q(signature)}'", order_by=["attributes.start_time ASC"])

    def campaign_with_uid(self, uid: str):
        runs = self.search(f"tags.`harness.kind` = '{CAMPAIGN}' AND tags.`harness.campaign_uid` = '{_q(uid)}'")
        return runs[0] if runs else None

    def find_regression(self, ident: str):
        """A regression run by run id or finding id (the 12-hex id of its corpus file)."""
        ident = ident.strip()
        if not ident or any(c not in "0123456789abcdef" for c in ident.lower()):
            raise UsageError(f"{ident!r} is not a regression id; pass the 12-hex finding id or the 32-hex run id "
                             "shown by `harness regressions`.")
        runs = self.search(f"tags.`harness.kind` = '{REGRESSION}' AND tags.`harness.finding_id` = '{_q(ident)}'")
        if runs:
            return runs[0]
        if len(ident) == 32:
            try:
                run = self.client.get_run(ident)
            except Exception:  # noqa: BLE001 - MLflow raises MlflowException for an unknown id
                run = None
            if run is not None and run.data.tags.get("harness.kind") == REGRESSION:
                return run
        raise UsageError(f"no regression {ident!r} in the MLflow store {self.uri}; run `harness regressions` "
                         "to list the ids it holds, or pass --tracking-uri for another store.")


def _q(s: str) -> str:
    return str(s).replace("'", "")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def open_store(uri: str | None, create: bool = False) -> Store:
    """A Store for a command: an unreachable or missing store is a usage error with the fix."""
    try:
        return Store(uri, create=create)
    except StoreUnavailable as e:
        raise UsageError(f"{e}. Start the tracking server, or pass --tracking-uri (or set MLFLOW_TRACKING_URI) "
                         "to the store the campaigns log to; the default is the embedded store "
                         "reports/mlflow.db of the working directory.") from None


