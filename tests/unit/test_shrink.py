"""The polish pass turns a 1-minimal Hypothesis result into the simplest trigger."""
from harness.case import Case
from harness.shrink import polish


def test_polish_drops_bystanders_and_moves_knobs_to_neutral():
    # the bug: a sequence of >= 39 tokens with temperature != 1 diverges, where stream 9's tensors are
    def fails(c):
        return max(c.seq_lens) >= 39 and c.temperature != 1.0 and 9 in c.ids

    start = Case(seed=7, seq_lens=(1, 39, 5), prompt_lens=(3, 0, 9), seq_ids=(4, 9, 2), temperature=0.5,
                 top_p=0.9, sample_top_k=7, pad_side="left", row_capacity=45, order=(2, 1, 0))
    got, evals, complete = polish(start, fails)
    assert complete and fails(got)
    assert got.seq_lens == (39,) and got.seq_ids == (9,)  # the trigger keeps its own stream
    assert got.prompt_lens == () and got.top_p == 1.0 and got.sample_top_k == 0 and got.pad_side == "right"
    assert got.temperature != 1.0 and abs(got.temperature - 1.0) < 0.01  # bisected to the edge of the trigger
    assert all(not fails(n) for n in got.simpler_neighbours())  # 1-minimal


def test_polish_reaches_a_boundary_that_half_and_one_less_miss():
    # a bug past position 64 that fires at most lengths above it, but not at 75 or 74 (it depends on
    # the values there): halving (38) and dropping one token (75) both pass from 76
    def fails(c):
        return c.prompt_len(0) > 64 and c.prompt_len(0) not in (74, 75, 66)

    got, _, complete = polish(Case(seed=3, seq_lens=(1,), prompt_lens=(76,)), fails)
    assert complete and got.prompt_lens == (65,), got.one_line()
    got, _, complete = polish(Case(seed=3, seq_lens=(76,)), lambda c: c.seq_lens[0] > 64 and c.seq_lens[0] != 75)
    assert complete and got.seq_lens == (65,), got.one_line()
    # a bug that needs two sequences (a packing leak past a boundary): the longest one still steps down
    got, _, complete = polish(Case(seed=3, seq_lens=(76, 3)), lambda c: c.batch_size == 2 and c.seq_lens[0] > 64
                              and c.seq_lens[0] not in (74, 75))
    assert complete and got.seq_lens == (65, 1), got.one_line()


def test_polish_reaches_a_kernel_switch_size_that_no_one_step_neighbour_shows():
    """A bug past a chunk or bucket switch that fires only at some sizes above it (the values decide:
    the key at the chunk boundary must draw attention): from a drawn 75-token prompt whose halving
    and n - 2^k neighbours all pass, the round sizes reach the switch, 48; a batch-bucket bug from 9
    sequences that the drawn 13 shows but 12 does not reaches the first 9."""
    def fails(c):  # 48 and 75 fail, every other prompt length passes
        return c.prompt_len(0) in (48, 75)

    got, _, complete = polish(Case(seed=3, seq_lens=(5,), prompt_lens=(75,)), fails)
    assert complete and got.prompt_lens == (48,) and got.seq_lens == (1,), got.one_line()
    got, _, complete = polish(Case(seed=3, seq_lens=(40,)), lambda c: c.seq_lens[0] in (17, 40))
    assert complete and got.seq_lens == (17,), got.one_line()  # a response: 17 = one past 16
    got, _, complete = polish(Case(seed=3, seq_lens=(2,) * 13, seq_ids=tuple(range(20, 33))),
                              lambda c: c.batch_size in (9, 13) and 20 in c.ids)  # (stream 20's tensors)
    assert complete and got.batch_size == 9 and got.seq_ids == tuple(range(20, 29)), got.one_line()


