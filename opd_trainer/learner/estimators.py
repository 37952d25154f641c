"""The distillation estimators: each declaration of `jobspec/estimators.py` (its name, whether it reads
the teacher's top-k) paired with the function the learner applies (`ESTIMATORS`). The job spec reads the
declarations alone; the learner and the benchmarks read `ESTIMATORS`.

An estimator is a function of one `DistillationInputs` (what it reads of a mini-batch, typed) and the
job's `DistillationSettings`; it returns its loss, the per-token signal whose spread is logged as
`signal_std`, and the policy gradient's statistics. The formulas are in `learner/loss.py`, whose pure
tensor functions they combine; `distillation_loss` applies the job's estimator and adds the metrics
every estimator logs.

torch is imported where an estimator runs, not at the top: benchmarks and tools read this table in
processes that may have no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opd_trainer.jobspec.estimators import DECLARED_ESTIMATORS, EstimatorDeclaration, declared_estimator

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class DistillationSettings:
    """The job's settings the estimators read (the `hyper_parameters` of the same names)."""

    distill_loss: str
    """Which estimator of `ESTIMATORS` the learner applies."""
    teacher_top_k: int
    """Teacher tokens per completion position the batch carries (0: none)."""
    kl_coef: float
    """Weight of the distillation term, whichever estimator computes it."""
    jsd_beta: float
    ratio_cap: float
    """Truncation cap of the policy gradient's importance ratio."""
    stale_divergence: str = "current"
    """`sampled`'s log-ratio on stale rows: under the learner's student now, or the sampler's."""

    def __post_init__(self) -> None:
        declared_estimator(self.distill_loss).check_top_k(self.teacher_top_k)

    @property
    def estimator(self) -> Estimator:
        return ESTIMATORS[self.distill_loss]


@dataclass(frozen=True)
class DistillationInputs:
    """What an estimator reads of one mini-batch (this rank's share), built by `LearnerBatch`.

    `_B_T` tensors span the batch's width, aligned with its targets (position t: the token predicted
    there); `_B_S` ones start at `first_scored_position` (where every row's first completion token is
    predicted), where the learner's logits are. Values at masked positions are never read.
    """

    mask_B_T: Tensor
    """1.0 on trained completion tokens, 0.0 elsewhere."""
    sampler_B_T: Tensor
    """Logprob of each sampled token under the weights that sampled it."""
    teacher_B_T: Tensor
    """Logprob of the same token under the teacher."""
    learner_B_T: Tensor
    """The learner's logprob of the same token at the sampling temperature, with grad."""
    logits_B_S_V: Tensor
    """The learner's float logits (temperature 1), with grad."""
    first_scored_position: int
    top_ids_B_S_K: Tensor | None
    """The teacher's top-k ids at the scored positions; None when the job asks for no top-k."""
    top_logprobs_B_S_K: Tensor | None
    """Their teacher logprobs (temperature 1)."""
    row_advantages_B: Tensor | None
    """Each row's weighted advantage added to its trained tokens through the policy gradient (reward and
    hindsight terms, `batch.row_advantages`), or None."""
    num_tokens: float | None
    """The loss normaliser (None: this batch's trained tokens); see `loss.policy_loss`."""
    stale_B: Tensor | None = None
    """True on rows sampled with older weights than the learner's now (`LLMCall.staleness`); None: none."""

    def student_signal_B_T(self, stale_divergence: str) -> Tensor:
        """The student's logprob of each sampled token in the log-ratio signal: the sampler's, but on
        stale rows with `stale_divergence` "current" the learner's own now (detached), so a stale
        sample is judged by the student being trained, not the one that sampled it."""
        if self.stale_B is None or stale_divergence != "current" or not bool(self.stale_B.any()):
            return self.sampler_B_T
        # Lazy: the estimator table stays torch-free (the spec's validators read it).
        import torch

        return torch.where(self.stale_B[:, None], self.learner_B_T.detach(), self.sampler_B_T)

    @property
    def has_top_k(self) -> bool:
        return self.top_ids_B_S_K is not None and self.top_logprobs_B_S_K is not None

    def top_k(self) -> tuple[Tensor, Tensor, Tensor]:
        """`(top_ids_B_S_K, top_logprobs_B_S_K, mask_B_S)`, the arguments of the top-k functions."""
        if self.top_ids_B_S_K is None or self.top_logprobs_B_S_K is None:
            raise ValueError("this batch holds no teacher top-k (hyper_parameters.teacher_top_k is 0)")
        return self.top_ids_B_S_K, self.top_logprobs_B_S_K, self.mask_B_T[:, self.first_scored_position :]

    def full_width(self, values_B_S: Tensor) -> Tensor:
        """`values_B_S` padded back to the batch's width with zeros before the first scored position."""
        # Lazy: the estimator table stays torch-free (the spec's validators read it).
        import torch

        return torch.nn.functional.pad(values_B_S, (self.first_scored_position, 0))


