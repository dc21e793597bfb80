"""The conformance check a backend author calls in one line, run over every registered pair."""

import math
import re
import warnings

import pytest

from harness import REGISTRY, check_pair
from harness.conformance import ConformanceError

from ..conftest import PLUGINS

REGISTRY.load_plugin(str(PLUGINS / "lm_head_bf16.py"))


@pytest.mark.parametrize("name", [p.name for p in REGISTRY.all() if "cpu" in p.devices and p.kind == "op"])
def test_every_op_pair_obeys_the_contract(name):
    if name == "lm_head.temperature_order":  # its bug is a temperature applied after the softmax: unnormalised rows
        from harness.conformance import ConformanceWarning

        with pytest.warns(ConformanceWarning, match="the rollout's rows are not normalised"):
            assert len(check_pair(name, n_cases=4)) == 4
        return
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


def test_nan_in_the_same_places_is_reported_as_nan_not_as_nondeterminism():
    import torch

    from harness import Axes, Outcome, TargetPair

    def nan_rows(case, device):
        lp = torch.log_softmax(case.randn((case.n_tokens, 8), "x"), -1)
        lp[0, 0] = math.nan  # deterministic: the same NaN on every run
        return lp

    pair = TargetPair(name="nan.same", kind="op", expected="aligned", build=nan_rows,
                      trainer=lambda x: Outcome(logprobs=x.clone()), rollout=lambda x: Outcome(logprobs=x.clone()),
                      axes=Axes(n_seqs=(1, 2), seq_len=(1, 3)))
    with pytest.raises(ConformanceError) as e:
        check_pair(pair, n_cases=2)
    assert "contain NaN" in str(e.value) and "not deterministic" not in str(e.value)


def test_a_raise_in_the_pair_is_reported_with_the_pairs_own_line():
    import torch

    from harness import Axes, Outcome, TargetPair

    def build(case, device):
        return torch.zeros(case.prompt_lens[0])  # () when no sequence has a prompt: case.prompt_len(j) is safe

    pair = TargetPair(name="raise.where", kind="op", expected="aligned", build=build,
                      trainer=lambda x: Outcome(logprobs=x), rollout=lambda x: Outcome(logprobs=x),
                      axes=Axes(n_seqs=(1, 2), seq_len=(1, 3)))
    with pytest.raises(ConformanceError, match=r"raised IndexError: tuple index out of range \(at .*test_conformance"
                                               r"\.py:\d+, in build\)"):
        check_pair(pair, n_cases=1)


def test_wrong_row_count_is_reported():
    import torch

    from harness import Axes, Outcome, TargetPair

    pair = TargetPair(name="rows.wrong", kind="op", expected="aligned", build=lambda c, d: c.n_tokens,
                      trainer=lambda n: Outcome(logprobs=torch.zeros(n + 1, 4)),
                      rollout=lambda n: Outcome(logprobs=torch.zeros(n + 1, 4)),
                      axes=Axes(n_seqs=(1, 1), seq_len=(2, 2)))
    with pytest.raises(ConformanceError, match="one row per token of the case"):
        check_pair(pair, n_cases=1)


@pytest.mark.parametrize("width_t, rows_r, words", [
    (32, None, "the trainer's hidden states are 32 wide and the rollout's 64"),  # two unrelated readout heads
    (64, 8, "rollout hidden states have shape (8, 64), expected (3, hidden)"),  # not the case's rows
])
def test_hidden_states_of_another_width_or_row_count_are_named_before_the_readout(width_t, rows_r, words):
    """A trainer 32 wide against a rollout 64 wide passed check_pair and fuzzed as a divergence (the
    readout drew a head per width); a wrong row count was said as the readout's (rows, vocab)."""
    import torch

    from harness import Axes, Outcome, Readout, TargetPair

    pair = TargetPair(name="hidden.wide", kind="op", expected="aligned", build=lambda c, d: c.n_tokens,
                      trainer=lambda n: Outcome(hidden=torch.ones(n, width_t)),
                      rollout=lambda n: Outcome(hidden=torch.ones(rows_r or n, 64)), readout=Readout(vocab=128),
                      axes=Axes(n_seqs=(1, 1), seq_len=(3, 3)))
    with pytest.raises(ConformanceError, match=re.escape(words)):
        check_pair(pair, n_cases=1)


