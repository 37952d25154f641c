"""A workspace's `requirements.txt`, read as package specifiers and nothing else.

Its lines become arguments of `pip install` (inside the sandbox, `processor_channel`), so a line that
pip would read as an option (`--requirement=/etc/passwd`, `--index-url`, `-e`), a URL
(`pkg @ https://...`) or a local path would let a tenant read server files into an error, fetch from
anywhere or run a build backend. Only PEP 508 specifiers pass (`name[extras] (version) ; marker`),
and an error names the line number, never its content.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from opd_trainer.errors import ConfigError

MAX_LINES = 200


def parse_requirements(text: str, field: str) -> list[str]:
    """The specifiers of a requirements file, normalised; `ConfigError` naming the line otherwise."""
    specifiers: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line.startswith("-"):
            raise ConfigError(
                f"line {number} is a pip option; only package specifiers are allowed", field=field
            )
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            raise ConfigError(
                f"line {number} is not a package specifier (name, extras, version, marker)", field=field
            ) from None
        if requirement.url:
            raise ConfigError(
                f"line {number} ({requirement.name}) names a URL or path; only index packages are allowed",
                field=field,
            )
        specifiers.append(str(requirement))
        if len(specifiers) > MAX_LINES:
            raise ConfigError(f"more than {MAX_LINES} requirements", field=field)
    return specifiers


def requirements_of(workspace: Path, field: str = "fcmodel.requirements.txt") -> list[str]:
    """The validated specifiers of the workspace's requirements.txt (a folder or a zip); [] if none."""
    if workspace.is_file():
        with zipfile.ZipFile(workspace) as archive:
            names = set(archive.namelist())
            text = (
                archive.read("requirements.txt").decode(errors="replace")
                if "requirements.txt" in names
                else ""
            )
    else:
        file = workspace / "requirements.txt"
        text = file.read_text(errors="replace") if file.exists() else ""
    return parse_requirements(text, field)
