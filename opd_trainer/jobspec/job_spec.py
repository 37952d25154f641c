"""The OPD job spec: one pydantic model, the single definition of every field, its default and meaning.

Field names follow Alibaba Bailian's OPD product (`n_epochs`, `batch_size`, `n_rollouts`, ...) so
job files port unchanged; `kl_coef`, `reward_coef`, `temperature`, `max_tokens`, `seed`,
`max_failed_ratio` and `max_staleness` are ours. Unknown fields and wrong types are rejected with a
message naming the field (`load_job_spec` turns pydantic's errors into one `ConfigError`).

A job with no rollout component is Model OPD (the built-in one-call rollout); with one it is Agentic OPD.
Reward components score every rollout (training and validation); an evaluator component, if any, scores
validation rollouts only. Rewards enter the loss by default (`reward_coef`, see `opd_trainer.learner.loss`).

Bailian job documents are accepted as written: a dataset may be Bailian's
`{data_source_type: FILE_ID, file_name}` object (normalised here, once, to its `file_name`), and
Bailian-only settings with no meaning here (`resources.charge_type`, `resources.mtu_spec_code`,
`resources.mtu_capacity`, `hyper_parameters.opd_teacher_*` deployment keys) are moved to
`ignored_fields`, which the job driver reports once in the job's events. Anything else unknown is
still an error naming the field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    JsonValue,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.estimators import DECLARED_ESTIMATORS, DEFAULT_TEACHER_TOP_K, ESTIMATOR_NAMES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Bailian settings that have no meaning for this trainer: billing and Bailian's own teacher deployment.
SELF_TEACHER = "self"
"""`teacher_model: self`: the student's initial weights score the student (frozen)."""

BAILIAN_ONLY_RESOURCES = frozenset({"charge_type", "mtu_spec_code", "mtu_capacity"})
BAILIAN_ONLY_HYPER_PARAMETER_PREFIX = "opd_teacher_"


def is_bailian_only(path: str) -> bool:
    """True for `resources.{charge_type,mtu_spec_code,mtu_capacity}` and `hyper_parameters.opd_teacher_*`."""
    section, _, name = path.partition(".")
    if section == "resources":
        return name in BAILIAN_ONLY_RESOURCES
    return section == "hyper_parameters" and name.startswith(BAILIAN_ONLY_HYPER_PARAMETER_PREFIX)


class DataSourceType(str, Enum):  # noqa: UP042 -- `str, Enum` like Bailian's, so it compares to "FILE_ID"
    """Where a Bailian dataset object's `file_name` points; FILE_ID: a file (a local path or a file id)."""

    FILE_ID = "FILE_ID"


class DatasetSource(_Strict):
    """Bailian's dataset object; in a job spec it stands for its `file_name`."""

    data_source_type: DataSourceType = Field(
        default=DataSourceType.FILE_ID, description="FILE_ID: `file_name` is a local path or a file id."
    )
    file_name: str = Field(min_length=1, description="A local JSONL path (uploaded on submit) or a file id.")

    @field_validator("data_source_type", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


def _dataset_file(value: Any) -> Any:
    """A dataset entry in its one stored form, the string: Bailian's object becomes its `file_name`."""
    if isinstance(value, DatasetSource):
        return value.file_name
    if isinstance(value, Mapping):
        try:
            return DatasetSource.model_validate(value).file_name
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ValueError(f"{error_field_path(first['loc'])}: {first['msg']}") from None
    return value


# The schema (and so the API's OpenAPI document) shows both accepted forms; the value is the string.
DatasetFile = Annotated[str, BeforeValidator(_dataset_file, json_schema_input_type=str | DatasetSource)]


class FcModel(_Strict):
    """Where a processor's code lives and which class to load."""

    zipdir: str | None = Field(default=None, description="Local workspace directory (or .zip) with the code.")
    workspace: str | None = Field(
        default=None, description="Id of a workspace zip uploaded to the job server."
    )
    classpath: str = Field(description="`pkg.module.Class` or `path/file.py:Class` inside the workspace.")

    @model_validator(mode="after")
    def _one_source(self) -> FcModel:
        if (self.zipdir is None) == (self.workspace is None):
            raise ValueError("give exactly one of zipdir or workspace")
        return self


# `runtime.env` names a component may not set, exactly or by prefix (`*`), and why: each changes how
# the dynamic loader, an interpreter or a shell starts (and so runs code of the tenant's choosing before
# the sandbox applies, e.g. PYTHONPATH to a sitecustomize.py), or belongs to the service. OMP_* and
# the like stay the component's own.
RESERVED_ENV: dict[str, str] = {
    "LD_*": "the dynamic loader's (LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT load code into every process)",
    "PYTHON*": "the Python interpreter's (PYTHONPATH, PYTHONSTARTUP, PYTHONHOME load code at its start)",
    "BASH_ENV": "a file bash runs at its start",
    "ENV": "a file sh runs at its start",
    "PATH": "it decides which programs the launcher runs",
    "HOME": "programs read start-up files from it",
    "IFS": "it changes how the shell splits words",
    "SHELLOPTS": "the shell's options (xtrace with PS4 runs code)",
    "PS4": "the shell expands it, running code, under xtrace",
    "PERL5*": "the Perl interpreter's (PERL5LIB, PERL5OPT load code)",
    "RUBY*": "the Ruby interpreter's (RUBYLIB, RUBYOPT load code)",
    "NODE_OPTIONS": "the Node.js interpreter's options (--require loads code)",
    "GCONV_PATH": "glibc loads charset modules from it",
    "MALLOC_*": "glibc's allocator's",
    "GLIBC_TUNABLES": "glibc's settings",
    "LOCPATH": "glibc reads locale files from it",
    "TMPDIR": "the sandbox sets the private scratch folder",
    "VIRTUAL_ENV": "the service sets the workspace's Python environment",
    "PIP_*": "pip's (an index URL or options: requirements install from the operator's index only)",
    "SSL_CERT_*": "it decides which TLS certificates are trusted",
    "REQUESTS_CA_BUNDLE": "it decides which TLS certificates are trusted",
    "OPD_*": "the service's own settings",
    "RAY_*": "the Ray cluster's settings",
    "CUDA_*": "the service places workers on devices",
    "NCCL_*": "the service's GPU communication",
}
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_VALUE_MAX_CHARS = 4096


def reserved_env_reason(name: str) -> str | None:
    """Why `name` is in `RESERVED_ENV` (exactly, or by a prefix entry), None if it is not."""
    for pattern, reason in RESERVED_ENV.items():
        if name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            return reason
    return None


class FunctionRuntime(_Strict):
    """Size and autoscaling of the worker pool that runs one processor component."""

    cpu: float = Field(default=1.0, gt=0, description="CPU cores per worker.")
    memory_size: int = Field(default=2048, gt=0, description="Memory per worker, MB.")
    disk_size: int = Field(
        default=1024,
        gt=0,
        description="Scratch disk per worker, MB: the size of the sandbox's private /tmp, which holds the "
        "workspace and anything the processor writes (not enforced when processors run unconfined).",
    )
    concurrency: int = Field(default=8, ge=1, description="Calls one worker runs at once.")
    capacity: int = Field(default=1, ge=0, description="Workers at start.")
    min_capacity: int = Field(default=1, ge=0, description="Fewest workers the autoscaler keeps.")
    max_capacity: int = Field(default=4, ge=1, description="Most workers the autoscaler starts.")
    memory_scale_threshold: float = Field(
        default=0.8, gt=0, le=1, description="Scale up when worker memory use passes this fraction."
    )
    concurrency_scale_threshold: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="Scale up when in-flight calls / (workers × concurrency) pass this.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for the component's processes: names of letters, digits and `_` "
        "(not starting with a digit), values of at most 4096 characters without NUL. Names that change how "
        "a loader, interpreter or shell starts, or that the service owns, are refused (`RESERVED_ENV`: "
        "LD_*, PYTHON*, PATH, HOME, BASH_ENV, PIP_*, OPD_*, RAY_*, CUDA_*, ...).",
    )

    @model_validator(mode="after")
    def _capacities_ordered(self) -> FunctionRuntime:
        if not self.min_capacity <= self.capacity <= self.max_capacity:
            raise ValueError("need min_capacity <= capacity <= max_capacity")
        return self