@pytest.mark.parametrize("tokens, vocab_r, words", [
    (lambda n: torch_zeros_int(n - 1), 4, "rollout tokens have shape (2,), expected (3,)"),  # one token short
    (lambda n: torch_zeros_int(n, 2), 4, "rollout tokens have shape (3, 2), expected (3,)"),
    (None, 6, "the trainer's logprobs have 4 vocabulary entries per row and the rollout's 6"),  # a padded vocab
])
def test_tokens_of_the_wrong_shape_and_a_padded_vocabulary_are_named_in_the_pairs_terms(tokens, vocab_r, words):
    """Not a numpy reshape error from inside the metrics (recorded as a finding in a harness frame)."""
    import torch

    from harness import Axes, Case, Outcome, TargetPair
    from harness.execute import run_case

    def rollout(n):
        return Outcome(logprobs=torch.log_softmax(torch.zeros(n, vocab_r), -1),
                       tokens=tokens(n) if tokens else None)

    pair = TargetPair(name="shapes.wrong", kind="op", expected="aligned", build=lambda c, d: c.n_tokens,
                      trainer=lambda n: Outcome(logprobs=torch.log_softmax(torch.zeros(n, 4), -1)), rollout=rollout,
                      axes=Axes(n_seqs=(1, 1), seq_len=(3, 3)))
    ev = run_case(pair, Case(seed=1, seq_lens=(3,)))
    assert ev.symptom.value == "error" and words in ev.error["message"], ev.error
    assert ev.error["message"].startswith("shapes.wrong: ")
    with pytest.raises(ConformanceError, match=words.split(" have")[0].replace("(", r"\(")):
        check_pair(pair, n_cases=1)


def test_rows_that_are_not_log_probabilities_are_warned_about_once_per_path():
    """A path returning raw logits (log-softmax forgotten) passed every check and fuzzed as a plain
    divergence; now it is named. Bf16-rounded log-probabilities are not flagged."""
    import torch

    from harness import Axes, Outcome, TargetPair
    from harness.conformance import ConformanceWarning

    def build(case, device):
        return case.token_randn(32, "x") * 3

    for rollout, warned in ((lambda x: Outcome(logprobs=x), True),  # raw logits
                            (lambda x: Outcome(logprobs=torch.log_softmax(x, -1).bfloat16().float()), False)):
        pair = TargetPair(name="rows.logits", kind="op", expected="aligned", build=build,
                          trainer=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)), rollout=rollout,
                          axes=Axes(n_seqs=(1, 3), seq_len=(1, 4)))
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            check_pair(pair, n_cases=4)
        said = [str(w.message) for w in got if issubclass(w.category, ConformanceWarning) and "normalised" in str(w.message)]
        assert len(said) == int(warned), said
        if warned:
            assert "the rollout's rows are not normalised" in said[0] and "raw logits?" in said[0]


def torch_zeros_int(*shape):
    import torch

    return torch.zeros(*shape, dtype=torch.int64)


# --- metamorphic checks ---------------------------------------------------------------------------
def _head_pair(name, trainer_rows=lambda lp, case: lp, rollout_rows=lambda lp, case: lp, per_sequence=True):
    """An LM-head pair over per-token hidden states; `*_rows` may rearrange or replace a path's rows."""
    import torch

    from harness import Axes, Outcome, TargetPair

    def build(case, device):
        h = case.token_randn(16, "hidden") if per_sequence else case.randn((case.n_tokens, 16), "hidden")
        return {"h": h, "w": torch.randn(16, 32, generator=torch.Generator().manual_seed(1)), "case": case}

    def path(rows):
        return lambda inp: Outcome(logprobs=rows(torch.log_softmax(3 * inp["h"] @ inp["w"], -1), inp["case"]))

    return TargetPair(name=name, kind="op", expected="aligned", build=build, trainer=path(trainer_rows),
                      rollout=path(rollout_rows), axes=Axes(n_seqs=(1, 4), seq_len=(1, 6), pad_sides=("right",),
                                                            logit_scale=(1.0, 1.0)))


def test_a_pair_drawing_per_sequence_passes_the_permutation_check():
    import warnings

    from harness.conformance import ConformanceWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(check_pair(_head_pair("meta.ok"), n_cases=4)) == 4
    # no ConformanceWarning: the check ran (other libraries' warnings, met by chance, are not this test's)
    assert not [w for w in caught if issubclass(w.category, ConformanceWarning)], [str(w.message) for w in caught]


