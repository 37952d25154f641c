"""What each distillation estimator is, declared once: its name, whether it reads the teacher's top-k,
and what it computes. The job spec validates `hyper_parameters.distill_loss` and `teacher_top_k` with
these declarations; the learner pairs each with its function (`learner/estimators.py`), so the spec (and
the API server that validates specs, which has no torch) never imports the learner.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TEACHER_TOP_K = 8
"""`hyper_parameters.teacher_top_k` when unset, for an estimator that reads the teacher's top-k."""


@dataclass(frozen=True)
class EstimatorDeclaration:
    """One value of `hyper_parameters.distill_loss`: what the spec and the docs know of it."""

    name: str
    needs_top_k: bool
    """Whether it reads the teacher's top-k (then `teacher_top_k` >= 1)."""
    summary: str
    """What it computes, in a sentence (the job spec's field description and the docs)."""

    @property
    def default_top_k(self) -> int:
        """`teacher_top_k` when the job leaves it unset: not paid for where nothing reads it."""
        return DEFAULT_TEACHER_TOP_K if self.needs_top_k else 0

    def check_top_k(self, top_k: int) -> None:
        """Raises ValueError, in the job spec's words, unless `top_k` gives this estimator what it reads."""
        if self.needs_top_k and top_k < 1:
            raise ValueError(
                f"distill_loss {self.name} needs hyper_parameters.teacher_top_k >= 1, got {top_k}"
            )


DECLARED_ESTIMATORS: dict[str, EstimatorDeclaration] = {
    declaration.name: declaration
    for declaration in (
        EstimatorDeclaration(
            "topk_forward",
            needs_top_k=True,
            summary="KL(teacher ‖ student) over the teacher's top-k tokens plus one tail bucket, "
            "differentiated through the student's logits (mass-covering).",
        ),
        EstimatorDeclaration(
            "topk_reverse",
            needs_top_k=True,
            summary="KL(student ‖ teacher) over the same buckets, differentiated through the student's "
            "logits (mode-seeking).",
        ),
        EstimatorDeclaration(
            "jsd",
            needs_top_k=True,
            summary="GKD's generalized JSD over the same buckets (β = jsd_beta).",
        ),
        EstimatorDeclaration(
            "sampled",
            needs_top_k=False,
            summary="the sampled token's log-ratio logp_student − logp_teacher as a policy-gradient "
            "advantage (a one-sample reverse KL).",
        ),
        EstimatorDeclaration(
            "sampled_baseline",
            needs_top_k=True,
            summary="sampled minus a per-position baseline computed from the teacher's top-k (unbiased, "
            "lower variance).",
        ),
    )
}
"""Every estimator's declaration, by its `distill_loss` name, in the order the docs list them."""

ESTIMATOR_NAMES: tuple[str, ...] = tuple(DECLARED_ESTIMATORS)


def declared_estimator(name: str) -> EstimatorDeclaration:
    """The estimator called `name`; ValueError naming the choices otherwise."""
    try:
        return DECLARED_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown distill_loss {name!r}; one of {', '.join(ESTIMATOR_NAMES)}") from None
