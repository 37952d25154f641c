"""TRL's on-policy distillation (GKD) on the tiny tool-routing models: the TRL side of "ours vs TRL".

What it measures: `trl.experimental.gkd.GKDTrainer` with `lmbda=1.0, temperature=1.0` and `beta`
(default 1.0), i.e. every step samples one completion per prompt from the student (HF `generate`, no
vLLM) and minimises GKD's full-vocabulary generalized JSD on those tokens: beta 1 the reverse
KL(student ‖ teacher), 0 the forward KL, 0.5 the JSD. It reports

- `samples_per_s`: completions generated and trained on per second of training-step wall time,
- `step_s`: wall seconds of every optimizer step (data collation, generation, teacher and student
  forwards, backward, AdamW step, logging), validation excluded,
- `evals`: greedy validation exact match (the tool-routing evaluator, as our trainer's validation
  scores it) at step 0 and every `eval_every` steps, against cumulative training seconds.

Everything runs on the CPU in float32: AdamW, constant learning rate, no warmup, no weight decay,
gradient clipping at 1.0 (the defaults of both trainers), no gradient checkpointing, nothing saved.

Launch from the repo root (needs the `bench` extra, i.e. `trl`, and the models of
`opd make-tiny-models .cache/tiny-models`):

    .venv/bin/python benchmarks/trl_gkd.py --steps 6 --batch-size 8 --max-new-tokens 64 --eval-every 3

or import it from another benchmark script (which has `benchmarks/` on `sys.path`):
`from trl_gkd import run_trl_gkd`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import SequentialSampler
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from opd_trainer.chat import prompt_token_ids
from opd_trainer.demo.tool_routing import evaluator
from opd_trainer.jsonl import read_jsonl

if TYPE_CHECKING:
    from datasets import Dataset

# GKD lives in `trl.experimental`, which warns on import unless silenced.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

DEFAULT_MODELS_DIR = Path(".cache/tiny-models")
EVAL_MAX_NEW_TOKENS = 64  # the validation budget our trainer's greedy evaluation uses
EVAL_BATCH = 16


@dataclass
class TrlRun:
    """One finished GKD run; times are wall seconds of training steps only (evaluations excluded)."""

    samples_per_s: float
    step_s: list[float]
    evals: list[dict[str, float]]  # {"step", "exact_match", "train_s"} (+ the evaluator's other metrics)
    config: dict[str, Any]
    losses: list[float] = field(default_factory=list)  # GKD's loss (mean reverse KL per token) per step
    completion_tokens: list[int] = field(default_factory=list)  # tokens trained on per step (EOS included)

    @property
    def train_s(self) -> float:
        return sum(self.step_s)


def _prompt_rows(tokenizer: PreTrainedTokenizerBase, records: Sequence[dict[str, Any]]) -> list[list[int]]:
    # Exactly the token ids our trainer samples on: the chat template with the tools and the generation
    # prompt, rendered to text and encoded without extra special tokens.
    return [prompt_token_ids(tokenizer, r["messages"], r.get("tools")) for r in records]


def _train_dataset(tokenizer: PreTrainedTokenizerBase, records: Sequence[dict[str, Any]]) -> Dataset:
    """Pre-tokenized prompt-only rows in the form TRL's `DataCollatorForChatML` passes through untouched.

    Given `input_ids` and an all-zero `completion_mask` the collator takes the whole row as the prompt
    (`prompts` = our exact prompt ids) instead of re-rendering `messages[:-1]` through the chat template
    itself, which would drop the tools. There is no reference reply: with `lmbda=1` the student's own
    completion replaces it in every step. `prompt` (the rendered text) is only there because the collator
    reads that key before it looks at `input_ids`.
    """
    from datasets import Dataset  # a dependency of trl (the `bench` extra), not of the project

    ids = _prompt_rows(tokenizer, records)
    return Dataset.from_dict(
        {
            "prompt": [tokenizer.decode(x) for x in ids],
            "input_ids": ids,
            "completion_mask": [[0] * len(x) for x in ids],
        }
    )


@torch.no_grad()
def greedy_exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    solutions: Sequence[str],
    max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
) -> dict[str, float]:
    """The tool-routing evaluator's metrics of greedy replies, decoded as our trainer's validation does.

    Each reply is cut after its first end-of-sequence token (<|im_end|> or padding) and decoded with
    special tokens dropped, which keeps the `<tool_call>` markers (added tokens that are not special).
    """
    pad_id = tokenizer.pad_token_id
    eos_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_id]
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id
    )
    was_training = model.training
    model.eval()
    texts: list[str] = []
    for lo in range(0, len(prompts), EVAL_BATCH):
        chunk = prompts[lo : lo + EVAL_BATCH]
        width = max(map(len, chunk))
        ids_B_T = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding: every reply starts at the same column
            ids_B_T[i, width - len(p) :] = torch.tensor(p)
            mask_B_T[i, width - len(p) :] = 1
        out = model.generate(input_ids=ids_B_T, attention_mask=mask_B_T, generation_config=config)
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    model.train(was_training)
    pairs = zip(texts, solutions, strict=True)
    return evaluator.aggregate([evaluator.score_reply(evaluator.parse_reply(t), s) for t, s in pairs])


class _StepClock(TrainerCallback):
    """Times every optimizer step and validates at step 0 and every `eval_every` steps, off the clock.

    A step's time runs from the end of the previous step (or of the step-0 evaluation) to this step's
    `on_step_end`, so it includes what the Trainer does between steps (logging, fetching and collating
    the next batch) but none of the evaluation.
    """

    def __init__(self, evaluate: Callable[[PreTrainedModel], dict[str, float]], eval_every: int) -> None:
        self.evaluate = evaluate
        self.eval_every = eval_every
        self.step_s: list[float] = []
        self.evals: list[dict[str, float]] = []
        self.losses: list[float] = []
        self._mark = 0.0

    def _validate(self, step: int, model: PreTrainedModel) -> None:
        metrics = self.evaluate(model)
        self.evals.append({"step": step, "train_s": sum(self.step_s), **metrics})
        em, train_s = metrics["exact_match"], sum(self.step_s)
        print(f"[trl-gkd] step {step:>4}  exact_match {em:.3f}  train_s {train_s:.1f}", flush=True)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._validate(0, kwargs["model"])
        self._mark = time.perf_counter()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.step_s.append(time.perf_counter() - self._mark)
        step = state.global_step
        if step % self.eval_every == 0 or step == state.max_steps:
            self._validate(step, kwargs["model"])
        self._mark = time.perf_counter()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def run_trl_gkd(
    models_dir: Path,
    steps: int,
    batch_size: int,
    max_new_tokens: int,
    learning_rate: float,
    eval_every: int,
    eval_samples: int,
    seed: int,
    num_threads: int | None = None,
    beta: float = 1.0,
    prompt_order: Sequence[int] | None = None,
) -> TrlRun:
    """Train the tiny student by TRL's GKD for `steps` steps of `batch_size` prompts (one completion each).

    `num_threads` sets `torch.set_num_threads` for the run (None: leave torch's default). `beta` is GKD's
    interpolation of its generalized JSD: 0 the forward KL(teacher ‖ student), 0.5 the JSD, 1 the reverse
    KL(student ‖ teacher). `prompt_order` (indices into the training records, `batch_size` per step) makes
    TRL take exactly those prompts in that order instead of its own seeded shuffle (`vs_trl_gkd.py` passes
    the order our job takes for the seed, so both sides train on the same batches step by step).
    """
    # Imported here so that importing this module (e.g. for `TrlRun`) does not need the `bench` extra.
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    class CountingGKDTrainer(GKDTrainer):
        """GKD unchanged; only records how many completion tokens each step trained on."""

        completion_tokens: list[int]

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            if prompt_order is None:
                return super()._get_train_sampler(train_dataset)
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def training_step(
            self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
        ) -> torch.Tensor:
            loss = super().training_step(model, inputs, num_items_in_batch)
            # GKD replaced `labels` in place with the student's completion (prompt and padding at -100).
            self.completion_tokens.append(int((inputs["labels"] != -100).sum()))
            return loss

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    models_dir = Path(models_dir)
    tokenizer = AutoTokenizer.from_pretrained(models_dir / "student")
    student = AutoModelForCausalLM.from_pretrained(models_dir / "student", dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(models_dir / "teacher", dtype=torch.float32)
    # The Trainer counts the collator's labels as `num_items_in_batch` when the model takes loss kwargs
    # (Qwen2 does) and GKD divides its summed KL by that count. With lmbda=1 those labels are not the
    # tokens trained on (they are replaced by the student's completion after collation), and prompt-only
    # rows have none, so the loss would be KL/0 = inf. Without the count GKD's own `batchmean` applies:
    # the KL summed over the generated tokens divided by their number, i.e. the per-token mean.
    student.accepts_loss_kwargs = False

    records = read_jsonl(models_dir / "data" / "train.jsonl")
    if prompt_order is not None:
        records = [records[index] for index in prompt_order]
    train = _train_dataset(tokenizer, records)
    val_records = read_jsonl(models_dir / "data" / "validation.jsonl")[:eval_samples]
    val_prompts = _prompt_rows(tokenizer, val_records)
    # The solution sits under `rollout_extra` (what reward workers get), where `evaluate_texts` reads it.
    val_solutions = [r.get("solution") or r["rollout_extra"]["solution"] for r in val_records]
    clock = _StepClock(lambda m: greedy_exact_match(m, tokenizer, val_prompts, val_solutions), eval_every)

    with tempfile.TemporaryDirectory(prefix="trl-gkd-") as out_dir:
        args = GKDConfig(
            output_dir=out_dir,
            # fully on-policy (lmbda=1), untempered sampling; beta picks the divergence
            lmbda=1.0,
            beta=beta,
            temperature=1.0,
            max_new_tokens=max_new_tokens,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=1,
            max_steps=steps,
            learning_rate=learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch",
            weight_decay=0.0,
            max_grad_norm=1.0,
            gradient_checkpointing=False,
            use_cpu=True,
            bf16=False,
            fp16=False,
            seed=seed,
            data_seed=seed,
            dataloader_num_workers=0,
            dataloader_pin_memory=False,
            logging_strategy="steps",
            logging_steps=1,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            disable_tqdm=True,
        )
        trainer = CountingGKDTrainer(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=train,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        trainer.completion_tokens = []
        trainer.train()

    config = {
        "trainer": "trl.experimental.gkd.GKDTrainer",
        "lmbda": 1.0,
        "beta": beta,
        "temperature": 1.0,
        "steps": steps,
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "learning_rate": learning_rate,
        "eval_every": eval_every,
        "eval_samples": len(val_records),
        "seed": seed,
        "prompt_order": "given" if prompt_order is not None else "trl's shuffle",
        "torch_threads": torch.get_num_threads(),
        "device": "cpu",
        "dtype": "float32",
    }
    train_s = sum(clock.step_s)
    return TrlRun(
        samples_per_s=steps * batch_size / train_s if train_s > 0 else 0.0,
        step_s=clock.step_s,
        evals=clock.evals,
        config=config,
        losses=clock.losses,
        completion_tokens=trainer.completion_tokens,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts (= completions) per step")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--eval-samples", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beta", type=float, default=1.0, help="0 forward KL, 0.5 JSD, 1 reverse KL")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--json", type=Path, default=None, help="also write the run as JSON here")
    a = parser.parse_args(argv)

    run = run_trl_gkd(
        a.models_dir,
        a.steps,
        a.batch_size,
        a.max_new_tokens,
        a.lr,
        a.eval_every,
        a.eval_samples,
        a.seed,
        num_threads=a.threads,
        beta=a.beta,
    )
    median_s = sorted(run.step_s)[len(run.step_s) // 2]
    tokens = sum(run.completion_tokens)
    print(f"\nTRL GKD  {json.dumps(run.config)}")
    print(f"samples/s        {run.samples_per_s:.2f}")
    print(f"step s           median {median_s:.2f}   first {run.step_s[0]:.2f}   total {run.train_s:.1f}")
    per_step, per_s = tokens / max(len(run.step_s), 1), tokens / max(run.train_s, 1e-9)
    print(f"tokens/step      {per_step:.0f}   ({per_s:.0f} completion tokens/s)")
    print(f"loss/step        {' '.join(f'{x:.3f}' for x in run.losses)}")
    print(f"{'step':>6} {'train_s':>8} {'exact_match':>12} {'format':>8}")
    for e in run.evals:
        print(f"{e['step']:>6} {e['train_s']:>8.1f} {e['exact_match']:>12.3f} {e['format_validity']:>8.3f}")
    if a.json:
        a.json.write_text(json.dumps(asdict(run), indent=2))


if __name__ == "__main__":
    main()