def test_a_trainer_whose_rows_are_reversed_fails():
    pair = _head_pair("meta.reversed", trainer_rows=lambda lp, case: lp.flip(0))
    with pytest.raises(ConformanceError, match=r"sequences rotated \(the last first\): the trainer's rows did "
                                               r"not follow .*one row per token in case order") as err:
        check_pair(pair, n_cases=4)
    assert "rollout's rows" not in str(err.value)


def test_rows_in_sequence_order_but_reversed_within_sequences_fail_too():
    import torch

    def within(lp, case):  # each sequence's rows reversed: right sequences, wrong tokens
        return torch.cat([lp[o:o + n].flip(0) for o, n in zip(case.offsets, case.seq_lens)])

    with pytest.raises(ConformanceError, match="last token of its longest sequence removed: the rollout's rows did "
                                               "not follow .*depend only on the tokens before it") as err:
        check_pair(_head_pair("meta.within", rollout_rows=within), n_cases=8)
    assert "sequences rotated" not in str(err.value)  # reordering whole sequences cannot see it


def test_a_path_that_ignores_its_input_is_reported():
    import torch

    constant = _head_pair("meta.constant", rollout_rows=lambda lp, case: torch.log_softmax(torch.zeros_like(lp), -1))
    with pytest.raises(ConformanceError, match="the rollout gives the same log-probabilities under seed"):
        check_pair(constant, n_cases=2)
    fixed = torch.log_softmax(torch.randn(64, 32, generator=torch.Generator().manual_seed(5)), -1)
    unseeded = _head_pair("meta.unseeded", trainer_rows=lambda lp, case: fixed[:lp.shape[0]])
    with pytest.raises(ConformanceError, match="the trainer gives the same log-probabilities under seed .*ignores "
                                               "its input"):
        check_pair(unseeded, n_cases=2)


def test_whole_batch_streams_skip_the_permutation_check_with_a_warning():
    from harness.conformance import ConformanceWarning

    with pytest.warns(ConformanceWarning, match="permutation check was skipped.*case.token_randn"):
        check_pair(_head_pair("meta.legacy", per_sequence=False), n_cases=4)


def _sampling_pair(name, whole_batch):
    """A head whose rollout samples its tokens: per sequence by inverse CDF, or by one multinomial
    over the whole batch on one generator."""
    import torch

    from harness import Axes, Outcome, TargetPair

    def build(case, device):
        return {"h": case.token_randn(16, "hidden"), "case": case,
                "w": torch.randn(16, 64, generator=torch.Generator().manual_seed(1))}

    def logprobs(inp):  # a flat distribution: two draws of one token rarely agree by chance
        return torch.log_softmax(0.1 * inp["h"] @ inp["w"], -1)

    def trainer(inp):
        return Outcome(logprobs=logprobs(inp))

    def rollout(inp):
        lp, case = logprobs(inp), inp["case"]
        if whole_batch:
            tokens = torch.multinomial(lp.exp(), 1, generator=case.generator("sample")).squeeze(-1)
        else:
            c = lp.double().exp().cumsum(-1)
            u = case.token_uniforms("sample")[:, None] * c[:, -1:]
            tokens = torch.searchsorted(c, u, right=True).squeeze(-1).clamp_(max=lp.shape[1] - 1)
        return Outcome(logprobs=lp, tokens=tokens)

    return TargetPair(name=name, kind="op", expected="aligned", build=build, trainer=trainer, rollout=rollout,
                      axes=Axes(n_seqs=(4, 6), seq_len=(2, 5), pad_sides=("right",), logit_scale=(1.0, 1.0)))


