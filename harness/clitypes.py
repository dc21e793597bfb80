"""Option types shared by the commands."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloat(click.FloatRange):
    """click's FloatRange, refusing "nan" and "inf" (which its bounds let through: every comparison
    with NaN is false)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number; give a number {self._describe_range()}.", param, ctx)
        return rv
