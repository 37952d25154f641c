"""The processor SDK: everything user code imports (`from opd_trainer.sdk import ...`).

`types` holds the contract (inputs, outputs, the abstract processors; Bailian's names and fields) and
needs only pydantic; the outputs and what makes a rollout a failure live in `outputs`, which `types`
re-exports. `tracing` sits on `outputs` (OpenTelemetry spans per rollout, LLM call and
reward) and is imported on first use of `observe_processor` or `trace_client`, so code that only
needs the types never loads the tracing and exporter stack. `workflow` turns workflow and judge
functions (AgentScope tuner's signatures) into rollout and reward processors.
"""

from __future__ import annotations

from typing import Any

from opd_trainer.sdk import types
from opd_trainer.sdk.types import *  # noqa: F403  (the contract is `types.__all__`)

_TRACING_NAMES = ("observe_processor", "trace_client")

__all__ = [*types.__all__, *_TRACING_NAMES]


def __getattr__(name: str) -> Any:
    """`observe_processor` and `trace_client` come from `opd_trainer.sdk.tracing`, loaded on first use."""
    if name in _TRACING_NAMES:
        from opd_trainer.sdk import tracing  # on first use: it loads OpenTelemetry

        return getattr(tracing, name)
    raise AttributeError(f"module 'opd_trainer.sdk' has no attribute {name!r}")
