import json

import pytest

from harness.case import Case, CaseError


def test_json_round_trip_is_exact():
    c = Case(seed=7, seq_lens=(3, 1, 5), probe=2, row_capacity=6, order=(2, 0, 1), pad_side="left",
             n_experts=6, top_k=3, tie_fraction=0.25, tie_gap=1.5e-7, logit_scale=3.25, dtype="float16",
             params={"shards": 4, "temperature": 0.7, "mode": "ring", "flag": True})
    text = json.dumps(c.to_json())
    back = Case.from_json(json.loads(text))
    assert back == c
    assert back.key() == c.key()
    assert c.to_json()["schema"] == 2


@pytest.mark.parametrize("field,value,words", [
    ("seq_lens", (), "at least one"),
    ("seq_lens", (2, 0), ">= 1"),
    ("probe", 3, "0 <= probe < 2"),
    ("row_capacity", 2, "longest sequence (5)"),
    ("order", (0, 0), "permutation"),
    ("pad_side", "middle", "one of"),
    ("top_k", 9, "top_k <= n_experts"),
    ("tie_fraction", 1.5, "[0, 1]"),
    ("tie_gap", -1e-3, "0 = exact tie"),
    ("logit_scale", 0.0, "> 0"),
    ("dtype", "int8", "one of"),
    ("seed", -1, "[0, 2**63)"),
])
def test_invalid_fields_name_the_field_and_rule(field, value, words):
    base = dict(seed=1, seq_lens=(5, 2), n_experts=8, top_k=2)
    base[field] = value
    with pytest.raises(CaseError) as err:
        Case(**base)
    msg = str(err.value)
    assert f"'{field}'" in msg and words in msg


def test_from_json_rejects_unknown_fields_wrong_schema_and_missing_seed():
    with pytest.raises(CaseError, match="unknown field"):
        Case.from_json({"seed": 1, "batch": 3})
    with pytest.raises(CaseError, match="schema 99"):
        Case.from_json({"schema": 99, "seed": 1})
    for not_a_schema in (2.0, True, "2"):  # the schema is a whole number: 2.0 or true is not one
        with pytest.raises(CaseError, match="schema"):
            Case.from_json({"schema": not_a_schema, "seed": 1})
    with pytest.raises(CaseError, match="'seed' is missing"):
        Case.from_json({"seq_lens": [1]})
    with pytest.raises(CaseError, match="must be a list"):
        Case.from_json({"seed": 1, "seq_lens": 4})
    with pytest.raises(CaseError, match="params.x"):
        Case.from_json({"seed": 1, "params": {"x": [1, 2]}})


def test_packed_rows_first_fit_in_packing_order():
    c = Case(seed=0, seq_lens=(3, 2, 4, 1), row_capacity=5, order=(2, 0, 1, 3))
    assert c.packed_rows() == [[2], [0, 1], [3]]
    assert Case(seed=0, seq_lens=(3, 2)).packed_rows() == [[0, 1]]  # default: one row


def test_generators_are_deterministic_and_independent_per_salt():
    import torch

    c = Case(seed=3)
    assert torch.equal(c.randn((4, 4), "a"), c.randn((4, 4), "a"))
    assert not torch.equal(c.randn((4, 4), "a"), c.randn((4, 4), "b"))
    assert not torch.equal(c.randn((4, 4), "a"), Case(seed=4).randn((4, 4), "a"))


def test_one_line_shows_only_non_default_fields():
    line = Case(seed=5, seq_lens=(2,), top_k=3, tie_gap=0.001).one_line()
    assert line == "seed=5 seq_lens=[2] top_k=3 tie_gap=0.001"


