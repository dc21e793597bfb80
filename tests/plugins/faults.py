"""Pairs that misbehave on purpose, for the fault-injection tests (tests/faults/): a hang, a segfault,
an abort, and a cheap demonstration that always diverges (slowly, on request)."""
import os
import signal
import time

import torch

from harness import Axes, Outcome, TargetPair, register

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


def flattened(inp):  # a different temperature: diverges on every case
    time.sleep(float(os.environ.get("FAULTS_SLEEP", "0")))
    return Outcome(logprobs=torch.log_softmax(inp["x"] * 0.5, -1))


for name, rollout, expected in (("faults.hang", hangs_on_batches, "aligned"),
                                ("faults.segfault", segfaults_on_batches, "aligned"),
                                ("faults.abort", aborts_on_batches, "aligned"),
                                ("faults.diverges", flattened, "diverges")):
    register(TargetPair(name=name, kind="op", expected=expected, build=build, trainer=fine, rollout=rollout,
                        axes=AX, description=f"fault injection: {name.split('.')[1]}"))
