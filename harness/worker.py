"""Supervised worker processes: targets run isolated from the campaign (libFuzzer's fork mode).

A campaign hands each case to a `Worker`: a child process, started with the `forkserver` method
(torch and plain `fork` do not mix: its thread pools and CUDA state do not survive a fork; the fork
server is a fresh single-threaded process that has imported torch and the engine once, so a worker
that replaces a dead one starts in milliseconds, not the seconds of an import), that owns one device
and is reused for every case of every pair until it dies. Only the case goes in; the pair's build,
both paths and the metrics run in the worker, and only the verdict comes back (a passing case's
metrics as plain values; a failing case's whole `Evaluation`: symptom, metrics, error; never the
outcomes), so tensors stay on their device and the pipe carries a few hundred bytes. The pipe
connects the campaign to its own child: nothing read from a file or a network is ever unpickled.

What the supervisor turns into findings:

- `timeout`: a case still running after the per-case timeout (wall seconds, default
  `DEFAULT_TIMEOUT`). The supervisor then signals the worker (SIGUSR1), whose faulthandler writes
  every thread's Python stack from the signal handler, even when the thread is stuck in C code
  holding the GIL, so the finding says where it hung; then it is killed and a fresh one starts for
  the next case. (A per-case watchdog thread, `faulthandler.dump_traceback_later`, cost a thread start and
  join on every case; the signal costs nothing until a case hangs.)
- `crash`: the worker died while running the case (a signal: SIGSEGV in a kernel, SIGABRT from an
  assert, SIGKILL from the OOM killer; or an exit). The stack faulthandler printed, if any, is kept.

A worker finds a pair by name in its own registry, importing only the module the pair was
registered from (a `targets.*` module, a plugin file or module named with `--plugin`), so a worker
that runs op pairs never imports a model or the torch.compile backend. The campaign's
`--budget` is a hard wall: a case still running when it ends is killed (and is not a finding).
The worker ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the campaign,
not the worker, decides what an interrupt does (it stops the worker).
"""

from __future__ import annotations

import functools
import os
import signal
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from .errors import HarnessError

DEFAULT_TIMEOUT = 60.0  # wall seconds one case may take (build, both paths, metrics) before it is a hang
PRELOAD = ["torch", "numpy", "hypothesis", "harness.execute"]  # imported once, by the fork server
_START_TIMEOUT = 300.0  # seconds a fresh worker may take to import torch and the pair's module
MEMORY_CHECK_SECONDS = 0.5  # how often the supervisor reads a worker's resident memory (/proc: ~30 us)


def _mib_setting(env: str, default: float) -> float:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not v > 0:
        from .errors import UsageError

        raise UsageError(f"${env}={raw!r} must be a number of MiB > 0 (unset: {default:.0f}); fix or unset it.")
    return v


