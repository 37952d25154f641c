"""Session fixtures shared by every test folder: the tiny models (built once, cached on disk)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models import TinyModels

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_models() -> TinyModels:
    """`make test` builds them first (`opd make-tiny-models`), so this is normally a cache hit.

    Imported here, not at module level: unit tests must not pay for (or be affected by) torch and
    transformers being imported at collection time.
    """
    from opd_trainer.demo.tiny_models import build_tiny_models

    return build_tiny_models(Path(os.environ.get("OPD_TINY_MODELS_DIR", REPO / ".cache" / "tiny-models")))
