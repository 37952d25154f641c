"""What one learner rank needs of the job (`LearnerSettings.from_spec`), and the learning-rate schedule it
names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import get_scheduler

from opd_trainer.learner.estimators import DistillationSettings

if TYPE_CHECKING:
    from opd_trainer.jobspec.job_spec import JobSpec, LoraSettings


@dataclass(frozen=True)
class LoraAdapter:
    """The job's LoRA adapter (`hyper_parameters.lora`), in PEFT's `LoraConfig` names; a plain frozen
    dataclass so that it pickles to the learner's actors without the job spec's pydantic models."""

    r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: tuple[str, ...]

    @classmethod
    def from_spec(cls, lora: LoraSettings) -> LoraAdapter:
        return cls(lora.r, lora.lora_alpha, lora.lora_dropout, tuple(lora.target_modules))


@dataclass(frozen=True)
class LearnerSettings:
    """What one learner rank needs; `from_spec` is the one way the job's fields become these."""

    model_path: str
    learning_rate: float
    lr_scheduler_type: str
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float
    total_updates: int
    """Optimizer updates over the whole job (steps × mini-batches per step); the schedule's length."""
    temperature: float
    kl_loss_coef: float
    reward_coef: float
    normalize_reward_by_std: bool
    hindsight_coef: float
    turn_preference_coef: float
    turn_preference_beta: float
    zero_stage: int
    seed: int
    distillation: DistillationSettings
    """What the estimator reads (`learner/estimators.py`)."""
    lora: LoraAdapter | None = None
    """Train PEFT LoRA adapters on the frozen student instead of every weight (None: full training)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them."""
    optimizer_offload: bool = False
    """DeepSpeed's `offload_optimizer` to host memory with its CPU Adam (ZeRO 2 or 3)."""
    turn_preference_reference: str = "initial"
    """The preference term's reference: 'initial', 'rolling' or 'teacher'
    (`hyper_parameters.turn_preference_reference`)."""
    turn_preference_reference_steps: int = 1
    """Steps between two refreshes of a 'rolling' reference."""
    turn_preference_reduction: str = "prompts"
    """'prompts': pair losses summed over the mini-batch's prompts; 'pairs': their mean."""
    turn_preference_swap: bool = False
    """Chosen and rejected swapped (a negative control)."""
    beacon_sft_coef: float = 0.0
    """Weight of the kept beacon rewrites' negative log-likelihood."""

    @property
    def frozen_student(self) -> bool:
        """A loss term reads the starting (or rolling) student's logprobs: the KL to it, or the
        preference term's reference."""
        return self.kl_loss_coef > 0 or (
            self.turn_preference_coef > 0 and self.turn_preference_reference != "teacher"
        )

    @classmethod
    def from_spec(cls, spec: JobSpec, total_updates: int) -> LearnerSettings:
        """The job's learner settings; `total_updates` is the driver's count of optimizer updates."""
        hp = spec.hyper_parameters
        return cls(
            model_path=spec.model,
            learning_rate=hp.learning_rate,
            lr_scheduler_type=hp.lr_scheduler_type,
            warmup_ratio=hp.warmup_ratio,
            weight_decay=hp.weight_decay,
            max_grad_norm=hp.max_grad_norm,
            total_updates=total_updates,
            temperature=hp.temperature,
            kl_loss_coef=hp.kl_loss_coef,
            reward_coef=hp.reward_coef,
            normalize_reward_by_std=hp.normalize_reward_by_std,
            hindsight_coef=hp.hindsight_coef,
            turn_preference_coef=hp.turn_preference_coef,
            turn_preference_beta=hp.turn_preference_beta,
            turn_preference_reference=hp.turn_preference_reference,
            turn_preference_reference_steps=hp.turn_preference_reference_steps,
            turn_preference_reduction=hp.turn_preference_reduction,
            turn_preference_swap=hp.turn_preference_swap,
            beacon_sft_coef=hp.beacon_sft_coef,
            zero_stage=spec.resources.zero_stage,
            seed=hp.seed,
            distillation=DistillationSettings(
                distill_loss=hp.distill_loss,
                teacher_top_k=hp.teacher_top_k,
                kl_coef=hp.kl_coef,
                jsd_beta=hp.jsd_beta,
                ratio_cap=hp.ratio_cap,
                stale_divergence=hp.stale_divergence,
            ),
            lora=None if hp.lora is None else LoraAdapter.from_spec(hp.lora),
            gradient_checkpointing=hp.gradient_checkpointing,
            optimizer_offload=spec.resources.optimizer_offload,
        )


# Our `lr_scheduler_type` names → transformers' schedules (linear warm-up from 0 in each).
HF_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def lr_schedule(optimizer: Any, schedule: str, total_updates: int, warmup_updates: int) -> Any:
    """`transformers.get_scheduler`: linear warm-up over `warmup_updates`, then cosine or linear decay
    to 0 at `total_updates`, or constant."""
    return get_scheduler(
        HF_SCHEDULES[schedule],
        optimizer,
        num_warmup_steps=warmup_updates,
        num_training_steps=total_updates,
    )
