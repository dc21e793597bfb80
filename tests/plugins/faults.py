"""Pairs that misbehave on purpose, for the fault-injection tests (tests/faults/): a hang, a segfault,
an abort, a hang on every case, a slow start in every process then a segfault, a cheap
demonstration that always diverges (slowly, on request), two that cannot run here (a harness
error from their own setup: on every case, or on batches of 2+ sequences), and two whose rollout
returns a row too few (on every case: it cannot run; on batches of 2+: a finding)."""
import os
import signal
import time

import torch

from harness import Axes, Outcome, TargetPair, register
from harness.errors import UsageError

AX = Axes(n_seqs=(1, 4), seq_len=(1, 8))


def build(case, device):
    return {"x": case.randn((case.n_tokens, 16), "x", device=device), "n": case.batch_size}


def fine(inp):
    return Outcome(logprobs=torch.log_softmax(inp["x"], -1))


def hangs_on_batches(inp):  # a deadlock in a collective, say: never returns
    if inp["n"] >= 2:
        time.sleep(1000)
    return fine(inp)


def segfaults_on_batches(inp):  # a bad pointer in a kernel
    if inp["n"] >= 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    return fine(inp)


def aborts_on_batches(inp):  # a failed assert in C++
    if inp["n"] >= 2:
        os.abort()
    return fine(inp)


def hangs_always(inp):  # an engine that deadlocks on every input, the first case included
    time.sleep(1000)
    return fine(inp)


STARTED = [False]
HELPERS: list = []


def hangs_with_a_helper(inp):  # an engine that starts a helper process (a scheduler), then deadlocks on batches
    if not HELPERS:
        import subprocess
        import sys

        marker = os.environ.get("FAULTS_HELPER_MARKER", "faults-helper")
        HELPERS.append(subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(1000)  # {marker}"]))
    return hangs_on_batches(inp)


def slow_start_then_segfaults(inp):  # a cold start in every new process (a compile), a bad kernel on batches
    if not STARTED[0]:
        time.sleep(float(os.environ.get("FAULTS_SLOW_START", "3")))
        STARTED[0] = True
    return segfaults_on_batches(inp)


KEPT: list = []


def leaks(inp):  # keeps what it allocated in every call (a cache keyed by something that never repeats)
    KEPT.append(b"\x01" * (int(os.environ.get("FAULTS_LEAK_MB", "8")) << 20))  # written: resident
    return fine(inp)


def flattened(inp):  # a different temperature: diverges on every case
    time.sleep(float(os.environ.get("FAULTS_SLEEP", "0")))
    return Outcome(logprobs=torch.log_softmax(inp["x"] * 0.5, -1))


def drops_a_row(inp):  # an adapter that slices off one row too many: the contract broken on every case
    return Outcome(logprobs=fine(inp).logprobs[:-1])


def drops_a_row_on_batches(inp):  # an engine that loses a token when it batches: a finding
    return Outcome(logprobs=fine(inp).logprobs[:-1]) if inp["n"] >= 2 else fine(inp)


for name, rollout, expected in (("faults.hang", hangs_on_batches, "aligned"),
                                ("faults.wrong_shape", drops_a_row, "aligned"),
                                ("faults.wrong_shape_batches", drops_a_row_on_batches, "aligned"),
                                ("faults.segfault", segfaults_on_batches, "aligned"),
                                ("faults.abort", aborts_on_batches, "aligned"),
                                ("faults.hang_always", hangs_always, "aligned"),
                                ("faults.hang_with_helper", hangs_with_a_helper, "aligned"),
                                ("faults.slow_start_segfault", slow_start_then_segfaults, "aligned"),
                                ("faults.leak", leaks, "aligned"),
                                ("faults.diverges", flattened, "diverges")):
    register(TargetPair(name=name, kind="op", expected=expected, build=build, trainer=fine, rollout=rollout,
                        axes=AX, description=f"fault injection: {name.split('.')[1]}"))


def build_from_a_gone_checkpoint(case, device):  # a checkpoint folder that is not there
    raise UsageError("the checkpoint folder /nonexistent/faults-ckpt is gone; point the pair at an existing one")


def build_refusing_batches(case, device):  # an engine setting that refuses batched cases
    if case.batch_size >= 2:
        raise UsageError(f"batch {case.batch_size} is not supported with max_num_seqs=1; raise max_num_seqs")
    return build(case, device)


register(TargetPair(name="faults.setup_gone", kind="op", expected="aligned", build=build_from_a_gone_checkpoint,
                    trainer=fine, rollout=fine, axes=AX, description="fault injection: its checkpoint is gone"))
register(TargetPair(name="faults.setup_gone_too", kind="op", expected="aligned", build=build_from_a_gone_checkpoint,
                    trainer=fine, rollout=fine, axes=AX, description="fault injection: another pair of that checkpoint"))
register(TargetPair(name="faults.setup_batches", kind="op", expected="aligned", build=build_refusing_batches,
                    trainer=fine, rollout=fine, axes=AX, description="fault injection: refuses batches"))