class FunctionComponent(_Strict):
    """A user processor: the rollout (at most one), a reward (any number), an evaluator (at most one) or a
    beacon writer (at most one)."""

    name: str = Field(min_length=1, description="Component name, unique in the job.")
    type: Literal["rollout", "reward", "evaluator", "beacon"] = Field(
        description="rollout: drives the student (AbstractRolloutProcessor). reward: scores every rollout "
        "(AbstractRewardProcessor). evaluator: scores validation rollouts only, with the reward interface; "
        "the means of its reward_metrics are reported under their own names, its reward_score as eval_score. "
        "beacon: writes the hindsight beacons of `hyper_parameters.beacon_rewrite` (AbstractBeaconProcessor: "
        "given each finished, scored rollout and its trained turns, feedback for the turns that went wrong) "
        "instead of the built-in rule for tool errors."
    )
    fcmodel: FcModel = Field(description="Code location and classpath.")
    timeout: float = Field(
        default=600.0, gt=0, description="Seconds one call may take before it counts FAILED."
    )
    weight: float = Field(
        default=1.0,
        description="Reward components: task reward R = Σ weight · (reward_score + Σ reward_metric_weight[m] "
        "· reward_metrics[m]), Bailian's meaning; R enters the loss scaled by hyper_parameters.reward_coef.",
    )
    reward_metric_weight: dict[str, float] | None = Field(
        default=None, description="Reward components: weights of named reward_metrics folded into the score."
    )
    runtime: FunctionRuntime = Field(default_factory=FunctionRuntime, description="Worker pool size/scaling.")

    @field_validator("runtime")
    @classmethod
    def _safe_env(cls, runtime: FunctionRuntime, info: ValidationInfo) -> FunctionRuntime:
        """`runtime.env`, checked here, where the error can name the component: a name and value that
        reach the worker's launcher as they are, and no name of `RESERVED_ENV`."""
        where = f"functions.{info.data.get('name', '?')}.runtime.env"
        for name, value in runtime.env.items():
            if not ENV_NAME.fullmatch(name):
                raise ValueError(f"{where}: {name[:64]!r} is not a variable name (letters, digits, _)")
            reason = reserved_env_reason(name)
            if reason is not None:
                raise ValueError(f"{where}.{name}: not settable by a job: {reason}")
            if len(value) > ENV_VALUE_MAX_CHARS or "\x00" in value:
                raise ValueError(f"{where}.{name}: the value must be at most 4096 characters, without NUL")
        return runtime


# The estimators and what each reads are declared once, in learner/estimators.py (a Literal of a tuple
# is the Literal of its items). The default was chosen from benchmarks/vs_trl_gkd.py and
# benchmarks/efficacy.py (docs/benchmarks.md).
DistillLoss = Literal[ESTIMATOR_NAMES]  # type: ignore[valid-type]
DEFAULT_DISTILL_LOSS = "topk_forward"


def _distill_loss_description() -> str:
    choices = " ".join(
        f"{e.name}: {e.summary}{' Needs teacher_top_k >= 1.' if e.needs_top_k else ''}"
        for e in DECLARED_ESTIMATORS.values()
    )
    return (
        f"Distillation estimator (learner/estimators.py; formulas in learner/loss.py), weighted by "
        f"kl_coef. {choices} The default, {DEFAULT_DISTILL_LOSS}, learned fastest per step in "
        "docs/benchmarks.md."
    )


