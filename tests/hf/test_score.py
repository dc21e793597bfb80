"""`harness score` end to end: rollouts recorded by the HF backend's own rollout, scored by a trainer.

- aligned: float32 rollouts scored by the float32 trainer: every sample under the line;
- misaligned: bf16-engine rollouts (router flips) scored by the float32 trainer: flagged, written
  as repros that replay / show / triage accept; with the recorded experts replayed: flips gone;
- a file with bad rows: each named by line and field, the rest scored;
- a checkpoint directory (--model PATH), JSONL and Parquet.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers", reason="harness score needs the HF backend: pip install -e '.[hf]'")

from harness import REGISTRY, Case  # noqa: E402
from harness.corpus import load_repro, replay  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from harness.score import BadRow, parse_sample, score  # noqa: E402
from targets.hf import FP32, HFModel, hf_pair  # noqa: E402
from targets.hf.backend import base_model  # noqa: E402
from targets.hf.configs import TINY  # noqa: E402
from targets.hf.paths import records  # noqa: E402


def record(pair_name_or_pair, seeds, path, **case_kw):
    """JSONL of the samples a pair's rollout produced over cases of 3 sequences."""
    pair = REGISTRY.get(pair_name_or_pair) if isinstance(pair_name_or_pair, str) else pair_name_or_pair
    rows = []
    for s in seeds:
        c = Case(seed=s, seq_lens=(12, 7, 16), prompt_lens=(5, 2, 8), **case_kw)
        inp = pair.build(c, "cpu")
        rows += records(inp, pair.rollout(inp))
    path.write_text("".join(json.dumps({"id": f"s{i}", **r}) + "\n" for i, r in enumerate(rows)))
    return rows


@pytest.fixture(scope="module")
def aligned_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rollouts") / "aligned.jsonl"
    record("hf.qwen3_moe.aligned", range(4), path)
    return path


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rollouts") / "bf16.jsonl"
    record("hf.qwen3_moe.bf16_rollout", range(8), path)
    return path


def test_aligned_rollouts_are_all_under_the_line(aligned_file, tmp_path):
    res = score(aligned_file, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "corpus", out_dir=tmp_path / "out",
                progress=False)
    assert len(res.scored) == 12 and not res.bad
    assert not res.flagged and not res.repros
    assert all(s.metrics["k3_kl"] < 1e-8 for s in res.scored)
    assert res.batch["k3_kl"] < 1e-8 and abs(res.batch["ppl_ratio"] - 1) < 1e-5
    assert res.batch["flip_rate"] == 0.0
    # token means (verl's weighting): a long sample weighs more; log_ppl_diff is a mean of sample means
    n = [s.metrics["n_tokens"] for s in res.scored]
    for key in ("k3_kl", "kl"):
        want = sum(s.metrics[key] * m for s, m in zip(res.scored, n)) / sum(n)
        assert res.batch[key] == pytest.approx(want, rel=1e-9, abs=1e-300), key
    assert len(set(n)) > 1  # (the weighting is tested only if the samples differ in length)
    assert res.batch["log_ppl_diff"] == pytest.approx(sum(s.metrics["log_ppl_diff"] for s in res.scored) / len(n),
                                                      rel=1e-9, abs=1e-300)
    for name in ("samples.csv", "summary.json", "k3_hist.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_bf16_rollouts_are_flagged_and_replay_removes_the_flips(bf16_file, tmp_path, harness_cli):
    corpus = tmp_path / "corpus"
    res = score(bf16_file, pair_name="hf.qwen3_moe.aligned", corpus=corpus, out_dir=tmp_path / "out",
                progress=False, max_repros=100)
    assert res.flagged, res.batch
    assert res.batch["k3_kl"] > 1e-3 and res.batch["flip_rate"] > 0
    # flagged = the mean k3 of the recorded tokens or the two-outcome KL over the line, and every
    # flagged sample gets a repro that fails as it did (none is dropped as "past the first 1024 tokens")
    over = [s for s in res.scored if s.metrics["k3_kl"] > 1e-3 or s.metrics["kl"] > 1e-3]
    assert {id(s) for s in res.flagged} == {id(s) for s in over}
    assert any(s.metrics["kl"] <= 1e-3 for s in res.flagged)  # flagged on k3 alone (the case that was dropped)
    assert len(res.repros) == len(res.flagged) and not res.notes, res.notes
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())  # written again once the repros exist
    assert summary["repros"] == [str(p) for p in res.repros]
    replayed = score(bf16_file, pair_name="hf.qwen3_moe.bf16_rollout.replay", corpus=tmp_path / "demo", progress=False,
                     max_repros=1)
    # scored with a demonstration pair (expected: diverges), a flagged sample is that pair's expected
    # divergence, not an open regression of an aligned pair
    assert replayed.repros and all(load_repro(p).status == "expected" for p in replayed.repros), replayed.repros
    assert replayed.batch["flip_rate"] == 0.0
    assert replayed.batch["k3_kl"] < res.batch["k3_kl"]

    # the worst sample's repro replays bit for bit and still diverges; triage names the trainer side
    path = res.repros[0]
    repro = load_repro(path)
    assert repro.found["recorded"]["file"] == str(bf16_file)
    assert path.stat().st_size < 64_000
    again = replay(repro)
    assert again.diverges and again.bit_for_bit, again.mismatches
    worst = res.flagged[0]
    assert math.isclose(again.evaluation.k3, worst.metrics["k3_kl"], rel_tol=0, abs_tol=0)

    from harness.triage import triage

    from harness.triage import write_report

    t = triage(repro)
    assert t.verdict and "did not evaluate" not in t.verdict
    if not (t.localization is not None and t.localization.explained):  # not "no torch modules": it is a recording
        assert "the rollout is a recording" in t.verdict and "exposes no torch modules" not in t.verdict, t.verdict
        assert "code-level difference" not in t.verdict, t.verdict
    report = write_report(t, tmp_path / "triage").read_text()
    assert "the recorded tokens' mean" in report  # no expectation over a recording's vocabulary
    if t.localization is not None and not t.localization.explained:  # swapping the trainer's numerics
        assert "Not explained by these components" in report and "Minimal set" not in report
    code, out, err = harness_cli("show", str(path))
    assert code == 0 and "hf.qwen3_moe.aligned" in out, err
    assert f"by `harness score`: sample {worst.sample.id} at line {worst.sample.line} of {bf16_file}" in out, out
    assert "case (the recorded sample):" in out and "campaign seed" not in out
    assert "fields a recorded sample does not use" in out and "at neutral values" not in out, out
    assert "here only its trainer ran: the rollout is the recording" in out  # (not the pair's own rollout path)
    assert "mean two-outcome KL" in out and "mean exact KL" not in out  # a recording's KL is a lower bound


