"""The conformance check a backend author calls in one line, run over every registered pair."""

import pytest

from harness import REGISTRY, check_pair
from harness.conformance import ConformanceError

from ..conftest import PLUGINS

REGISTRY.load_plugin(str(PLUGINS / "lm_head_bf16.py"))


@pytest.mark.parametrize("name", [p.name for p in REGISTRY.all() if "cpu" in p.devices and p.kind == "op"])
def test_every_op_pair_obeys_the_contract(name):
    assert len(check_pair(name, n_cases=4)) == 4


def test_a_nondeterministic_pair_fails_with_the_fix(tmp_path):
    plugin = tmp_path / "flaky.py"
    plugin.write_text(
        "import torch\nfrom harness import Axes, Outcome, TargetPair\n"
        "pair = TargetPair(name='flaky.pair', kind='op', expected='aligned',\n"
        "    build=lambda case, device: case.n_tokens,\n"
        "    trainer=lambda n: Outcome(logprobs=torch.log_softmax(torch.randn(n, 8), -1)),\n"
        "    rollout=lambda n: Outcome(logprobs=torch.log_softmax(torch.zeros(n, 8), -1)),\n"
        "    axes=Axes(n_seqs=(1, 2), seq_len=(1, 4)))\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("flaky_plugin", plugin)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(ConformanceError, match="trainer is not deterministic.*case.generator"):
        check_pair(mod.pair, n_cases=2)


def test_wrong_row_count_is_reported():
    import torch

    from harness import Axes, Outcome, TargetPair

    pair = TargetPair(name="rows.wrong", kind="op", expected="aligned", build=lambda c, d: c.n_tokens,
                      trainer=lambda n: Outcome(logprobs=torch.zeros(n + 1, 4)),
                      rollout=lambda n: Outcome(logprobs=torch.zeros(n + 1, 4)),
                      axes=Axes(n_seqs=(1, 1), seq_len=(2, 2)))
    with pytest.raises(ConformanceError, match="one row per token of the case"):
        check_pair(pair, n_cases=1)