class LoraSettings(_Strict):
    """Low-rank adapters (LoRA) on the student, named as PEFT's `LoraConfig`: the learner trains only
    the adapters (PEFT), the student engines serve them with vLLM's LoRA support (one `LoRARequest` per
    weight version), and each step moves the adapter's bytes, not the model's."""

    r: int = Field(default=16, ge=1, le=256, description="Adapter rank (PEFT's `r`).")
    lora_alpha: float = Field(
        default=32.0, gt=0, description="Scaling numerator: the update is (lora_alpha / r) · B·A."
    )
    lora_dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="Names of the linear modules that get adapters (suffixes of module names, as PEFT "
        "matches them); pre-flight refuses a name the student lacks. Default: every attention and MLP "
        "projection of Llama / Qwen / Mistral-style models.",
    )


# Every projection of a Llama / Qwen2 / Mistral decoder layer (vLLM serves adapters on each of them).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class HyperParameters(_Strict):
    """Optimisation and sampling settings."""

    n_epochs: int = Field(default=1, ge=1, description="Passes over the training datasets.")
    max_steps: int | None = Field(
        default=None, ge=1, description="Stop after this many steps (None: epochs)."
    )
    learning_rate: float = Field(default=1e-5, gt=0, description="Peak AdamW learning rate.")
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="Decay after warm-up."
    )
    warmup_ratio: float = Field(default=0.0, ge=0, lt=1, description="Fraction of steps spent warming up.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    batch_size: int = Field(default=8, ge=1, description="Prompts per step.")
    n_rollouts: int = Field(
        default=4, ge=1, description="Samples per prompt (the group of the reward baseline)."
    )
    ppo_mini_batch_size: int = Field(
        default=8, ge=1, description="Rollout samples per optimizer update; a step makes ceil(samples/this)."
    )
    max_length: int | None = Field(
        default=None,
        ge=16,
        description="Longest prompt + completion, in tokens. None: the model's context (the smaller "
        "max_position_embeddings of student and teacher); larger than that is rejected by pre-flight.",
    )
    max_tokens: int = Field(default=256, ge=1, description="Most tokens sampled per LLM call.")
    lora: LoraSettings | None = Field(
        default=None,
        description="Train low-rank adapters instead of every weight (None: full training). With "
        "teacher_model 'self' the teacher is the base model without the adapter.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping "
        "them: activation memory of about one layer instead of all, for ~30 % more learner compute.",
    )
    temperature: float = Field(default=1.0, gt=0, description="Student sampling temperature.")
    kl_coef: float = Field(
        default=1.0,
        ge=0,
        description="Weight of the distillation term toward the teacher, whichever distill_loss computes it.",
    )
    kl_loss_coef: float = Field(default=0.0, ge=0, description="Weight of KL(learner ‖ initial student).")
    reward_coef: float = Field(
        default=1.0,
        ge=0,
        description="Weight of the group-baselined task reward in each token's advantage (the formula is in "
        "opd_trainer/learner/loss.py). Rewards count by default; 0 keeps them as logged monitoring only.",
    )
    hindsight_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the turn-level hindsight advantage (opd_trainer/signal/hindsight.py): at the "
        "first turn where one of a prompt's worst trajectories parted from one of its best, from the same "
        "context, the better turn's tokens get +hindsight_coef and the worse one's -hindsight_coef in their "
        "advantage. 0 (default): off.",
    )
    turn_preference_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the turn-level preference term (pairs: opd_trainer/signal/pairs.py; loss: "
        "opd_trainer/learner/preference_loss.py): "
        "per prompt, at the first turn where a best and a worst trajectory answered the same context "
        "differently (parsed actions: tool names and canonical arguments, else normalised text), a DPO "
        "loss prefers the better answer's tokens over the worse one's against "
        "`turn_preference_reference`; actions both chosen and rejected are dropped. Per step: "
        "`preference/pairs`, `preference/skipped_context`, `preference/same_action`, "
        "`preference/conflicting`, `preference/low_reward`, `preference/turn_index_mean`, and the "
        "learner's `preference/loss`, `preference/accuracy`, `preference/margin`, "
        "`grad_norm/distillation`, `grad_norm/preference`. 0 (default): off.",
    )
    turn_preference_reference: Literal["initial", "rolling", "teacher"] = Field(
        default="initial",
        description="The DPO reference of the preference term: 'initial' (default), the frozen starting "
        "student (the margin is 0 at step 1; under LoRA the base with the adapter off, else a frozen copy "
        "of the student on the learner); 'rolling', that copy refreshed to the learner's weights every "
        "`turn_preference_reference_steps` steps (TurnSight's per-round reference); 'teacher', the "
        "teacher's logprobs of the same tokens.",
    )
    turn_preference_reference_steps: int = Field(
        default=1,
        ge=1,
        description="With `turn_preference_reference: rolling`, the steps between two refreshes of the "
        "reference (1: every step starts from a margin of 0).",
    )
    turn_preference_reduction: Literal["prompts", "pairs"] = Field(
        default="prompts",
        description="How the preference term's pair losses are reduced: 'prompts' (default), summed and "
        "divided by the mini-batch's prompts (a step with two pairs among 32 prompts weighs 2/32 of one "
        "with a pair per prompt); 'pairs', their mean (two pairs carry the whole term).",
    )
    turn_preference_min_chosen_reward: float | None = Field(
        default=None,
        description="A pair's chosen trajectory must have at least this reward (pairs below it are "
        "skipped, `preference/low_reward`); None (default): any reward above the rejected side's.",
    )
    turn_preference_swap: bool = Field(
        default=False,
        description="Swap every pair's chosen and rejected sides: a negative control for studies (the term "
        "then prefers the worse action). False (default).",
    )
    preference_level: Literal["turn", "outcome"] = Field(
        default="turn",
        description="What `turn_preference_coef` prefers: 'turn' (default), the two answers at the turn "
        "where a best and a worst trajectory parted (TurnSight's turn-level pairs); 'outcome', the whole "
        "better trajectory "
        "over the whole worse one, every trained turn of each (the ablation's baseline: turns both share "
        "cancel in the margin).",
    )
    turn_preference_beta: float = Field(
        default=0.1,
        gt=0,
        description="DPO's beta of the turn-level preference term: the scale of the log-ratio margin "
        "inside the sigmoid (larger: the preference saturates sooner).",
    )
    beacon_rewrite: Literal["off", "teacher", "student"] = Field(
        default="off",
        description="Hindsight beacons (TurnSight's): each trained turn whose "
        "tool calls got an error answer (or, with a `beacon` component, each turn it writes feedback for) "
        "is written again by the teacher ('teacher') or the student's engines ('student'), with a beacon "
        "saying what the turn did and what the tools answered (or the component's feedback) in its "
        "context; the rewrite becomes the chosen action of a preference pair against the original "
        "turn, for the turn's own context (the beacon is never in what is trained), weighted by "
        "`turn_preference_coef`, which must be above 0. A rewrite that repeats the turn, is cut off or "
        "carries the beacon's wording is dropped. Per step: `beacons/turns`, `beacons/pairs`, "
        "`beacons/unchanged`, `beacons/cut_off`, `beacons/leaked`, `beacons/skipped`, and with a beacon "
        "component `beacons/failed` (rollouts whose call failed) and `beacons/unknown_turn` (feedback "
        "naming no trained turn, or a second one for a turn). 'off' (default).",
    )

    beacon_sft_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of a supervised term on the kept beacon rewrites (`beacon_rewrite`): their "
        "tokens' mean negative log-likelihood, the improved action as a target (TurnSight's SFT "
        "positive) besides its place as a pair's chosen side. 0 (default): off.",
    )
    beacon_temperature: float = Field(
        default=0.0,
        ge=0,
        description="Sampling temperature of a beacon's rewrite (`beacon_rewrite`): 0 (default) is greedy, "
        "the rewriting model's most likely reply given the beacon; above 0 samples, seeded per step and "
        "turn (a model that does not act on the beacon greedily repeats the turn: `beacons/unchanged`).",
    )

    @field_validator("beacon_rewrite")
    @classmethod
    def _beacons_train_as_pairs(cls, value: str, info: ValidationInfo) -> str:
        if value != "off" and info.data.get("turn_preference_coef", 0.0) <= 0:
            raise ValueError(
                "each rewrite trains as a preference pair's chosen action: set "
                "hyper_parameters.turn_preference_coef above 0"
            )
        return value

    teacher_hindsight: Literal["none", "reference", "outcome"] = Field(
        default="none",
        description="Hindsight for the teacher (opd_trainer/signal/notes.py): a system note "
        "added to the context the teacher scores each LLM call with; what the student is sampled on and "
        "trained on never holds it. 'reference': the sample's reference answer (rollout_extra.ground_truth, "
        "else .solution). 'outcome': what the tools answered after the call (e.g. the error it caused), "
        "for calls the agent ran tools for. Calls with nothing to note, and calls the note cannot be placed "
        "in, are scored as sampled (`hindsight/teacher_note_share` per step). Pairs with `teacher_model: "
        "self`. 'none' (default): the teacher sees what the student saw.",
    )
    normalize_reward_by_std: bool = Field(default=False, description="Divide reward advantages by group std.")
    ratio_cap: float = Field(
        default=2.0,
        ge=1,
        description="Truncation cap of the importance ratio (>= 1: on-policy ratios are 1).",
    )
    stale_divergence: Literal["current", "sampler"] = Field(
        default="current",
        description="distill_loss sampled / sampled_baseline, with max_staleness >= 1: the log-ratio "
        "signal of a call sampled with older weights, taken under the student as the learner holds it "
        "now (`current`: the learner's own logprob of the token, the staleness-aware correction of "
        "asynchronous OPD) or under the weights that sampled it (`sampler`). The top-k estimators always "
        "compare the current student; the importance ratio corrects the sampling either way.",
    )
    eval_steps: int = Field(default=10, ge=1, description="Validate every this many steps.")
    eval_success_threshold: float = Field(
        default=1.0,
        description="A validation trajectory counts as a success (`agent/task_success`, pass@k) when its "
        "evaluator score, or without an evaluator its reward, is at least this.",
    )
    eval_pass_k: int = Field(
        default=1,
        ge=1,
        le=64,
        description="k of pass@k: with k > 1 each validation prompt is also rolled out k times at "
        "`eval_temperature` and `agent/pass_at_k` reports the share of prompts where one of them succeeded "
        "(k times more validation rollouts). 1 (default): the greedy validation pass only.",
    )
    eval_temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature of the pass@k rollouts (validation is greedy)."
    )
    save_steps: int = Field(
        default=50, ge=1, description="Checkpoint every this many steps (and at the end)."
    )
    keep_last_n: int | None = Field(
        default=None,
        ge=1,
        description="Checkpoints kept: the newest this many, plus the promoted (best) one, which is never "
        "removed. None keeps every checkpoint.",
    )
    seed: int = Field(default=42, description="Seed of data order, sampling and initialisation.")
    max_failed_ratio: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Fail the job when a step's failed rollout fraction exceeds this.",
    )
    max_staleness: int = Field(
        default=0,
        ge=0,
        description="Policy versions a sample may lag the learner. 0: strictly on-policy, each phase "
        "waits for the one before. k >= 1: the next k steps' rollouts (and teacher scores) run while the "
        "learner trains; 1 waits for the next batch before publishing weights (exactly one version "
        "behind), >= 2 samples on through the weight updates (each call keeps the version it was sampled "
        "with, at most k behind). Older samples are dropped and counted (`staleness/*` metrics).",
    )
    max_drift: float = Field(
        default=0.05, gt=0, description="Pre-flight: largest allowed mean |learner − sampler| logprob drift."
    )
    distill_loss: DistillLoss = Field(default=DEFAULT_DISTILL_LOSS, description=_distill_loss_description())
    jsd_beta: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="distill_loss jsd: β of JSD_β = β·KL(teacher ‖ m) + (1 − β)·KL(student ‖ m), "
        "m = β·teacher + (1 − β)·student (use topk_forward / topk_reverse for the end points).",
    )
    teacher_top_k: int = Field(
        default=0,
        validate_default=True,
        ge=0,
        # The teacher's scores are unpacked per (position, rank) in Python; beyond a few hundred that
        # costs more than the teacher's forward pass.
        le=256,
        description="Teacher tokens scored per completion position: the sampled token's logprob plus the "
        "teacher's teacher_top_k most likely tokens (temperature 1). 0: the sampled token only. Unset: "
        f"{DEFAULT_TEACHER_TOP_K} for the estimators that read the top-k, 0 for the others.",
    )

    @model_validator(mode="before")
    @classmethod
    def _top_k_default_follows_the_estimator(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("teacher_top_k") is None:
            estimator = DECLARED_ESTIMATORS.get(data.get("distill_loss", DEFAULT_DISTILL_LOSS))
            # An unknown name keeps the field's default; the distill_loss field reports the name.
            if estimator is not None:
                data = {**data, "teacher_top_k": estimator.default_top_k}
        return data

    @field_validator("teacher_top_k")
    @classmethod
    def _top_k_for_the_estimator(cls, value: int, info: ValidationInfo) -> int:
        estimator = DECLARED_ESTIMATORS.get(info.data.get("distill_loss", ""))
        if estimator is not None:  # None: distill_loss already failed, and says so
            estimator.check_top_k(value)
        return value

    @model_validator(mode="after")
    def _preference_knobs_need_the_term(self) -> HyperParameters:
        if self.beacon_sft_coef > 0 and self.beacon_rewrite == "off":
            raise ValueError(
                "hyper_parameters.beacon_sft_coef trains the kept beacon rewrites: set "
                "hyper_parameters.beacon_rewrite to 'teacher' or 'student'"
            )
        if (
            self.turn_preference_coef > 0
            and self.turn_preference_reference == "rolling"
            and self.kl_loss_coef > 0
        ):
            raise ValueError(
                "hyper_parameters.turn_preference_reference 'rolling' refreshes the frozen copy that "
                "kl_loss_coef holds the student near: use 'initial', or kl_loss_coef 0"
            )
        return self

    def lora_targets(self) -> list[str] | None:
        """The modules that get adapters (None: full training)."""
        return None if self.lora is None else self.lora.target_modules

    def total_steps(self, training_samples: int) -> int:
        """Steps a job of `training_samples` runs: `max_steps`, else `n_epochs` passes of `batch_size`."""
        return self.max_steps or self.n_epochs * math.ceil(training_samples / self.batch_size)


class EngineResources(_Strict):
    """Placement of one model's vLLM engines."""

    replicas: int = Field(default=1, ge=1, description="Independent engine replicas.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per replica (CUDA only).")
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        gt=0,
        description="KV-cache bytes per replica. None: on GPU vLLM sizes it (see gpu_fraction); on CPU it "
        "holds batch_size × n_rollouts sequences of max_length, capped at a share of the node's free memory.",
    )
    dtype: str = Field(default="auto", description="Engine weight dtype; 'auto' takes the checkpoint's.")
    ray_resources: dict[str, float] = Field(
        default_factory=dict,
        description='Custom Ray resources each replica requires, e.g. {"h100": 1} to run only on nodes '
        "started with `ray start --resources '{\"h100\": 8}'` (how a job picks node types).",
    )
    gpu_fraction: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Share of one GPU per replica (CUDA only): Ray reserves this fraction and, unless "
        "kv_cache_memory_bytes is set, vLLM may use this fraction of the GPU's memory. Below 1, "
        "student, teacher and learner can share one GPU; needs tensor_parallel_size 1.",
    )

    @model_validator(mode="after")
    def _fraction_needs_one_gpu(self) -> EngineResources:
        # A fractional Ray reservation exposes one GPU to the actor, so a TP group could not form.
        if self.gpu_fraction < 1 and self.tensor_parallel_size != 1:
            raise ValueError("gpu_fraction below 1 needs tensor_parallel_size 1")
        return self


