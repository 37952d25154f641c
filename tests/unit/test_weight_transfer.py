"""`resources.weight_transfer`: which handoff each student engine replica gets."""

from __future__ import annotations

import pytest

from opd_trainer.engine.weight_sync import transfer_for
from opd_trainer.jobspec.job_spec import Resources


def test_auto_uses_shared_memory_only_on_the_learners_node() -> None:
    assert transfer_for("auto", "node-a", "node-a") == "shm"
    assert transfer_for("auto", "node-a", "node-b") == "ray"


def test_explicit_choices() -> None:
    assert transfer_for("ray", "node-a", "node-a") == "ray"
    assert transfer_for("shm", "node-a", "node-a") == "shm"
    with pytest.raises(ValueError, match="learner's node"):
        transfer_for("shm", "node-a", "node-b")


def test_the_job_field_defaults_to_auto_and_refuses_unknown_kinds() -> None:
    from pydantic import ValidationError

    assert Resources().weight_transfer == "auto"
    with pytest.raises(ValidationError, match="weight_transfer"):
        Resources.model_validate({"weight_transfer": "nccl"})
