"""Fixtures the deployment tests share: the loaded chart, each install scenario rendered once, and
the chart's values.yaml."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest
import yaml
from chart_rendering import CHART_DIR, SCENARIOS, Rendered, load_values, render


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def rendered_by_scenario(chart: helm.Chart) -> dict[str, Rendered]:
    return {name: render(chart, load_values(file), name) for name, file in SCENARIOS.items()}


@pytest.fixture(scope="session")
def default_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    return values