def test_smaller_neighbours_drop_one_row_or_one_token():
    c = Case(seed=1, seq_lens=(3, 1, 2), probe=2, order=(2, 0, 1), row_capacity=4)
    got = {(n.seq_lens, n.probe, n.order, n.row_capacity) for n in c.smaller_neighbours()}
    assert got == {
        ((1, 2), 1, (1, 0), 0), ((3, 2), 1, (1, 0), 4), ((3, 1), 0, (0, 1), 0),  # a row dropped
        ((2, 1, 2), 2, (2, 0, 1), 4), ((3, 1, 1), 2, (2, 0, 1), 4),  # a token dropped
    }
    assert Case(seed=1, seq_lens=(1,)).smaller_neighbours() == []


def test_schema1_repro_loads_upgraded_with_its_single_stream():
    import torch

    old = Case.from_json({"schema": 1, "seed": 5, "seq_lens": [2, 3], "pad_side": "left"})
    assert old.streams == "single" and old.to_json()["schema"] == 2
    assert Case.from_json(old.to_json()) == old  # rewritten as schema 2, still the same case
    assert torch.equal(old.token_randn(4, "x"), old.randn((5, 4), "x"))  # schema-1 tensors, bit-for-bit
    with pytest.raises(CaseError, match="unknown field"):
        Case.from_json({"schema": 1, "seed": 5, "temperature": 0.5})  # schema 1 had no sampling fields


def test_dropping_a_sequence_or_a_token_leaves_every_other_row_bit_identical():
    import torch

    c = Case(seed=3, seq_lens=(3, 5, 2), prompt_lens=(4, 0, 2))
    rows = c.token_randn(6, "h")
    assert torch.equal(c.drop_sequence(0).token_randn(6, "h"), rows[3:])
    assert torch.equal(c.drop_sequence(1).token_randn(6, "h"), torch.cat([rows[:3], rows[8:]]))
    shorter = c.replace(seq_lens=(3, 4, 2))
    assert torch.equal(shorter.token_randn(6, "h"), torch.cat([rows[:7], rows[8:]]))
    assert torch.equal(c.drop_sequence(0).prompt_tokens(1, 100), c.prompt_tokens(2, 100))
    assert torch.equal(c.replace(prompt_lens=(2, 0, 2)).prompt_tokens(0, 100), c.prompt_tokens(0, 100)[:2])
    u = c.token_uniforms("tokens")
    assert torch.equal(c.drop_sequence(1).token_uniforms("tokens"), torch.cat([u[:3], u[8:]]))


def test_rl_batch_fields_validate_and_pack_prompt_plus_response():
    c = Case(seed=1, seq_lens=(2, 3), prompt_lens=(4, 1), row_capacity=6)
    assert c.total_lens == (6, 4) and c.packed_rows() == [[0], [1]] and c.offsets == [0, 2]
    for field, value, words in [("prompt_lens", (1,), "one length per sequence"), ("temperature", 0.0, "> 0"),
                                ("top_p", 1.5, "(0, 1]"), ("sample_top_k", -1, ">= 0"), ("min_p", -0.1, "[0, 1]"),
                                ("min_p", 1.5, "[0, 1]"),
                                ("row_capacity", 5, "longest sequence (6) counting prompt + response"), ("streams", "x", "one of"),
                                ("seq_ids", (1, 2, 3), "one id per sequence")]:
        with pytest.raises(CaseError) as err:
            Case(**{**dict(seed=1, seq_lens=(2, 3), prompt_lens=(4, 1)), field: value})
        assert f"'{field}'" in str(err.value) and words in str(err.value)
        if field in ("prompt_lens", "seq_ids"):  # a hand edit of seq_lens alone: say what goes with it
            assert "edit seq_ids, prompt_lens and order with it" in str(err.value)


