"""What a chat-completions request may ask of the gateway, and how it becomes a prompt and vLLM's
sampling parameters.

Requests are vLLM's own `ChatCompletionRequest`, validated as `vllm serve` validates them, and turned
into `SamplingParams` by its `to_sampling_params`. On top, the gateway refuses what it does not serve
with an `InvalidRequest` naming the field (a 400), never ignoring it: `NOT_SERVED` fields set to
anything but their default, fields outside vLLM's model but for `IGNORED_EXTRAS`, `n` > 1, template
arguments it sets itself, token ids the model does not have. The conversation is rendered with the
model's chat template (`opd_trainer/chat.py`), each distinct one once (`RenderedPrompts`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from opd_trainer.chat import RESERVED_TEMPLATE_KWARGS, prompt_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import SamplingParams
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest


class InvalidRequest(ValueError):
    """A request vLLM's own validation or the gateway's rules refuse; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


NOT_SERVED: dict[str, str] = {
    "use_beam_search": "beam search is not served: a call records the one completion it samples",
    "length_penalty": "applies to beam search, which is not served",
    "echo": "the prompt is not echoed",
    "add_generation_prompt": "the gateway always renders the assistant's generation prompt",
    "continue_final_message": "the gateway renders a new assistant turn; it does not continue one",
    "add_special_tokens": "the chat template places every special token",
    "chat_template": "the model's own chat template renders every call (the learner trains on it)",
    "documents": "documents are not passed to the chat template",
    "media_io_kwargs": "only text is served",
    "mm_processor_kwargs": "only text is served",
    "truncate_prompt_tokens": "prompts are not truncated: a prompt that does not fit is refused",
    "truncation_side": "prompts are not truncated",
    "prompt_logprobs": "prompt logprobs are not served",
    "logprob_token_ids": "logprobs of chosen token ids are not served; use top_logprobs",
    "thinking_token_budget": "the gateway has no reasoning parser to count thinking tokens with",
    "include_reasoning": "the gateway has no reasoning parser: reasoning stays in the content",
    "watermarking": "watermarked sampling is not served",
    "vllm_xargs": "custom sampling extensions are not served",
    "kv_transfer_params": "disaggregated serving is not served",
    "ec_transfer_params": "disaggregated serving is not served",
    "priority": "the engines do not schedule by priority",
    "cache_salt": "the engines are the job's own; their prefix cache is not salted",
    "return_prompt_text": "the rendered prompt text is not returned",
    "return_token_offsets": "served by vLLM's render endpoints only",
    "mm_payload": "served by vLLM's render endpoints only",
    "return_mm_kwargs": "served by vLLM's render endpoints only",
    "routed_experts_prompt_start": "routed experts are not returned",
}
"""Fields of vLLM's `ChatCompletionRequest` the gateway does not serve, and why: a request that sets
one to anything but its default is refused (400 naming it) rather than answered as if it had not."""

IGNORED_EXTRAS = frozenset({"enable_thinking", "store", "metadata", "service_tier", "prompt_cache_key"})
"""Fields outside vLLM's request model that are not refused: `enable_thinking` (read, see the module
docstring) and OpenAI's storage, metadata and routing hints, which change nothing about the answer.
Any other unknown field is refused: vLLM would ignore it silently (`functions`, `prediction`, ...)."""

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on `top_logprobs`, and vLLM's default `max_logprobs` (the student's)."""


def chat_request(body: object) -> ChatCompletionRequest:
    """vLLM's own `ChatCompletionRequest` for a request body, with the gateway's rules on top.

    vLLM validates the body as `vllm serve` does (messages, tools, `tool_choice`, `response_format`,
    ...); the gateway refuses what it cannot honour: `n` > 1 (a rollout records one completion per
    call), no messages, template arguments it sets itself, `NOT_SERVED` fields and unknown ones.
    Raises `InvalidRequest`."""
    # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
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
    for name, why in NOT_SERVED.items():
        # Read from __dict__: the deprecated fields warn on attribute access.
        default = ChatCompletionRequest.model_fields[name].get_default(call_default_factory=True)
        if request.__dict__[name] != default:
            raise InvalidRequest(f"{name}: {why}", name)
    unknown = sorted(set(request.model_extra or {}) - IGNORED_EXTRAS)
    if unknown:
        raise InvalidRequest(f"{unknown[0]}: not a chat-completions field this gateway serves", unknown[0])
    if request.logprobs and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    for name in ("max_completion_tokens", "max_tokens"):
        asked = request.__dict__[name]
        if asked is not None and asked < 1:
            raise InvalidRequest(f"{name}: must be at least 1", name)
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


def check_token_ids(request: ChatCompletionRequest, vocabulary: int) -> None:
    """Token ids a request names (`logit_bias`, `allowed_token_ids`) must be the model's; checked here,
    before a stream's first byte, rather than by the engine once the answer has begun."""
    named: list[tuple[str, object]] = [("logit_bias", key) for key in request.logit_bias or {}]
    named += [("allowed_token_ids", token) for token in request.allowed_token_ids or []]
    for param, token in named:
        try:
            ok = 0 <= int(str(token)) < vocabulary
        except ValueError:
            ok = False
        if not ok:
            raise InvalidRequest(
                f"{param}: {token!r} is not a token id of this model (0..{vocabulary - 1})", param
            )


def sampling_params(
    request: ChatCompletionRequest, *, temperature: float, seed: int | None, max_tokens: int
) -> SamplingParams:
    """vLLM's own translation of the request into `SamplingParams` (`to_sampling_params`, as its server
    does), with the key's temperature and the call's seed; vLLM's range checks become a 400."""
    # Lazy: vLLM/transformers/uvicorn load in the gateway's actor, not where this module is imported.
    from vllm.exceptions import VLLMValidationError

    owned = request.model_copy(update={"temperature": temperature, "seed": seed})
    try:
        return owned.to_sampling_params(max_tokens, {})
    except VLLMValidationError as exc:
        message = str(exc.args[0]) if exc.args else str(exc)
        # Some of vLLM's checks name their field only in the message ("top_k must be ...").
        first = message.split(" ", 1)[0]
        param = exc.parameter or (first if first in type(request).model_fields else "body")
        raise InvalidRequest(message, param) from None


def template_kwargs(
    request: ChatCompletionRequest, job_defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Extra variables for the chat template: the job's `chat_template_kwargs`, overridden by a
    request's `reasoning_effort` (passed as vLLM's server passes it: the variable itself, and
    `enable_thinking` unless it is "none"), overridden by its top-level `enable_thinking` (Bailian's
    convention), overridden by an entry in its `chat_template_kwargs` (vLLM's field)."""
    effort: dict[str, Any] = {}
    if request.reasoning_effort is not None:
        effort = {
            "reasoning_effort": request.reasoning_effort,
            "enable_thinking": request.reasoning_effort != "none",
        }
    thinking = (request.model_extra or {}).get("enable_thinking")
    top_level = {} if thinking is None else {"enable_thinking": thinking}
    return {**(job_defaults or {}), **effort, **top_level, **(request.chat_template_kwargs or {})}


def asked_max_tokens(request: ChatCompletionRequest) -> int | None:
    """`max_completion_tokens`, else the deprecated `max_tokens` (read without pydantic's warning)."""
    asked = request.max_completion_tokens
    return request.__dict__.get("max_tokens") if asked is None else asked


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
        tokenizer: PreTrainedTokenizerBase,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> list[int]:
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


def _text_content(content: object) -> str:
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