class Resources(_Strict):
    """Where the job's models run."""

    student: EngineResources = Field(default_factory=EngineResources, description="Student sampling engines.")
    teacher: EngineResources = Field(default_factory=EngineResources, description="Teacher scoring engines.")
    learner_gpus: int = Field(
        default=1,
        ge=0,
        description="Data-parallel learner ranks, one GPU each (gloo CPU ranks on a machine without "
        "GPUs); 0 means one rank. Each mini-batch is split across ranks by prompt group.",
    )
    learner_gpu_fraction: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Share of one GPU per learner rank (CUDA only); below 1 shares a GPU with engines.",
    )
    learner_ray_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each learner rank requires (as `student.ray_resources`).",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(default=2, description="DeepSpeed ZeRO stage of the learner.")
    optimizer_offload: bool = Field(
        default=False,
        description="Keep AdamW's state and step in host memory (DeepSpeed's offload_optimizer, CPU Adam): "
        "frees ~12 bytes a trained parameter of GPU memory (on a CPU learner: DeepSpeed's fused CPU Adam "
        "on its own fp32 copy). Needs zero_stage 2 or 3.",
    )
    placement_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="How long Ray may take to place the engines and learner ranks (an autoscaler adding "
        "nodes included); past it the job fails naming the resource field and what the cluster has.",
    )
    max_recoveries: int | None = Field(
        default=None,
        ge=0,
        description="How many times the job recovers from a lost component (an engine replica, the gateway "
        "host, a learner rank, a node: restarted, resumed from the latest checkpoint) before it fails; the "
        "same components lost at the same step twice fail it at once. Default: the server's "
        "OPD_MAX_RECOVERIES (3), or 3 under `opd train`. 0: the first loss fails the job.",
    )
    weight_transfer: Literal["auto", "shm", "ray", "cuda_ipc", "nccl"] = Field(
        default="auto",
        description="How the learner's weights reach the student engines after each step: 'shm' a "
        "shared-memory file on the learner's node (engines there only), 'ray' Ray's object store (any "
        "node, one more copy per engine node), 'auto' shared memory for engines on the learner's node "
        "and the object store for the others. Opt-in on GPU jobs, never chosen by 'auto' and not yet run "
        "on a GPU: 'cuda_ipc' (engines on the learner's node open its GPU buffer) and 'nccl' (a broadcast "
        "group with the engines, any node); both move 512 MiB buckets GPU to GPU and are refused on a "
        "machine without CUDA. One transport class each in `opd_trainer/weight_sync/`.",
    )

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> Resources:
        if self.optimizer_offload and self.zero_stage < 2:
            raise ValueError(
                "optimizer_offload needs zero_stage 2 or 3 (DeepSpeed offloads ZeRO's partitions)"
            )
        return self


