"""Recording gateway: an OpenAI-compatible `/v1/chat/completions` in front of the student engines.

User rollout code talks to the student with any OpenAI client (openai, LangChain, ...) through this
gateway. Each rollout gets its own API key; every call made with it is answered normally and
recorded with the exact prompt token ids, completion token ids and sampler logprobs, which become
that rollout's training segments. Unknown or closed keys get 401. Whoever ran the rollout closes its
key at `POST /v1/rollouts/close` with the gateway's close secret, and the answer carries the record
(`opd_trainer/recorded_calls.py`); a chat completion sent with the secret closes its key once it is
recorded and answers the record beside the completion. A closed key's record is kept a while
(`CLOSED_KEYS_KEPT`): a repeated close answers it again, and `POST /v1/rollouts/reopen` (the same
secret) opens the key again for a retried rollout. A rollout key cannot close keys or read records.

It speaks vLLM's own protocol: requests are parsed and validated by vLLM's `ChatCompletionRequest`
and translated into sampling parameters by its `to_sampling_params`, as `vllm serve` does; answers,
stream chunks and errors are vLLM's `ChatCompletionResponse`, `ChatCompletionStreamResponse` and
`ErrorResponse`. What it does not serve is refused with a 400 naming the field, never ignored
(`rollout/chat_requests.py`: `NOT_SERVED`, and unknown fields but for `IGNORED_EXTRAS`). Every
sampling field vLLM's server honours is passed to the engine: `stop` / `stop_token_ids`, `top_p`,
`top_k`, `min_p`, the penalties, `logit_bias`, `bad_words`, `allowed_token_ids`, `min_tokens`,
`ignore_eos`, `seed`, `logprobs` / `top_logprobs` (the answer's logprobs are the sampler's, after
temperature, penalties and truncation: vLLM's `processed_logprobs`, not the raw model's).

Two policies differ from a plain OpenAI server, on purpose:
- `temperature` comes from the rollout key, not the request: the job's for training keys, 0 for the
  greedy keys validation opens, so a processor that forwards its sampling parameters cannot turn a
  validation greedy. A key may also carry a seed: calls that send none get `seed + call index`, so an
  agent that never passes a seed still resamples identically when a run is repeated or resumed.
- `max_tokens` is capped at the job's `max_tokens`.
Everything a request may set acts before vLLM's sampler computes `processed_logprobs` (allowed
tokens, bad words, min tokens, logit bias, penalties, temperature, min-p, top-k, top-p, and the
structured-output constraint below), so the recorded sampler logprobs are those of the distribution
each token was really drawn from; where that distribution differs from the student's plain one, the
learner's truncated importance ratio corrects toward the policy it trains.
Tool calls go through vLLM's parser for the model family (`tool_call_parser`, as `vllm serve
--enable-auto-tool-choice --tool-call-parser`; `opd_trainer/rollout/tool_calls.py`): it decides
whether the completion is decoded with special tokens, and for `tool_choice: "required"` or a named
function it constrains sampling (vLLM's structured outputs) so that a call is made;
`parallel_tool_calls: false` keeps the first call, as vLLM does.
`response_format` (`json_object`, `json_schema`) and vLLM's `structured_outputs` constrain sampling
the same way. `tool_choice: "none"` renders no tools and parses none.
Streaming responses send text as the engine generates it (the engine's `sample_stream`: in-process
where the gateway runs in that engine's process, else a Ray streaming generator, `EngineReplica`); a
reply with tools to parse is sent once complete, as content and tool-call chunks.
Template variables reach the chat template as they do on vLLM and Bailian: `chat_template_kwargs`
(vLLM's field), `reasoning_effort` (as vLLM passes it) and a top-level `enable_thinking` (what
`extra_body={"enable_thinking": False}` sends, Bailian's convention); an entry in
`chat_template_kwargs` wins over the others.

Launch: hosted by a `GatewayHost` (`rollout/gateway_host.py`) where `rollout/gateway_placement.py` puts
it, uvicorn on that process's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from opd_trainer.cluster.ports import free_port
from opd_trainer.cluster.process_usage import actor_usage
from opd_trainer.engine.lengths import completion_room
from opd_trainer.errors import ConfigError, EngineError
from opd_trainer.recorded_calls import (
    CLOSE_ROUTE,
    CLOSE_SECRET_HEADER,
    REOPEN_ROUTE,
    encode_recorded,
    encode_with_record,
)
from opd_trainer.records import LLMCall
from opd_trainer.rollout.chat_requests import (
    InvalidRequest,
    RenderedPrompts,
    asked_max_tokens,
    chat_request,
    check_token_ids,
    normalize_messages,
    sampling_params,
    template_kwargs,
)
from opd_trainer.rollout.tool_calls import ToolCallParsing

# vLLM's protocol modules are imported where they are used: importing vLLM takes seconds, and the
# driver and the rollout runner import this module for `RolloutKeyRequest` alone.
if TYPE_CHECKING:
    import uvicorn
    from transformers import PreTrainedTokenizerBase
    from vllm import SamplingParams
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProbs,
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.logprobs import Logprob

    from opd_trainer.engine.vllm_engine import Sampled, SampledText

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 75.0
"""How long the gateway keeps an idle client connection open (uvicorn's `timeout_keep_alive`, 5 s by
default). Longer than the idle timeout of the pools that call it (the built-in rollout's aiohttp pool:
15 s, `runner.CLIENT_KEEPALIVE_S`; httpx's, under the OpenAI SDK: 5 s), so a client drops an idle
connection before the server closes it, and never writes a request into a connection the server has
just closed."""
CLOSED_KEYS_KEPT = 256
"""How many closed keys keep their record (the oldest goes first): a close that comes again gets the
same calls (the driver's fallback, when the worker's close reached the gateway but its answer never
reached the driver), and a retried rollout can reopen its key. Bounded because a record holds every
call's token ids; the driver's fallback comes within seconds, and a retry goes first in the pool's
queue, so far fewer keys close in between."""


class EngineReplica(Protocol):
    """One engine replica as a gateway samples on it: `Engine.sample` / `Engine.sample_stream`, called
    in-process where the gateway runs in that engine's process, else by Ray (`gateway_host`)."""

    async def sample(
        self, prompt_token_ids: list[int], params: SamplingParams, client: str | None
    ) -> Sampled:
        """The whole completion (`Engine.sample`)."""
        ...

    def sample_stream(
        self, prompt_token_ids: list[int], params: SamplingParams, client: str | None
    ) -> AsyncIterator[SampledText | Sampled]:
        """Its pieces as generated, then the whole completion (`Engine.sample_stream`)."""
        ...


class RolloutKeyRequest(NamedTuple):
    """What `Gateway.open_rollouts` opens a key for (see `open_rollout`)."""

    rollout_id: str
    temperature: float | None = None
    seed: int | None = None


@dataclass
class RolloutSession:
    rollout_id: str
    expires_at: float
    temperature: float | None = None
    seed: int | None = None
    calls: list[LLMCall] = field(default_factory=list)
    started_calls: int = 0


class RenderedPrompt(NamedTuple):
    """A request's conversation as rendered for the engine, and what it was rendered with."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    prompt_ids: list[int]


@dataclass
class PreparedCall:
    """One chat completion between its checks and its sampling: where it is recorded, what is sampled."""

    key: str
    session: RolloutSession
    started: float
    rendered: RenderedPrompt
    sampling: SamplingParams
    parsing: ToolCallParsing | None  # None: no tools to parse
    request: ChatCompletionRequest  # as the tool-call parser adjusted it
    response_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> ErrorResponse:
    """vLLM's error answer (`create_error_response`: `type`, `param`, the status as `code`)."""
    # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    return create_error_response(message, _ERROR_TYPES.get(status, "InternalServerError"), status, param)


def _error(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status.value, content=error_body(status, message, param).model_dump())


async def _keys_of(raw: Request) -> list[str] | None:
    """The keys of a close or reopen body, `{"keys": [str, ...]}`; None for any other body."""
    try:
        keys = (await raw.json())["keys"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    return keys if isinstance(keys, list) and all(isinstance(k, str) for k in keys) else None


def _finish_reason(prepared: PreparedCall, completion: LLMCall, called: bool) -> str:
    """OpenAI's (and vLLM's) finish reason: `tool_calls` when a call was made under `auto` or
    `required`, `stop` for a named function (the caller asked for it), else `length` or `stop`."""
    choice = prepared.request.tool_choice if prepared.parsing is not None else None
    named = choice is not None and not isinstance(choice, str)
    if called and not named:
        return "tool_calls"
    if completion.finish_reason == "length":
        return "length"
    return "tool_calls" if choice == "required" else "stop"


def chat_logprobs(
    token_ids: list[int],
    steps: list[dict[int, Logprob]],
    top: int,
    tokenizer: PreTrainedTokenizerBase,
    as_token_ids: bool,
) -> ChatCompletionLogProbs:
    """OpenAI's `logprobs` for completion tokens, as vLLM's server builds them
    (`OpenAIServingChat._create_chat_logprobs`, a method of its serving object): each token's text,
    logprob and UTF-8 bytes, with its `top` most likely alternatives by rank (vLLM lists the sampled
    token first and may keep it in place of the k-th; OpenAI's are the k most likely)."""
    # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProb,
        ChatCompletionLogProbs,
        ChatCompletionLogProbsContent,
    )

    def text(token_id: int, logprob: Logprob) -> str:
        if as_token_ids:
            return f"token_id:{token_id}"
        return logprob.decoded_token if logprob.decoded_token is not None else tokenizer.decode([token_id])

    def alternative(token_id: int, logprob: Logprob) -> ChatCompletionLogProb:
        token = text(token_id, logprob)
        return ChatCompletionLogProb(
            token=token,
            logprob=max(logprob.logprob, -9999.0),
            bytes=list(token.encode("utf-8", errors="replace")),
        )

    content = []
    for token_id, step in zip(token_ids, steps, strict=True):
        ranked = sorted(
            ((i, lp) for i, lp in step.items() if lp.rank is not None and lp.rank <= top),
            key=lambda x: x[1].rank,
        )
        sampled = alternative(token_id, step[token_id])
        content.append(
            ChatCompletionLogProbsContent(
                **sampled.model_dump(), top_logprobs=[alternative(i, lp) for i, lp in ranked]
            )
        )
    return ChatCompletionLogProbs(content=content)


class Gateway:
    """Routes chat completions to the least-loaded replica of one model's engines; records them per key.

    The job's student gateway is what rollouts train on; validation also puts one in front of the
    teacher, so the teacher's baseline is measured by the same rollout code.
    """

    def __init__(
        self,
        model_name: str,
        tokenizer_path: str,
        engines: list[EngineReplica],
        *,
        max_tokens: int,
        temperature: float,
        max_length: int,
        tool_call_parser: str = "hermes",
        chat_template_kwargs: dict[str, Any] | None = None,
        key_ttl_s: float = 3600.0,
        keep_alive_s: float = KEEP_ALIVE_S,
    ) -> None:
        self.model_name = model_name
        self.tokenizer_path = tokenizer_path
        self.engines = list(engines)
        self.client: str | None = None  # the job's name on engines shared with other jobs (`set_engines`)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_length = max_length
        self.key_ttl_s = key_ttl_s
        self.keep_alive_s = keep_alive_s
        self.tool_call_parser = tool_call_parser
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._tool_calls: ToolCallParsing | None = None
        self._sessions: dict[str, RolloutSession] = {}
        self._closed: collections.OrderedDict[str, RolloutSession] = collections.OrderedDict()
        self._in_flight = [0] * len(self.engines)
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._prompts = RenderedPrompts()
        self._server: uvicorn.Server | None = None
        self.base_url = ""
        self.calls_served = 0
        self.close_secret = secrets.token_urlsafe(32)
        """What closes keys over HTTP (`recorded_calls`): held by the driver and the workers it hands
        a rollout to, never by user code."""

    # -- keys -----------------------------------------------------------------------------------

    def open_rollout(
        self,
        rollout_id: str,
        ttl_s: float | None = None,
        *,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> str:
        """A fresh API key for one rollout; calls made with it are recorded under it.

        `temperature` (None: the job's) applies to every call made with the key; `seed`, if given, seeds
        the calls that bring no seed of their own (the n-th call started gets `seed + n`).
        """
        key = f"opd-{secrets.token_urlsafe(24)}"
        expires = time.monotonic() + (ttl_s or self.key_ttl_s)
        self._sessions[key] = RolloutSession(rollout_id, expires, temperature=temperature, seed=seed)
        return key

    def open_rollouts(self, rollouts: list[RolloutKeyRequest]) -> list[str]:
        """`open_rollout` for many rollouts in one call (a step's, as one Ray round trip instead of one
        per rollout); keys in the order asked."""
        return [self.open_rollout(r.rollout_id, temperature=r.temperature, seed=r.seed) for r in rollouts]

    def close_rollout(self, key: str) -> list[LLMCall] | None:
        """Ends the key (later calls get 401) and returns what it recorded, in call order (the close
        route's work, `app`): again for a key among the last `CLOSED_KEYS_KEPT` closed, None for a key
        this gateway does not know."""
        session = self._sessions.pop(key, None)
        if session is None:
            session = self._closed.get(key)
            return None if session is None else session.calls
        self._closed[key] = session
        if len(self._closed) > CLOSED_KEYS_KEPT:
            self._closed.popitem(last=False)
        return session.calls

    def reopen_rollout(self, key: str) -> bool:
        """Opens a key closed lately again, its record and call count as they were (a retried rollout
        goes on where the lost attempt ended, as if the key had stayed open); whether the key is open."""
        session = self._closed.pop(key, None)
        if session is not None:
            self._sessions[key] = session
        return self._session(key) is not None

    def _holds_close_secret(self, raw: Request) -> bool:
        given = raw.headers.get(CLOSE_SECRET_HEADER, "").encode()
        return secrets.compare_digest(given, self.close_secret.encode())

    def _session(self, key: str) -> RolloutSession | None:
        session = self._sessions.get(key)
        if session is not None and session.expires_at < time.monotonic():
            self._sessions.pop(key, None)
            return None
        return session

    def set_engines(self, engines: list[EngineReplica], client: str | None = None) -> None:
        """The engines calls go to; `client`: the job's name on engines shared with other jobs
        (`EngineGroup.client`), which every call then passes (its own adapter, fair admission, its own
        counts)."""
        self.engines = list(engines)
        self.client = client
        self._in_flight = [0] * len(self.engines)

    # -- completion -----------------------------------------------------------------------------

    def _load_tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, trust_remote_code=False)
        return self._tokenizer

    def _parsing(self) -> ToolCallParsing:
        """vLLM's tool-call parser for the model, loaded on first use (importing vLLM takes seconds).

        Loaded on the actor's event loop, not in a thread: transformers' lazy imports are not safe
        against another thread importing at the same time. The driver calls `ready()` before any
        rollout, so requests never wait for it; elsewhere the first request with tools does."""
        if self._tool_calls is None:
            self._tool_calls = ToolCallParsing(self.tool_call_parser, self._load_tokenizer())
        return self._tool_calls

    async def ready(self) -> None:
        """Loads the tool-call parser; raises its `ConfigError` (unknown name, or a parser whose
        markers the tokenizer lacks), so a job fails at start naming `tool_call_parser`."""
        self._parsing()

    def _render(self, request: ChatCompletionRequest) -> RenderedPrompt:
        tokenizer = self._load_tokenizer()
        messages = normalize_messages(request.messages)  # type: ignore[arg-type]  # TypedDicts: dicts
        tools = None
        if request.tools and request.tool_choice != "none":
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]  # as the client sent them
        kwargs = template_kwargs(request, self.chat_template_kwargs)
        ids = self._prompts.get(tokenizer, messages, tools, kwargs)
        return RenderedPrompt(messages, tools, kwargs, ids)

    async def _prepare(self, key: str, request: ChatCompletionRequest) -> PreparedCall:
        """Everything decided before sampling; raises `PermissionError` for a closed key and
        `InvalidRequest` for a request that cannot be served (then it is not counted as a call)."""
        session = self._session(key)
        if session is None:
            raise PermissionError("unknown or expired API key")
        started = time.perf_counter()
        rendered = self._render(request)
        prompt_ids = rendered.prompt_ids
        room = completion_room(self.max_length, len(prompt_ids))
        if room < 1:
            raise InvalidRequest(
                f"prompt of {len(prompt_ids)} tokens leaves no room for a reply under "
                f"max_length={self.max_length}",
                "messages",
            )
        check_token_ids(request, len(self._load_tokenizer()))
        parsing = None
        if request.tools and request.tool_choice != "none":
            parsing = self._parsing()
            request = parsing.adjust(request)
        seed = request.seed
        if seed is None and session.seed is not None:
            seed = session.seed + session.started_calls
        asked = asked_max_tokens(request) or self.max_tokens
        sampling = sampling_params(
            request,
            temperature=self.temperature if session.temperature is None else session.temperature,
            seed=seed,
            max_tokens=min(asked, self.max_tokens, room),
        )
        session.started_calls += 1
        return PreparedCall(key, session, started, rendered, sampling, parsing, request)

    def _replica(self) -> int:
        return min(range(len(self.engines)), key=self._in_flight.__getitem__)

    def _logprobs(
        self, prepared: PreparedCall, token_ids: list[int], steps: list[dict[int, Logprob]]
    ) -> ChatCompletionLogProbs | None:
        """The answer's `logprobs` when the request asked for them."""
        request = prepared.request
        if not request.logprobs:
            return None
        as_ids = bool(request.return_tokens_as_token_ids)
        return chat_logprobs(token_ids, steps, request.top_logprobs, self._load_tokenizer(), as_ids)

    def _record(self, prepared: PreparedCall, sampled: Sampled) -> tuple[ChatCompletionResponse, LLMCall]:
        """The OpenAI response for a finished completion; the call is recorded under its key."""
        # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
        )
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        completion = sampled.call
        message = self._message(prepared, completion)
        finish = _finish_reason(prepared, completion, bool(message.tool_calls))
        format_valid = completion.finish_reason != "length" and (
            prepared.parsing is None
            or prepared.parsing.well_formed(
                message.content,
                [call.model_dump(mode="json") for call in message.tool_calls],
                prepared.request,
            )
        )
        response_message = message.model_dump(mode="json", include={"role", "content", "tool_calls"})
        call = dataclasses.replace(
            completion,
            finish_reason=finish,
            format_valid=format_valid,
            messages=prepared.rendered.messages,
            tools=prepared.rendered.tools,
            template_kwargs=prepared.rendered.template_kwargs,
            response_message=response_message,
            latency_s=time.perf_counter() - prepared.started,
        )
        # The key may have been closed while generating (rollout timed out): then nothing is recorded.
        if self._session(prepared.key) is prepared.session:
            prepared.session.calls.append(call)
        self.calls_served += 1
        prompt_tokens = len(prepared.rendered.prompt_ids)
        completion_tokens = len(completion.completion_token_ids)
        with_ids = bool(prepared.request.return_token_ids)
        choice = ChatCompletionResponseChoice(
            index=0,
            message=message,
            logprobs=self._logprobs(prepared, completion.completion_token_ids, sampled.top_logprobs),
            finish_reason=finish,
            token_ids=completion.completion_token_ids if with_ids else None,
        )
        response = ChatCompletionResponse(
            id=prepared.response_id,
            created=prepared.created,
            model=self.model_name,
            choices=[choice],
            usage=UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            ),
            prompt_token_ids=prepared.rendered.prompt_ids if with_ids else None,
        )
        return response, call

    def _message(self, prepared: PreparedCall, completion: LLMCall) -> ChatMessage:
        """The assistant message: the text, or the content and tool calls vLLM's parser reads in it
        (only the first with `parallel_tool_calls: false`, as vLLM's server answers)."""
        # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

        if prepared.parsing is None:
            return ChatMessage(role="assistant", content=completion.text)
        content, calls = prepared.parsing.parse(completion.text, prepared.request)
        tool_calls = [ToolCall.model_validate(call) for call in calls]
        return ChatMessage(
            role="assistant",
            content=content,
            tool_calls=maybe_filter_parallel_tool_calls(tool_calls, prepared.request),
        )

    async def complete(
        self, key: str, request: ChatCompletionRequest
    ) -> tuple[ChatCompletionResponse, LLMCall]:
        prepared = await self._prepare(key, request)
        replica = self._replica()
        self._in_flight[replica] += 1
        try:
            engine = self.engines[replica]
            sampled = await engine.sample(prepared.rendered.prompt_ids, prepared.sampling, self.client)
        except ValueError as exc:  # vLLM's own input checks, in the engine (Ray raises the cause's type)
            cause = getattr(exc, "cause", exc)
            raise InvalidRequest(str(cause), getattr(cause, "parameter", None) or "body") from None
        finally:
            self._in_flight[replica] -= 1
        return self._record(prepared, sampled)

    async def stream(self, prepared: PreparedCall, include_usage: bool) -> AsyncIterator[str]:
        """vLLM's `chat.completion.chunk` server-sent events while the engine generates.

        Text goes out as vLLM detokenizes it, with its tokens' logprobs when asked for. With tools to
        parse, the reply is sent once complete (content, then each tool call): what looks like text
        may turn out to be a call's markup. The call is recorded as a non-streamed one would be.
        """
        # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
        from vllm.entrypoints.generate.base.protocol import DeltaMessage

        # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
        from opd_trainer.engine.vllm_engine import Sampled

        with_ids = bool(prepared.request.return_token_ids)
        event = functools.partial(self._chunk, prepared)
        yield event(DeltaMessage(role="assistant", content=""))
        replica = self._replica()
        self._in_flight[replica] += 1
        sampled: Sampled | None = None
        try:
            pieces = self.engines[replica].sample_stream(
                prepared.rendered.prompt_ids, prepared.sampling, self.client
            )
            async for piece in pieces:
                if isinstance(piece, Sampled):  # the last item: the whole completion
                    sampled = piece
                elif prepared.parsing is None and (piece.text or prepared.request.logprobs or with_ids):
                    logprobs = self._logprobs(prepared, piece.token_ids, piece.top_logprobs)
                    yield event(DeltaMessage(content=piece.text), None, logprobs, piece.token_ids)
        except Exception as exc:  # the client sees vLLM's error event; the call is not recorded
            status = HTTPStatus.BAD_REQUEST if isinstance(exc, ValueError) else HTTPStatus.SERVICE_UNAVAILABLE
            yield f"data: {error_body(status, f'generation failed: {exc}').model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
            return
        finally:
            self._in_flight[replica] -= 1
        if sampled is None:  # the engine's stream ends with the whole completion; this one did not
            message = "generation failed: the engine's stream ended without a completion"
            yield f"data: {error_body(HTTPStatus.SERVICE_UNAVAILABLE, message).model_dump_json()}\n\n"
        else:
            for chunk in self._closing_chunks(prepared, sampled, include_usage):
                yield chunk
        yield "data: [DONE]\n\n"

    def _chunk(
        self,
        prepared: PreparedCall,
        delta: Any,
        finish: str | None = None,
        logprobs: ChatCompletionLogProbs | None = None,
        token_ids: list[int] | None = None,
    ) -> str:
        """One `chat.completion.chunk` server-sent event carrying `delta` (vLLM's `DeltaMessage`)."""
        # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
        )

        choice = ChatCompletionResponseStreamChoice(
            index=0, delta=delta, logprobs=logprobs, finish_reason=finish
        )
        chunk = ChatCompletionStreamResponse(
            id=prepared.response_id,
            object="chat.completion.chunk",
            created=prepared.created,
            model=self.model_name,
            choices=[choice],
        )
        if prepared.request.return_token_ids:  # assigned, so only then set and sent (as vLLM's server does)
            choice.token_ids = token_ids or []
            if delta.role is not None:
                chunk.prompt_token_ids = prepared.rendered.prompt_ids
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

    def _closing_chunks(self, prepared: PreparedCall, sampled: Any, include_usage: bool) -> Iterator[str]:
        """After generation: the call recorded, then (with tools to parse) the reply's content and each
        tool call, the finish reason, and the usage when asked for."""
        # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
        from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

        response, _ = self._record(prepared, sampled)
        choice = response.choices[0]
        if prepared.parsing is not None:
            if choice.message.content or choice.logprobs:
                content = DeltaMessage(content=choice.message.content or "")
                yield self._chunk(prepared, content, None, choice.logprobs, sampled.call.completion_token_ids)
            for index, call in enumerate(choice.message.tool_calls):
                function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
                delta = DeltaToolCall(index=index, id=call.id, type="function", function=function)
                yield self._chunk(prepared, DeltaMessage(tool_calls=[delta]))
        yield self._chunk(prepared, DeltaMessage(), choice.finish_reason)
        if include_usage:
            usage = ChatCompletionStreamResponse(
                id=prepared.response_id,
                object="chat.completion.chunk",
                created=prepared.created,
                model=self.model_name,
                choices=[],
                usage=response.usage,
            )
            yield f"data: {usage.model_dump_json(exclude_unset=True)}\n\n"

    # -- HTTP -----------------------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI(title="OPD gateway", docs_url=None, redoc_url=None)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
            from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

            card = ModelCard(id=self.model_name, owned_by="opd", max_model_len=self.max_length)
            return JSONResponse(ModelList(data=[card]).model_dump())

        @app.post(f"/v1{CLOSE_ROUTE}")
        async def close_rollouts(raw: Request) -> Response:
            """Closes the body's `keys` and answers what each recorded (`recorded_calls`); only for
            the holder of the close secret: a rollout key is no credential here."""
            if not self._holds_close_secret(raw):
                return _error(HTTPStatus.UNAUTHORIZED, "closing keys takes the gateway's close secret")
            keys = await _keys_of(raw)
            if keys is None:
                return _error(HTTPStatus.BAD_REQUEST, 'the body must be {"keys": [str, ...]}', "keys")
            recorded = encode_recorded([self.close_rollout(key) for key in keys])
            return Response(recorded, media_type="application/json")

        @app.post(f"/v1{REOPEN_ROUTE}")
        async def reopen_rollouts(raw: Request) -> Response:
            """Reopens the body's `keys` (`reopen_rollout`); answers whether each is open. Only for the
            holder of the close secret."""
            if not self._holds_close_secret(raw):
                return _error(HTTPStatus.UNAUTHORIZED, "reopening keys takes the gateway's close secret")
            keys = await _keys_of(raw)
            if keys is None:
                return _error(HTTPStatus.BAD_REQUEST, 'the body must be {"keys": [str, ...]}', "keys")
            return JSONResponse([self.reopen_rollout(key) for key in keys])

        @app.get("/health")
        async def health() -> dict[str, int | str]:
            return {
                "status": "ok",
                "rollouts_open": len(self._sessions),
                "calls_served": self.calls_served,
                "prompt_cache_hits": self._prompts.hits,
                "prompt_cache_misses": self._prompts.misses,
            }

        @app.post("/v1/chat/completions", response_model=None)
        async def chat_completions(raw: Request) -> Response:
            header = raw.headers.get("authorization", "")
            key = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
            if not key or self._session(key) is None:
                return _error(HTTPStatus.UNAUTHORIZED, "unknown or expired API key", "Authorization")
            # The whole body is read before anything is decided or recorded: a client may resend a
            # request whose body did not arrive in full (`runner.post_json`).
            try:
                request = chat_request(await raw.json())
            except json.JSONDecodeError:
                return _error(HTTPStatus.BAD_REQUEST, "request body is not JSON", "body")
            except InvalidRequest as exc:
                return _error(HTTPStatus.BAD_REQUEST, str(exc), exc.param)
            # With the close secret the key ends with this call, and the answer carries its record.
            closing = CLOSE_SECRET_HEADER.lower() in raw.headers
            if closing and not self._holds_close_secret(raw):
                return _error(HTTPStatus.UNAUTHORIZED, "closing keys takes the gateway's close secret")
            if closing and request.stream:
                return _error(HTTPStatus.BAD_REQUEST, "a call that closes its key is not streamed", "stream")
            try:
                if request.stream:
                    prepared = await self._prepare(key, request)
                    include_usage = bool(request.stream_options and request.stream_options.include_usage)
                    return StreamingResponse(
                        self.stream(prepared, include_usage), media_type="text/event-stream"
                    )
                response, _ = await self.complete(key, request)
            except PermissionError as exc:
                return _error(HTTPStatus.UNAUTHORIZED, str(exc), "Authorization")
            except InvalidRequest as exc:
                return _error(HTTPStatus.BAD_REQUEST, str(exc), exc.param)
            except ConfigError as exc:
                return _error(HTTPStatus.SERVICE_UNAVAILABLE, exc.message, exc.field)
            except EngineError as exc:
                return _error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
            # pydantic's own encoder: model_dump + json.dumps (JSONResponse) built the dict first.
            if closing:
                answer = encode_with_record(response.model_dump_json(), self.close_rollout(key) or [])
                return Response(answer, media_type="application/json")
            return Response(response.model_dump_json(), media_type="application/json")

        return app

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Starts uvicorn on this event loop (idempotent) and returns the `/v1` base URL."""
        # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
        import uvicorn

        if self._server is not None:
            return self.base_url
        if port == 0:
            port = free_port(host)
        config = uvicorn.Config(
            self.app(),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=self.keep_alive_s,  # type: ignore[arg-type]  # a float works: call_later
        )
        self._server = uvicorn.Server(config)
        task = asyncio.get_running_loop().create_task(self._server.serve())
        while not self._server.started:
            if task.done():
                task.result()  # raises the start-up error
            await asyncio.sleep(0.02)
        advertised = ray.util.get_node_ip_address() if host == "0.0.0.0" else host
        self.base_url = f"http://{advertised}:{port}/v1"
        logger.info("gateway for %s serving at %s", self.model_name, self.base_url)
        return self.base_url

    async def usage(self) -> dict[str, float]:
        """This gateway's CPU-seconds so far (`process_usage.actor_usage`), for metering."""
        return actor_usage()

    async def shutdown(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.sleep(0.1)
            self._server = None


GatewayActor = ray.remote(Gateway)
"""`Gateway` as a Ray actor; its HTTP server runs inside the actor."""
