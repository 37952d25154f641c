"""Every package of `opd_trainer` names each of its modules in its docstring, so the map a newcomer
reads first (`opd_trainer/__init__.py`, then each package's) cannot silently fall behind the files."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "opd_trainer"
PACKAGES = sorted(p.parent for p in ROOT.rglob("__init__.py") if "__pycache__" not in p.parts)


def _members(package: Path) -> list[str]:
    """The package's modules and subpackages, as a reader would name them."""
    names = [p.stem for p in package.glob("*.py") if p.stem not in {"__init__", "__main__"}]
    names += [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(names)


def _named(docstring: str, name: str) -> bool:
    """`name`, `name.py`, `name/` or a dotted path ending in it, in backticks."""
    return re.search(rf"`(?:[\w./]*[./])?{re.escape(name)}(?:\.py|/)?`", docstring) is not None


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_the_package_docstring_names_every_module(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    missing = [name for name in _members(package) if not _named(docstring, name)]
    assert not missing, f"{package.relative_to(ROOT.parent)}/__init__.py does not name {missing}"


def test_a_docstring_naming_a_module_that_is_gone_is_seen() -> None:
    # The check reads names, so it must also see a name in backticks that no file carries any more.
    assert _named("`chat` renders prompts", "chat") and not _named("`chat_requests`", "chat")
