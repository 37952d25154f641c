"""The processor SDK's types: what users write rollout and reward code against (Bailian's names and fields).

Code written for Alibaba Bailian's OPD product ports by changing its import lines to
`from opd_trainer.sdk import ...`. A rollout processor runs the user's agent against the student
(reached through `RolloutInput.model_resource`, an OpenAI-compatible endpoint) and returns the
conversation; a reward processor scores one finished conversation.

    class MyRollout(AbstractRolloutProcessor):
        def setup(self) -> None:                      # once per worker
            self.tools = load_my_tools()

        @observe_processor                            # optional: the worker applies it anyway
        async def process(self, rollout_input: RolloutInput) -> RolloutOutput:
            mr = rollout_input.model_resource
            client = mr.openai_client()               # traced AsyncOpenAI, shared connection pool
            ...
            return RolloutOutput(agent_output=AgentOutput(messages=messages))

`process` may be `async def` or plain `def`; the worker calls it through `call_processor`, which
runs a plain `def` in a thread so it cannot stall the worker's event loop.

Inputs accept unknown fields (a newer trainer may send more); outputs reject them, so a misspelt
field (`reward_scores=`) fails loudly instead of being dropped. Every model pickles (Ray ships them
between processes); `api_key` is a `SecretStr`, so it never shows in a repr, log line or JSON dump.
`ground_truth` arrives exactly as the dataset stores it (a JSON string stays a string, an object is a
dict), and `request_metadata` is optional so a local test can build an input by hand, as Bailian's
local-test advice does; the trainer's workers always set it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import weakref
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, SecretStr

from opd_trainer.sdk.outputs import (
    PROMPT_MESSAGES_KEY,
    ROLLOUT_ERROR_PREFIX,
    AgentOutput,
    Beacon,
    BeaconOutput,
    Reward,
    RewardOutput,
    RolloutOutput,
    TaskStatus,
    is_rollout_failure,
)

__all__ = [
    "PROMPT_MESSAGES_KEY",
    "ROLLOUT_ERROR_PREFIX",
    "AbstractBeaconProcessor",
    "AbstractRewardProcessor",
    "AbstractRolloutProcessor",
    "AgentOutput",
    "Beacon",
    "BeaconInput",
    "BeaconOutput",
    "BeaconTurn",
    "BeaconVerdict",
    "BeaconVerifyInput",
    "ModelResource",
    "RequestMetadata",
    "Reward",
    "RewardInput",
    "RewardOutput",
    "RolloutInput",
    "RolloutOutput",
    "TaskStatus",
    "call_processor",
    "is_rollout_failure",
]


class _Input(BaseModel):
    model_config = ConfigDict(extra="allow")


class ModelResource(_Input):
    """The student endpoint a rollout talks to (OpenAI-compatible, via the trainer's gateway)."""

    model_name: str = Field(description="Model name to pass as `model=` in chat completion calls.")
    base_url: str = Field(description="OpenAI-compatible base URL, ending in /v1.")
    api_key: SecretStr = Field(description="Per-rollout token; `.get_secret_value()` gives the string.")

    def openai_client(self) -> Any:
        """An `openai.AsyncOpenAI` for this rollout (its key, calls traced), on a shared connection pool.

        Building an `AsyncOpenAI` costs ~20 ms of CPU (measured on the 2-core box), more than a tiny
        model's whole completion; this reuses one client per event loop and base URL and only swaps
        the key (`with_options`, ~0.03 ms). Retries are off: a retried call would be recorded twice.
        Call it inside the processor's `async def process` (the pool belongs to the running loop).
        """
        # On first use only: openai costs ~2 s to import, tracing loads OpenTelemetry, and code that
        # only needs the types (the sandboxed processor host, the server) never pays for either.
        from openai import AsyncOpenAI

        from opd_trainer.sdk.tracing import trace_client

        per_loop = _SHARED_CLIENTS.setdefault(asyncio.get_running_loop(), {})
        shared = per_loop.get(self.base_url)
        if shared is None:
            shared = per_loop[self.base_url] = AsyncOpenAI(
                base_url=self.base_url,
                api_key="per-rollout",
                max_retries=0,
                http_client=shared_http_client(),
            )
            _describe_platform_once(shared)
        client = shared.with_options(api_key=self.api_key.get_secret_value())
        _carry_platform(shared, client)
        return trace_client(client)


def _describe_platform_once(client: Any) -> None:
    """Fills in the platform description (`X-Stainless-*` headers) openai computes on a client's first
    request, off the event loop in a new thread (`asyncify(get_platform)`). A copy made by
    `with_options` starts without it, so every per-rollout client would pay that thread hop on its one
    call (~7 % of a one-call rollout processor's busy samples in py-spy). Best effort: an openai without
    these private names just computes it per client."""
    if not hasattr(client, "_platform") or client._platform is not None:
        return
    with contextlib.suppress(ImportError, AttributeError):
        from openai._base_client import get_platform

        client._platform = get_platform()


def _carry_platform(shared: Any, client: Any) -> None:
    platform = getattr(shared, "_platform", None)
    if platform is not None and hasattr(client, "_platform"):
        client._platform = platform


# One shared AsyncOpenAI per (event loop, base URL): httpx connection pools cannot cross event loops.
_SHARED_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = (
    weakref.WeakKeyDictionary()
)
_SHARED_HTTP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()


def shared_http_client() -> Any:
    """The running event loop's connection pool for calls to the job's gateways (openai's async HTTP
    client, made once per loop by `_http_client`). A client built on it costs ~0.04 ms instead of ~20
    ms of CPU for one with a pool of its own (`ModelResource.openai_client`, AgentScope's chat model in
    `sdk.workflow.chat_model`). Call it from inside the loop that will use it."""
    loop = asyncio.get_running_loop()
    shared = _SHARED_HTTP.get(loop)
    if shared is None:
        shared = _SHARED_HTTP[loop] = _http_client()
    return shared


def _http_client() -> Any:
    import httpx  # with openai, on first use (see `openai_client`)
    from openai import DefaultAioHttpClient, DefaultAsyncHttpxClient

    # A worker runs up to `runtime.concurrency` rollouts at once, each holding a connection while the
    # engine generates; httpx's default cap (100) would queue the rest.
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    try:
        # aiohttp's transport (openai's `aiohttp` option): httpx's own pool checks every idle
        # connection's socket on each request, which at 64 rollouts in flight was ~10 % of a worker's CPU.
        return DefaultAioHttpClient(limits=limits)
    except RuntimeError:  # an openai without its aiohttp transport
        return DefaultAsyncHttpxClient(limits=limits)


class RequestMetadata(_Input):
    """Ids of one rollout attempt; tracing spans carry them as `opd.*` attributes."""

    job_id: str = Field(description="Training job id.")
    sample_id: str = Field(description="Dataset sample (prompt) id; the rollouts of one prompt share it.")
    rollout_id: str = Field(description="Id of this rollout, unique in the job.")
    attempt_id: int = Field(default=0, ge=0, description="Retry number of this rollout, from 0.")


class RolloutInput(_Input):
    """What a rollout processor receives: one dataset sample plus where to reach the student."""

    messages: list[dict[str, Any]] = Field(description="The sample's chat messages (OpenAI format).")
    tools: list[dict[str, Any]] | None = Field(default=None, description="The sample's tool schemas.")
    ground_truth: JsonValue = Field(
        default=None, description="The sample's reference answer as stored (string, number, object, ...)."
    )
    rollout_extra: dict[str, Any] = Field(default_factory=dict, description="The sample's extra data.")
    sampling_params: dict[str, Any] = Field(
        default_factory=dict, description="Sampling settings to pass to the student (temperature, ...)."
    )
    model_resource: ModelResource = Field(description="The student endpoint.")
    auxiliary_models: dict[str, ModelResource] = Field(
        default_factory=dict,
        description="Other models the job serves to its processors (job field `auxiliary_models`), by "
        "name; calls to them are never trained on.",
    )
    # Optional, as in Bailian's SDK: a local test builds a RolloutInput without it; workers always set it.
    request_metadata: RequestMetadata | None = Field(default=None, description="Ids of this rollout attempt.")


class RewardInput(_Input):
    """What a reward processor receives: one finished rollout."""

    ground_truth: JsonValue = Field(
        default=None, description="The sample's reference answer as stored (string, number, object, ...)."
    )
    request_metadata: RequestMetadata | None = Field(
        default=None, description="Ids of the rollout being scored."
    )
    agent_output: AgentOutput = Field(description="The rollout's conversation.")
    auxiliary_models: dict[str, ModelResource] = Field(
        default_factory=dict,
        description="Other models the job serves to its processors (job field `auxiliary_models`), by "
        "name, e.g. the teacher as an LLM judge.",
    )


class BeaconTurn(_Input):
    """One trained turn of a finished rollout: the student's reply at that point and what answered it."""

    turn: int = Field(
        description="Its index among the rollout's LLM calls (0: the first); a Beacon names it."
    )
    messages: list[dict[str, Any]] = Field(description="The conversation the turn replied to.")
    reply: dict[str, Any] = Field(
        description="The student's reply (an assistant message, tool calls included)."
    )
    tool_answers: list[dict[str, Any]] = Field(
        default_factory=list, description="The tool messages that answered the reply (none: no tool ran)."
    )


class BeaconInput(_Input):
    """What a beacon processor receives: one finished, scored rollout and its trained turns."""

    ground_truth: JsonValue = Field(
        default=None, description="The sample's reference answer as stored (string, number, object, ...)."
    )
    request_metadata: RequestMetadata | None = Field(default=None, description="Ids of the rollout.")
    agent_output: AgentOutput = Field(description="The rollout's conversation.")
    reward: float = Field(
        description="The rollout's task reward (the weighted sum of its reward components)."
    )
    component_rewards: dict[str, float] = Field(
        default_factory=dict, description="Each reward component's score, by component name."
    )
    turns: list[BeaconTurn] = Field(description="The rollout's trained turns, in order.")


class BeaconVerifyInput(_Input):
    """What a beacon processor's `verify` receives: one rewrite of a beaconed turn, to be checked against
    the episode's own tools before it is trained."""

    ground_truth: JsonValue = Field(
        default=None, description="The sample's reference answer as stored (string, number, object, ...)."
    )
    request_metadata: RequestMetadata | None = Field(default=None, description="Ids of the rollout.")
    rollout_extra: dict[str, Any] = Field(
        default_factory=dict, description="The sample's extra data (what its tool backend reads)."
    )
    tools: list[dict[str, Any]] | None = Field(default=None, description="The turn's tool schemas.")
    agent_output: AgentOutput = Field(description="The rollout's conversation.")
    turn: BeaconTurn = Field(description="The turn that was rewritten, as `process` was given it.")
    feedback: str = Field(description="The beacon the rewrite was written with (header included).")
    rewrite: dict[str, Any] = Field(
        description="The rewrite as an assistant message: `content` and `tool_calls` (OpenAI's shape, "
        "arguments a JSON string), parsed from its text by the job's tool-call parser as the gateway "
        "parses the student's replies."
    )


class BeaconVerdict(BaseModel):
    """What a `verify` call comes back as (the worker wraps the processor's bool or None)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    verified: bool | None = Field(
        default=None, description="True: the rewrite works; False: it still fails; None: not checked."
    )
    status: TaskStatus = Field(default=TaskStatus.SUCCESS, description="SUCCESS or FAILED.")
    error: str | None = Field(default=None, description="Why the call failed.")


class AbstractRolloutProcessor(abc.ABC):
    """Base of user rollout code: one instance per worker, `process` called concurrently."""

    def setup(self) -> None:  # noqa: B027 -- an optional hook, deliberately a no-op
        """Runs once per worker before the first `process` call (load tools, warm caches)."""

    @abc.abstractmethod
    async def process(self, rollout_input: RolloutInput) -> RolloutOutput:
        """Runs one rollout. May be overridden as `async def` or plain `def`."""


class AbstractRewardProcessor(abc.ABC):
    """Base of user reward code: one instance per worker, `process` called concurrently."""

    def setup(self) -> None:  # noqa: B027 -- an optional hook, deliberately a no-op
        """Runs once per worker before the first `process` call."""

    @abc.abstractmethod
    async def process(self, reward_input: RewardInput) -> RewardOutput:
        """Scores one rollout. May be overridden as `async def` or plain `def`."""


class AbstractBeaconProcessor(abc.ABC):
    """Base of user beacon code (a `beacon` component, TurnSight's hindsight beacons): one instance per
    worker, `process` called concurrently, once per finished rollout of a step."""

    def setup(self) -> None:  # noqa: B027 -- an optional hook, deliberately a no-op
        """Runs once per worker before the first `process` call."""

    @abc.abstractmethod
    async def process(self, beacon_input: BeaconInput) -> BeaconOutput:
        """Feedback for the turns that went wrong. May be overridden as `async def` or plain `def`."""

    async def verify(self, verify_input: BeaconVerifyInput) -> bool | None:
        """Whether a turn's rewrite works, replayed against the episode's tools: True (it does), False
        (it still fails: dropped, `beacons/unverified`) or None (cannot tell: kept,
        `beacons/unverifiable`). Called once per rewrite that survived the other filters, in the same
        sandboxed worker as `process`. May be overridden as `async def` or plain `def`; by default
        nothing is checked (None)."""
        return None


# Each processor kind's input, output and base class: the one table the workers and the loader read.
PROCESSOR_KINDS: dict[str, tuple[type[BaseModel], type[BaseModel], type[abc.ABC]]] = {
    "rollout": (RolloutInput, RolloutOutput, AbstractRolloutProcessor),
    "reward": (RewardInput, RewardOutput, AbstractRewardProcessor),
    "beacon": (BeaconInput, BeaconOutput, AbstractBeaconProcessor),
}


# A kind's methods besides `process`, by name: (input, output). The sandboxed host serves a call by its
# method name (`processor_host`), the worker validates the answer with the output (`pool`).
EXTRA_METHODS: dict[str, dict[str, tuple[type[BaseModel], type[BaseModel]]]] = {
    "beacon": {"verify": (BeaconVerifyInput, BeaconVerdict)},
}


def method_types(kind: str, method: str) -> tuple[type[BaseModel], type[BaseModel]]:
    """(input, output) of `kind`'s `method`; KeyError for a method the kind does not have."""
    if method == "process":
        input_type, output_type, _ = PROCESSOR_KINDS[kind]
        return input_type, output_type
    return EXTRA_METHODS[kind][method]


def method_of(payload: object) -> tuple[str, type[BaseModel] | None]:
    """(the method a payload is for, its output model; None for a payload of no known kind)."""
    for methods in EXTRA_METHODS.values():
        for method, (input_type, output_type) in methods.items():
            if isinstance(payload, input_type):
                return method, output_type
    for input_type, output_type, _ in PROCESSOR_KINDS.values():
        if isinstance(payload, input_type):
            return "process", output_type
    return "process", None


async def call_processor(processor: Any, payload: Any) -> Any:
    """Calls `processor.process(payload)` (for a `BeaconVerifyInput`, `processor.verify(payload)`):
    awaited if async, else in a worker thread.

    A plain-`def` processor runs via `asyncio.to_thread` (which copies the context, so tracing spans
    still nest) and so cannot block the event loop the worker uses for its other calls. For a
    `RolloutInput`/`RewardInput`/`BeaconInput` payload a returned dict is validated into the output model,
    and any other return type raises `TypeError` naming the processor class; `verify`'s bool or None
    comes back as a `BeaconVerdict`.
    """
    method, expected = method_of(payload)
    function = getattr(processor, method)
    if inspect.iscoroutinefunction(function):
        result = await function(payload)
    else:
        result = await asyncio.to_thread(function, payload)
        if inspect.isawaitable(result):  # a sync wrapper around an async implementation
            result = await result
    if expected is BeaconVerdict and (result is None or isinstance(result, bool)):
        return BeaconVerdict(verified=result)
    if expected is None or isinstance(result, expected):
        return result
    if isinstance(result, dict) and expected is not BeaconVerdict:
        return expected.model_validate(result)
    raise TypeError(
        f"{type(processor).__qualname__}.{method} returned {type(result).__qualname__}, "
        f"expected {'True, False or None' if expected is BeaconVerdict else expected.__name__}"
    )
