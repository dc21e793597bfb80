"""`harness shrink`: a repro whose shrinking was cut short is shrunk further from its own case."""
import json
from pathlib import Path

from harness import Case
from harness.corpus import load_repro, replay
from harness.reshrink import shrink_file

ROOT = Path(__file__).resolve().parents[2]
BIG = Case(seed=3, seq_lens=(5, 7, 3, 6))  # attention.mask_leak diverges on it (k3 ~0.5)


def cut_short_repro(tmp_path: Path, case: Case = BIG, pair: str = "attention.mask_leak") -> Path:
    """The committed mask-leak repro as a campaign cut short would have left it: a big case."""
    src = next((ROOT / "corpora" / "attention.mask_leak").glob("*.json"))
    dst = tmp_path / pair / src.name
    dst.parent.mkdir(parents=True)
    data = json.loads(src.read_text())
    data["pair"] = pair
    data["case"] = case.to_json()
    data.pop("case_fingerprint")
    data["found"]["shrink_complete"] = False
    dst.write_text(json.dumps(data, indent=2))
    return dst


def test_a_cut_short_repro_is_shrunk_to_its_minimal_case_and_replays_bit_for_bit(tmp_path):
    path = cut_short_repro(tmp_path)
    lines: list[str] = []
    assert shrink_file(path, budget=300, max_evals=500, log=lines.append) == "shrunk"
    assert "4 sequence(s), 21 token(s) -> 2 sequence(s)" in lines[0], lines
    repro = load_repro(path)
    assert repro.case.batch_size == 2 and repro.case.n_tokens <= 4  # two sequences sharing a row leak
    assert repro.found["shrink_complete"] is True and not repro.case_edited
    last = repro.history[-1]
    assert last["event"] == "shrunk further" and Case.from_json(last["replaced_case"]) == BIG
    res = replay(repro)
    assert res.diverges and res.compared and res.mismatches == {}
    # shrinking again finds nothing simpler and leaves the file alone
    before = path.read_text()
    lines.clear()
    assert shrink_file(path, budget=300, max_evals=500, log=lines.append) == "minimal"
    assert path.read_text() == before and "minimal" in lines[0]


def test_a_budget_that_runs_out_keeps_what_was_shrunk_and_says_so(tmp_path):
    path = cut_short_repro(tmp_path)
    lines: list[str] = []
    assert shrink_file(path, budget=300, max_evals=2, log=lines.append) == "cut short"
    assert "run again to go on" in lines[0]
    repro = load_repro(path)
    assert repro.found["shrink_complete"] is False and repro.case.n_tokens < BIG.n_tokens


def test_a_repro_that_no_longer_fails_is_not_touched(tmp_path, harness_cli):
    path = cut_short_repro(tmp_path, Case(seed=3, seq_lens=(12,)))  # one sequence: no leak
    before = path.read_text()
    code, out, err = harness_cli("shrink", str(path))
    assert code == 1, (out, err)
    assert "does not fail" in out and "harness replay" in out and "1 does not fail" in out
    assert path.read_text() == before
