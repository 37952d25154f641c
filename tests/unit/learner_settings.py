"""`LearnerSettings` for unit tests that build a `Learner` without DeepSpeed (no model is loaded)."""

from __future__ import annotations

from opd_trainer.learner.deepspeed_learner import LearnerSettings

SETTINGS = LearnerSettings(
    model_path="unused",
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    warmup_ratio=0.0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    total_updates=1,
    temperature=1.0,
    kl_coef=1.0,
    kl_loss_coef=0.0,
    reward_coef=1.0,
    normalize_reward_by_std=False,
    hindsight_coef=0.0,
    ratio_cap=2.0,
    zero_stage=0,
    seed=0,
    distill_loss="sampled",
    jsd_beta=0.5,
)