def test_the_neighbours_shrinking_ran_say_where_a_size_threshold_is():
    """`neighbours_of` reads what the polish's moves gave around the minimal case: the shorter prompts of
    a sequence make one row named by the nearest (48 -> 47), dropped sequences another, and a
    neighbour that fails another way keeps a row of its own; a case never run is left out."""
    from harness.shrink import describe_change, neighbours_of

    def fails(c):
        return c.prompt_len(0) >= 48 and c.batch_size == 2

    ran = {}

    def judged(c):
        ran[c.key()] = (0.5 if fails(c) else 1e-9 * c.prompt_len(0), "divergence" if fails(c) else "none")
        return fails(c)

    got, _, complete = polish(Case(seed=3, seq_lens=(5, 2), prompt_lens=(75, 3)), judged)
    assert complete and got.prompt_lens == (48, 0) and got.seq_lens == (1, 1), got.one_line()
    rows = neighbours_of(got, None, lambda c: ran.get(c.key()))
    assert rows[0]["change"].startswith("without sequence ") and rows[0]["cases"] == 2, rows
    prompt = next(r for r in rows if r["change"].startswith("sequence 0: prompt 48 -> "))
    assert prompt["change"] == "sequence 0: prompt 48 -> 47" and prompt["judged"] == 1e-9 * 47 and prompt["cases"] > 5
    assert all(r["symptom"] == "none" for r in rows)
    ran[got.drop_sequence(1).key()] = (float("nan"), "error")  # (as if it had raised)
    rows = neighbours_of(got, None, lambda c: ran.get(c.key()))
    assert [r["symptom"] for r in rows if r["change"].startswith("without")] == ["none", "error"], rows
    assert neighbours_of(got, None, lambda c: None) == []
    base = Case(seed=1, seq_lens=(3, 2, 2), prompt_lens=(4, 4, 4), prompt_ids=(7, 7, 7), temperature=0.5)
    assert describe_change(base, base.first_sequences(1)) == "its first 1 of 3 sequences"
    assert describe_change(base, base.replace(prompt_ids=())) == "every prompt its own"
    assert describe_change(base, base.replace(temperature=1.0)) == "temperature 0.5 -> 1"
    # the same sizes and knobs on other tensors is not "the same case" (it read so, as if the repro were flaky)
    drawn = Case(seed=1, seq_lens=(2, 2), seq_ids=(5, 9), prompt_lens=(3, 3), prompt_ids=(5, 5))
    assert describe_change(drawn, drawn.replace(seq_ids=())) == "other random streams: sequence ids 5, 9 -> 0, 1"
    assert describe_change(drawn, drawn.replace(prompt_ids=(9, 9))) == "other prompt streams: prompt ids 5, 5 -> 9, 9"


def test_one_line_names_the_sequences_streams():
    assert "seq_ids=[296]" in Case(seed=0, seq_lens=(1,), prompt_lens=(76,), seq_ids=(296,)).one_line()
    assert "seq_ids" not in Case(seed=0, seq_lens=(1, 2)).one_line()


def test_polish_stops_at_its_budget_and_says_so():
    got, evals, complete = polish(Case(seed=1, seq_lens=(8, 8, 8)), lambda c: True, max_evals=2)
    assert evals == 2 and not complete and got.seq_lens == (8,)


def test_polish_bisects_a_continuous_knob_toward_neutral():
    from harness import Axes

    got, _, complete = polish(Case(seed=1, seq_lens=(4,), temperature=0.5, logit_scale=12.0),
                              lambda c: abs(c.temperature - 1.0) > 0.02, axes=Axes(logit_scale=(1.0, 16.0)))
    assert complete and 0.02 < abs(got.temperature - 1.0) < 0.05  # near the trigger's edge, not 0.5
    assert got.logit_scale == 1.0 and got.seq_lens == (1,)


def test_polish_steps_discrete_knobs_down_to_the_trigger():
    # the bug: router top-k >= 4 (any expert count), or a sampling top-k of 5 or more
    from harness import Axes
    from harness.pairs import RoutingAxes

    axes = Axes(routing=RoutingAxes(n_experts=(4, 16), top_k=(1, 8)), sample_top_k=(0, 64))
    start = Case(seed=3, seq_lens=(2,), n_experts=14, top_k=7, tie_fraction=0.0, sample_top_k=40)
    got, _, complete = polish(start, lambda c: c.top_k >= 4 and c.sample_top_k >= 5, axes=axes)
    assert complete and got.top_k == 4 and got.n_experts == 5 and got.sample_top_k == 5
    assert got.seq_lens == (1,)