class Promotion(_Strict):
    """Which checkpoint becomes the job's `fine_tuned_model`: the best validation by `metric`, with
    optional gates. Needs validation_datasets; without them the last checkpoint is the model."""

    metric: str | None = Field(
        default=None,
        min_length=1,
        description="A metric the job's validation reports (any name: the evaluator's, `reward_mean`, "
        "`reverse_kl`, `agent/...`). Default: `eval_score` with an evaluator component, else `reward_mean` "
        "with reward components, else `reverse_kl`. A name the first validation does not report fails the "
        "job naming the ones it does.",
    )
    higher_is_better: bool | None = Field(
        default=None,
        description="The metric's direction. Default: lower is better for `reverse_kl` and names ending in "
        "`loss` or `kl`, higher for everything else.",
    )
    min_gain_over_start: float | None = Field(
        default=None,
        ge=0,
        description="Gate: promote only a validation that beats the starting student's by at least this "
        "much (in the metric's direction). A job whose gate is never met ends succeeded with no "
        "fine_tuned_model and an event saying why.",
    )
    threshold: float | None = Field(
        default=None,
        description="Gate: promote only a validation at least this good (>= when higher is better, <= "
        "otherwise).",
    )

    def direction_higher(self, metric: str) -> bool:
        if self.higher_is_better is not None:
            return self.higher_is_better
        return not (metric == "reverse_kl" or metric.endswith(("loss", "kl")))


