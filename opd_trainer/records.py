"""One LLM call, the record that travels from the engine that sampled it to the learner that trains on it.

Each stage fills its part and passes a copy on (`dataclasses.replace`):

- the student engine (`engine.vllm_engine.Engine.generate`): the exact prompt and completion token ids,
  the sampler's logprob of each completion token, the text, vLLM's finish reason and the weight
  version it sampled with;
- the rollout gateway (agentic rollouts): the OpenAI messages it was asked with (and the tools and
  chat-template variables they were rendered with), the reply message it returned and whether it
  was well formed, OpenAI's finish reason (`stop`, `length`, `tool_calls`) and the call's latency;
- the training signal (`signal/`), for the learner: the teacher's logprob of each completion token (and with
  `hyper_parameters.teacher_top_k` = K > 0 its K most likely tokens per position, [T, K] int32 /
  float32 arrays, else None), whether the teacher scored it with hindsight, the prompt group, the
  rollout index and the rollout's reward; then staleness, hindsight values and preference pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

CHOSEN, REJECTED = 1, -1
"""The two sides of a preference pair, as `LLMCall.preference_pairs` marks them."""


@dataclass(frozen=True)
class LLMCall:
    # -- sampled (the student engine) --
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    sampler_logprobs: list[float]
    """Sampler logprob of each completion token, after temperature (the behaviour policy)."""
    weight_version: int = 0
    finish_reason: str | None = None
    text: str = ""
    # -- served (the rollout gateway) --
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    """The tools the prompt was rendered with (None: none)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """The chat-template variables the prompt was rendered with (job's and request's)."""
    response_message: dict[str, Any] = field(default_factory=dict)
    format_valid: bool = True
    """The reply was well formed: not cut off by max_tokens and, with tools offered, no call markup left
    unparsed and every call naming an offered tool with a JSON object of arguments."""
    latency_s: float = 0.0
    # -- scored, grouped and shaped (the training signal, for the learner) --
    teacher_logprobs: list[float] | None = None
    teacher_top_ids: np.ndarray | None = None
    teacher_top_logprobs: np.ndarray | None = None
    group_id: int = 0
    rollout_id: int = 0
    reward: float = 0.0
    hindsight: float = 0.0
    """Turn-level hindsight advantage of this call (signal/hindsight.py; 0 unless `hindsight_coef`)."""
    preference_pairs: tuple[tuple[int, int], ...] = ()
    """(pair id, `CHOSEN` / `REJECTED`) of each preference pair this call is an action of (signal/pairs.py,
    signal/beacons.py; empty unless `turn_preference_coef`)."""
    distilled: bool = True
    """The distillation loss trains on this call's tokens. False for a beacon's rewrite of a turn
    (signal/beacons.py): not the student's own sample, trained only as its pair's chosen action."""
    teacher_saw_note: bool = False
    """The teacher scored this call with the reference in its context (signal/notes.py)."""
    beacon: str = ""
    """A beacon's rewrite (signal/beacons.py): the beacon it was written with. Never trained; the
    trajectory view shows it beside the turn the rewrite is preferred over."""
    teacher_name: str = ""
    """The teacher that scored this call (`teacher_model`'s names; `teacher` for a job's only one)."""
    teacher_latency_s: float = 0.0
    """Seconds the scoring request that held this call took."""
    staleness: int = 0
    """Weight versions the learner is ahead of `weight_version` when it trains this call (set while the
    signal is shaped, `signal/staleness.py`; > 0 only with `max_staleness`)."""