def test_polish_moves_free_parameters_to_their_strategys_simplest_value():
    """A uniform case copies its example's parameters, which Hypothesis never shrank: a min-p that
    plays no part goes to the strategy's simplest value; one that does is bisected toward it."""
    import hypothesis.strategies as st

    from harness import Axes

    axes = Axes(n_seqs=(1, 4), seq_len=(1, 8), params={"min_p": st.floats(0.0, 0.2), "mode": st.sampled_from(["a", "b"])})
    case = Case(seed=1, seq_lens=(2, 1), pad_side="left", params={"min_p": 0.0832, "mode": "b"})
    out, _, complete = polish(case, lambda c: c.batch_size == 2 and c.pad_side == "left", axes=axes)
    assert complete and out.params == {"min_p": 0.0, "mode": "a"}
    out, _, _ = polish(case, lambda c: c.params["min_p"] > 0.01, axes=axes)  # halfway while it still fails
    assert 0.01 < out.params["min_p"] < 0.021 and out.params["mode"] == "a"



def test_a_listed_parameter_shrinks_through_its_list_never_to_a_value_it_cannot_draw():
    """A trial's `st.sampled_from([0.0, 0.05, 0.1])` min-p came back bisected toward 0.0,
    a value its strategy never draws; a penalty from [1.0, 1.1, 1.3] steps to 1.1, then 1.0."""
    import hypothesis.strategies as st

    from harness import Axes
    from harness.shrink import moves

    axes = Axes(n_seqs=(1, 4), seq_len=(1, 8), params={"min_p": st.sampled_from([0.0, 0.05, 0.1]),
                                                        "rep": st.sampled_from([1.0, 1.1, 1.3])})
    case = Case(seed=1, seq_lens=(2,), params={"min_p": 0.1, "rep": 1.3})
    drawn = {(c.params["min_p"], c.params["rep"]) for c in moves(case, axes)}
    assert {(0.0, 1.3), (0.05, 1.3), (0.1, 1.0), (0.1, 1.1)} <= drawn
    assert all(p in (0.0, 0.05, 0.1) and r in (1.0, 1.1, 1.3) for p, r in drawn), drawn
    out, _, _ = polish(case, lambda c: c.params["min_p"] > 0, axes=axes)
    assert out.params == {"min_p": 0.05, "rep": 1.0}, out.params


def test_the_polish_moves_stay_inside_the_pairs_axes():
    """Neutral knobs as the axes allow them: a pair that only left-pads, or samples at
    temperatures in [0.5, 0.9], is never shown a case outside them."""
    from harness import Axes
    from harness.shrink import moves

    axes = Axes(pad_sides=("left",), temperature=(0.5, 0.9), top_p=(0.8, 0.95), sample_top_k=(4, 8))
    case = Case(seed=1, seq_lens=(3, 2), pad_side="left", temperature=0.7, top_p=0.9, sample_top_k=6)
    seen = list(moves(case, axes))
    assert seen and all(c.pad_side == "left" for c in seen)
    assert all(0.5 <= c.temperature <= 0.9 and 0.8 <= c.top_p <= 0.95 and 4 <= c.sample_top_k <= 8 for c in seen)
    assert any(c.temperature == 0.9 for c in seen) and any(c.top_p == 0.95 for c in seen)  # as near neutral as allowed
    # and the whole polish: a failure that needs nothing but a batch of two shrinks inside them
    out, _, _ = polish(case, lambda c: c.batch_size >= 2, axes=axes)
    assert out.pad_side == "left" and out.temperature == 0.9 and out.sample_top_k == 4 and out.seq_lens == (1, 1)
    # and their sizes' lower bounds: a pair that declares prompts of 2-16 tokens and batches of 2 or more
    # is never shown a case without a prompt or with one sequence, whatever fails
    sized = Axes(n_seqs=(2, 8), seq_len=(2, 16), prompt_len=(2, 16))
    start = Case(seed=1, seq_lens=(9, 5, 3), prompt_lens=(12, 7, 2))
    assert all(c.batch_size >= 2 and min(c.seq_lens) >= 2 and min(c.prompt_lens) >= 2 for c in moves(start, sized))
    out, _, complete = polish(start, lambda c: True, axes=sized)
    assert complete and out.seq_lens == (2, 2) and out.prompt_lens == (2, 2), out.one_line()
    assert all(c.batch_size >= 2 and min(c.prompt_lens, default=0) >= 2 for c in out.simpler_neighbours(sized))