def test_score_logs_a_campaign_run_with_the_batch_metrics(aligned_file, tmp_path):
    pytest.importorskip("mlflow", reason="tracking needs mlflow")
    from mlflow import MlflowClient

    from harness.tracking import make_tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = score(aligned_file, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", out_dir=tmp_path / "o",
                tracker=make_tracker(uri), progress=False)
    client = MlflowClient(tracking_uri=uri)
    [exp] = [e for e in client.search_experiments() if e.name != "Default"]
    [run] = client.search_runs([exp.experiment_id])
    assert run.data.metrics["score.k3_kl"] == pytest.approx(res.batch["k3_kl"], abs=1e-15)
    assert run.data.metrics["cases"] == 12
    assert run.info.run_name == f"score {aligned_file.name} with hf.qwen3_moe.aligned"  # not "campaign seed 0"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "score")} >= {"score/k3_hist.png"}
    assert run.info.status == "FINISHED"

    # a score that fails (no row scores) ends its campaign run too: KILLED, not RUNNING forever
    bad = tmp_path / "allbad.jsonl"
    bad.write_text('{"x": 1}\n')
    with pytest.raises(UsageError, match="could be scored"):
        score(bad, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", tracker=make_tracker(uri), progress=False)
    failed = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name.startswith("score allbad")]
    assert [r.info.status for r in failed] == ["KILLED"]


def test_bad_rows_are_named_by_line_and_field_and_the_rest_is_scored(aligned_file, tmp_path, harness_cli):
    good = aligned_file.read_text().splitlines()[:3]
    row = json.loads(good[0])
    bad = [
        json.dumps({k: v for k, v in row.items() if k != "rollout_logprobs"}),  # missing field
        json.dumps({**row, "rollout_logprobs": row["rollout_logprobs"][:-1]}),  # ragged
        json.dumps({**row, "rollout_logprobs": [float("nan")] + row["rollout_logprobs"][1:]}),  # non-finite
        json.dumps({**row, "response_ids": [999999] + row["response_ids"][1:]}),  # out of vocabulary
        "{not json",
        good[1][:40],  # a line cut short (a writer killed mid-line)
        json.dumps({**row, "rollout_logprobs": [-(10 ** 400)] + row["rollout_logprobs"][1:]}),  # no float holds it
        '{"rollout_logprobs": [-' + "1" * 5000 + "]}",  # more digits than Python's int reader takes
        "[" * 100000 + "]" * 100000,  # nested too deeply for the reader
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([good[0], *bad, *good[1:]]) + "\n")
    code, out, err = harness_cli("score", str(path), "--pair", "hf.qwen3_moe.aligned", "--no-tracking",
                                 "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "o"))
    assert code == 2, err  # every scored sample is under the line, but bad rows are bad input
    assert "scored 3 sample(s)" in out and "9 bad row(s)" in out and "9 bad row(s) were not scored" in err
    for line, fld in ((2, "rollout_logprobs"), (3, "rollout_logprobs"), (4, "rollout_logprobs"), (5, "response_ids"),
                      (6, "(line)"), (7, "(line)"), (8, "rollout_logprobs"), (9, "(line)"), (10, "(line)")):
        assert f"line {line}, field '{fld}'" in err, err
    assert "ragged" in err and "finite" in err and "vocabulary" in err and "missing" in err
    assert "line 7, field '(line)': not valid JSON" in err and "at column 41)" in err, err  # (where it was cut)
    assert "Traceback" not in err


def test_parse_sample_slime_layout_and_expert_shapes():
    s = parse_sample(1, {"tokens": [1, 2, 3, 4, 5], "response_length": 2, "rollout_log_probs": [-0.1, -0.2]}, 16,
                     None)
    assert s.prompt == [1, 2, 3] and s.response == [4, 5]
    row = {"prompt_ids": [1, 2], "response_ids": [3], "rollout_logprobs": [-0.5],
           "routed_experts": [[[0, 1]], [[1, 9]]]}
    got = parse_sample(7, row, 16, (8, 2, 1))
    assert isinstance(got, BadRow) and got.line == 7 and got.field == "routed_experts" and "9" in got.message
    got = parse_sample(8, {**row, "routed_experts": [[[0, 1]], [[3, 3]]]}, 16, (8, 2, 1))
    assert isinstance(got, BadRow) and "position 1, layer 0: expert ids [3, 3] repeat" in got.message
    got = parse_sample(9, {**row, "prompt_ids": [], "routed_experts": None}, 16, None)  # says why, and what to record
    assert isinstance(got, BadRow) and got.field == "prompt_ids" and "scored from the last prompt position" in got.message


def test_recorded_experts_the_trainer_disagrees_with_are_noted(aligned_file, tmp_path):
    """Log-probs that agree with experts recorded wrong (an engine's recording bug): scored clean, but
    named, since router replay would force those experts into the trainer."""
    rows = [json.loads(x) for x in aligned_file.read_text().splitlines()[:3]]
    assert rows[1].get("routed_experts"), "the backend's records carry the routed experts"
    n_experts = REGISTRY.get("hf.qwen3_moe.aligned").profiles.model.moe()[0]
    rows[1]["routed_experts"] = [[[(e + 1) % n_experts for e in layer] for layer in pos]
                                 for pos in rows[1]["routed_experts"]]  # every expert shifted by one
    path = tmp_path / "experts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = score(path, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", progress=False)
    assert not res.flagged
    [note] = [n for n in res.notes if n.startswith("recorded experts")]
    assert "1 sample(s)" in note and "line 2 " in note and "--replay" in note
    # every sample's experts offset, replayed: nats per token off, which named only the model (a trial's
    # --replay run); the note names the experts too
    for r in rows:
        r["routed_experts"] = [[[(e + 3) % n_experts for e in layer] for layer in pos] for pos in r["routed_experts"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = REGISTRY.get("hf.qwen3_moe.aligned").profiles.model.save_pretrained(tmp_path / "ckpt")
    res = score(path, model=str(ckpt.path), replay=True, corpus=tmp_path / "c", progress=False)
    [note] = [n for n in res.notes if "another model" in n]
    assert "Or the recorded experts: router replay forced them into the trainer" in note, note


def test_score_a_checkpoint_directory_jsonl_and_parquet(tmp_path, harness_cli):
    ckpt = tmp_path / "ckpt"
    base_model(HFModel.from_config(TINY["qwen3"], init_seed=5)).save_pretrained(ckpt)
    pair = hf_pair("test.ckpt.aligned", HFModel.from_pretrained(ckpt), FP32, FP32)
    rows = record(pair, range(2), tmp_path / "ckpt.jsonl")
    res = score(tmp_path / "ckpt.jsonl", model=str(ckpt), corpus=tmp_path / "c", progress=False)
    assert len(res.scored) == 6 and not res.flagged and res.batch["k3_kl"] < 1e-8
    code, _, err = harness_cli("score", str(tmp_path / "ckpt.jsonl"), "--model", str(ckpt), "--replay", "--no-tracking")
    assert code == 2 and err.count("has no experts (a dense model)") == 1 and "leave --replay out" in err, err
    pa = pytest.importorskip("pyarrow", reason="Parquet input needs pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ckpt.parquet")
    res = score(tmp_path / "ckpt.parquet", model=str(ckpt), corpus=tmp_path / "c", progress=False)
    assert len(res.scored) == 6 and not res.flagged
    # a file damaged in its middle row group: that group is a bad row, the others are scored
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "damaged.parquet", row_group_size=2, compression="none")
    meta = pq.ParquetFile(tmp_path / "damaged.parquet").metadata
    data = bytearray((tmp_path / "damaged.parquet").read_bytes())
    col = meta.row_group(1).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    data[start:start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    (tmp_path / "damaged.parquet").write_bytes(bytes(data))
    res = score(tmp_path / "damaged.parquet", model=str(ckpt), corpus=tmp_path / "c", progress=False)
    assert len(res.scored) == 4 and [(b.line, b.field) for b in res.bad] == [(3, "(row group)")], res.bad
    assert "rows 3 to 4" in res.bad[0].message
    code, _, err = harness_cli("score", str(tmp_path / "ckpt.jsonl"), "--model", str(tmp_path / "nowhere"),
                               "--no-tracking")
    assert code == 2 and "not a checkpoint directory" in err and "Traceback" not in err


def test_samples_of_another_model_are_named_as_such(tmp_path, harness_cli):
    """Samples scored against the wrong checkpoint: a gap of nats per token says so (not a precision
    finding); every id past the vocabulary says so too; a config.json given for its folder is named."""
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    base_model(HFModel.from_config(TINY["qwen3"], init_seed=5)).save_pretrained(ckpt)
    base_model(HFModel.from_config(TINY["qwen3"], init_seed=6)).save_pretrained(other)
    rows = record(hf_pair("test.wrong.aligned", HFModel.from_pretrained(ckpt), FP32, FP32), range(2),
                  tmp_path / "s.jsonl")
    own = score(tmp_path / "s.jsonl", model=str(ckpt), corpus=tmp_path / "c", progress=False)
    assert not any("another model" in n for n in own.notes), own.notes
    res = score(tmp_path / "s.jsonl", model=str(other), corpus=tmp_path / "c", progress=False)
    assert res.batch["log_ppl_diff"] < -2, res.batch
    assert any("another model" in n and "--model" in n for n in res.notes), res.notes
    # scored by a registered pair of another model: the note names that pair's model, not --model
    REGISTRY._pairs["test.wrong.other"] = hf_pair("test.wrong.other", HFModel.from_pretrained(other), FP32, FP32)
    try:
        res = score(tmp_path / "s.jsonl", pair_name="test.wrong.other", corpus=tmp_path / "c", progress=False)
    finally:
        REGISTRY._pairs.pop("test.wrong.other", None)
    assert any("check that the model of --pair test.wrong.other is the policy" in n for n in res.notes), res.notes
    vocab = TINY["qwen3"]["vocab_size"]
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({**r, "response_ids": [vocab + i for i in r["response_ids"]]})
                                                + "\n" for r in rows * 2))
    code, _, err = harness_cli("score", str(tmp_path / "big.jsonl"), "--model", str(ckpt), "--no-tracking")
    assert code == 2 and "another model" in err and f"and {len(rows) * 2 - 5} more bad row(s)" in err, err
    code, _, err = harness_cli("score", str(tmp_path / "s.jsonl"), "--model", str(ckpt / "config.json"),
                               "--no-tracking")
    assert code == 2 and "pass its folder" in err and "Traceback" not in err, err


