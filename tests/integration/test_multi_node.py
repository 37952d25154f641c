"""Weights cross Ray nodes: a two-node cluster (`ray.cluster_utils.Cluster`) in a process of its own,
since the other integration tests share one single-node Ray in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from opd_trainer.demo.tiny_models import TinyModels

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("multi_node_weight_sync.py")


def test_weights_reach_an_engine_on_another_node_through_the_object_store(tiny_models: TinyModels) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny_models.student), str(tiny_models.teacher)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["different_nodes"] is True
    assert result["auto"] == ["ray"] and result["shm_refused"] is True
    assert result["version"] == 7 and result["tokens"] >= 4
    # Before: the student's own weights score differently; after: the teacher's weights, as sent.
    assert result["before_vs_teacher"] > 1e-2
    assert result["after_vs_teacher"] < 1e-3, result
