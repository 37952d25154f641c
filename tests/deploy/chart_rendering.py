"""Renders the Helm chart offline for the deployment tests: paths, install scenarios, `render`, and
the accessors the tests read rendered objects with.

helm-python-sdk binds Helm's Go SDK (libhelm_c, Helm v4) through ctypes: `Chart.load`, `Chart.render`
(`helm template`), `lint` (`helm lint`) and `values_from_yaml` (`-f`) all run in-process with no
helm binary, no cluster and no network. Values files are parsed by Helm's own YAML reader so that
they mean exactly what `helm install -f FILE` would make of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "opd-trainer"
VALUES_DIR = Path(__file__).resolve().parent / "values"
SCHEMAS_DIR = Path(__file__).resolve().parent / "schemas"

# The Kubernetes minor whose API schemas the rendered objects are checked against (Helm's
# `--kube-version` too). Chart.yaml asks for >= 1.28.
KUBE_VERSION = "1.32.0"
RELEASE = "opd"
NAMESPACE = "ml"

# Install scenario → values file under tests/deploy/values (None: the chart's defaults only).
SCENARIOS: dict[str, str | None] = {
    "default": None,
    "cpu-only": "cpu-only.yaml",
    "two-gpu-groups": "two-gpu-groups.yaml",
    "external-postgres": "external-postgres.yaml",
    "existing-ray": "existing-ray.yaml",
    "untrusted-code": "untrusted-code.yaml",
}


def load_values(filename: str | None) -> dict[str, Any] | None:
    """A values file as Helm reads it for `-f`; None stays None (chart defaults only)."""
    if filename is None:
        return None
    return helm.values_from_yaml((VALUES_DIR / filename).read_text())


@dataclass(frozen=True)
class Rendered:
    """One `helm template` result: the parsed objects and the NOTES.txt text."""

    scenario: str
    objects: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert len(found) == 1, f"{self.scenario}: expected one {kind}, found {len(found)}"
        return found[0]


def render(chart: helm.Chart, values: dict[str, Any] | None, scenario: str = "custom") -> Rendered:
    """Renders like `helm template RELEASE CHART -n NAMESPACE -f VALUES` (an install)."""
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(scenario=scenario, objects=objects, notes=notes)


def pod_templates(rendered: Rendered) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod template) of the API Deployment and of every Ray group."""
    for deployment in rendered.of_kind("Deployment"):
        yield deployment["metadata"]["name"], deployment["spec"]["template"]
    for cluster in rendered.of_kind("RayCluster"):
        yield "ray head", cluster["spec"]["headGroupSpec"]["template"]
        for group in cluster["spec"]["workerGroupSpecs"]:
            yield f"ray group {group['groupName']}", group["template"]


def worker_groups(rendered: Rendered) -> dict[str, dict[str, Any]]:
    cluster = rendered.one("RayCluster")
    return {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}


def ray_container(pod_template: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = pod_template["spec"]["containers"][0]  # KubeRay's Ray container
    return container


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in container.get("env", [])}