def test_a_repro_names_its_checkpoint_by_weights_and_replay_says_when_they_changed_or_went(tmp_path, harness_cli):
    """RL runs overwrite checkpoints: a repro replayed against other weights says so; against a
    folder that is gone it cannot be evaluated (exit 2), it does not 'still diverge'."""
    import shutil

    from targets.hf import BF16

    ckpt = tmp_path / "ckpt"
    base_model(HFModel.from_config(TINY["qwen3_moe"], init_seed=5)).save_pretrained(ckpt)
    engine = hf_pair("test.ckpt.bf16", HFModel.from_pretrained(ckpt), FP32, BF16)
    record(engine, range(8), tmp_path / "bf16.jsonl")
    res = score(tmp_path / "bf16.jsonl", model=str(ckpt), corpus=tmp_path / "c", progress=False)
    assert res.repros, "a bf16 engine's log-probs are flagged"
    repro = res.repros[0]
    assert load_repro(repro).case.params["rec_model_id"] == HFModel.from_pretrained(ckpt).fingerprint()
    code, _, err = harness_cli("replay", str(repro))
    assert code == 1 and "not the one these recordings were scored with" not in err, err
    shutil.rmtree(ckpt)
    base_model(HFModel.from_config(TINY["qwen3_moe"], init_seed=6)).save_pretrained(ckpt)  # overwritten in place
    code, out, err = harness_cli("replay", str(repro))
    assert f"the checkpoint at {ckpt.resolve()} is not the one these recordings were scored with" in err, err
    shutil.rmtree(ckpt)
    code, _, err = harness_cli("replay", "--no-bisect", str(repro))
    assert code == 2 and "could not run: UsageError" in err and "not a checkpoint directory" in err, err


def test_replay_on_a_file_without_experts_says_nothing_was_replayed(aligned_file, tmp_path):
    rows = [json.loads(x) for x in aligned_file.read_text().splitlines()[:2]]
    path = tmp_path / "no_experts.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "routed_experts"}) + "\n" for r in rows))
    res = score(path, pair_name="hf.qwen3_moe.bf16_rollout.replay", replay=True, corpus=tmp_path / "c",
                progress=False)
    assert len(res.scored) == 2 and any("nothing was replayed" in n for n in res.notes), res.notes
    assert math.isnan(res.batch["flip_rate"])  # no recorded experts: no flip rate (not 0)


def test_without_recorded_experts_the_cli_says_flip_rate_n_a(aligned_file, tmp_path,
                                                              harness_cli):
    rows = [json.loads(x) for x in aligned_file.read_text().splitlines()[:2]]
    path = tmp_path / "no_experts.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "routed_experts"}) + "\n" for r in rows))
    code, out, err = harness_cli("score", str(path), "--pair", "hf.qwen3_moe.aligned", "--no-tracking", "--corpus",
                                 str(tmp_path / "c"), cwd=tmp_path)
    assert code == 0 and "flip_rate n/a (no experts recorded)" in out, (out, err)
    [folder] = (tmp_path / "reports" / "score").glob("no_experts.jsonl-*")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["batch"]["flip_rate"] == "nan"  # (strict JSON)
    # the same file scored with other sampling: a folder of its own, the first one kept
    code, out, err = harness_cli("score", str(path), "--pair", "hf.qwen3_moe.aligned", "--no-tracking", "--corpus",
                                 str(tmp_path / "c"), "--temperature", "0.9", cwd=tmp_path)
    assert len(list((tmp_path / "reports" / "score").glob("no_experts.jsonl-*"))) == 2 and folder.exists()


def test_a_recorded_log_prob_of_zero_probability_is_blamed_on_the_recording(aligned_file, tmp_path, harness_cli):
    """k3 = inf where the *recording* gives its own sampled token probability 0 (-1e30: a fill value,
    or an engine reporting another distribution than it samples): the line says so, not that the
    trainer cuts tokens the engine kept (the other way round)."""
    rows = [json.loads(x) for x in aligned_file.read_text().splitlines()[:2]]
    rows[1]["rollout_logprobs"] = [-1e30] + rows[1]["rollout_logprobs"][1:]
    # -inf itself (JSON's -Infinity, what an engine that reports log 0 writes): judged, not a bad row
    rows[0]["rollout_logprobs"] = rows[0]["rollout_logprobs"][:2] + [float("-inf")] + rows[0]["rollout_logprobs"][3:]
    path = tmp_path / "zero.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "routed_experts"}) + "\n" for r in rows))
    code, out, err = harness_cli("score", str(path), "--pair", "hf.qwen3_moe.aligned", "--no-tracking", "--corpus",
                                 str(tmp_path / "c"), "--max-repros", "0", cwd=tmp_path)
    assert code == 1, (out, err)
    [line] = [x for x in out.splitlines() if x.strip().startswith("line 2 ")]
    assert "the recording gives a token the engine sampled log-probability -1e+30" in line, line
    assert "trainer gives probability 0" not in line, line
    [line] = [x for x in out.splitlines() if x.strip().startswith("line 1 ")]
    assert "the recording gives a token the engine sampled log-probability -inf" in line, line
    assert "bad row" not in out + err, out + err