@dataclass(frozen=True)
class EstimatorResult:
    loss: Tensor
    """0-dim, with grad: the distillation term plus the policy gradient of the per-row advantages."""
    signal_B_T: Tensor
    """The per-token distillation signal whose spread over trained tokens is logged (`signal_std`)."""
    stats: dict[str, Tensor]
    """`loss.policy_loss`'s ratio statistics."""


EstimatorFunction = Callable[[DistillationInputs, DistillationSettings], EstimatorResult]


@dataclass(frozen=True)
class Estimator:
    """One value of `hyper_parameters.distill_loss`: its declaration and the function that computes it."""

    declaration: EstimatorDeclaration
    function: EstimatorFunction

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def needs_top_k(self) -> bool:
        return self.declaration.needs_top_k

    @property
    def summary(self) -> str:
        return self.declaration.summary

    @property
    def default_top_k(self) -> int:
        return self.declaration.default_top_k


# -- the estimators ----------------------------------------------------------------------------------
# `from opd_trainer.learner import loss` inside each: see the module docstring (torch on use only).


def _policy_gradient(
    inputs: DistillationInputs, settings: DistillationSettings, advantages_B_T: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    # Lazy: the estimator table stays torch-free (the spec's validators read it).
    from opd_trainer.learner import loss

    return loss.policy_loss(
        inputs.learner_B_T,
        inputs.sampler_B_T,
        advantages_B_T,
        inputs.mask_B_T,
        settings.ratio_cap,
        inputs.num_tokens,
    )


def topk_forward(inputs: DistillationInputs, settings: DistillationSettings) -> EstimatorResult:
    """`kl_coef`·KL(teacher ‖ student) over the top-k buckets (`loss.topk_forward_kl_loss`) + row terms."""
    # Lazy: the estimator table stays torch-free (the spec's validators read it).
    from opd_trainer.learner import loss

    return _divergence(inputs, settings, loss.topk_forward_kl_loss)


def topk_reverse(inputs: DistillationInputs, settings: DistillationSettings) -> EstimatorResult:
    """`kl_coef`·KL(student ‖ teacher) over the top-k buckets (`loss.topk_reverse_kl_loss`) + row terms."""
    # Lazy: the estimator table stays torch-free (the spec's validators read it).
    from opd_trainer.learner import loss

    return _divergence(inputs, settings, loss.topk_reverse_kl_loss)


def jsd(inputs: DistillationInputs, settings: DistillationSettings) -> EstimatorResult:
    """`kl_coef`·JSD_β over the top-k buckets (`loss.topk_jsd_loss`, β = `jsd_beta`) + row terms."""
    # Lazy: the estimator table stays torch-free (the spec's validators read it).
    from opd_trainer.learner import loss

    def divergence(
        logits_B_S_V: Tensor, ids: Tensor, logprobs: Tensor, mask_B_S: Tensor, num_tokens: float | None
    ) -> tuple[Tensor, Tensor]:
        return loss.topk_jsd_loss(
            logits_B_S_V, ids, logprobs, mask_B_S, beta=settings.jsd_beta, num_tokens=num_tokens
        )

    return _divergence(inputs, settings, divergence)


def _divergence(
    inputs: DistillationInputs,
    settings: DistillationSettings,
    divergence: Callable[..., tuple[Tensor, Tensor]],
) -> EstimatorResult:
    """A top-k divergence, differentiated through the student's logits, plus the per-row advantages
    (reward, hindsight) through the policy gradient (a zero advantage where there are none)."""
    # Lazy: the estimator table stays torch-free (the spec's validators read it).
    from opd_trainer.learner import loss

    distill, per_token_B_S = divergence(inputs.logits_B_S_V, *inputs.top_k(), inputs.num_tokens)
    zeros_B_T = inputs.learner_B_T.new_zeros(inputs.learner_B_T.shape)
    advantages_B_T = loss.add_reward_advantages(zeros_B_T, inputs.mask_B_T, inputs.row_advantages_B, 1.0)
    policy, stats = _policy_gradient(inputs, settings, advantages_B_T)
    return EstimatorResult(policy + settings.kl_coef * distill, inputs.full_width(per_token_B_S), stats)


def sampled(inputs: DistillationInputs, settings: DistillationSettings) -> EstimatorResult:
    """The sampled token's log-ratio as a policy-gradient advantage (`loss.opd_advantages`)."""
    # Lazy: the estimator table stays torch-free (the spec's validators read it).
    from opd_trainer.learner import loss

    student_B_T = inputs.student_signal_B_T(settings.stale_divergence)
    advantages_B_T = loss.opd_advantages(
        student_B_T,
        inputs.teacher_B_T,
        inputs.mask_B_T,
        settings.kl_coef,
        inputs.row_advantages_B,
        1.0,
    )
    policy, stats = _policy_gradient(inputs, settings, advantages_B_T)
    return EstimatorResult(policy, student_B_T - inputs.teacher_B_T, stats)


def sampled_baseline(inputs: DistillationInputs, settings: DistillationSettings) -> EstimatorResult:
    """`sampled` minus a per-position baseline from the top-k (`loss.topk_signal_baseline`)."""
    # Lazy: the estimator table stays torch-free (the spec's validators read it).
    from opd_trainer.learner import loss

    baseline_B_T = inputs.full_width(loss.topk_signal_baseline(inputs.logits_B_S_V.detach(), *inputs.top_k()))
    student_B_T = inputs.student_signal_B_T(settings.stale_divergence)
    distill_B_T = loss.sampled_baseline_advantages(
        student_B_T, inputs.teacher_B_T, baseline_B_T, inputs.mask_B_T, settings.kl_coef
    )
    advantages_B_T = loss.add_reward_advantages(distill_B_T, inputs.mask_B_T, inputs.row_advantages_B, 1.0)
    policy, stats = _policy_gradient(inputs, settings, advantages_B_T)
    return EstimatorResult(policy, student_B_T - inputs.teacher_B_T - baseline_B_T, stats)


_FUNCTIONS: dict[str, EstimatorFunction] = {
    "topk_forward": topk_forward,
    "topk_reverse": topk_reverse,
    "jsd": jsd,
    "sampled": sampled,
    "sampled_baseline": sampled_baseline,
}

ESTIMATORS: dict[str, Estimator] = {
    name: Estimator(declaration, _FUNCTIONS[name]) for name, declaration in DECLARED_ESTIMATORS.items()
}
"""Every estimator, by its `distill_loss` name, in the declarations' order."""


def distillation_loss(
    settings: DistillationSettings, inputs: DistillationInputs
) -> tuple[Tensor, dict[str, Tensor]]:
    """The job's estimator on one mini-batch: its loss and stats, plus what every estimator logs.

    `signal_std` is the spread over trained tokens of the estimator's per-token signal; with the
    teacher's top-k in the batch, `teacher_topk_mass` and `student_topk_mass` (`loss.topk_metrics`)
    whatever the estimator. The top-k functions see both models at temperature 1.
    """
    # Lazy: the estimator table stays torch-free (the spec's validators read it).
    from opd_trainer.learner import loss

    extra = loss.topk_metrics(inputs.logits_B_S_V.detach(), *inputs.top_k()) if inputs.has_top_k else {}
    result = settings.estimator.function(inputs, settings)
    signal_std = loss.signal_std(result.signal_B_T.detach(), inputs.mask_B_T)
    return result.loss, {**result.stats, **extra, "signal_std": signal_std}
