"""A differential fuzzing and regression-test harness for trainer vs rollout numerics.

Importing `harness` is cheap: it does not import onnxruntime, MLflow or CUDA code. The names a
target author needs are exported here; see `harness.pairs` for the contract.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .case import Case, CaseError
from .errors import HarnessError, UsageError
from .pairs import (
    REGISTRY,
    Axes,
    Outcome,
    PairError,
    Profiles,
    Readout,
    Routing,
    RoutingAxes,
    TargetPair,
    register,
    sampled_tokens_only,
    token_outcome,
)


def check_pair(pair: TargetPair | str, **kwargs):
    """Conformance check for a target pair (see `harness.conformance.check_pair`)."""
    from .conformance import check_pair as _check

    return _check(pair, **kwargs)


__all__ = [
    "Axes", "Case", "CaseError", "HarnessError", "Outcome", "PairError", "Profiles", "REGISTRY", "Readout",
    "Routing", "RoutingAxes", "TargetPair", "UsageError", "__version__", "check_pair", "register",
    "sampled_tokens_only",
    "token_outcome",
]