def test_a_long_recorded_sample_fits_a_repro_and_outputs_survive_a_repro_that_fails(bf16_file, tmp_path, monkeypatch):
    # 1000 recorded tokens: ~25 characters of log-prob each, far above the old 1024-character limit
    import random

    import harness.score as sc
    from harness.corpus import check_case_size
    from harness.score import Sample, sample_case

    rng = random.Random(0)
    s = Sample(line=1, id="long", prompt=[1, 2, 3], response=[rng.randrange(100) for _ in range(1000)],
               logprobs=[-rng.random() * 5 for _ in range(1000)])
    case, cut = sample_case(s, {}, {}, sc.MAX_REPRO_TOKENS)
    assert not cut
    check_case_size(case, "a 1000-token recorded sample")  # refused before: params.rec_logprobs too long

    def broken(*a, **kw):
        raise sc.UsageError("the corpus is read-only")

    monkeypatch.setattr(sc, "write_repro", broken)
    res = score(bf16_file, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", out_dir=tmp_path / "o",
                progress=False)
    assert res.flagged and not res.repros and any("could not be written" in n for n in res.notes)
    assert res.unsaved == min(3, len(res.flagged))  # (the command exits 3 on it, as fuzz does)
    assert (tmp_path / "o" / "samples.csv").stat().st_size > 0  # what was scored is kept


def test_a_divergence_past_the_tokens_a_repro_carries_gets_a_repro_of_its_worst_token(aligned_file, tmp_path,
                                                                                        monkeypatch):
    """Flagged by a token past MAX_REPRO_TOKENS: the cut response passes, so the repro scores the
    worst token alone with the response before it moved into the prompt (no repro was written)."""
    import harness.score as sc

    row = json.loads(aligned_file.read_text().splitlines()[0])
    lps = row["rollout_logprobs"]
    row["rollout_logprobs"] = lps[:-2] + [lps[-2] - 4.0, lps[-1]]  # the engine's second-to-last token is off
    path = tmp_path / "late.jsonl"
    path.write_text(json.dumps({k: v for k, v in row.items() if k != "routed_experts"}) + "\n")
    n_prompt, n_resp = len(row["prompt_ids"]), len(row["response_ids"])
    monkeypatch.setattr(sc, "MAX_REPRO_TOKENS", n_prompt + 4)  # a cut keeps 4 response tokens, all clean
    res = score(path, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", out_dir=tmp_path / "o", progress=False)
    assert res.flagged and len(res.repros) == 1, res.notes
    assert any(f"worst token (response token {n_resp - 2})" in n for n in res.notes), res.notes
    repro = load_repro(res.repros[0])
    assert repro.case.seq_lens == (1,) and repro.case.prompt_lens == (n_prompt + n_resp - 2,)
    assert repro.found["recorded"]["scored_from"] == n_resp - 2
    again = replay(repro)
    assert again.diverges and again.bit_for_bit, again.mismatches
    assert again.evaluation.k3 > res.flagged[0].metrics["k3_kl"]  # (one token: the mean of the bad one alone)


def test_repeated_ids_are_noted_and_a_zero_probability_token_keeps_the_summary_strict_json(aligned_file, tmp_path):
    rows = [json.loads(x) for x in aligned_file.read_text().splitlines()[:2]]
    zero = {**rows[1], "id": "z", "rollout_logprobs": [-1e30] + rows[1]["rollout_logprobs"][1:]}  # p = 0 recorded
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (rows[0], rows[0], zero)))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (numpy's overflow warnings must not leak out)
        res = score(path, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", out_dir=tmp_path / "o",
                    progress=False, max_repros=0)
    [note] = [n for n in res.notes if n.startswith("sample ids repeated")]
    assert f"{rows[0]['id']!r} at lines 1, 2" in note
    assert res.batch["k3_kl"] == math.inf and [s.sample.id for s in res.flagged] == ["z"]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert summary["batch"]["k3_kl"] == "inf" and summary["flagged"][0]["k3_kl"] == "inf"


def test_recorded_experts_that_differ_only_at_prompt_positions_count_as_flips(aligned_file, tmp_path):
    """Experts are recorded for the prompt too: a recording wrong there (the response's own positions
    right) is a routing difference router replay would force into the trainer, so it counts."""
    rows = [json.loads(x) for x in aligned_file.read_text().splitlines()[:3]]
    n_experts = REGISTRY.get("hf.qwen3_moe.aligned").profiles.model.moe()[0]
    n_prompt = len(rows[1]["prompt_ids"])
    assert n_prompt >= 3
    rows[1]["routed_experts"] = [[[(e + 1) % n_experts for e in layer] for layer in pos] if i < n_prompt - 1 else pos
                                 for i, pos in enumerate(rows[1]["routed_experts"])]  # prompt positions only
    path = tmp_path / "prompt_experts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = score(path, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", progress=False)
    flips = {s.sample.line: s.metrics["flip_rate"] for s in res.scored}
    assert flips[2] > 0.1 and flips[1] == 0.0 and flips[3] == 0.0, flips
    assert res.batch["flip_rate"] > 0 and any(n.startswith("recorded experts") for n in res.notes)
    # the batch's rate is over every routed position, as each sample's (not weighted by response tokens)
    layers = [v for s in res.scored for v in s.evaluation.divergence.flips_per_layer.values()]
    want = sum(v["flips"] for v in layers) / sum(v["tokens"] for v in layers)  # (exact ties: tie_flip_rate)
    assert res.batch["flip_rate"] == pytest.approx(want, rel=1e-12)
    assert res.batch["tie_flip_rate"] == pytest.approx(
        sum(v["tie_flips"] for v in layers) / sum(v["tokens"] for v in layers), rel=1e-12)
    routed = {s.sample.line: sum(v["tokens"] for v in s.evaluation.divergence.flips_per_layer.values())
              for s in res.scored}
    assert res.batch["flip_rate"] == pytest.approx(flips[2] * routed[2] / sum(routed.values()), rel=1e-12)


