"""The security tests drive real servers with the API tests' helpers (`tests/api/apiserver.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