def test_simpler_neighbours_move_one_knob_to_neutral():
    c = Case(seed=1, seq_lens=(2,), temperature=0.5, top_p=0.9, sample_top_k=7, pad_side="left")
    knobs = {(n.temperature, n.top_p, n.sample_top_k, n.pad_side) for n in c.simpler_neighbours()}
    assert (1.0, 0.9, 7, "left") in knobs and (0.5, 1.0, 7, "left") in knobs
    assert (0.5, 0.9, 0, "left") in knobs and (0.5, 0.9, 7, "right") in knobs
    from harness import Axes

    # a pair that always left-pads, with temperature drawn from [0.5, 0.8]: neutral within its axes
    axes = Axes(pad_sides=("left",), temperature=(0.5, 0.8), top_p=(0.5, 1.0), sample_top_k=(0, 16))
    knobs = {(n.temperature, n.top_p, n.sample_top_k, n.pad_side) for n in c.simpler_neighbours(axes)}
    assert all(pad == "left" for *_, pad in knobs) and (0.8, 0.9, 7, "left") in knobs, knobs


def test_stream_draws_are_the_same_one_row_at_a_time_and_in_blocks():
    import torch

    c = Case(seed=9, seq_lens=(7, 3), prompt_lens=(5, 2))
    for width in (16, 64, (4, 16), 3, 17):
        rows = []
        for j, n in enumerate(c.seq_lens):
            g = c.seq_generator(j, "w")
            shape = (width,) if isinstance(width, int) else width
            rows.extend(torch.randn(*shape, generator=g) for _ in range(n))
        assert torch.equal(c.token_randn(width, "w"), torch.stack(rows)), width
    g = c.seq_generator(0, "prompt")
    assert torch.equal(c.prompt_tokens(0, 50), torch.cat([torch.randint(0, 50, (1,), generator=g) for _ in range(5)]))


def test_cases_hash_like_they_compare_params_included():
    a, b = Case(seed=1, params={"tie_layer": 1}), Case(seed=1, params={"tie_layer": 1})
    assert a == b and hash(a) == hash(b) and len({a, b, Case(seed=1, params={"tie_layer": 2})}) == 2
    c, d = Case(seed=0, temperature=1, params={"x": 1}), Case(seed=0, temperature=1.0, params={"x": 1.0})
    assert c == d and hash(c) == hash(d)  # equal as == says (1 == 1.0), so equal hashes


def test_one_line_brief_cuts_a_recordings_long_params_for_notes_and_keeps_them_otherwise():
    """A recorded sample's params hold thousands of numbers: the MLflow note's minimal case (and
    `show`) cut them, so the note stays under MLflow's 8000-character limit with its Replay section;
    the case itself, and its plain one-line form, keep them whole."""
    from harness.case import brief_value

    long = " ".join(f"{-0.001 * i:.6f}" for i in range(3000))
    c = Case(seed=1, seq_lens=(3,), params={"rec_logprobs": long, "tie_layer": "0"})
    assert long in c.one_line()
    short = c.one_line(brief=True)
    assert long not in short and len(short) < 300 and "(3000 items, " in short and "'tie_layer': '0'" in short
    assert brief_value(long).startswith("-0.000000 -0.001000 -0.002000 -0.003000 ... ")
    assert brief_value("short") == "short" and brief_value(7) == 7