def test_a_sample_longer_than_the_models_positions_is_a_bad_row(aligned_file, tmp_path, monkeypatch):
    """Positions past max_position_embeddings are ones the model was never built for: such a sample is
    a bad row (line, field, why, how to fix), not scored."""
    import targets.hf.backend as backend

    fields = backend.HFModel.fields
    monkeypatch.setattr(backend.HFModel, "fields", lambda self: {**fields(self), "max_position_embeddings": 16})
    rows = [json.loads(x) for x in aligned_file.read_text().splitlines()[:3]]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = score(path, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", progress=False, max_repros=0)
    n = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    long = [i + 1 for i, k in enumerate(n) if k > 16]
    assert long and len(long) < len(rows), n  # (some rows too long, some not)
    assert [b.line for b in res.bad] == long and {b.field for b in res.bad} == {"response_ids"}, res.bad
    assert all("longer than the model's max_position_embeddings (16)" in b.message and "cut the response" in b.message
               and "drop the sample" in b.message for b in res.bad), res.bad
    assert sorted(s.sample.line for s in res.scored) == [i + 1 for i, k in enumerate(n) if k <= 16]
    assert not any("max_position_embeddings" in x for x in res.notes)


def test_parse_sample_checks_positions_and_rope_scaling_extends_them():
    from harness.score import position_limit

    row = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "rollout_logprobs": [-0.1, -0.2]}
    four = position_limit({"max_position_embeddings": 4})
    got = parse_sample(4, row, 16, None, four)
    assert isinstance(got, BadRow) and (got.line, got.field) == (4, "response_ids"), got
    assert "3 prompt + 2 response = 5 tokens, longer than the model's max_position_embeddings (4)" in got.message
    assert "to its first 1 token(s)" in got.message, got.message
    assert not isinstance(parse_sample(4, row, 16, None, position_limit({"max_position_embeddings": 5})), BadRow)
    got = parse_sample(5, {**row, "prompt_ids": [1, 2, 3, 4]}, 16, None, four)
    assert isinstance(got, BadRow) and got.field == "prompt_ids" and "the prompt alone" in got.message, got
    # RoPE scaling (vLLM's rule): yarn scales the original table, linear / dynamic the table itself
    assert position_limit({"max_position_embeddings": 512})[0] == 512 and position_limit({}) is None
    assert position_limit({"n_positions": 1024}) == (1024, "n_positions (1024)")  # (GPT-2-style configs)
    assert position_limit({"max_position_embeddings": 40960, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})[0] == 131072
    assert position_limit({"max_position_embeddings": 100, "rope_parameters": {"type": "linear", "factor": 2}}) \
        == (200, "positions (200: 100 x its linear RoPE scaling factor 2)")
    assert position_limit({"max_position_embeddings": 100, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 1e4}})[0] == 100
    assert position_limit({"max_position_embeddings": 8192, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}})[0] == 8192


def _no_experts(aligned_file, n):
    return [{k: v for k, v in json.loads(x).items() if k != "routed_experts"}
            for x in aligned_file.read_text().splitlines()[:n]]


def test_a_checkpoint_folder_without_weights_is_one_usage_error(aligned_file, tmp_path, harness_cli):
    """config.json and no weight file: one error up front naming the folder and the fix, exit 2,
    nothing scored (not the same OSError once per line)."""
    ckpt = tmp_path / "ckpt"
    base_model(HFModel.from_config(TINY["qwen3"], init_seed=5)).save_pretrained(ckpt)
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _no_experts(aligned_file, 4)))
    weights = ckpt / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(b"\0" * 64)  # damaged weights: the trainer cannot be built, said once
    with pytest.raises(UsageError) as e:
        score(path, model=str(ckpt), corpus=tmp_path / "c", out_dir=tmp_path / "o1", progress=False)
    assert str(e.value).count("cannot be built") == 1 and "line 2" not in str(e.value), e.value
    assert not (tmp_path / "o1" / "samples.csv").exists()
    weights.unlink()
    code, out, err = harness_cli("score", str(path), "--model", str(ckpt), "--no-tracking", "--corpus",
                                 str(tmp_path / "c"), "--out", str(tmp_path / "o"))
    assert code == 2 and "Traceback" not in err and "bad row" not in err, err
    assert err.count(f"the checkpoint folder {str(ckpt.resolve())!r} has a config.json but no weights") == 1, err
    assert "save_pretrained" in err and "scored" not in out and not (tmp_path / "o" / "samples.csv").exists()
    weights.write_bytes(good)  # (the check reads the folder as it is now)
    assert len(score(path, model=str(ckpt), corpus=tmp_path / "c", progress=False).scored) == 4


def test_rows_of_a_padded_verl_batch_are_scored_with_one_warning(aligned_file, tmp_path):
    """verl pads responses on the right (ids: pad, log-probs: 0.0 from its agent loop, -1 from its
    vLLM rollout) and prompts on the left: rows not unpadded are named once, with how to unpad."""
    from harness.score import padding_hint

    rows = _no_experts(aligned_file, 5)
    pad = 0
    rows[1] = {**rows[1], "response_ids": rows[1]["response_ids"] + [pad] * 5,
               "rollout_logprobs": rows[1]["rollout_logprobs"] + [0.0] * 5}
    rows[2] = {**rows[2], "prompt_ids": [pad] * 4 + rows[2]["prompt_ids"],
               "response_ids": rows[2]["response_ids"] + [pad] * 3,
               "rollout_logprobs": rows[2]["rollout_logprobs"] + [-1.0] * 3}
    rows[3] = {**rows[3], "prompt_ids": [pad] * 4 + rows[3]["prompt_ids"]}  # a left-padded prompt, no right pad
    # legitimate data: a repeated last token with real log-probs; one certain token (log-prob 0.0)
    rows[4] = {**rows[4], "response_ids": rows[4]["response_ids"] + [7, 7, 9],
               "rollout_logprobs": rows[4]["rollout_logprobs"] + [-0.3, -0.2, 0.0]}
    rows[0] = {**rows[0], "response_ids": rows[0]["response_ids"] + [5, 5],
               "rollout_logprobs": rows[0]["rollout_logprobs"] + [-0.0, -0.5]}
    path = tmp_path / "padded.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = score(path, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", progress=False, max_repros=0)
    assert len(res.scored) == 5 and not res.bad  # scored anyway: a warning, not a bad row
    [note] = [n for n in res.notes if "not unpadded" in n]
    assert note.startswith("warning: 3 line(s) look like rows of a verl batch that was not unpadded"), note
    assert "line 2: the response ends with 5 copies of token 0 recorded at log-prob 0.0" in note, note
    assert "line 3: the prompt starts with 4 copies of token 0" in note and "line 4: the prompt" in note, note
    assert "line 1" not in note and "line 5" not in note and "response_mask" in note, note
    # the rule on its own: a run of >= 2 identical trailing ids, every log-prob exactly 0.0 (or -1.0)
    assert padding_hint([1], [4, 3, 3], [-0.1, 0.0, 0.0], set()) is not None
    assert padding_hint([1], [4, 3, 3], [-0.1, -0.1, 0.0], set()) is None
    assert padding_hint([1], [4, 3], [-0.1, 0.0], set()) is None  # (one token: a certain last token)
    assert padding_hint([0, 0, 1], [4], [-0.1], {0}) is not None and padding_hint([0, 0, 1], [4], [-0.1], set()) is None


def test_a_confident_repeat_the_trainer_agrees_with_is_not_called_padding():
    """A confident model repeating a token, recorded at log-prob 0.0 (a bf16 engine rounds it there),
    was warned about as verl padding "which makes the metrics meaningless" on a clean, genuine file.
    Padding is a token the trainer gives a low probability; a run it finds near certain is not."""
    from types import SimpleNamespace

    import numpy as np

    from harness.score import _response_pad, _trainer_agrees

    def scored(response, lt):
        return SimpleNamespace(sample=SimpleNamespace(response=response), evaluation=SimpleNamespace(
            divergence=SimpleNamespace(per_token={"logp_trainer": np.asarray(lt, dtype=np.float64)})))

    response, recorded = [4, 23, 23, 23], [-0.7, 0.0, 0.0, 0.0]
    run = _response_pad(response, recorded)
    assert run == (23, 3, 0.0)
    assert _trainer_agrees(scored(response, [-0.7, -1e-6, -2e-7, -1e-7]), run)  # the model's own repeat
    assert not _trainer_agrees(scored(response, [-0.7, -9.1, -8.7, -9.4]), run)  # pad ids the trainer finds unlikely
    assert not _trainer_agrees(scored(response, [-1e-6, -1e-6]), run)  # (a response cut short: not known)
    assert not _trainer_agrees(scored(response, [-0.7, 0.0, 0.0, 0.0]), (23, 3, -1.0))  # verl's -1 fill: always padding


