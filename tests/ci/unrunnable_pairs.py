"""Pairs that cannot do their job, for the plugin tests (tests/ci/test_plugin_unrunnable.py): a
demonstration whose build raises on every case (it errors instead of diverging: BROKEN), a
demonstration and an aligned pair whose build raises a harness error (a checkpoint folder that is
gone: CANNOT RUN), and a demonstration that is caught (the control)."""
import torch

from harness import Axes, Outcome, TargetPair, register
from harness.errors import UsageError

AX = Axes(n_seqs=(1, 2), seq_len=(1, 4))


def build(case, device):
    return case.randn((case.n_tokens, 16), "x", device=device)  # (T, V)


def build_raises(case, device):  # a demonstration whose inputs cannot be built (a renamed helper, say)
    raise RuntimeError("unrunnable: the demonstration's input builder is broken")


def build_from_a_gone_checkpoint(case, device):
    raise UsageError("the checkpoint folder /nonexistent/unrunnable-ckpt is gone; point the pair at an existing one")


def trainer(x):
    return Outcome(logprobs=torch.log_softmax(x, -1))  # (T, V)


def flattened(x):  # another temperature: diverges on every case
    return Outcome(logprobs=torch.log_softmax(x * 0.5, -1))  # (T, V)


for name, expected, make in (("unrunnable.demo_build_raises", "diverges", build_raises),
                             ("unrunnable.demo_gone", "diverges", build_from_a_gone_checkpoint),
                             ("unrunnable.aligned_gone", "aligned", build_from_a_gone_checkpoint),
                             ("unrunnable.demo_caught", "diverges", build)):
    register(TargetPair(name=name, kind="op", expected=expected, build=make, trainer=trainer, rollout=flattened,
                        axes=AX, devices=("cpu",), description=f"plugin test: {name.split('.')[1]}"))
