"""A target shares its process with every other pair of the campaign (in-process, or in its worker):
what it changes process-wide is put back after each case, and what it raises, however odd, is a
finding of its own."""

from __future__ import annotations

import os

import torch

from harness import Axes, Case, Outcome, TargetPair
from harness.execute import Symptom, run_case


def _build(case, device):
    return case.token_randn(16, "x", device=device)


def _fine(x):
    return Outcome(logprobs=torch.log_softmax(x, -1))


def _pair(name, trainer):
    return TargetPair(name=name, kind="op", expected="aligned", build=_build, trainer=trainer, rollout=_fine,
                      axes=Axes(n_seqs=(1, 2), seq_len=(1, 4)), description=name)


def test_process_wide_settings_a_target_changes_are_put_back_with_a_warning(tmp_path, capsys):
    cwd, threads = os.getcwd(), torch.get_num_threads()

    def meddles(x):
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(max(1, threads + 1))
        torch.use_deterministic_algorithms(True)
        torch.set_float32_matmul_precision("medium")
        os.chdir(tmp_path)
        return _fine(x)

    ev = run_case(_pair("state.meddles", meddles), Case(seed=1, seq_lens=(2,)))
    assert ev.symptom is Symptom.NONE
    assert torch.get_default_dtype() == torch.float32 and torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_float32_matmul_precision() == "highest" and os.getcwd() == cwd
    err = capsys.readouterr().err
    assert "pair state.meddles changed the process's torch default dtype (torch.float32 -> torch.float64)" in err
    assert "working directory" in err
    run_case(_pair("state.meddles", meddles), Case(seed=2, seq_lens=(2,)))
    assert capsys.readouterr().err == ""  # one warning per pair and setting
    assert torch.get_default_dtype() == torch.float32 and os.getcwd() == cwd


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no")


def test_odd_exceptions_from_a_target_are_error_findings_with_their_traceback():
    def bad_str(x):
        raise _Unprintable()

    def exits(x):
        raise SystemExit(0)

    ev = run_case(_pair("state.bad_str", bad_str), Case(seed=1, seq_lens=(1,)))
    assert ev.symptom is Symptom.ERROR and ev.error["type"] == "_Unprintable"
    assert "str() of the _Unprintable raised RuntimeError" in ev.error["message"]
    assert "bad_str" in ev.error["traceback"] and ev.error["where"].endswith(":bad_str")
    ev = run_case(_pair("state.exits", exits), Case(seed=1, seq_lens=(1,)))
    assert ev.symptom is Symptom.ERROR and ev.error["type"] == "SystemExit"
    assert ev.error["message"] == "the target called sys.exit(0)" and "exits" in ev.error["traceback"]


def test_outputs_that_break_the_contract_are_errors_that_say_what_is_wrong():
    def ints(x):
        return Outcome(logprobs=torch.log_softmax(x, -1).round().long())

    def as_numpy(x):
        return Outcome(logprobs=torch.log_softmax(x, -1).numpy())

    def meta(x):
        return Outcome(logprobs=torch.empty(x.shape, device="meta"))

    def float_tokens(x):
        return Outcome(logprobs=torch.log_softmax(x, -1), tokens=torch.full((x.shape[0],), 0.5))

    def far_tokens(x):
        return Outcome(logprobs=torch.log_softmax(x, -1), tokens=torch.full((x.shape[0],), 16 + 5))

    expect = {ints: "dtype torch.int64; log-probabilities are floating point",
              as_numpy: "must be a torch.Tensor, got ndarray", meta: "on the meta device",
              float_tokens: "tokens must be an integer torch.Tensor", far_tokens: "must lie in [0, 16)"}
    for rollout, words in expect.items():
        pair = TargetPair(name=f"state.{rollout.__name__}", kind="op", expected="aligned", build=_build,
                          trainer=_fine, rollout=rollout, axes=Axes(n_seqs=(1, 2), seq_len=(1, 4)), description="x")
        ev = run_case(pair, Case(seed=1, seq_lens=(2,)))
        assert ev.symptom is Symptom.ERROR and words in ev.error["message"], (rollout.__name__, ev.error)