def test_progress_outside_a_terminal_is_a_plain_line_now_and_then(aligned_file, tmp_path, monkeypatch):
    """A job's log (stderr not a TTY) gets a plain progress line every PROGRESS_EVERY seconds; the
    clock is not asserted on: the interval is set to 0, so every row prints one."""
    import harness.score as sc

    monkeypatch.setattr(sc, "PROGRESS_EVERY", 0.0)
    monkeypatch.setattr(sc, "_interactive", lambda: False)
    lines = []
    res = score(aligned_file, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", progress=True,
                log=lines.append)
    assert len(res.scored) == 12
    shown = [x for x in lines if x.startswith(f"scoring {aligned_file.name}: ")]
    assert len(shown) == 12 and "12/12 rows (100%), 12 scored, 0 bad" in shown[-1], lines
    lines.clear()
    monkeypatch.setattr(sc, "PROGRESS_EVERY", 1e9)  # a short file under the interval: not a line
    score(aligned_file, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", progress=True, log=lines.append)
    assert not [x for x in lines if x.startswith("scoring ")], lines


def test_samples_csv_gives_both_flip_rates_or_neither(aligned_file, tmp_path):
    import csv

    rows = [json.loads(x) for x in aligned_file.read_text().splitlines()[:2]]
    rows[1] = {k: v for k, v in rows[1].items() if k != "routed_experts"}
    path = tmp_path / "mixed_experts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    score(path, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", out_dir=tmp_path / "o", progress=False)
    with (tmp_path / "o" / "samples.csv").open() as fh:
        got = {int(r["line"]): (r["flip_rate"], r["tie_flip_rate"]) for r in csv.DictReader(fh)}
    assert got[2] == ("", ""), got  # no experts recorded: neither rate (the console's n/a)
    assert all(math.isfinite(float(v)) for v in got[1]), got


def test_show_shortens_long_recorded_params_and_the_file_keeps_them(bf16_file, tmp_path):
    from click.testing import CliRunner

    from harness.cli import cli

    res = score(bf16_file, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", progress=False, max_repros=1)
    [path] = res.repros
    before = path.read_text()
    params = load_repro(path).case.params
    lps = params["rec_logprobs"].split()
    assert len(lps) > 8
    got = CliRunner().invoke(cli, ["show", str(path)])
    assert got.exit_code == 0, got.output
    assert params["rec_logprobs"] not in got.output and lps[-1] in got.output and lps[0] in got.output
    assert f"({len(lps)} items, {len(params['rec_logprobs'])} characters in the file)" in got.output, got.output
    assert len(max(got.output.splitlines(), key=len)) < 2000
    assert path.read_text() == before


def test_an_interrupt_writes_what_was_scored_then_goes_on(aligned_file, tmp_path, monkeypatch):
    """Ctrl-C (and SIGTERM, which the command turns into one) after two samples: samples.csv and
    summary.json hold those two, then the interrupt goes on (the command exits 130)."""
    import harness.execute as ex

    real, calls = ex.run_case, []

    def interrupted_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ex, "run_case", interrupted_third)  # (score imports it from there at each call)
    with pytest.raises(KeyboardInterrupt):
        score(aligned_file, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", out_dir=tmp_path / "o",
              progress=False)
    rows = (tmp_path / "o" / "samples.csv").read_text().splitlines()
    assert len(rows) == 1 + 2, rows
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert any(n.startswith("interrupted after 2 scored sample(s)") for n in summary["notes"]), summary["notes"]


def test_a_token_far_off_in_a_long_sample_under_the_line_is_named(tmp_path):
    """One token 0.8 nat off among 500 leaves the sample's mean k3 under the line (the verdict), but a
    rollout-correction mask at ratio 2 would act on it: a note names the sample, the token and how far."""
    path = tmp_path / "long.jsonl"
    pair = REGISTRY.get("hf.qwen3_moe.aligned")
    inp = pair.build(Case(seed=5, seq_lens=(500,), prompt_lens=(4,)), "cpu")
    [row] = records(inp, pair.rollout(inp))
    lps = list(row["rollout_logprobs"])
    lps[321] -= 0.8
    path.write_text(json.dumps({"id": "long", **{k: v for k, v in row.items() if k != "routed_experts"},
                                "rollout_logprobs": lps}) + "\n")
    res = score(path, pair_name="hf.qwen3_moe.aligned", corpus=tmp_path / "c", out_dir=tmp_path / "o", progress=False)
    assert not res.flagged and res.scored[0].metrics["k3_kl"] < 1e-3, res.scored[0].metrics["k3_kl"]
    [note] = [n for n in res.notes if "outside [1/2, 2]" in n]
    assert "line 1: 1 token(s), the largest difference 0.8 at response token 321" in note, note


def test_replay_on_a_pair_that_does_not_replay_names_what_does(aligned_file, tmp_path, harness_cli):
    code, _, err = harness_cli("score", str(aligned_file), "--pair", "hf.qwen3_moe.aligned", "--replay",
                               "--no-tracking", "--out", str(tmp_path / "o"))
    assert code == 2 and "does not replay routing" in err, err
    assert "hf_pair(name, model, ..., replay=True)" in err and "--model CHECKPOINT --replay" in err, err
    assert "use its `.replay` variant" not in err  # (hf.qwen3_moe.aligned has none)
    code, _, err = harness_cli("score", str(aligned_file), "--pair", "hf.qwen3_moe.bf16_rollout", "--replay",
                               "--no-tracking", "--out", str(tmp_path / "o2"))
    assert code == 2 and "score with its replay variant, --pair hf.qwen3_moe.bf16_rollout.replay" in err, err


def test_recorded_experts_of_a_model_with_a_dense_first_layer_and_a_config_missing_top_k(tmp_path):
    """A trial's DeepSeek-V3 (first_k_dense_replace=1): a recording with one entry per MoE layer was
    refused ('must hold 2 layer(s)'), and one with a placeholder [0, 0] for the dense layer too
    ('expert ids repeat'); an OLMoE config.json without num_experts_per_tok was read as top-2 (the
    model routes transformers' default, 8) and every recorded row refused."""
    from targets.hf import default_axes
    from tests.hf.test_hf_backend import small_moe

    cfg = {**small_moe("deepseek_v3"), "num_hidden_layers": 2, "first_k_dense_replace": 1}
    pair = hf_pair("test.dsv3.aligned", HFModel.from_config(cfg, init_seed=2), FP32, FP32)
    n_experts, top_k, layers = pair.profiles.model.moe()
    assert (n_experts, top_k, layers) == (8, 2, 2)
    rows = record(pair, range(1), tmp_path / "per_moe_layer.jsonl")
    assert all(len(pos) == 1 for pos in rows[0]["routed_experts"])  # the backend records its one router
    ckpt = pair.profiles.model.save_pretrained(tmp_path / "ckpt")
    for name, rws in (("per_moe_layer", rows),
                      ("per_decoder_layer", [{**r, "routed_experts": [[[0, 0], *pos] for pos in r["routed_experts"]]}
                                             for r in rows])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rws))
        res = score(path, model=str(ckpt.path), replay=True, corpus=tmp_path / "c", progress=False)
        assert not res.bad and len(res.scored) == 3 and not res.flagged, (name, res.bad)
        assert all(s.sample.expert_layers == (1,) for s in res.scored)
        assert max(s.metrics["flip_rate"] for s in res.scored) == 0.0, name  # the trainer replayed layer 1's own
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "routed_experts": [pos * 3 for pos in rows[0]["routed_experts"]]}) + "\n")
    with pytest.raises(UsageError, match=r"one entry per MoE layer \(1: layers 1; its decoder layers 0 are dense\)"):
        score(bad, model=str(ckpt.path), corpus=tmp_path / "c", progress=False)
    olmoe = {k: v for k, v in small_moe("olmoe").items() if k != "num_experts_per_tok"}
    import transformers

    default_k = transformers.AutoConfig.for_model("olmoe").num_experts_per_tok
    assert HFModel.from_config({**olmoe, "num_experts": 16}).moe() == (16, default_k, 1)
    with pytest.raises(UsageError, match="num_experts_per_tok=8 of its 8"):
        default_axes(HFModel.from_config({**olmoe, "num_experts": default_k}))


