"""Plain statistics used across roles' metrics."""

from __future__ import annotations

from collections.abc import Iterable


def mean(values: Iterable[float]) -> float:
    """The arithmetic mean; 0.0 for no values (a step with no scored rollouts reports 0, not NaN)."""
    items = list(values)
    return sum(items) / len(items) if items else 0.0