@functools.lru_cache(maxsize=1)
def machine_memory_mib() -> float:
    """The memory this process may use, in MiB: the machine's, or its container's cgroup limit
    when lower (a CI container on a large host). Read once per process (the memory watch asks
    every 0.5 s)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (ValueError, OSError, AttributeError):
        total = 16384.0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw) / 2**20)
    return total


def memory_limits() -> tuple[float, float]:
    """(MiB a worker may grow while it runs one pair's cases before the campaign warns of a leak,
    MiB of resident memory above which a worker that has also grown that much is replaced between
    cases): $HARNESS_WORKER_LEAK_MB (default 1024, or the worker's own size when larger) and
    $HARNESS_WORKER_MAX_MB (default half the memory this process may use: the machine's, or its
    container's), so a leaking path neither goes unnoticed nor takes a shared runner down."""
    return (_mib_setting("HARNESS_WORKER_LEAK_MB", 1024.0),
            _mib_setting("HARNESS_WORKER_MAX_MB", machine_memory_mib() / 2))


def _rss_mib(pid: int) -> float | None:
    """Resident memory of a process in MiB (Linux /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def _peak_mib(pid: int) -> float | None:
    """The most resident memory of a process since it started or since `_reset_peak` (Linux's VmHWM),
    in MiB; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024  # (kB)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak(pid: int) -> bool:
    """Start a process's VmHWM over from its resident size now (Linux 4.0+: `clear_refs` 5)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class WorkerError(HarnessError):
    """A worker cannot run a pair at all (the pair does not load there): a setup error, not a finding."""


class OutOfTime(Exception):
    """The campaign's hard wall came while a case was running; the worker was stopped. `stack`: the
    worker's Python stacks (faulthandler's dump) when the case had already run past its per-case
    timeout (a first case in its cold-start allowance that may be a hang), else ""."""

    def __init__(self, stack: str = "") -> None:
        super().__init__("the campaign's budget ended while a case was running")
        self.stack = stack


def _signal_name(code: int | None) -> str:
    if code is None:
        return "unknown"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


class _main_file_hidden_if_missing:
    """multiprocessing re-runs the main script in a new process from `__main__.__file__`; for code read
    from stdin that is "<stdin>", no file, and the worker would die at start (FileNotFoundError).
    Such a script cannot be run again anyway: hide the name while the worker starts."""

    def __enter__(self) -> None:
        import sys

        self.main = sys.modules.get("__main__")
        self.path = getattr(self.main, "__file__", None)
        self.hidden = (self.path is not None and getattr(getattr(self.main, "__spec__", None), "name", None) is None
                       and not os.path.isfile(self.path))
        if self.hidden:
            del self.main.__file__

    def __exit__(self, *exc: Any) -> None:
        if self.hidden:
            self.main.__file__ = self.path


ENTRY_POINT = [False]  # set by `harness` and the pytest plugin: the process is not a script of the user's


def start_fork_server() -> None:
    """Start the fork server now, without waiting for it: it imports torch and the engine (about a
    second) while this process does its own imports, so the first `Worker.start` finds it ready
    instead of waiting for those imports. For a process about to run a campaign isolated; one that
    cannot start it here says nothing (`Worker.start` reports the failure when a case needs it)."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    try:
        mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
        with _main_file_hidden_if_missing():
            forkserver.ensure_running()
    except Exception:
        pass


def _main_hint() -> str:
    """A script of one's own that calls the harness at import time (no `if __name__ == "__main__":`)
    is imported again in the worker, where the call starts another process and fails: say so."""
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if ENTRY_POINT[0] or not path or not os.path.isfile(path):  # (the command line, pytest, an interactive
        return ""  # session, code read from stdin)
    return (f" If you called the harness from your own script ({path}), put the call under `if __name__ == "
            "\"__main__\":`: worker processes import that script again (multiprocessing's forkserver), and a "
            "call at import time runs there too.")


# ---------------------------------------------------------------------------------------------
# The supervisor side
# ---------------------------------------------------------------------------------------------
class Worker:
    """One supervised child process on one device. `evaluate` is the only call a campaign needs."""

    def __init__(self, device: str = "cpu", plugins: tuple[str, ...] | list[str] = (),
                 timeout: float = DEFAULT_TIMEOUT, threads: int | None = None) -> None:
        self.device = device
        self.plugins = tuple(plugins)
        self.timeout = timeout
        self.threads = threads
        self.proc: Any = None
        self.conn: Any = None
        self.restarts = 0  # workers started after the first (each timeout or crash costs one)
        # (pair, case, timeout, sent at, cold extra) of each case sent and not collected yet, in order: the worker
        # runs them one after another, so a campaign may hand it the next few while it computes
        self.queue: deque[tuple] = deque()
        self._last_done = 0.0  # when the last result came back (the next queued case started by then)
        self._log: Path | None = None
        self._dir = tempfile.mkdtemp(prefix="harness-worker-")
        # memory watch (see `_watch_memory`): each pair's size and growth, the last check, when it was,
        # pairs already warned about, and a replacement due before the next case
        memory_limits()  # (a mistyped HARNESS_WORKER_*_MB: a UsageError now, not in the middle of a campaign)
        self._mem: dict[str, list[float]] = {}  # pair -> [its first resident MiB here, growth while it ran since]
        self._mem_last: tuple[str, float] | None = None  # (the pair of the last check, resident MiB then)
        self._mem_checked = 0.0
        self._mem_warned: set[str] = set()
        # pair -> what its cases did to the worker's memory, for the campaign's summary (the warnings on
        # stderr are hidden where a pytest item passes): [the largest growth counted for it (MiB) past the
        # allowance, replacements at the cap its growth caused]
        self.memory_seen: dict[str, list] = {}
        # pair -> the most resident MiB while its cases ran: the process's peak (VmHWM), started over when
        # another pair's first case is sent to an idle worker (`_peak_for`), else its size at each check
        self.peak_seen: dict[str, float] = {}
        self._peak_pair = ""  # the pair the process's peak since it was last started over belongs to
        self._replace_for = ""
        self._replace = ""
        self.memory_restarts = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        import multiprocessing as mp

        if self.threads is None:
            import torch

            self.threads = torch.get_num_threads()  # the same numerics as an in-process run
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # (as `start_fork_server`: a server started there is the one used)
        parent, child = ctx.Pipe()
        fd, log = tempfile.mkstemp(prefix="fault-", suffix=".log", dir=self._dir)
        os.close(fd)
        self._log = Path(log)
        self.proc = ctx.Process(target=serve, args=(child, self.device, self.plugins, self.threads, str(log)),
                                name="harness-worker", daemon=True)
        try:
            with _main_file_hidden_if_missing():
                self.proc.start()
        except BaseException:  # (never started: nothing to kill or join later)
            self.proc = None
            parent.close()
            child.close()
            raise
        child.close()
        self.conn = parent
        self.ready = False  # until the worker says it has imported what every case needs

    @property
    def inflight(self) -> tuple | None:
        """(pair, case, timeout, sent at, cold extra) of the oldest case not yet collected, or None."""
        return self.queue[0] if self.queue else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def kill(self) -> None:
        """Kill the worker and every process it started (its process group: `serve` made it a session)."""
        if self.proc is None:
            return
        try:  # (also once the worker itself has exited: what it started may still be running)
            if self.proc.pid is not None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()
        self.proc = self.conn = None
        self.queue.clear()  # what was queued behind the case is lost with the process
        self._mem, self._mem_last = {}, None  # (a new process measures from its own sizes)
        self._replace = ""

    def close_process(self) -> None:
        """Stop the worker process (asked politely first, then killed with its process group)."""
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(("stop",))
                self.proc.join(2)
            except (OSError, BrokenPipeError):
                pass
        self.kill()

    def close(self) -> None:
        """Stop the worker (asked politely first) and remove its temporary files."""
        self.close_process()
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one case --------------------------------------------------------------------------------
    def evaluate(self, pair: Any, case: Any, threshold: float, timeout: float | None = None,
                 wall: float | None = None) -> Any:
        """The Evaluation of `case` on `pair`, computed in the worker.

        `timeout` (default: the worker's) bounds this case; `wall` (time.monotonic()) is the
        campaign's hard end: a case still running then is stopped and `OutOfTime` raised.
        """
        self.submit(pair, case, threshold, timeout, wall)
        return self.collect(wall)

    def submit(self, pair: Any, case: Any, threshold: float, timeout: float | None = None,
               wall: float | None = None, cold_extra: float = 0.0) -> None:
        """Send a case to the worker (starting one if needed); `collect` gets its Evaluation. Cases
        sent before it and not collected yet run first (`collect` returns them in order).
        `cold_extra`: the part of `timeout` granted for a first case's imports and compilation."""
        timeout = self.timeout if timeout is None else timeout
        for attempt in range(2):
            self._ensure_started(wall)
            if not self.queue:
                self._clear_log()
                if pair.name != self._peak_pair:  # (nothing in flight: the peak so far is the other pair's)
                    self._peak_for(pair.name)
            try:
                self.conn.send(("case", pair.name, pair.source, case, threshold))
                break
            except (OSError, BrokenPipeError):  # died between cases: start another and send again
                self.kill()
                self.restarts += 1
        self.queue.append((pair, case, timeout, time.monotonic(), cold_extra))

    def collect(self, wall: float | None = None, until: float | None = None) -> Any:
        """The Evaluation of the oldest case in flight, or None when `until` (time.monotonic()) comes
        first.

        A case past its timeout is a `timeout` Evaluation, a worker that died a `crash` one (the
        worker is replaced at the next case, and the cases queued behind this one are dropped: they
        are sent again when asked for); past `wall` the case is stopped and `OutOfTime` raised. A
        queued case's timeout counts from when the one before it came back (or from when it was
        sent, if later): it started no earlier.
        """
        from .execute import Evaluation, Symptom

        pair, case, timeout, sent, cold_extra = self.queue[0]
        hang_at = max(sent, self._last_done) + timeout
        wall_at = wall if wall is not None else float("inf")
        stop = min(hang_at, wall_at, until if until is not None else float("inf"))
        if self.conn.poll(max(0.0, stop - time.monotonic())):
            self.queue.popleft()
            self._last_done = time.monotonic()
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = None
            if msg is not None:
                self._watch_memory(pair.name)
                kind, payload = msg
                if kind == "pass":  # a passing case: its metrics (see `serve`)
                    from .metrics import METRIC_KEYS, Divergence

                    values, fired, flips, seconds = payload
                    return Evaluation(pair.name, case, Symptom.NONE, divergence=Divergence(
                        **dict(zip(METRIC_KEYS, values)), fired=fired, flips_per_layer=flips,
                        verdict_over=getattr(pair, "verdict_over", "batch")), seconds=seconds)
                if kind == "ok":
                    return payload
                raise WorkerError(payload)
            self.proc.join(5)
            what = _signal_name(self.proc.exitcode)
            self.kill()
            self.restarts += 1
            return Evaluation(pair.name, case, Symptom.CRASH, error={
                "type": what, "where": "worker",
                "message": f"the worker process died ({what}) while running this case on {self.device}",
                "traceback": self._read_log()}, threads=self.threads)
        if stop < min(hang_at, wall_at):
            return None  # still running; the caller may come back for it
        out_of_wall = wall_at <= hang_at
        # stopped by the budget past its per-case timeout (a first case inside its cold-start allowance):
        # perhaps a hang, so its stacks are read as for a timeout
        dump = not out_of_wall or time.monotonic() - max(sent, self._last_done) >= timeout - cold_extra
        stack = self._stacks(dump)
        self.kill()
        self.restarts += 1
        if out_of_wall:
            raise OutOfTime(stack if dump else "")
        return Evaluation(pair.name, case, Symptom.TIMEOUT, error={
            "type": "Timeout", "where": "worker",
            "message": f"the case ran longer than the per-case timeout of {timeout - cold_extra:g} s"
                       + (f" (+{cold_extra:.3g} s for its first case in a fresh worker process: imports, compilation)"
                          if cold_extra >= 0.5 else "") + " (build, both paths and metrics)\n"  # (ms: not said)
                       # (the first line is the headline a table prints; the fix goes below it, whole)
                       f"If the pair is just slow, raise it: `harness fuzz --timeout '{pair.name}=SECONDS'`, "
                       f"`pytest --harness-timeout={pair.name}=SECONDS`, or the pair's own TargetPair(timeout=SECONDS) "
                       "(a plain --timeout SECONDS does not override a pair's own)",
            "traceback": stack, "timeout_s": float(timeout - cold_extra)}, threads=self.threads)  # (the per-case timeout)

    def _ensure_started(self, wall: float | None) -> None:
        """A live worker that has imported the engine (a dead one is replaced: a restart); OutOfTime
        when `wall` (time.monotonic()), or the start-up timeout, comes first."""
        if self.proc is None or not self.proc.is_alive():
            if self.proc is not None:
                self.kill()
                self.restarts += 1
            self.start()
        if not self.ready:
            if not self._wait_ready(wall):
                raise OutOfTime
            self.ready = True

    def _stacks(self, dump: bool = True) -> str:
        """Every thread's Python stack in the running worker, written by its faulthandler on SIGUSR1
        (even a thread stuck in C code holding the GIL); "" without `dump`."""
        if not dump:
            return ""
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except (OSError, TypeError):
            pass
        stack = prev = ""
        for _ in range(40):  # until the dump stops growing: faulthandler writes it in many small writes
            stack = self._read_log()
            if stack and stack == prev:
                break
            prev = stack
            time.sleep(0.025)
        return stack

    # -- a contract check ------------------------------------------------------------------------
    def check(self, pair: Any, n_cases: int, timeout: float, cold: float,
              progress: Callable[[int, float], None] | None = None) -> tuple[str, str, list[str], str]:
        """`harness check` of one pair in the worker (`conformance.check_pair`), each run of a case's
        paths timed as a campaign times a case: (verdict, text, warnings, stack), the verdict one of
        PASS (text: the cases checked), FAIL (text: the violations), CANNOT (its own setup failed: a
        harness error), TIMEOUT (a run past `timeout` seconds, or `cold` for the first, which pays the
        imports; text: the case; stack: where it was) or CRASH (the worker died; text: the case).
        `progress(runs done, seconds)`, where given, is called as each run of a case's paths begins."""
        for _ in range(2):
            try:
                self._ensure_started(None)
            except OutOfTime:  # (it did not import the engine within _START_TIMEOUT)
                return "TIMEOUT", "", [], ""
            self._clear_log()
            try:
                self.conn.send(("check", pair.name, pair.source, n_cases))
                break
            except (OSError, BrokenPipeError):
                self.kill()
        step, limit, since = "", cold, time.monotonic()
        began, runs = since, 0
        while True:
            if not self.conn.poll(max(0.0, since + limit - time.monotonic())):
                stack = self._stacks()
                self.kill()
                self.restarts += 1
                return "TIMEOUT", step, [], stack
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = None
            if msg is None:
                self.proc.join(5)
                what = _signal_name(self.proc.exitcode)
                stack = self._read_log()
                self.kill()
                self.restarts += 1
                return "CRASH", f"{step} (the worker process died: {what})", [], stack
            kind, payload = msg
            if kind == "step":  # a run of a case's paths begins: the one before it came back
                if step:
                    limit = timeout
                    runs += 1
                step, since = payload, time.monotonic()
                if progress is not None:
                    progress(runs, since - began)
                continue
            if kind == "checked":
                return (*payload, "")
            raise WorkerError(payload)

    @property
    def replace_due(self) -> bool:
        """Grown past its memory cap: `replace_if_due` replaces it once no case is in flight (hand it
        no cases ahead meanwhile)."""
        return bool(self._replace)

    def replace_if_due(self) -> bool:
        """Replace a worker grown past its memory cap by a fresh process (started by the next
        `submit`), when no case is in flight. Call it before deciding a case's timeout: the fresh
        process is cold (`restarts` counts it, so a campaign's warm set starts again). True when
        it did."""
        if not self._replace or self.queue or self.proc is None:
            return False
        import sys

        print(f"warning: {self._replace}; it was replaced by a fresh worker process before the next case "
              "(the campaign goes on)", file=sys.stderr, flush=True)
        self.memory_seen.setdefault(self._replace_for, [0.0, 0])[1] += 1
        self.close_process()
        self.memory_restarts += 1
        self.restarts += 1
        return True

    def _watch_memory(self, name: str) -> None:
        """Every MEMORY_CHECK_SECONDS, the worker's resident memory. A pair's growth is what the
        process grew between two checks that both followed its cases, summed (from its first check
        in this process, after its first case: loading its model is not a leak, nor is another
        pair's model loaded in between). Growth above the leak allowance (`memory_limits`; or the
        process's size at the pair's first check, when larger) is a warning naming the pair, once per
        pair; such a worker above the cap is replaced before its next case (`replace_if_due`: the
        cases run on a fresh process; nothing is lost)."""
        now = time.monotonic()
        if now - self._mem_checked < MEMORY_CHECK_SECONDS or self.proc is None:
            return
        self._mem_checked = now
        rss = _rss_mib(self.proc.pid)
        if rss is None:
            return
        peak = _peak_mib(self.proc.pid) if name == self._peak_pair else None
        self.peak_seen[name] = max(self.peak_seen.get(name, 0.0), rss, peak or 0.0)
        seen = self._mem.setdefault(name, [rss, 0.0])
        if self._mem_last is not None and self._mem_last[0] == name:  # growth while this pair's cases ran
            seen[1] += rss - self._mem_last[1]  # (another pair's model loaded in between is not its own)
        self._mem_last = (name, rss)
        base, leak, cap = seen[0], *memory_limits()
        grown = seen[1] > max(leak, base)
        if grown:
            mem = self.memory_seen.setdefault(name, [0.0, 0])
            mem[0] = max(mem[0], seen[1])
        if grown and name not in self._mem_warned:
            import sys

            self._mem_warned.add(name)
            print(f"warning: the worker process grew by {seen[1]:.0f} MiB (to {rss:.0f} MiB resident) while running "
                  f"{name}'s cases: a path that keeps memory across cases (a leak, a cache that grows with every "
                  f"shape)? Above the cap of {cap:.0f} MiB (half this machine's memory unless "
                  "$HARNESS_WORKER_MAX_MB sets it) such a worker is replaced between cases; $HARNESS_WORKER_LEAK_MB "
                  "sets this warning's allowance", file=sys.stderr, flush=True)
        if grown and rss > cap:  # (a model larger than the cap that does not grow is left alone)
            self._replace = (f"the worker process running {name}'s cases holds {rss:.0f} MiB, above the cap of "
                             f"{cap:.0f} MiB")
            self._replace_for = name

    def settle_peak(self) -> None:
        """Count the process's peak since it was last started over for the pair it belongs to (its last
        cases ran after the last check)."""
        if self.proc is not None and self._peak_pair:
            peak = _peak_mib(self.proc.pid)
            if peak is not None:
                self.peak_seen[self._peak_pair] = max(self.peak_seen.get(self._peak_pair, 0.0), peak)

    def _peak_for(self, name: str) -> None:
        """The next cases are `name`'s: settle the peak so far for its pair, start the peak over."""
        self.settle_peak()
        self._peak_pair = name if self.proc is not None and _reset_peak(self.proc.pid) else ""

    def _wait_ready(self, wall: float | None) -> bool:
        limit = _START_TIMEOUT if wall is None else max(0.0, min(_START_TIMEOUT, wall - time.monotonic()))
        if self.conn.poll(limit):
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = None
            if msg == ("ready",):
                return True
            detail = self._read_log() or f"it exited with {_signal_name(self.proc.exitcode)}"
            self.kill()
            raise WorkerError(f"a worker process for device {self.device} failed to start: {detail[-2000:]}. Run "
                              "with --no-isolation to see the error in this process." + _main_hint())
        self.kill()
        return False

    def _clear_log(self) -> None:
        if self._log is not None and self._log.exists() and self._log.stat().st_size:
            self._log.write_text("")

    def _read_log(self) -> str:
        try:
            return self._log.read_text(errors="replace")[-8000:] if self._log else ""
        except OSError:
            return ""


# ---------------------------------------------------------------------------------------------
# The worker side
# ---------------------------------------------------------------------------------------------
def serve(conn: Any, device: str, plugins: tuple[str, ...], threads: int, log: str) -> None:
    """The worker's loop: load pairs on demand, evaluate cases, answer with Evaluations."""
    import faulthandler

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # a process group of its own: processes a target starts (an engine's helpers) die with the worker
        os.setsid()
    except OSError:
        pass
    try:  # what a target prints goes to stderr, beside the progress lines: the campaign's stdout (its
        os.dup2(2, 1)  # summary table, perhaps piped into a file) stays the campaign's own
    except OSError:
        pass
    try:
        fault = open(log, "a")  # appends: the supervisor empties it between cases
    except OSError:  # the campaign ended (an interrupt) and removed its folder while this one started
        return
    faulthandler.enable(file=fault)
    faulthandler.register(signal.SIGUSR1, file=fault, all_threads=True)  # a hang: the supervisor asks
    import torch

    torch.set_num_threads(threads)
    from .execute import run_case
    from .metrics import METRIC_KEYS
    from .pairs import WARN_BROKEN_ENTRY_POINTS

    WARN_BROKEN_ENTRY_POINTS[0] = False  # (the campaign process warned of a broken plugin package)

    pairs: dict[tuple[str, str], Any] = {}
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the campaign is gone
            return
        if msg[0] == "stop":
            return
        if msg[0] == "check":
            _serve_check(conn, msg[1], msg[2], msg[3], device, plugins, pairs)
            continue
        _, name, source, case, threshold = msg
        pair = _loaded(conn, pairs, name, source, plugins)
        if pair is None:
            continue
        try:
            ev = run_case(pair, case, device, threshold)
        except KeyboardInterrupt as e:  # SIGINT is ignored here: the target raised it
            from .execute import Evaluation, Symptom, describe_error

            ev = Evaluation(pair.name, case, Symptom.ERROR, error=describe_error(e), threads=torch.get_num_threads())
        if not ev.failed and ev.divergence is not None:
            # a passing case's verdict is all the campaign keeps: its metrics as plain values (the campaign
            # has the case; pickling the whole Evaluation cost 20x more, on every case)
            d = ev.divergence
            conn.send(("pass", (tuple(getattr(d, k) for k in METRIC_KEYS), d.fired, d.flips_per_layer, ev.seconds)))
            continue
        if ev.failed:  # what the pair ran on, for its repro's environment (imported here, not in the campaign)
            from .corpus import backend_versions

            ev.backends = backend_versions()
        conn.send(("ok", ev))


def _loaded(conn: Any, pairs: dict, name: str, source: str, plugins: tuple[str, ...]) -> Any:
    """The pair of that name from the worker's cache (loaded on first use), or None after telling the
    campaign it does not load."""
    try:
        pair = pairs.get((name, source))
        if pair is None:
            pair = pairs[(name, source)] = load_pair(name, source, plugins)
        return pair
    except Exception as e:
        conn.send(("error", f"pair {name!r} does not load in the worker process: {type(e).__name__}: {e}"))
        return None


def _serve_check(conn: Any, name: str, source: str, n_cases: int, device: str, plugins: tuple[str, ...],
                 pairs: dict) -> None:
    """`Worker.check` on the worker's side: the contract check of one pair, a ("step", case) message
    before each run of a case's paths, then ("checked", (verdict, text, warnings))."""
    from .conformance import RUN_WATCHERS, check_verdict

    pair = _loaded(conn, pairs, name, source, plugins)
    if pair is None:
        return

    def watch(case: Any) -> None:
        conn.send(("step", f"case {case.one_line()}"))

    RUN_WATCHERS.append(watch)
    try:
        verdict = check_verdict(pair, n_cases, device)
    finally:
        RUN_WATCHERS.remove(watch)
    conn.send(("checked", verdict))


def load_pair(name: str, source: str, plugins: tuple[str, ...] = ()) -> Any:
    """Find a pair by name, importing only what it needs: the module it was registered from."""
    import importlib

    from .pairs import REGISTRY

    # what is registered so far, without loading every built-in
    if REGISTRY.get_loaded(name) is None and source:
        if source.endswith(".py") or os.sep in source:
            REGISTRY.load_plugin(source)
        elif not source.startswith("entry point "):
            importlib.import_module(source)
    if REGISTRY.get_loaded(name) is None:
        for spec in plugins:
            REGISTRY.load_plugin(spec)
    pair = REGISTRY.get_loaded(name)
    return pair if pair is not None else REGISTRY.get(name)


def memory_note(grown: float, replaced: int) -> str:
    """A pair's summary note on its worker's memory (`Worker.memory_seen`)."""
    return (f"memory: the worker grew by {grown:.0f} MiB over its cases (a path that keeps memory across "
            "cases?)" + (f"; replaced at the cap {replaced} time(s)" if replaced else ""))