class Budget(_Strict):
    """Limits on what a job may use (`driver/metering.py` measures it). Checked after every step: the job
    stops at the first limit reached, as a finished job does (final validation, checkpoint, promotion)
    and ends succeeded, the limit named in its events. Unset limits do not apply."""

    max_teacher_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens the teacher engines processed: scored prompts and completions, and what the "
        "teacher generated for its validation baseline (`usage.teacher_tokens`).",
    )
    max_cpu_seconds: float | None = Field(
        default=None,
        gt=0,
        description="CPU-seconds of every role together: engines, learner, gateways, processor workers "
        "(`usage.cpu_s`).",
    )
    max_gpu_seconds: float | None = Field(
        default=None,
        gt=0,
        description="GPUs held times wall seconds, engines and learner together (`usage.gpu_s`).",
    )
    max_wall_seconds: float | None = Field(
        default=None, gt=0, description="Seconds since the job's driver started (`usage.wall_s`)."
    )


DEFAULT_TEACHER_NAME = "teacher"
"""The name of a job's only teacher when `teacher_model` is one model."""


class Teacher(_Strict):
    """One of several teachers (`teacher_model` given as a list): the samples whose data tag it lists
    are scored by it."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="Names the teacher in metrics (`teacher/NAME/...`) and engine actors.",
    )
    model: str = Field(
        min_length=1, description="Given like the job's `model`; `self`: the student's initial weights."
    )
    data_tags: list[str] = Field(
        default_factory=list,
        description="The data tags it scores: a record's `rollout_extra.data_tag`, else the name of the "
        "dataset file it came from without its extension (`math` for math.jsonl, or the file id). The "
        "teacher listing none is the default (for every other tag); without one, the first teacher is.",
    )

    @field_validator("data_tags")
    @classmethod
    def _tags_once(cls, value: list[str]) -> list[str]:
        if any(not tag for tag in value):
            raise ValueError("a data tag cannot be empty")
        if len(value) != len(set(value)):
            raise ValueError("names a data tag more than once")
        return value


def _teacher_form(value: Any) -> str:
    return "list" if isinstance(value, list) else "model"


class JobSpec(_Strict):
    """One OPD job."""

    job_name: str = Field(min_length=1, max_length=128, description="Human-readable job name.")
    model: str = Field(
        min_length=1,
        description="Student: a model folder, a Hugging Face id (org/name[@revision]) resolved "
        "through the hub cache (the job server uses only what its cache holds), or on the job server "
        "the file id of an uploaded model (purpose `model`).",
    )
    teacher_model: Annotated[
        Annotated[str, Field(min_length=1), Tag("model")]
        | Annotated[list[Teacher], Field(min_length=1), Tag("list")],
        Discriminator(_teacher_form),
    ] = Field(
        description="Teacher, given like `model`: same tokenizer and chat template as the student. "
        "`self`: a frozen copy of the student's initial weights (hindsight self-distillation with "
        "`hyper_parameters.teacher_hindsight`; without it, the KL only holds the student near its start); "
        "the job then shows `model` here. Several teachers: a list of {name, model, data_tags}, each "
        "scoring the samples whose data tag it lists (multi-teacher OPD); each runs its own engines with "
        "`resources.teacher`, and the default one also serves validation's teacher baseline and "
        "`auxiliary_models`.",
    )
    training_datasets: list[DatasetFile] = Field(
        min_length=1,
        description="JSONL files (paths or file ids, or Bailian's {data_source_type, file_name}).",
    )
    validation_datasets: list[DatasetFile] = Field(
        default_factory=list, description="JSONL files for evaluation, in the same forms."
    )
    functions: list[FunctionComponent] = Field(
        default_factory=list,
        description="At most one rollout component, any number of reward components, at most one "
        "evaluator component (validation only) and at most one beacon component (with beacon_rewrite).",
    )
    hyper_parameters: HyperParameters = Field(
        default_factory=HyperParameters, description="Training settings."
    )
    tool_call_parser: str = Field(
        default="hermes",
        min_length=1,
        description="vLLM's tool-call parser for the models' output format, as `vllm serve "
        "--tool-call-parser`: hermes (Qwen2.5/Qwen3, Hermes), llama3_json, mistral, pythonic, qwen3_xml, "
        "...; turns a completion into the `tool_calls` rollouts and evaluators see. Checked when the "
        "job starts against vLLM's registry and the tokenizer.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra chat-template variables for every prompt the job renders, as vLLM's "
        '`chat_template_kwargs` (e.g. {"enable_thinking": false} for Qwen3): built-in rollouts, and '
        "every call through the gateway unless the request sets its own.",
    )
    auxiliary_models: dict[str, Literal["teacher"]] = Field(
        default_factory=dict,
        description="Models served to the user's processors besides the student, by the name they look "
        "them up under (`RolloutInput.auxiliary_models`, `RewardInput.auxiliary_models`, a workflow's or "
        "judge's `auxiliary_models`), e.g. {judge: teacher} for an LLM judge. `teacher`: the job's "
        "teacher engines through a gateway of their own; calls are greedy (temperature 0), capped at "
        "max_tokens, never trained on and never scored. Another model would need engines of its own: "
        "not served.",
    )
    resources: Resources = Field(default_factory=Resources, description="Engine and learner placement.")
    promotion: Promotion = Field(
        default_factory=Promotion,
        description="How the best checkpoint is chosen by validation and gated; it becomes fine_tuned_model.",
    )
    budget: Budget = Field(
        default_factory=Budget,
        description="Limits on teacher tokens, CPU-/GPU-seconds and wall time; the job stops cleanly at the "
        "first one reached.",
    )
    report_to: list[Literal["tensorboard", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers that get every training and validation record besides the run "
        "dir's metrics.jsonl: `tensorboard` (event files in the run dir's tensorboard/) and `mlflow` (one "
        "run per job in the experiment named after job_name; see mlflow_tracking_uri). [] for none.",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="Where `report_to: [mlflow]` logs: an MLflow tracking URI (http://..., "
        "sqlite:///...). Default: the MLFLOW_TRACKING_URI environment variable of the job's driver, "
        "else a SQLite store in the run dir (mlflow.db; works offline). On the job server only a "
        "tracking server its operator allows (OPD_TRACKER_ALLOWED_URIS: scheme, host and port) is "
        "accepted, never sqlite:/file:; `opd train` accepts any.",
    )
    ignored_fields: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="Bailian-only settings with no meaning here, by path (`resources.charge_type`, "
        "`resources.mtu_spec_code`, `resources.mtu_capacity`, `hyper_parameters.opd_teacher_*`): "
        "set aside from the document as given and reported once in the job's events.",
    )

    @model_validator(mode="before")
    @classmethod
    def _teacher_self(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or "model" not in data:
            return data
        teacher = data.get("teacher_model")
        if teacher == SELF_TEACHER:
            return {**data, "teacher_model": data["model"]}
        if isinstance(teacher, list):
            teachers = [
                {**t, "model": data["model"]}
                if isinstance(t, Mapping) and t.get("model") == SELF_TEACHER
                else t
                for t in teacher
            ]
            return {**data, "teacher_model": teachers}
        return data

    @model_validator(mode="before")
    @classmethod
    def _set_aside_bailian_only(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data, moved = dict(data), {}
        for section in ("resources", "hyper_parameters"):
            values = data.get(section)
            if not isinstance(values, Mapping):
                continue
            ignored = {k: v for k, v in values.items() if is_bailian_only(f"{section}.{k}")}
            if ignored:
                data[section] = {k: v for k, v in values.items() if k not in ignored}
                moved.update({f"{section}.{k}": v for k, v in ignored.items()})
        if moved:
            earlier = data.get("ignored_fields")
            data["ignored_fields"] = {**(earlier if isinstance(earlier, Mapping) else {}), **moved}
        return data

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"names {', '.join(repeated)} more than once")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any]) -> dict[str, Any]:
        from opd_trainer.chat import RESERVED_TEMPLATE_KWARGS

        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(value))
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be set here: the trainer renders the prompt")
        return value

    @field_validator("ignored_fields")
    @classmethod
    def _only_bailian_fields(cls, value: dict[str, JsonValue]) -> dict[str, JsonValue]:
        unknown = sorted(path for path in value if not is_bailian_only(path))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a Bailian-only field this trainer ignores")
        return value

    @model_validator(mode="after")
    def _components(self) -> JobSpec:
        if len(self.rollout_components) > 1:
            raise ValueError("at most one rollout component")
        if len(self.evaluator_components) > 1:
            raise ValueError("at most one evaluator component")
        if len(self.beacon_components) > 1:
            raise ValueError("at most one beacon component")
        if self.beacon_components and self.hyper_parameters.beacon_rewrite == "off":
            raise ValueError(
                f"functions.{self.beacon_components[0].name}: a beacon component writes the beacons of "
                "hyper_parameters.beacon_rewrite: set it to 'teacher' or 'student'"
            )
        if self.evaluator_components and not self.validation_datasets:
            raise ValueError("an evaluator component scores validation rollouts: give validation_datasets")
        gates = (self.promotion.metric, self.promotion.min_gain_over_start, self.promotion.threshold)
        if any(value is not None for value in gates) and not self.validation_datasets:
            raise ValueError("promotion chooses a checkpoint by validation: give validation_datasets")
        names = [f.name for f in self.functions]
        if len(names) != len(set(names)):
            raise ValueError("component names must be unique")
        if self.hyper_parameters.beacon_rewrite != "off" and not (
            self.rollout_components or self.beacon_components
        ):
            raise ValueError(
                "hyper_parameters.beacon_rewrite rewrites turns whose tool calls got an error: it needs a "
                "rollout component whose agent runs tools (or a beacon component that writes the beacons)"
            )
        hp = self.hyper_parameters
        if (
            hp.turn_preference_coef > 0
            and hp.turn_preference_reference == "rolling"
            and hp.lora is not None
            and self.resources.zero_stage == 3
        ):
            raise ValueError(
                "hyper_parameters.turn_preference_reference 'rolling' keeps a copy of the LoRA adapter, "
                "which ZeRO-3 partitions: use 'initial', or resources.zero_stage 0-2"
            )
        if self.hyper_parameters.teacher_hindsight == "outcome" and not self.rollout_components:
            raise ValueError(
                "hyper_parameters.teacher_hindsight 'outcome' notes what the tools answered after each call: "
                "it needs a rollout component whose agent runs tools"
            )
        return self

    @field_validator("teacher_model")
    @classmethod
    def _teacher_routes(cls, value: str | list[Teacher]) -> str | list[Teacher]:
        if isinstance(value, str):
            return value
        names = [t.name for t in value]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"teacher names must be unique ({', '.join(repeated)} repeated)")
        tags = [tag for t in value for tag in t.data_tags]
        shared = sorted({tag for tag in tags if tags.count(tag) > 1})
        if shared:
            raise ValueError(f"data tag {', '.join(shared)} is listed by more than one teacher")
        if sum(not t.data_tags for t in value) > 1:
            raise ValueError("at most one teacher may list no data_tags (that one is the default)")
        return value

    @property
    def teachers(self) -> list[Teacher]:
        """Every teacher, the default first (one `teacher_model` is the teacher named `teacher`)."""
        if isinstance(self.teacher_model, str):
            return [Teacher(name=DEFAULT_TEACHER_NAME, model=self.teacher_model)]
        default = next((t for t in self.teacher_model if not t.data_tags), self.teacher_model[0])
        return [default, *(t for t in self.teacher_model if t is not default)]

    @property
    def default_teacher_model(self) -> str:
        """The default teacher's model: validation's teacher baseline and the auxiliary `teacher`."""
        return self.teachers[0].model

    def teacher_for_tag(self, tag: str) -> str:
        """The name of the teacher that scores samples tagged `tag`."""
        teachers = self.teachers
        return next((t.name for t in teachers if tag in t.data_tags), teachers[0].name)

    def weight_sources(self) -> dict[str, str]:
        """Every model the job loads, by the field that names it: `model`, then `teacher_model` (one
        teacher) or `teacher_model.I.model` (the I-th of several)."""
        if isinstance(self.teacher_model, str):
            return {"model": self.model, "teacher_model": self.teacher_model}
        teachers = {f"teacher_model.{i}.model": t.model for i, t in enumerate(self.teacher_model)}
        return {"model": self.model, **teachers}

    def with_weight_sources(self, sources: dict[str, str]) -> JobSpec:
        """A copy with the models `sources` names (keys as in `weight_sources`) replaced."""
        update: dict[str, Any] = {"model": sources.get("model", self.model)}
        if isinstance(self.teacher_model, str):
            update["teacher_model"] = sources.get("teacher_model", self.teacher_model)
        else:
            update["teacher_model"] = [
                t.model_copy(update={"model": sources.get(f"teacher_model.{i}.model", t.model)})
                for i, t in enumerate(self.teacher_model)
            ]
        return self.model_copy(update=update)

    @property
    def rollout_components(self) -> list[FunctionComponent]:
        return [f for f in self.functions if f.type == "rollout"]

    @property
    def reward_components(self) -> list[FunctionComponent]:
        return [f for f in self.functions if f.type == "reward"]

    @property
    def evaluator_components(self) -> list[FunctionComponent]:
        return [f for f in self.functions if f.type == "evaluator"]

    @property
    def beacon_components(self) -> list[FunctionComponent]:
        return [f for f in self.functions if f.type == "beacon"]

    @property
    def promotion_metric(self) -> str:
        """The metric promotion selects by (`promotion.metric` or its default for this job)."""
        if self.promotion.metric is not None:
            return self.promotion.metric
        if self.evaluator_components:
            return "eval_score"
        return "reward_mean" if self.reward_components else "reverse_kl"

    @property
    def is_agentic(self) -> bool:
        return bool(self.rollout_components)


def error_field_path(location: tuple[int | str, ...] | list[int | str]) -> str:
    """A validation error's location as the field it names (`hyper_parameters.batch_size`,
    `teacher_model.1.model`), "(job)" for the whole spec."""
    # teacher_model's second part is the form pydantic tried ("model" or "list", `_teacher_form`).
    parts = [
        part for index, part in enumerate(location) if not (index == 1 and location[0] == "teacher_model")
    ]
    return ".".join(str(part) for part in parts) or "(job)"


def parse_job_spec(data: Any) -> JobSpec:
    """Validates a decoded job document; raises `ConfigError` naming the first bad field."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        first, *rest = exc.errors()
        message = first["msg"]
        if rest:
            message += "; also " + "; ".join(f"{error_field_path(e['loc'])}: {e['msg']}" for e in rest)
        raise ConfigError(message, field=error_field_path(first["loc"])) from None