def test_a_rollout_sampling_from_one_whole_batch_stream_is_warned_about():
    import warnings

    from harness.conformance import ConformanceWarning

    with pytest.warns(ConformanceWarning, match=r"sampled tokens did not follow .*case.seq_generator\(j, \"sample\"\)"):
        check_pair(_sampling_pair("meta.batch_sampler", whole_batch=True), n_cases=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_pair(_sampling_pair("meta.seq_sampler", whole_batch=False), n_cases=2)
    assert not [w for w in caught if issubclass(w.category, ConformanceWarning)], [str(w.message) for w in caught]


def test_rows_that_do_not_follow_name_an_input_drawn_from_a_whole_batch_stream():
    """One input drawn per sequence (so the inputs 'follow'), another from one whole-batch stream:
    the violation names the second, the likelier cause, beside the row-order rule."""
    import torch

    from harness import Axes, Outcome, TargetPair

    def build(case, device):
        return {"h": case.token_randn(16, "hidden"), "bias": case.randn((case.n_tokens, 32), "bias"),
                "w": torch.randn(16, 32, generator=torch.Generator().manual_seed(1))}

    def path(inp):
        return Outcome(logprobs=torch.log_softmax(inp["h"] @ inp["w"] + inp["bias"], -1))

    pair = TargetPair(name="meta.mixed_streams", kind="op", expected="aligned", build=build, trainer=path,
                      rollout=path, axes=Axes(n_seqs=(2, 4), seq_len=(1, 6)))
    with pytest.raises(ConformanceError, match=r"rows did not follow .*inputs\['bias'\] \(\d+, 32\) did not follow"):
        check_pair(pair, n_cases=4)


def test_rotated_case_keeps_each_sequences_stream_and_packing():
    from harness import Case
    from harness.conformance import rotated_case

    c = Case(seed=1, seq_lens=(2, 3, 1), prompt_lens=(4, 0, 2), order=(2, 0, 1), row_capacity=8, probe=1)
    new, src, seqs = rotated_case(c)
    assert seqs == [2, 0, 1] and new.seq_lens == (1, 2, 3) and new.prompt_lens == (2, 4, 0) and new.ids == (2, 0, 1)
    assert [[new.ids[j] for j in row] for row in new.packed_rows()] == [[c.ids[j] for j in row]
                                                                         for row in c.packed_rows()]
    assert src == [5, 0, 1, 2, 3, 4] and new.ids[new.probe] == 1
    assert rotated_case(Case(seed=1, seq_lens=(3,))) is None


@pytest.mark.slow
def test_a_model_pair_with_its_trainer_rows_reversed_fails():
    """The full-model pair on small cases: clean as registered, caught with its trainer's rows reversed."""
    import dataclasses

    pair = REGISTRY.get("model.bf16_rollout")
    small = dataclasses.replace(pair, axes=dataclasses.replace(pair.axes, n_seqs=(2, 3), seq_len=(3, 8),
                                                               prompt_len=(0, 4)))
    check_pair(small, n_cases=3)

    def reversed_trainer(inp, rollout, _trainer=pair.trainer):
        out = _trainer(inp, rollout)
        out.logprobs = out.logprobs.flip(0)
        return out

    with pytest.raises(ConformanceError, match="sequences rotated .*the trainer's rows did not follow"):
        check_pair(dataclasses.replace(small, trainer=reversed_trainer), n_cases=3)


def test_the_readmes_decode_example_passes_the_check_it_recommends():
    # a fixed-weight model from a fixed start token: a one-token, prompt-free case is the same under
    # every seed, rightly; input dependence is judged on the longest response instead
    REGISTRY.load_plugin(str(PLUGINS / "decode_sampling.py"))
    from harness.conformance import ConformanceWarning

    with warnings.catch_warnings():  # (and without a warning: it reads every axis it fuzzes)
        warnings.simplefilter("error", ConformanceWarning)
        assert len(check_pair("example.decode", n_cases=4)) == 4


def test_row_distances_are_taken_in_chunks_with_the_same_values(monkeypatch):
    """The permutation checks compare rows by total variation; at a real vocabulary (151936) the
    2016 row pairs of 64 rows held at once were 12 GB, so they go in chunks of bounded size: the
    values are those of the one-shot definition."""
    import torch

    from harness import conformance

    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(40, 300) * 3, -1)
    lp[3, :7] = float("-inf")
    i, j = torch.triu_indices(40, 40, 1)
    p = torch.nan_to_num(lp.double().exp(), nan=0.0)
    tv = 0.5 * (p[i] - p[j]).abs().sum(-1)  # the definition, all pairs at once
    for chunk in (1 << 22, 1000, 300, 1):  # one chunk, several, one row (or pair) per chunk
        monkeypatch.setattr(conformance, "_TV_CHUNK", chunk)
        assert conformance._distinct_scale(lp) == float(tv.median())
        assert torch.equal(conformance._tv_rows(lp[i[:50]], lp[j[:50]]), tv[:50])