def test_a_temperature_left_out_is_suggested(tmp_path, harness_cli):
    """A trial sampled at T 0.7 and scored without --temperature (k3 0.2): neither score nor triage
    suggested the sampling settings."""
    record("hf.qwen3.aligned", range(2), tmp_path / "t07.jsonl", temperature=0.7)
    res = score(tmp_path / "t07.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False)
    [note] = [n for n in res.notes if n.startswith("sampling:")]
    assert "pass them (--temperature, --top-p, --top-k, --min-p)" in note, note
    code, out, err = harness_cli("show", str(res.repros[0]))  # a dense model's recording: no experts
    assert code == 0 and "flip_rate          n/a (no experts recorded" in out, out + err
    # a recording's prompt is used as recorded: no first token before it, so none is counted in its positions
    assert "the pair puts before each prompt" not in out, out
    from harness import REGISTRY
    from harness.pairs import lead_of

    repro = load_repro(res.repros[0])
    assert lead_of(REGISTRY.get("hf.qwen3.aligned"), repro.case) == 0
    assert lead_of(REGISTRY.get("hf.qwen3.aligned"), repro.case.replace(params={})) == 1
    res = score(tmp_path / "t07.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
                sampling={"temperature": 0.7})
    assert not res.flagged and not any(n.startswith("sampling:") for n in res.notes), res.notes


def test_a_min_p_recording_scores_clean_with_its_min_p_and_not_without(tmp_path, harness_cli):
    """A rollout sampled with min-p 0.1 (at T 0.8) reports log-probabilities renormalised over what min-p
    kept: scored at its settings it is aligned; scored without --min-p its tokens' mass is off by
    the cut mass on every row, and the sampling note names --min-p."""
    record("hf.qwen3.aligned", range(2), tmp_path / "m.jsonl", temperature=0.8, min_p=0.1)
    ok = score(tmp_path / "m.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
               sampling={"temperature": 0.8, "min_p": 0.1})
    assert not ok.flagged, [sc.metrics for sc in ok.scored]
    off = score(tmp_path / "m.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
                sampling={"temperature": 0.8})
    assert off.flagged and off.batch["k3_kl"] > 100 * max(ok.batch["k3_kl"], 1e-9), (off.batch, ok.batch)
    code, out, err = harness_cli("score", str(tmp_path / "m.jsonl"), "--pair", "hf.qwen3.aligned", "--temperature",
                                 "0.8", "--min-p", "0.1", "--corpus", str(tmp_path / "c2"), "--no-tracking",
                                 "--out", str(tmp_path / "o"))
    assert code == 0, out + err
    code, out, err = harness_cli("score", str(tmp_path / "m.jsonl"), "--pair", "hf.qwen3.aligned", "--min-p", "1.5",
                                 "--no-tracking")
    assert code == 2 and "1.5" in err, out + err


def test_raw_log_probs_of_a_processed_sampler_are_named(tmp_path):
    """An engine that samples at T 0.7 but reports the raw distribution's log-probs (vLLM's default
    logprobs_mode): scored at its settings every sample is flagged, and the note says the recorded
    log-probs are the raw distribution's, with the k3 of the rescored samples."""
    record("hf.qwen3.aligned", range(2), tmp_path / "raw.jsonl")  # log-probs of the T = 1 distribution
    res = score(tmp_path / "raw.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
                max_repros=0, sampling={"temperature": 0.7, "top_p": 0.9})
    assert res.flagged
    [note] = [n for n in res.notes if "raw distribution" in n]
    assert "logprobs_mode='raw_logprobs'" in note and "-> " in note, note
    ok = score(tmp_path / "raw.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False)
    assert not ok.flagged and not any("raw distribution" in n for n in ok.notes)
    # a sampler bug that no setting explains is not blamed on raw log-probs
    rows = [json.loads(x) for x in (tmp_path / "raw.jsonl").read_text().splitlines()]
    for r in rows:
        r["rollout_logprobs"] = [v - 0.3 for v in r["rollout_logprobs"]]
    (tmp_path / "off.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = score(tmp_path / "off.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
                max_repros=0, sampling={"temperature": 0.7})
    assert res.flagged and not any("raw distribution" in n for n in res.notes), res.notes
    # raw rows beside rows flagged for another cause (shifted by 0.3): the note still comes, counting both
    raw_rows = [json.loads(x) for x in (tmp_path / "raw.jsonl").read_text().splitlines()]
    (tmp_path / "both.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw_rows[:3] + rows[3:]))
    res = score(tmp_path / "both.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
                max_repros=0, sampling={"temperature": 0.7, "repetition_penalty": 1.2})
    [note] = [n for n in res.notes if "raw distribution" in n]
    assert "3 of the 6 flagged sample(s) rescored" in note and "The other 3 rescored fail either way" in note, note
    assert "(temperature 0.7, repetition_penalty 1.2)" in note and "min-p or penalties" in note, note
    # ... and scored as raw (the command's mode, or the row's own logprobs_mode), the raw rows are clean
    res = score(tmp_path / "raw.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
                max_repros=0, sampling={"temperature": 0.7}, logprobs_mode="raw")
    assert not res.flagged and any(n.startswith("sampling: --logprobs raw") for n in res.notes), res.notes
    (tmp_path / "moded.jsonl").write_text("".join(
        json.dumps({**r, "sampling_params": {"temperature": 0.7, "logprobs_mode": "raw_logprobs"}}) + "\n"
        for r in raw_rows))
    res = score(tmp_path / "moded.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
                max_repros=0)
    assert not res.flagged and any("say logprobs_mode raw_logprobs" in n for n in res.notes), res.notes


def test_log_probs_sliced_one_off_their_tokens_are_named(tmp_path):
    """A recording whose log-prob list is one off its tokens (entry i holds token i+1's: a slice done
    twice), or the other way (a prompt token's log-prob left in front): the note names the shift."""
    rows = record("hf.qwen3.aligned", range(2), tmp_path / "r.jsonl")
    for shift, words in ((1, "the next response token's (i + 1)"), (-1, "the previous response token's (i - 1)")):
        out = []
        for r in rows:
            lp = r["rollout_logprobs"]
            lp = lp[1:] + [-0.5] if shift == 1 else [-0.5] + lp[:-1]
            out.append({**r, "rollout_logprobs": lp})
        path = tmp_path / f"s{shift}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in out))
        res = score(path, pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False, max_repros=0)
        assert len(res.flagged) == len(rows), [s.metrics for s in res.scored]
        [note] = [n for n in res.notes if n.startswith("log-probs shifted by one token")]
        assert words in note and f"on {len(rows)} of the {len(rows)} flagged" in note, note
    assert not any("shifted" in n for n in score(tmp_path / "r.jsonl", pair_name="hf.qwen3.aligned",
                                                  corpus=tmp_path / "c", progress=False).notes)


def test_rows_that_record_their_own_sampling_settings_are_scored_with_them(tmp_path):
    """A file mixing requests sampled at different settings (vLLM's per-request SamplingParams): each
    row's temperature / top_p / top_k / min_p, top-level or under sampling_params, over the command's."""
    hot = record("hf.qwen3.aligned", range(2), tmp_path / "hot.jsonl", temperature=0.7, sample_top_k=20)
    cold = record("hf.qwen3.aligned", range(2, 4), tmp_path / "cold.jsonl", top_p=0.9, min_p=0.05)
    rows = ([{**r, "temperature": 0.7, "top_k": 20} for r in hot]
            + [{**r, "sampling_params": {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "min_p": 0.05,
                                         "repetition_penalty": 1.0}} for r in cold])
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = score(path, pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False, max_repros=0)
    assert len(res.scored) == len(rows) and not res.flagged and not res.bad, [s.metrics for s in res.flagged]
    [note] = [n for n in res.notes if "record their own sampling settings" in n]
    assert "temperature on 12" in note and "top_k on 12" in note and "min_p on 6" in note, note
    assert not any("penalties" in n for n in res.notes)
    bare = tmp_path / "bare.jsonl"  # the same rows without their settings: the command's defaults flag them
    bare.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("temperature", "top_k",
                                                                               "sampling_params")}) + "\n"
                            for r in rows))
    assert score(bare, pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False, max_repros=0).flagged
    # a setting no engine samples with is a bad row naming its field; penalties are applied, and noted
    bad = [{**rows[0], "temperature": 0}, {**rows[1], "sampling_params": {"top_p": 1.5}},
           {**rows[2], "sampling_params": "fast"}, {**rows[3], "presence_penalty": 0.5},
           {**rows[4], "frequency_penalty": 3.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    res = score(path, pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False, max_repros=0)
    assert [(b.line, b.field) for b in res.bad] == [(1, "temperature"), (2, "sampling_params.top_p"),
                                                   (3, "sampling_params"), (5, "frequency_penalty")], res.bad
    assert "greedy" in res.bad[0].message
    [note] = [n for n in res.notes if "scored with penalties" in n]
    assert "(presence_penalty)" in note and "1 sample(s)" in note, note
    assert res.scored[0].case.presence_penalty == 0.5
    # a setting given twice with two values is a bad row; settings the scorer does not apply, or misspelt, are
    # noted; a row's own settings can be set aside (--ignore-row-sampling)
    odd = [{**rows[0], "temperature": 0.5, "sampling_params": {"temperature": 0.7}},
           {**rows[1], "sampling_params": {"typical_p": 0.9, "logit_bias": {"5": 2.0}, "max_tokens": 16}},
           {**rows[2], "repetiton_penalty": 1.5}, {**rows[3], "sampling_params": {"typical_p": 1.0}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in odd))
    res = score(path, pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False, max_repros=0)
    assert [(b.line, b.field) for b in res.bad] == [(1, "sampling_params.temperature")], res.bad
    assert "and temperature is 0.5" in res.bad[0].message, res.bad[0].message
    [note] = [n for n in res.notes if "settings recorded that the scorer does not apply" in n]
    assert "sampling_params.typical_p on 1 sample(s) (line 2)" in note and "sampling_params.logit_bias" in note, note
    assert "repetiton_penalty (did you mean repetition_penalty?) on 1 sample(s) (line 3)" in note, note
    assert "max_tokens" not in note and "line 4" not in note, note
    res = score(path, pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False, max_repros=0,
                row_settings=False)
    assert [b.line for b in res.bad] == [1] and any("(--ignore-row-sampling)" in n for n in res.notes), res.notes


def test_a_penalised_recording_scores_clean_with_its_penalties(tmp_path, harness_cli):
    """A rollout sampled with repetition and frequency penalties (its log-probs of the penalised
    distribution): scored with them (the command's options) it is aligned, without them flagged."""
    record("hf.qwen3.aligned", range(2), tmp_path / "p.jsonl", repetition_penalty=1.4, frequency_penalty=0.8)
    code, out, err = harness_cli("score", str(tmp_path / "p.jsonl"), "--pair", "hf.qwen3.aligned",
                                 "--repetition-penalty", "1.4", "--frequency-penalty", "0.8", "--corpus",
                                 str(tmp_path / "c"), "--no-tracking", "--out", str(tmp_path / "o"))
    assert code == 0 and "scored with penalties (frequency_penalty, repetition_penalty)" in out, out + err
    import csv

    with (tmp_path / "o" / "samples.csv").open() as fh:  # each sample's settings beside its metrics
        first = next(csv.DictReader(fh))
    assert float(first["repetition_penalty"]) == 1.4 and float(first["frequency_penalty"]) == 0.8, first
    assert float(first["temperature"]) == 1.0 and int(first["top_k"]) == 0, first
    code, out, err = harness_cli("score", str(tmp_path / "p.jsonl"), "--pair", "hf.qwen3.aligned", "--corpus",
                                 str(tmp_path / "c"), "--no-tracking", "--out", str(tmp_path / "o2"), "--max-repros", "0",
                                 "--top-k", "-1")  # (-1: off, as vLLM writes it)
    assert code == 1, out + err
    # a recording of greedy decoding (every log-prob 0.0) scored as sampling: said so
    rows = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    (tmp_path / "g.jsonl").write_text("".join(json.dumps({**r, "rollout_logprobs": [0.0] * len(r["response_ids"])})
                                              + "\n" for r in rows))
    res = score(tmp_path / "g.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
                max_repros=0)
    [note] = [n for n in res.notes if "record every log-prob as exactly 0.0" in n]
    assert "Score greedy samples with --top-k 1" in note, note


def test_tokens_the_trainer_cuts_are_named_not_taken_for_another_model(tmp_path):
    """A trial scored with a top-p the engine did not use: a few recorded tokens got probability 0
    from the trainer, the mean gap over them was inf, and the note said 'inf nats lower per token
    ... check that --model is the policy'. They are counted and named; the gap reads the rest."""
    record("hf.qwen3.aligned", range(2), tmp_path / "p.jsonl", top_p=0.95)
    res = score(tmp_path / "p.jsonl", pair_name="hf.qwen3.aligned", corpus=tmp_path / "c", progress=False,
                sampling={"top_p": 0.3})
    assert res.batch["k3_kl"] == math.inf, res.batch
    assert not any("check that --model is the policy" in n for n in res.notes), res.notes
    [note] = [n for n in res.notes if "tokens the trainer gives probability 0" in n]
    assert "Check --temperature, --top-p, --top-k and --min-p" in note, note
