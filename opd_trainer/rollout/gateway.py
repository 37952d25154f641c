"""Recording gateway: an OpenAI-compatible `/v1/chat/completions` in front of the student engines.

User rollout code talks to the student with any OpenAI client (openai, LangChain, ...) through this
gateway. Each rollout gets its own API key; every call made with it is answered normally and
recorded with the exact prompt token ids, completion token ids and sampler logprobs, which become
that rollout's training segments. Unknown or closed keys get 401.

Two policies differ from a plain OpenAI server, on purpose:
- `temperature` / `top_p` come from the job, not the request: the learner's importance ratio needs
  the distribution the tokens were really sampled from. A rollout key may carry its own temperature
  (validation opens greedy keys) and a seed: calls that send none get `seed + call index`, so an
  agent that never passes a seed still resamples identically when a run is repeated or resumed.
- `max_tokens` is capped at the job's `max_tokens`.
Requests are validated by vLLM's own `ChatCompletionRequest`, as `vllm serve` validates them, and
tool calls go through vLLM's parser for the model family (`tool_call_parser`, as `vllm serve
--enable-auto-tool-choice --tool-call-parser`; `opd_trainer/rollout/tool_calls.py`): it decides
whether the completion is decoded with special tokens, and for `tool_choice: "required"` or a named
function it constrains sampling (vLLM's structured outputs) so that a call is made.
`response_format` (`json_object`, `json_schema`) and vLLM's `structured_outputs` constrain sampling
the same way. `tool_choice: "none"` renders no tools and parses none. Under a constraint the
recorded sampler logprobs are those of the constrained distribution the tokens were drawn from, so
the learner's (truncated) importance ratio corrects toward the unconstrained policy it trains.
Streaming responses send text as the engine generates it (a Ray streaming generator from the engine
actor); a reply with tools to parse is sent once complete, as content and tool-call chunks.
Template variables reach the chat template as they do on vLLM and Bailian: `chat_template_kwargs`
(vLLM's field) and a top-level `enable_thinking` (what `extra_body={"enable_thinking": False}` sends,
Bailian's convention); an entry in `chat_template_kwargs` wins over the top-level one.

Launch: started by the job driver as `GatewayActor` (uvicorn inside the actor's event loop).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from opd_trainer.errors import ConfigError, EngineError
from opd_trainer.ports import free_port
from opd_trainer.records import LLMCall
from opd_trainer.rollout.chat import RESERVED_TEMPLATE_KWARGS
from opd_trainer.rollout.tool_calls import ToolCallParsing

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 75.0
"""How long the gateway keeps an idle client connection open (uvicorn's `timeout_keep_alive`, 5 s by
default). Longer than the idle timeout of the pools that call it (the built-in rollout's aiohttp pool:
15 s, `runner.CLIENT_KEEPALIVE_S`; httpx's, under the OpenAI SDK: 5 s), so a client drops an idle
connection before the server closes it, and never writes a request into a connection the server has
just closed."""


class InvalidRequest(ValueError):
    """A request vLLM's own validation or the gateway's rules refuse; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def chat_request(body: Any) -> Any:
    """vLLM's own `ChatCompletionRequest` for a request body, with the gateway's rules on top.

    vLLM validates the body as `vllm serve` does (messages, tools, `tool_choice`, `response_format`,
    ...); the gateway refuses what it cannot honour: `n` > 1 (a rollout records one completion per
    call), no messages, and template arguments it sets itself. Raises `InvalidRequest`."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError

    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", "body")
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidRequest(f"{param}: {first['msg']}", param) from None
    except VLLMValidationError as exc:
        raise InvalidRequest(str(exc.args[0]) if exc.args else str(exc), exc.parameter or "body") from None
    if not request.messages:
        raise InvalidRequest("messages: at least one message is required", "messages")
    if request.n != 1:
        raise InvalidRequest("n: only n=1 is served (each call records one completion)", "n")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(request.chat_template_kwargs or {}))
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs: {', '.join(reserved)} cannot be set here: the gateway renders the prompt",
            "chat_template_kwargs",
        )
    thinking = (request.model_extra or {}).get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise InvalidRequest("enable_thinking: must be true or false", "enable_thinking")
    return request


def template_kwargs(request: Any, job_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Extra variables for the chat template: the job's `chat_template_kwargs`, overridden by a
    request's top-level `enable_thinking` (Bailian's convention), overridden by an entry in the
    request's `chat_template_kwargs` (vLLM's field)."""
    thinking = (request.model_extra or {}).get("enable_thinking")
    top_level = {} if thinking is None else {"enable_thinking": thinking}
    return {**(job_defaults or {}), **top_level, **(request.chat_template_kwargs or {})}


def asked_max_tokens(request: Any) -> int | None:
    """`max_completion_tokens`, else the deprecated `max_tokens` (read without pydantic's warning)."""
    return request.max_completion_tokens or request.__dict__.get("max_tokens")


class RenderedPrompts:
    """The token ids of the last `size` prompts rendered, by (messages, tools, template variables).

    A prompt group's `n_rollouts` first calls send the same messages: one renders the chat template
    and tokenizes, the others reuse its ids (measured: ~3 ms a render of the example's prompts).
    A request whose parts are not JSON data is rendered every time."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(
        self,
        tokenizer: Any,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> list[int]:
        from opd_trainer.rollout.chat import prompt_token_ids

        try:
            key = json.dumps([messages, tools, kwargs], sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError):
            return prompt_token_ids(tokenizer, messages, tools, kwargs)
        ids = self._ids.get(key)
        if ids is None:
            self.misses += 1
            ids = tuple(prompt_token_ids(tokenizer, messages, tools, kwargs))
            self._ids[key] = ids
            if len(self._ids) > self.size:
                self._ids.popitem(last=False)
        else:
            self.hits += 1
            self._ids.move_to_end(key)
        return list(ids)


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
    sampling: dict[str, Any]  # Engine.generate's keyword arguments
    parsing: ToolCallParsing | None  # None: no tools to parse
    request: Any  # vLLM's ChatCompletionRequest, as the tool-call parser adjusted it
    response_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def _text_content(content: Any) -> str:
    """OpenAI content may be a list of parts; the chat template wants text."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content, tool-call arguments as JSON strings."""
    normalized = []
    for message in messages:
        item: dict[str, Any] = {"role": message.get("role"), "content": _text_content(message.get("content"))}
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = call.get("function", {})
                arguments = function.get("arguments", "{}")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                calls.append(
                    {
                        "id": call.get("id", ""),
                        "type": "function",
                        "function": {"name": function.get("name", ""), "arguments": arguments},
                    }
                )
            item["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if key in message:
                item[key] = message[key]
        normalized.append(item)
    return normalized


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={
            "error": {"message": message, "type": "invalid_request_error", "code": code, "param": param}
        },
    )


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


class Gateway:
    """Routes chat completions to the least-loaded replica of one model's engines; records them per key.

    The job's student gateway is what rollouts train on; validation also puts one in front of the
    teacher, so the teacher's baseline is measured by the same rollout code.
    """

    def __init__(
        self,
        model_name: str,
        tokenizer_path: str,
        engines: list[ActorHandle],
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
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_length = max_length
        self.key_ttl_s = key_ttl_s
        self.keep_alive_s = keep_alive_s
        self.tool_call_parser = tool_call_parser
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._tool_calls: ToolCallParsing | None = None
        self._sessions: dict[str, RolloutSession] = {}
        self._in_flight = [0] * len(self.engines)
        self._tokenizer: Any = None
        self._prompts = RenderedPrompts()
        self._server: Any = None
        self.base_url = ""
        self.calls_served = 0

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

    def close_rollout(self, key: str) -> list[LLMCall]:
        """Ends the key (later calls get 401) and returns what it recorded, in call order."""
        session = self._sessions.pop(key, None)
        return [] if session is None else session.calls

    def _session(self, key: str) -> RolloutSession | None:
        session = self._sessions.get(key)
        if session is not None and session.expires_at < time.monotonic():
            self._sessions.pop(key, None)
            return None
        return session

    def set_engines(self, engines: list[ActorHandle]) -> None:
        self.engines = list(engines)
        self._in_flight = [0] * len(self.engines)

    # -- completion -----------------------------------------------------------------------------

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
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

    def _render(self, request: Any) -> RenderedPrompt:
        self._load_tokenizer()
        messages = normalize_messages(request.messages)
        tools = None
        if request.tools and request.tool_choice != "none":
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]  # as the client sent them
        kwargs = template_kwargs(request, self.chat_template_kwargs)
        ids = self._prompts.get(self._tokenizer, messages, tools, kwargs)
        return RenderedPrompt(messages, tools, kwargs, ids)

    async def _prepare(self, key: str, request: Any) -> PreparedCall:
        """Everything decided before sampling; raises for a request that cannot be served."""
        session = self._session(key)
        if session is None:
            raise PermissionError("unknown or expired API key")
        started = time.perf_counter()
        rendered = self._render(request)
        prompt_ids = rendered.prompt_ids
        if len(prompt_ids) >= self.max_length:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_length={self.max_length}")
        asked = asked_max_tokens(request) or self.max_tokens
        seed = request.seed
        if seed is None and session.seed is not None:
            seed = session.seed + session.started_calls
        session.started_calls += 1
        parsing = None
        if request.tools and request.tool_choice != "none":
            parsing = self._parsing()
            request = parsing.adjust(request)
        sampling = {
            "max_tokens": min(asked, self.max_tokens, self.max_length - len(prompt_ids)),
            "temperature": self.temperature if session.temperature is None else session.temperature,
            "seed": seed,
            "skip_special_tokens": bool(request.skip_special_tokens),
        }
        structured = request.extract_structured_outputs()
        if structured is not None:
            sampling["structured_outputs"] = structured
        return PreparedCall(key, session, started, rendered, sampling, parsing, request)

    def _replica(self) -> int:
        return min(range(len(self.engines)), key=self._in_flight.__getitem__)

    def _record(self, prepared: PreparedCall, completion: LLMCall) -> tuple[dict[str, Any], LLMCall]:
        """The OpenAI response for a finished completion; the call is recorded under its key."""
        if prepared.parsing is None:
            content, tool_calls = completion.text, []
        else:
            content, tool_calls = prepared.parsing.parse(completion.text, prepared.request)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = _finish_reason(prepared, completion, bool(tool_calls))
        format_valid = completion.finish_reason != "length" and (
            prepared.parsing is None or prepared.parsing.well_formed(content, tool_calls, prepared.request)
        )
        call = dataclasses.replace(
            completion,
            finish_reason=finish,
            format_valid=format_valid,
            messages=prepared.rendered.messages,
            tools=prepared.rendered.tools,
            template_kwargs=prepared.rendered.template_kwargs,
            response_message=message,
            latency_s=time.perf_counter() - prepared.started,
        )
        # The key may have been closed while generating (rollout timed out): then nothing is recorded.
        if self._session(prepared.key) is prepared.session:
            prepared.session.calls.append(call)
        self.calls_served += 1
        prompt_tokens = len(prepared.rendered.prompt_ids)
        completion_tokens = len(completion.completion_token_ids)
        body = {
            "id": prepared.response_id,
            "object": "chat.completion",
            "created": prepared.created,
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        return body, call

    async def complete(self, key: str, request: Any) -> tuple[dict[str, Any], LLMCall]:
        prepared = await self._prepare(key, request)
        replica = self._replica()
        self._in_flight[replica] += 1
        try:
            engine = self.engines[replica]
            completion = await engine.generate.remote(prepared.rendered.prompt_ids, **prepared.sampling)
        finally:
            self._in_flight[replica] -= 1
        return self._record(prepared, completion)

    async def stream(self, prepared: PreparedCall, include_usage: bool) -> AsyncIterator[str]:
        """OpenAI `chat.completion.chunk` server-sent events while the engine generates.

        Text goes out as vLLM detokenizes it. With tools to parse, the reply is sent once complete
        (content, then each tool call): what looks like text may turn out to be a call's markup.
        The call is recorded as a non-streamed one would be.
        """
        base = {
            "id": prepared.response_id,
            "object": "chat.completion.chunk",
            "created": prepared.created,
            "model": self.model_name,
        }

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            payload = {
                **base,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        yield chunk({"role": "assistant", "content": ""})
        replica = self._replica()
        self._in_flight[replica] += 1
        completion: LLMCall | None = None
        try:
            pieces = (
                self.engines[replica]
                .generate_stream.options(num_returns="streaming")
                .remote(prepared.rendered.prompt_ids, **prepared.sampling)
            )
            async for ref in pieces:
                piece = await ref
                if isinstance(piece, LLMCall):
                    completion = piece
                elif prepared.parsing is None:
                    yield chunk({"content": piece})
        except Exception as exc:  # the client sees an error event; the call is not recorded
            error = {
                "message": f"generation failed: {exc}",
                "type": "server_error",
                "code": "engine_unavailable",
            }
            yield f"data: {json.dumps({'error': error})}\n\n"
            return
        finally:
            self._in_flight[replica] -= 1
        assert completion is not None
        body, _ = self._record(prepared, completion)
        choice = body["choices"][0]
        if prepared.parsing is not None:
            if choice["message"].get("content"):
                yield chunk({"content": choice["message"]["content"]})
            for index, call in enumerate(choice["message"].get("tool_calls", [])):
                yield chunk({"tool_calls": [{"index": index, **call}]})
        yield chunk({}, choice["finish_reason"])
        if include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': body['usage']})}\n\n"
        yield "data: [DONE]\n\n"

    # -- HTTP -----------------------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI(title="OPD gateway", docs_url=None, redoc_url=None)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "opd"}]}

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {
                "status": "ok",
                "rollouts_open": len(self._sessions),
                "calls_served": self.calls_served,
                "prompt_cache_hits": self._prompts.hits,
                "prompt_cache_misses": self._prompts.misses,
            }

        @app.post("/v1/chat/completions", response_model=None)
        async def chat_completions(raw: Request) -> JSONResponse | StreamingResponse:
            header = raw.headers.get("authorization", "")
            key = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
            if not key or self._session(key) is None:
                return _error(401, "unknown or expired API key", "invalid_api_key")
            try:
                request = chat_request(await raw.json())
            except json.JSONDecodeError:
                return _error(400, "request body is not JSON", "invalid_json")
            except InvalidRequest as exc:
                return _error(400, str(exc), "invalid_request", exc.param)
            try:
                if request.stream:
                    prepared = await self._prepare(key, request)
                    include_usage = bool(request.stream_options and request.stream_options.include_usage)
                    return StreamingResponse(
                        self.stream(prepared, include_usage), media_type="text/event-stream"
                    )
                body, _ = await self.complete(key, request)
            except PermissionError as exc:
                return _error(401, str(exc), "invalid_api_key")
            except ConfigError as exc:
                return _error(503, exc.message, "tool_call_parser", exc.field)
            except ValueError as exc:
                return _error(400, str(exc), "context_length_exceeded", "messages")
            except EngineError as exc:
                return _error(503, str(exc), "engine_unavailable")
            return JSONResponse(body)

        return app

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Starts uvicorn on this event loop (idempotent) and returns the `/v1` base URL."""
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

    async def shutdown(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.sleep(0.1)
            self._server = None


GatewayActor = ray.remote(Gateway)
"""`Gateway` as a Ray actor; its HTTP server runs inside the actor."""
