"""A pair whose first case in a process takes seconds (as a cold torch.compile does), then is fast:
for the fair-budget test (tests/faults/test_isolation.py). Diverges on every case."""
import os
import time

import torch

from harness import Axes, Outcome, TargetPair, register

STARTED = [False]


def build(case, device):
    if not STARTED[0]:
        time.sleep(float(os.environ.get("SLOW_START_SECONDS", "8")))
        STARTED[0] = True
    return case.randn((case.n_tokens, 16), "x", device=device)


register(TargetPair(name="cold.compiled", kind="op", expected="diverges", build=build,
                    trainer=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)),
                    rollout=lambda x: Outcome(logprobs=torch.log_softmax(x * 0.5, -1)),
                    axes=Axes(n_seqs=(1, 4), seq_len=(1, 8)), description="a slow first case, then fast"))