def test_an_axis_the_pair_fuzzes_but_never_reads_is_warned_about_with_its_fix():
    import torch
    from hypothesis import strategies as st

    from harness import Axes, Outcome, TargetPair
    from harness.conformance import ConformanceWarning

    def build(case, device):  # reads the temperature and one of its two params (the one through .get)
        x = case.token_randn(8, "x") * case.params.get("scale", 1.0)
        return torch.log_softmax(x / case.temperature, -1)

    def pair(axes):
        return TargetPair(name="unread.axes", kind="op", expected="aligned", build=build,
                          trainer=lambda x: Outcome(logprobs=x.clone()), rollout=lambda x: Outcome(logprobs=x.clone()),
                          axes=axes)

    axes = Axes(n_seqs=(1, 3), seq_len=(1, 4), temperature=(0.5, 2.0), logit_scale=(1.0, 1.0),
                params={"scale": st.sampled_from([1.0, 2.0]), "unused": st.integers(0, 3)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_pair(pair(axes), n_cases=3)
    notes = [str(w.message) for w in caught if issubclass(w.category, ConformanceWarning)]
    assert len(notes) == 2, notes
    assert notes[0].startswith("axes.pad_sides: the pair fuzzes it, but neither path read case.pad_side on the 3 case(s)")
    assert "declare Axes(pad_sides=('right',))" in notes[0]
    assert notes[1].startswith("axes.params['unused']: the pair draws it, but neither path read")
    # read, held fixed, or read by the harness itself (a readout scales by the logit scale): nothing to say
    from harness import Readout

    read = TargetPair(name="read.axes", kind="op", expected="aligned", build=build, readout=Readout(vocab=16),
                      trainer=lambda x: Outcome(hidden=x.clone()), rollout=lambda x: Outcome(hidden=x.clone()),
                      axes=Axes(n_seqs=(1, 3), seq_len=(1, 4), temperature=(0.5, 2.0), pad_sides=("left",),
                                params={"scale": st.sampled_from([1.0, 2.0])}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConformanceWarning)
        check_pair(read, n_cases=3)


def test_a_pair_that_fuzzes_groups_but_never_draws_a_shared_prompt_is_warned_about():
    """A trial's GRPO pair read `case.prompt_ids` (for its prefix cache) but drew each sequence's prompt
    from its own stream: `harness check` passed, and the fuzz then reported its correct cache as a
    regression. Check says so; drawing through `case.prompt_tokens` silences it."""
    import torch

    from harness import Axes, Outcome, TargetPair
    from harness.conformance import ConformanceWarning

    def build(own_stream):
        def b(case, device):
            _ = case.prompt_ids  # (a prefix cache keyed by the group)
            rows = []
            for j, n in enumerate(case.seq_lens):
                g = case.seq_generator(j, "prompt") if own_stream else case.prompt_generator(j, "prompt")
                p = torch.randint(0, 16, (case.prompt_len(j),), generator=g)
                rows.append(torch.randn(n, 16, generator=case.seq_generator(j, "x")) + p.float().mean().nan_to_num())
            return torch.log_softmax(torch.cat(rows), -1)
        return b

    def pair(own_stream):
        return TargetPair(name="groups.check", kind="op", expected="aligned", build=build(own_stream),
                          trainer=lambda x: Outcome(logprobs=x.clone()), rollout=lambda x: Outcome(logprobs=x.clone()),
                          axes=Axes(n_seqs=(2, 4), seq_len=(1, 4), prompt_len=(1, 8), prompt_group=(2, 3),
                                    logit_scale=(1.0, 1.0), pad_sides=("right",)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_pair(pair(True), n_cases=4)
    notes = [str(w.message) for w in caught if issubclass(w.category, ConformanceWarning)]
    assert any(n.startswith("axes.prompt_group: the pair fuzzes groups") and "case.prompt_tokens" in n
               for n in notes), notes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_pair(pair(False), n_cases=4)
    assert not [w for w in caught if "prompt_group" in str(w.message)], [str(w.message) for w in caught]


def test_the_same_violation_on_several_cases_is_said_once_with_a_count():
    """A patch that raises past some size listed every case it raised on (seven lines of ~600
    characters): once, on the first case, with how many more."""
    import torch

    from harness import Axes, Outcome, TargetPair

    def build(case, device):
        if case.n_tokens > 3:
            raise ValueError("kernel does not support more than 3 tokens")
        return case.token_randn(16, "x")

    pair = TargetPair(name="t.raisy", kind="op", expected="aligned", build=build,
                      trainer=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)),
                      rollout=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)),
                      axes=Axes(n_seqs=(2, 4), seq_len=(2, 8)))
    with pytest.raises(ConformanceError) as e:
        check_pair(pair)
    lines = [line for line in str(e.value).splitlines() if "the pair raised" in line]
    assert len(lines) == 1 and "kernel does not support more than 3 tokens" in lines[0], str(e.value)
    assert re.search(r"\(and on \d+ more case\(s\)\)$", lines[0]), lines[0]
