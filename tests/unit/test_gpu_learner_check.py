"""benchmarks/gpu_learner_check.py's CPU smoke path, in-process on a tiny model: every part it runs
leaves its section in the record, and the loss kernels agree with their float64 reference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_learner_check  # noqa: E402

TINY = [
    "--device", "cpu", "--size", "small", "--layers", "1", "--vocab-size", "256", "--rows", "4",
    "--n-rollouts", "2", "--prompt-tokens", "12", "--max-new-tokens", "6", "--loss-rows", "3",
    "--loss-tokens", "6", "--warmup", "0", "--steps", "1", "--ipc-rounds", "1", "--budget-s", "120",
]  # fmt: skip


def test_cpu_smoke_record(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    out = tmp_path / "record.json"
    record = gpu_learner_check.main([*TINY, "--parts", "learner,losses,ipc,plan", "--out", str(out)])
    assert json.loads(out.read_text())["parts"].keys() == record["parts"].keys()
    parts = record["parts"]
    assert set(parts) == {"learner", "losses", "ipc", "plan"}
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(parts, "ok")

    variants = parts["learner"]["variants"]
    assert set(variants) == {"full", "full+ckpt", "lora", "lora+ckpt"}
    for row in variants.values():
        assert row["status"] == "ok", row.get("error")
        assert row["finite"] and row["step_s"] > 0 and row["bytes_per_parameter"] > 0
    assert variants["lora"]["trainable_parameters"] < variants["full"]["trainable_parameters"]
    assert variants["full+ckpt"]["forward"] == "padded"  # transformers keeps no KV cache under checkpointing

    losses = parts["losses"]
    from opd_trainer.learner.estimators import ESTIMATORS

    assert set(losses["estimators"]) == set(ESTIMATORS)
    assert losses["passed"], losses["failed"]
    for row in losses["estimators"].values():
        assert row["fp32"]["loss_rel"] < 1e-5 and row["fp32"]["grad_rel"] < 1e-5

    ipc = parts["ipc"]
    assert ipc["passed"] and ipc["weights_changed"] and ipc["logits_max_abs_diff"] == 0.0

    assert set(parts["plan"]["rows"]) == {f"torch/{name}" for name in variants}


def test_budget_skips_parts_with_a_note(tmp_path: Path) -> None:
    record = gpu_learner_check.main([*TINY, "--budget-s", "1", "--parts", "losses,plan", "--out", ""])
    assert record["parts"]["losses"]["status"] == "skipped"
    assert "left" in record["parts"]["losses"]["note"]
    assert record["parts"]["plan"]["note"].startswith("no measured peaks")