def test_polish_gives_response_tokens_to_the_prompt_for_a_bug_past_a_position():
    """A decode position clamped at 40: a case fails once prompt + response reaches past it. Shortening
    alone ends at some split of 41 tokens (a long response: many clean scored tokens); giving the
    response's tokens to the prompt leaves one scored token, the one that fails."""
    from harness import Axes

    def fails(c):
        return c.prompt_len(0) + c.seq_lens[0] > 40

    axes = Axes(seq_len=(1, 64), prompt_len=(0, 64))
    got, _, complete = polish(Case(seed=3, seq_lens=(30,), prompt_lens=(20,)), fails, axes=axes)
    assert complete and got.seq_lens == (1,) and got.prompt_lens == (40,), got.one_line()
    # never past the axes' prompt lengths, and not for a pair without prompts
    got, _, _ = polish(Case(seed=3, seq_lens=(30,), prompt_lens=(20,)), fails, axes=Axes(seq_len=(1, 64),
                                                                                       prompt_len=(0, 24)))
    assert got.prompt_len(0) <= 24 and got.prompt_len(0) + got.seq_lens[0] == 41, got.one_line()
    got, _, _ = polish(Case(seed=3, seq_lens=(50,)), lambda c: c.seq_lens[0] > 40, axes=Axes(seq_len=(1, 64)))
    assert got.seq_lens == (41,) and not got.prompt_lens, got.one_line()


def test_polish_gives_response_tokens_to_the_prompt_of_a_sequence_that_is_not_the_longest():
    """The same bug in the second of two sequences, while the first stays the longest (the bug needs
    it whole): the second's response still goes to its prompt, down to the one token that fails."""
    from harness import Axes

    def fails(c):
        return c.batch_size == 2 and c.seq_lens[0] == 40 and c.prompt_len(1) + c.seq_lens[1] > 20

    axes = Axes(n_seqs=(2, 2), seq_len=(1, 64), prompt_len=(0, 64))
    got, _, complete = polish(Case(seed=3, seq_lens=(40, 12), prompt_lens=(0, 10)), fails, axes=axes)
    assert complete and got.seq_lens[1] == 1 and got.prompt_len(1) == 20, got.one_line()


def test_polish_keeps_two_scored_tokens_when_the_failing_one_needs_one_before_it():
    """A KV-cache bug past slot 48 whose failing token is read at the position before it: prompt +
    response must reach 49 and the response must keep two tokens (a one-token response is read at
    the last prompt position, before the bug). Giving one response token at a time to the prompt
    finds the two-token case; all-but-one and half alone stop at a longer response."""
    from harness import Axes

    def fails(c):
        return c.prompt_len(0) + c.seq_lens[0] >= 49 and c.seq_lens[0] >= 2

    axes = Axes(seq_len=(1, 64), prompt_len=(0, 64))
    got, _, complete = polish(Case(seed=3, seq_lens=(3,), prompt_lens=(46,)), fails, axes=axes)
    assert complete and got.seq_lens == (2,) and got.prompt_lens == (47,), got.one_line()
    assert all(not fails(n) for n in got.simpler_neighbours(axes))  # 1-minimal, moving a token to the prompt included
    assert Case(seed=3, seq_lens=(3,), prompt_lens=(46,)).replace(seq_lens=(2,), prompt_lens=(47,)) in \
        Case(seed=3, seq_lens=(3,), prompt_lens=(46,)).simpler_neighbours(axes)


