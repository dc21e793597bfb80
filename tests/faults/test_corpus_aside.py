"""A corpus file that does not load (damaged, edited by hand) where a campaign writes a finding is
moved aside, never lost: the file as it was at `<id>.json.broken-<time>`, a JSON sidecar beside it
(`.why`: its original path, when and why it was moved, what could be read of it), one line saying
where it went and how to restore it, and whatever of its history could still be read carried into
the new repro written in its place. Only JSON is read from it."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from types import SimpleNamespace

from harness import REGISTRY
from harness.corpus import iter_corpus, load_repro, record_finding
from harness.execute import run_case
from harness.fuzz import Finding, signature

from .test_repro_faults import DIVERGING, make_repro


def finding() -> Finding:
    name, case = DIVERGING
    ev = run_case(REGISTRY.get(name), case, "cpu", 1e-3)
    return Finding(pair=name, expected="diverges", symptom=ev.symptom, signature=signature(name, ev), case=case,
                   evaluation=ev, examples=1)


def record(corpus: Path) -> tuple[Finding, list[str]]:
    f, messages = finding(), []
    record_finding(f, corpus, 1e-3, 0, "cpu", log=messages.append)
    return f, messages


def test_a_file_that_is_not_json_is_moved_aside_with_a_sidecar_and_one_line(tmp_path):
    corpus = tmp_path / "corpora"
    path = make_repro(corpus)
    damaged = path.read_bytes()[:40]  # cut short (a killed editor, a bad merge)
    path.write_bytes(damaged)
    f, messages = record(corpus)
    [aside] = [p for p in path.parent.iterdir() if p.name.startswith(f"{path.name}.broken-") and p.suffix != ".why"]
    assert aside.read_bytes() == damaged  # the file as it was
    why = json.loads(aside.with_name(aside.name + ".why").read_text())
    assert why["original_path"] == str(path) and why["moved_to"] == str(aside)
    assert why["id"] == path.stem and why["pair"] == path.parent.name
    assert "is not valid JSON" in why["reason"]
    dt.datetime.fromisoformat(why["moved_at"])  # when (an ISO time)
    assert why["recovered"] == {} and why["replaced_by"] == f.signature
    assert load_repro(path).signature == f.signature and f.new  # the new finding in its place
    [line] = messages  # one line: where it went, the sidecar, how to restore it
    assert "\n" not in line and str(aside) in line and f"{aside}.why" in line, line
    assert f"mv {aside} {path}" in line and "is not valid JSON" in line, line
    assert iter_corpus(corpus) == [path]  # the sidecar is not taken for a repro (replay, the corpus test)


def test_what_can_be_read_of_a_damaged_repro_is_kept_in_the_new_one(tmp_path):
    """A repro refused by one field (a status typed by hand) still holds when it was found, its
    MLflow regression and its history: none of that is lost with the file."""
    corpus = tmp_path / "corpora"
    path = make_repro(corpus)
    data = json.loads(path.read_text())
    data["status"] = "maybe"
    data["tracking"] = {"run_id": "abc123", "uri": "sqlite:///x.db"}
    data["history"] = [{"at": "2024-01-02T03:04:05+00:00", "event": "recurred", "campaign_seed": 7},
                       "not an object"]  # (a damaged entry is left in the file aside, not carried)
    data["found"] = {**data["found"], "at": "2024-01-01T00:00:00+00:00", "campaign_seed": 5}
    path.write_text(json.dumps(data))
    f, messages = record(corpus)
    new = load_repro(path)
    old, moved = new.history[0], new.history[-1]
    assert old == {"at": "2024-01-02T03:04:05+00:00", "event": "recurred", "campaign_seed": 7}
    assert moved["event"] == "took the place of a corrupted file" and "status" in moved["reason"]
    assert moved["recovered"]["found"]["at"] == "2024-01-01T00:00:00+00:00"
    assert moved["recovered"]["tracking"] == {"run_id": "abc123", "uri": "sqlite:///x.db"}
    assert moved["recovered"]["status"] == "maybe" and moved["recovered"]["signature"] == data["signature"]
    aside = path.parent / moved["moved_to"]  # (its name: the file aside is in the same folder)
    assert aside.exists() and json.loads(aside.read_text()) == data  # the whole file is still there
    why = json.loads(Path(f"{aside}.why").read_text())
    assert why["recovered"]["found"]["campaign_seed"] == 5 and why["recovered"]["history_entries"] == 1
    assert len(messages) == 1 and "history" in messages[0], messages


def test_two_files_moved_aside_in_the_same_second_are_both_kept(tmp_path, monkeypatch):
    import harness.corpus as corpus_mod

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=tz)

    monkeypatch.setattr(corpus_mod, "_dt", SimpleNamespace(datetime=Frozen, timezone=dt.timezone))
    corpus = tmp_path / "corpora"
    path = make_repro(corpus)
    for text in ("{ first", "{ second"):
        path.write_text(text)
        record(corpus)
    kept = sorted(p.read_text() for p in path.parent.iterdir() if ".broken-" in p.name and p.suffix != ".why")
    assert kept == ["{ first", "{ second"]
    assert len([p for p in path.parent.iterdir() if p.suffix == ".why"]) == 2
