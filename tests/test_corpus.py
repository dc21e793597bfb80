"""Replays every committed repro under this repository's corpora/ (`harness.corpus_tests`, which any
repository runs as `pytest --pyargs harness.corpus_tests --harness-corpus=corpora`): the regression
tests that grow with each finding. `--harness-corpus=DIR` replays DIR instead; see that module."""

from __future__ import annotations

from pathlib import Path

from harness.corpus_tests import (check_recorded_metrics, corpus_root, pytest_generate_tests, root,  # noqa: F401
                                  test_corpus_files_are_named_by_signature, test_replay)

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "corpora"

__all__ = ["DEFAULT_CORPUS", "check_recorded_metrics", "corpus_root", "pytest_generate_tests", "root",
           "test_corpus_files_are_named_by_signature", "test_replay"]