def test_polish_shortens_equal_lengths_together_for_a_bug_that_needs_them_equal():
    """A prefix cache keyed by the prompt's length: two prompts of one length collide. Every one-prompt
    step makes the lengths differ (and passes), so shrinking stopped at the drawn lengths (4, 4);
    shortening every prompt of one length together reaches (1, 1). The same for responses."""
    from harness import Axes

    def fails(c):
        return c.batch_size == 2 and c.prompt_len(0) == c.prompt_len(1) >= 1

    axes = Axes(n_seqs=(1, 4), seq_len=(1, 16), prompt_len=(0, 16))
    got, _, complete = polish(Case(seed=3, seq_lens=(3, 2, 5), prompt_lens=(4, 4, 2)), fails, axes=axes)
    assert complete and got.prompt_lens == (1, 1) and got.seq_lens == (1, 1), got.one_line()
    assert all(not fails(n) for n in got.simpler_neighbours(axes))
    got, _, complete = polish(Case(seed=3, seq_lens=(6, 6)), lambda c: c.batch_size == 2 and c.seq_lens[0] ==
                              c.seq_lens[1] >= 2, axes=axes)
    assert complete and got.seq_lens == (2, 2), got.one_line()


def test_polish_clears_a_probe_and_stream_ids_the_failure_does_not_need():
    """A uniform case's `probe` and drawn stream ids are shown in its repro as if they were the trigger
    (a slot bug in the last of three sequences read `probe=2`): where the case fails without them, the
    repro has the plain ones (probe 0, streams 0..n-1); where it needs them, it keeps them."""
    got, _, complete = polish(Case(seed=1, seq_lens=(1, 1, 1), probe=2, seq_ids=(7, 8, 9)), lambda c: c.batch_size == 3)
    assert complete and got.probe == 0 and got.seq_ids == () and got.one_line() == "seed=1 seq_lens=[1, 1, 1]"
    got, _, _ = polish(Case(seed=1, seq_lens=(1, 1, 1), probe=2, seq_ids=(7, 8, 9)),
                       lambda c: c.batch_size == 3 and c.probe == 2 and 9 in c.ids)
    assert got.probe == 2 and 9 in got.ids


def test_a_bisected_knob_stops_where_the_failure_keeps_a_margin():
    """With `strong` (a campaign's: fails by `EDGE_MARGIN` over the line), halfway steps of a continuous
    knob are kept only while the case fails by that margin: the logit scale stops where the judged
    value is still 1.5x the line, not at 1.2x (nearer the edge, where another CPU's last bits may read
    it clean); the full move to the low bound is still kept at any margin."""
    from harness import Axes
    from harness.shrink import EDGE_MARGIN

    axes = Axes(logit_scale=(1.0, 16.0))
    judged = lambda c: 1e-3 * (c.logit_scale / 1.7) ** 2  # noqa: E731 - over the line above scale 1.7
    start = Case(seed=1, seq_lens=(1,), logit_scale=12.0)
    got, _, complete = polish(start, lambda c: judged(c) > 1e-3, axes=axes,
                              strong=lambda c: judged(c) >= EDGE_MARGIN * 1e-3)
    assert complete and judged(got) >= EDGE_MARGIN * 1e-3 and got.logit_scale < 4, got.logit_scale  # 12 -> 3.46
    edge, _, _ = polish(start, lambda c: judged(c) > 1e-3, axes=axes)
    assert 1e-3 < judged(edge) < EDGE_MARGIN * 1e-3 and edge.logit_scale < got.logit_scale  # without: 1.86, 1.2x
    got, _, _ = polish(start, lambda c: True, axes=axes, strong=lambda c: False)
    assert got.logit_scale == 1.0  # the full move to the low bound: kept whatever the margin


def test_a_knob_left_out_of_the_json_when_off_reads_as_its_neutral_value_in_a_change():
    """min-p and the penalties are left out of a case's JSON when off: the change to off reads
    'min_p 0.13 -> 0', not '-> None' (as `show`'s list of the neighbours shrinking tried printed it)."""
    from harness.shrink import describe_change

    c = Case(seed=1, seq_lens=(2,), min_p=0.13, repetition_penalty=1.2)
    assert describe_change(c, c.replace(min_p=0.0)) == "min_p 0.13 -> 0", describe_change(c, c.replace(min_p=0.0))
    assert describe_change(c, c.replace(repetition_penalty=1.0)) == "repetition_penalty 1.2 -> 1"
