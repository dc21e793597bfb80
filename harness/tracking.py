"""Where a campaign reports what it found, besides the corpus.

The fuzz engine talks to a tracker through three calls, in this order: `campaign_started`,
`finding` (once per finding, after its corpus file is written), `campaign_finished`. A tracker must
never be the only copy of a finding and must not raise into the campaign. `NullTracker` does
nothing (`--no-tracking`); the MLflow tracker (`harness.mlflow_tracking`) is the system of record
for regressions across nights, imported only when tracking is on.
"""

from __future__ import annotations

from typing import Any


class NullTracker:
    """Tracks nothing."""

    def campaign_started(self, config: Any, seed: int, pairs: list) -> None:
        pass

    def finding(self, finding: Any) -> None:
        pass

    def campaign_finished(self, result: Any) -> None:
        pass


def make_tracker(uri: str | None, enabled: bool = True, log: Any = None, night: str | None = None) -> Any:
    """The tracker for a campaign: MLflow unless tracking is off. `night`: what its regressions count
    as seen by, where that is more than this process (`profiles.SeedChoice.night`: a run's shards)."""
    if not enabled:
        return NullTracker()
    from .mlflow_tracking import MlflowTracker

    return MlflowTracker(uri, log=log, campaign_uid=night)


def fetch_repro(run_id: str, uri: str | None = None) -> Any:
    """The repro attached to an MLflow regression run."""
    from .mlflow_tracking import fetch_repro as _fetch

    return _fetch(run_id, uri)