def test_a_group_of_samples_shares_its_prompt_bit_for_bit_and_keeps_it_when_shrunk():
    """`prompt_ids`: the sequences of a group draw their prompt (tokens, whatever a path draws at the
    prompt's positions, its router-tie flags) from the stream of one id, their responses from their
    own; the group's prompt is what it would be as that sequence's own, so an ungrouped case draws
    exactly what it drew before groups existed."""
    import torch

    from harness import Axes

    c = Case(seed=3, seq_lens=(3, 5, 2), prompt_lens=(4, 4, 2), seq_ids=(7, 8, 9), prompt_ids=(7, 7, 9),
             tie_fraction=0.5)
    own = c.replace(prompt_ids=())
    assert c.groups == [[0, 1], [2]] and c.group_of(1) == [0, 1] and c.prompt_id(1) == 7
    assert torch.equal(c.prompt_tokens(1, 100), c.prompt_tokens(0, 100))
    assert torch.equal(c.prompt_tokens(0, 100), own.prompt_tokens(0, 100))  # the owner's: as without groups
    assert not torch.equal(own.prompt_tokens(1, 100), own.prompt_tokens(0, 100))
    assert torch.equal(c.prompt_generator(1, "x").get_state(), c.seq_generator(0, "x").get_state())
    f0, f1 = c.tie_forced(0, 20), c.tie_forced(1, 20)
    assert torch.equal(f0[:4], f1[:4]) and torch.equal(f1[4:], own.tie_forced(1, 20)[4:])  # prompt shared, rest own
    assert torch.equal(c.tie_forced(1, 20, prompt_positions=5)[:5], c.tie_forced(0, 20)[:5])  # (a first token too)
    assert torch.equal(c.token_randn(4, "h"), own.token_randn(4, "h"))  # responses: each sequence's own
    # dropping the group's first sequence keeps the other's prompt (its stream id), and one left alone
    assert torch.equal(c.drop_sequence(0).prompt_tokens(0, 100), c.prompt_tokens(1, 100))
    assert c.drop_sequence(2).prompt_ids == (7, 7) and c.drop_sequence(1).prompt_ids == ()
    # a shared prompt is shortened for the whole group; ungrouping is one simpler neighbour
    axes = Axes(prompt_len=(0, 16), prompt_group=(1, 4))
    near = c.simpler_neighbours(axes)
    assert c.replace(prompt_lens=(3, 3, 2)) in near and c.replace(prompt_ids=()) in near
    assert not any(n.prompt_lens[:2] in ((5, 4), (4, 5), (3, 4), (4, 3)) for n in near if n.prompt_lens)
    assert Case.from_json(json.loads(json.dumps(c.to_json()))) == c and "prompt_ids" not in own.to_json()
    with pytest.raises(CaseError, match="same prompt length"):
        c.replace(prompt_lens=(4, 3, 2))
    with pytest.raises(CaseError, match="one prompt id per sequence"):
        c.replace(prompt_ids=(7, 7))


def test_grouped_cases_are_drawn_only_where_the_axis_is_on_and_are_valid():
    import random

    from hypothesis import HealthCheck, given, settings

    from harness import Axes
    from harness.strategies import cases, uniform_cases

    axes = Axes(n_seqs=(1, 8), seq_len=(1, 8), prompt_len=(0, 6), prompt_group=(1, 4), packing=True)
    seen = []

    @settings(max_examples=150, database=None, suppress_health_check=list(HealthCheck))
    @given(cases(axes))
    def draw(c):
        seen.append(c)

    draw()
    grouped = [c for c in seen if c.prompt_ids]
    assert grouped and all(len({c.prompt_len(j) for j in g}) == 1 for c in grouped for g in c.groups)
    assert any(g != list(range(g[0], g[0] + len(g))) for c in grouped for g in c.groups)  # interleaved: A B A B
    rng = random.Random(0)
    assert any(uniform_cases(axes, rng).prompt_ids for _ in range(50))
    off = Axes(n_seqs=(1, 8), seq_len=(1, 8), prompt_len=(0, 6))
    assert not any(uniform_cases(off, rng).prompt_ids for _ in range(50))


def test_min_p_is_left_out_of_a_cases_json_when_off_so_older_keys_and_ids_stay():
    c = Case(seed=3, seq_lens=(2,), temperature=0.7)
    assert "min_p" not in c.to_json() and c.min_p == 0.0
    assert Case.from_json(c.to_json()) == c  # (a repro written before min-p existed reads as min-p off)
    m = c.replace(min_p=0.05)
    assert m.to_json()["min_p"] == 0.05 and m.key() != c.key() and Case.from_json(m.to_json()) == m
    assert c in {n for n in m.simpler_neighbours()}  # min-p off is one knob moved to neutral
