"""Session fixtures shared by every test folder: the tiny models (built once, cached on disk)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opd_trainer.tiny_models import TinyModels, build_tiny_models

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_models() -> TinyModels:
    """`make test` builds them first (`opd make-tiny-models`), so this is normally a cache hit."""
    return build_tiny_models(Path(os.environ.get("OPD_TINY_MODELS_DIR", REPO / ".cache" / "tiny-models")))
