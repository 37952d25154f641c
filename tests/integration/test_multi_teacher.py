"""Two teachers routed by data tag, as a whole job on real engines (multi-teacher OPD).

The `mirror` teacher is a frozen copy of the student (`model: self`), so a sample it scores before the
first update has a reverse KL of zero up to the engines' rounding: that is how the test knows which
teacher scored what, besides the per-teacher counts. The `tutor` (the tiny teacher) is far from the
student. Records are routed by their own `rollout_extra.data_tag` and by the name of the dataset file
they come from; the data is plain questions without tools, unlike the demo's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_runs import run_driver

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.jsonl import write_jsonl
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration

N_ROLLOUTS = 2


def _records(prefix: str, count: int, **extra: Any) -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "user", "content": f"{prefix} question {i}: name a colour."}], **extra}
        for i in range(count)
    ]


def test_each_sample_is_scored_by_the_teacher_its_tag_names(
    ray_session: None, tiny_models: TinyModels, tmp_path: Path
) -> None:
    general, mirror = tmp_path / "general.jsonl", tmp_path / "mirror.jsonl"
    # general.jsonl: 2 untagged records (the default teacher, tutor) and 2 tagged for the mirror;
    # mirror.jsonl: 4 untagged records, routed by their file's name.
    write_jsonl(general, _records("general", 2) + _records("tagged", 2, rollout_extra={"data_tag": "mirror"}))
    write_jsonl(mirror, _records("mirrored", 4))
    validation = tmp_path / "validation.jsonl"
    write_jsonl(validation, _records("held-out", 4, rollout_extra={"data_tag": "mirror"}))
    engine = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
    spec = parse_job_spec(
        {
            "job_name": "two-teachers",
            "model": str(tiny_models.student),
            "teacher_model": [
                {"name": "tutor", "model": str(tiny_models.teacher)},
                {"name": "mirror", "model": "self", "data_tags": ["mirror"]},
            ],
            "training_datasets": [str(general), str(mirror)],
            "validation_datasets": [str(validation)],
            "hyper_parameters": {
                "n_epochs": 1,
                "batch_size": 4,
                "n_rollouts": N_ROLLOUTS,
                "ppo_mini_batch_size": 8,
                "max_length": 512,
                "max_tokens": 24,
                "temperature": 1.0,
                "eval_steps": 100,
                "save_steps": 100,
                "seed": 0,
            },
            "resources": {"student": engine, "teacher": engine, "learner_gpus": 0},
            "report_to": [],
        }
    )
    run_dir = tmp_path / "run"
    summary: dict[str, Any] = run_driver(spec, run_dir)

    train = [r for r in RunDir(run_dir).records() if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    # Every rollout succeeded and each teacher scored exactly its samples: 6 records x 2 rollouts
    # routed to the mirror (2 by their own tag, 4 by their file's name), 2 x 2 to the tutor.
    assert sum(r["failed_rollouts"] for r in train) == 0
    assert sum(r.get("teacher/mirror/segments", 0.0) for r in train) == 6 * N_ROLLOUTS
    assert sum(r.get("teacher/tutor/segments", 0.0) for r in train) == 2 * N_ROLLOUTS
    assert sum(r["segments"] for r in train) == 8 * N_ROLLOUTS

    # Known teachers: before any update the mirror scores the student's samples as the student
    # sampled them (temperature 1), the tutor does not; and the validation, tagged for the mirror,
    # measures the starting student against itself.
    first = train[0]
    mirror_kl = first["teacher/mirror/reverse_kl"]  # 6 of 8 records are the mirror's: step 1 has some
    tutor_kl = first.get("teacher/tutor/reverse_kl", train[1].get("teacher/tutor/reverse_kl"))
    print(
        f"step 1 reverse KL: mirror {mirror_kl:.4f}, tutor {tutor_kl:.4f}; validation at the start "
        f"{summary['student_before']['reverse_kl']:.4f}"
    )
    assert abs(mirror_kl) < 0.05, first
    assert tutor_kl > 0.2, first
    assert abs(summary["student_before"]["reverse_kl"]) < 0.05, summary["student_before"]

    # Two teacher engine groups served, each counted by its own engines' vLLM counters, and the
    # job's metered teacher tokens are theirs together.
    last = train[-1]
    tutor_tokens = last["engine/teacher.tutor/prompt_tokens"]
    mirror_tokens = last["engine/teacher.mirror/prompt_tokens"]
    assert tutor_tokens > 0 and mirror_tokens > 0
    assert last["engine/teacher/prompt_tokens"] == tutor_tokens + mirror_tokens
    assert all(r["teacher/mirror/latency_s"] > 0 for r in train if "teacher/mirror/latency_s" in r)