def load_job_spec(path: Path) -> JobSpec:
    """Reads a YAML or JSON job file; relative dataset/model/workspace paths resolve against its folder."""
    return resolve_paths(parse_job_spec(read_job_document(path)), path.parent)


def read_job_document(path: Path) -> dict[str, Any]:
    """The fields a YAML or JSON job file holds, not yet validated (paths as written)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read job file {path}: {exc.strerror}", field="job_file") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"{path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}", field="job_file"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of job fields", field="job_file")
    return data


def _resolve(value: str, base: Path) -> str:
    candidate = Path(value)
    if candidate.is_absolute() or not (base / candidate).exists():
        return value  # an absolute path, or not a local path at all (a file id / hub name)
    return str((base / candidate).resolve())


def resolve_paths(spec: JobSpec, base: Path) -> JobSpec:
    """Makes local paths in the spec absolute, relative to `base` (the job file's folder)."""
    functions = [
        f.model_copy(
            update={"fcmodel": f.fcmodel.model_copy(update={"zipdir": _resolve(f.fcmodel.zipdir, base)})}
        )
        if f.fcmodel.zipdir
        else f
        for f in spec.functions
    ]
    with_models = spec.with_weight_sources({k: _resolve(v, base) for k, v in spec.weight_sources().items()})
    return with_models.model_copy(
        update={
            "training_datasets": [_resolve(d, base) for d in spec.training_datasets],
            "validation_datasets": [_resolve(d, base) for d in spec.validation_datasets],
            "functions": functions,
        }
    )
