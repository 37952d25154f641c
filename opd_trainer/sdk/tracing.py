"""OpenTelemetry spans for user processors (rollout → each LLM call → reward), kept per rollout in memory.

- `observe_processor` decorates a processor's `process` (async or sync): one span named after the
  class, with `opd.kind` (`rollout`/`reward`) and the request ids `opd.job_id`, `opd.sample_id`,
  `opd.rollout_id`, `opd.attempt_id`; a FAILED output or an exception sets the span's status to
  ERROR (the exception still propagates). Workers call `ensure_observed(processor)`, which applies it
  unless the user already did (the wrapper carries the marker attribute `__opd_observed__`).
- `trace_client(client)` instruments, in place, an `openai.OpenAI`/`AsyncOpenAI` client (or anything
  with `.chat.completions.create`) or a LangChain `ChatOpenAI` (also through `bind_tools`), and
  returns it: each chat completion opens an `llm.call` child span with `llm.model`,
  `llm.num_messages`, `llm.num_tools`, and from the response `llm.tool_calls`, `llm.finish_reasons`,
  `llm.usage.{prompt,completion,total}_tokens` when present. In place, because Bailian's documented
  call `trace_client(llm)` discards the return value.
- Every finished span that belongs to a rollout (it or an ancestor carries `opd.rollout_id`) is kept
  in memory until `collect_spans(rollout_id)` hands it out as a plain dict, so a worker can attach a
  rollout's spans to its result; the store holds at most `max_spans` spans and drops the oldest.
- With `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) set, spans are also exported over
  OTLP through a `BatchSpanProcessor`; `OTEL_EXPORTER_OTLP_PROTOCOL=grpc` picks gRPC, otherwise
  http/protobuf (the OpenTelemetry default). The exporter reads the usual `OTEL_EXPORTER_OTLP_*`
  variables itself.

`configure_tracing` sets the process's tracer provider once (later calls do nothing); the helpers
call it lazily. A tracing failure is logged at debug level and never reaches user code.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
import threading
import types
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.trace import Status, StatusCode

from opd_trainer.sdk.outputs import RolloutOutput, TaskStatus, is_rollout_failure

logger = logging.getLogger(__name__)

__all__ = [
    "OBSERVED_MARKER",
    "TRACED_MARKER",
    "collect_spans",
    "configure_tracing",
    "ensure_observed",
    "observe_processor",
    "trace_client",
]

OBSERVED_MARKER = "__opd_observed__"
"""Attribute set to True on functions wrapped by `observe_processor`."""
TRACED_MARKER = "__opd_traced__"
"""Attribute set to True on client methods `trace_client` replaced."""

JOB_ID, SAMPLE_ID, ROLLOUT_ID, ATTEMPT_ID = "opd.job_id", "opd.sample_id", "opd.rollout_id", "opd.attempt_id"
DEFAULT_MAX_SPANS = 20_000
_TRACED_METHODS = frozenset({"create", "parse"})

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")

# The request ids of the processor call in progress, copied onto its `llm.call` spans.
_current_ids: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "opd_request_ids", default=None
)


def _safely(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception:
        logger.debug(
            "tracing step %s failed; continuing without it", getattr(fn, "__name__", fn), exc_info=True
        )
        return None


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as plain data (ids in hex, times in ns since the epoch)."""
    context = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": {key: _plain(value) for key, value in (span.attributes or {}).items()},
        "status": span.status.status_code.name,
        "error": span.status.description,
        "events": [
            {
                "name": event.name,
                "time_ns": event.timestamp,
                "attributes": {key: _plain(value) for key, value in (event.attributes or {}).items()},
            }
            for event in span.events
        ],
    }


class RolloutSpanCollector(SpanProcessor):
    """Keeps finished spans per rollout id; a span without the id inherits its parent's."""

    def __init__(self, max_spans: int = DEFAULT_MAX_SPANS) -> None:
        self.max_spans = max_spans
        self._lock = threading.Lock()
        self._by_rollout: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()
        self._stored = 0
        self._open: OrderedDict[int, str] = OrderedDict()  # span id → rollout id, for started spans

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        rollout_id = (span.attributes or {}).get(ROLLOUT_ID)
        with self._lock:
            if rollout_id is None and span.parent is not None:
                rollout_id = self._open.get(span.parent.span_id)
            if rollout_id is None:
                return
            self._open[span.get_span_context().span_id] = str(rollout_id)
            while len(self._open) > self.max_spans:  # spans that never end must not pile up
                self._open.popitem(last=False)

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            rollout_id = self._open.pop(span.get_span_context().span_id, None)
        if rollout_id is None:
            return
        record = span_to_dict(span)
        with self._lock:
            self._by_rollout.setdefault(rollout_id, deque()).append(record)
            self._stored += 1
            while self._stored > self.max_spans:
                oldest_id, oldest = next(iter(self._by_rollout.items()))
                oldest.popleft()
                self._stored -= 1
                if not oldest:
                    del self._by_rollout[oldest_id]

    def collect(self, rollout_id: str) -> list[dict[str, Any]]:
        with self._lock:
            records = self._by_rollout.pop(rollout_id, deque())
            self._stored -= len(records)
        return sorted(records, key=lambda r: r["start_ns"] or 0)

    def shutdown(self) -> None:
        with self._lock:
            self._by_rollout.clear()
            self._open.clear()
            self._stored = 0

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


_config_lock = threading.Lock()
_provider: TracerProvider | trace.TracerProvider | None = None
_collector: RolloutSpanCollector | None = None
_cached_tracer: trace.Tracer | None = None


def _otlp_span_processor() -> SpanProcessor | None:
    """A batch OTLP exporter when an endpoint is configured in the environment, else None."""
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return None
    # Lazy: the OTLP exporter loads only when OTEL_EXPORTER_OTLP_* asks for it.
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol == "grpc":
        # Lazy: the OTLP exporter loads only when OTEL_EXPORTER_OTLP_* asks for it.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        # Lazy: the OTLP exporter loads only when OTEL_EXPORTER_OTLP_* asks for it.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return BatchSpanProcessor(OTLPSpanExporter())


def configure_tracing(service_name: str = "opd-trainer", *, max_spans: int = DEFAULT_MAX_SPANS) -> None:
    """Sets up tracing for this process once; later calls (any arguments) do nothing.

    With no tracer provider installed yet, installs an SDK provider for `service_name` with the
    in-memory collector and, when configured, the OTLP exporter. If the process already has an SDK
    provider (the user's code set one), the collector is added to it and its exporters are left as
    they are; any other provider is left alone and the helpers here use a private one.
    """
    global _provider, _collector
    with _config_lock:
        if _provider is not None:
            return
        collector = RolloutSpanCollector(max_spans)
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            current.add_span_processor(collector)
            _provider, _collector = current, collector
            return
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(collector)
        try:
            exporter = _otlp_span_processor()
        except Exception:
            logger.warning("OTLP span export not set up; spans stay in memory only", exc_info=True)
            exporter = None
        if exporter is not None:
            provider.add_span_processor(exporter)
        if isinstance(current, trace.ProxyTracerProvider):
            trace.set_tracer_provider(provider)
        _provider, _collector = provider, collector


def _tracer() -> trace.Tracer:
    global _cached_tracer
    if _cached_tracer is None:
        if _provider is None:
            configure_tracing(os.environ.get("OTEL_SERVICE_NAME", "opd-trainer"))
        assert _provider is not None
        _cached_tracer = _provider.get_tracer(__name__)
    return _cached_tracer


def collect_spans(rollout_id: str) -> list[dict[str, Any]]:
    """Finished spans of one rollout (processor, LLM calls, rewards), oldest first; removes them."""
    if _collector is None:
        return []
    return _collector.collect(rollout_id)


# -- opening and closing spans without ever raising into user code ------------------------------


def _open_span(name: str, attributes: Mapping[str, Any]) -> tuple[Any, object | None]:
    """Starts a span and makes it current; returns (span, context token) or (None, None)."""
    try:
        span = _tracer().start_span(name, attributes={k: v for k, v in attributes.items() if v is not None})
    except Exception:
        logger.debug("could not start span %s", name, exc_info=True)
        return None, None
    token = _safely(otel_context.attach, trace.set_span_in_context(span))
    return span, token


def _close_span(
    span: Any,
    token: object | None,
    *,
    error: BaseException | None = None,
    attributes: Mapping[str, Any] | None = None,
    failure: str | None = None,
) -> None:
    if span is None:
        return
    if token is not None:
        _safely(otel_context.detach, token)
    if attributes:
        _safely(span.set_attributes, {k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        _safely(span.record_exception, error)
        _safely(span.set_status, Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    elif failure is not None:
        _safely(span.set_status, Status(StatusCode.ERROR, failure))
    else:
        _safely(span.set_status, Status(StatusCode.OK))
    _safely(span.end)


# -- processors ---------------------------------------------------------------------------------


def _request_ids(payload: Any) -> dict[str, Any]:
    metadata = getattr(payload, "request_metadata", None)
    if metadata is None:
        return {}
    return {
        JOB_ID: getattr(metadata, "job_id", None),
        SAMPLE_ID: getattr(metadata, "sample_id", None),
        ROLLOUT_ID: getattr(metadata, "rollout_id", None),
        ATTEMPT_ID: getattr(metadata, "attempt_id", None),
    }


def _split_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any]:
    """(span name, payload) for `process(self, payload)`, or for a bare `process(payload)`."""
    if len(args) >= 2 or (len(args) == 1 and kwargs):
        owner, payload = args[0], args[1] if len(args) >= 2 else next(iter(kwargs.values()))
        return type(owner).__name__, payload
    payload = args[0] if args else next(iter(kwargs.values()), None)
    return func.__name__, payload


def _open_processor_span(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, object | None, contextvars.Token[Any] | None]:
    try:
        name, payload = _split_call(func, args, kwargs)
        ids = _request_ids(payload)
        kind = "reward" if hasattr(payload, "agent_output") else "rollout"
        attributes = {"opd.kind": kind, "opd.processor": name, **ids}
        ids_token = _current_ids.set(ids)
    except Exception:
        logger.debug("could not describe processor call", exc_info=True)
        return None, None, None
    span, token = _open_span(name, attributes)
    return span, token, ids_token


def _output_outcome(output: Any) -> tuple[dict[str, Any], str | None]:
    """Span attributes for a processor's output, and the failure text if it reports one."""
    status = getattr(output, "status", None)
    attributes: dict[str, Any] = {"opd.status": getattr(status, "value", status)}
    failed = status == TaskStatus.FAILED
    agent_output = getattr(output, "agent_output", None)
    reward = getattr(output, "reward", None)
    if isinstance(output, RolloutOutput):
        failed = is_rollout_failure(output)
        if agent_output is not None:
            attributes["opd.num_messages"] = len(agent_output.messages)
            attributes["opd.reward_score"] = agent_output.reward_score
    if reward is not None:
        attributes["opd.reward_score"] = getattr(reward, "reward_score", None)
    if failed:
        return attributes, getattr(output, "error", None) or "processor reported FAILED"
    return attributes, None


def _close_processor_span(
    span: Any,
    token: object | None,
    ids_token: contextvars.Token[Any] | None,
    *,
    output: Any = None,
    error: BaseException | None = None,
) -> None:
    if ids_token is not None:
        _safely(_current_ids.reset, ids_token)
    if span is None:
        return
    outcome = _safely(_output_outcome, output) if error is None else None
    attributes, failure = outcome if outcome is not None else ({}, None)
    _close_span(span, token, error=error, attributes=attributes, failure=failure)


def observe_processor(func: F) -> F:
    """Decorates a processor's `process` (async or sync) with a span; the output passes unchanged."""
    if getattr(func, OBSERVED_MARKER, False):
        return func

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            span, token, ids_token = _open_processor_span(func, args, kwargs)
            try:
                output = await func(*args, **kwargs)
            except BaseException as exc:
                _close_processor_span(span, token, ids_token, error=exc)
                raise
            _close_processor_span(span, token, ids_token, output=output)
            return output

        wrapper: Any = async_wrapper
    else:

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            span, token, ids_token = _open_processor_span(func, args, kwargs)
            try:
                output = func(*args, **kwargs)
            except BaseException as exc:
                _close_processor_span(span, token, ids_token, error=exc)
                raise
            _close_processor_span(span, token, ids_token, output=output)
            return output

        wrapper = sync_wrapper
    setattr(wrapper, OBSERVED_MARKER, True)
    return wrapper


def ensure_observed(processor: C) -> C:
    """Wraps `processor.process` with `observe_processor` on this instance unless already wrapped."""
    process = getattr(processor, "process", None)
    if process is None or getattr(process, OBSERVED_MARKER, False):
        return processor
    if isinstance(process, types.MethodType):
        processor.process = types.MethodType(observe_processor(process.__func__), processor)  # type: ignore[attr-defined]
    else:
        processor.process = observe_processor(process)  # type: ignore[attr-defined]
    return processor


# -- LLM clients --------------------------------------------------------------------------------


def _get(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _request_attributes(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    messages, tools = kwargs.get("messages"), kwargs.get("tools")
    return {
        **(_current_ids.get() or {}),
        "llm.model": kwargs.get("model"),
        "llm.num_messages": len(messages) if isinstance(messages, list | tuple) else None,
        "llm.num_tools": len(tools) if isinstance(tools, list | tuple) else None,
        "llm.stream": bool(kwargs.get("stream")) or None,
    }


def _parsed(response: Any) -> Any:
    """The completion inside an openai raw response (`with_raw_response`, what LangChain calls)."""
    parse = getattr(response, "parse", None)
    if _get(response, "choices") is None and hasattr(response, "http_response") and callable(parse):
        # Only the legacy raw response parses synchronously, and it caches the result, so the caller's
        # own `.parse()` gets the same object; an async one is left alone (nothing here awaits it).
        if not inspect.iscoroutinefunction(parse):
            return parse()
        return None
    return response


def _response_attributes(response: Any) -> dict[str, Any]:
    response = _parsed(response)
    choices = _get(response, "choices") or []
    usage = _get(response, "usage")
    return {
        "llm.response.model": _get(response, "model"),
        "llm.tool_calls": sum(len(_get(_get(c, "message"), "tool_calls") or []) for c in choices),
        "llm.finish_reasons": [str(_get(c, "finish_reason")) for c in choices] or None,
        "llm.usage.prompt_tokens": _get(usage, "prompt_tokens"),
        "llm.usage.completion_tokens": _get(usage, "completion_tokens"),
        "llm.usage.total_tokens": _get(usage, "total_tokens"),
    }


def _open_llm_span(kwargs: Mapping[str, Any]) -> tuple[Any, object | None]:
    attributes = _safely(_request_attributes, kwargs) or {}
    return _open_span("llm.call", attributes)


def _close_llm_span(
    span: Any, token: object | None, kwargs: Mapping[str, Any], response: Any = None, error: Any = None
) -> None:
    attributes = None
    if error is None and not kwargs.get("stream"):  # a stream's contents arrive after the call returns
        attributes = _safely(_response_attributes, response)
    _close_span(span, token, error=error, attributes=attributes)


def _is_async(fn: Callable[..., Any]) -> bool:
    # openai wraps its async `create` in a plain-def argument checker; `unwrap` finds the real one.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(inspect.unwrap(fn))


def _traced_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    if _is_async(fn):

        @functools.wraps(fn)
        async def async_call(*args: Any, **kwargs: Any) -> Any:
            span, token = _open_llm_span(kwargs)
            try:
                response = await fn(*args, **kwargs)
            except BaseException as exc:
                _close_llm_span(span, token, kwargs, error=exc)
                raise
            _close_llm_span(span, token, kwargs, response=response)
            return response

        wrapper: Any = async_call
    else:

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            span, token = _open_llm_span(kwargs)
            try:
                response = fn(*args, **kwargs)
            except BaseException as exc:
                _close_llm_span(span, token, kwargs, error=exc)
                raise
            _close_llm_span(span, token, kwargs, response=response)
            return response

        wrapper = call
    setattr(wrapper, TRACED_MARKER, True)
    return wrapper


def _instrument_method(owner: Any, name: str) -> bool:
    """Shadows `owner.name` with a traced wrapper on this instance only; True if it is traced now."""
    method = getattr(owner, name, None)
    if not callable(method):
        return False
    if getattr(method, TRACED_MARKER, False):
        return True  # already traced: a second trace_client must not add a second span per call
    try:
        setattr(owner, name, _traced_call(method))
    except (AttributeError, TypeError):  # a frozen or slotted object
        return False
    return True


def _instrument_completions(completions: Any) -> bool:
    """Traces `create` and `parse` of one `chat.completions` resource, and of its raw-response view."""
    traced = [_instrument_method(completions, name) for name in _TRACED_METHODS]
    # openai builds `with_raw_response` (LangChain's path) on first use around the `create` it sees
    # then: built later it wraps the traced method, but one built before this call holds the plain
    # one and needs its own wrapper.
    raw_view = getattr(completions, "__dict__", {}).get("with_raw_response")
    if raw_view is not None:
        for name in _TRACED_METHODS:
            _instrument_method(raw_view, name)
    return any(traced)


def _instrument_openai_client(client: Any) -> bool:
    """Traces an `openai.OpenAI`/`AsyncOpenAI` (or anything with `.chat.completions.create`) in place."""
    completions = _get(_get(client, "chat"), "completions")
    if completions is None or not _instrument_completions(completions):
        return False
    # `with_options`/`copy` build a new client with fresh resources: keep those traced too, so
    # `trace_client(client).with_options(timeout=5)` still records. The original is left as it was.
    for name in ("copy", "with_options"):
        derive = getattr(client, name, None)
        if callable(derive) and not getattr(derive, TRACED_MARKER, False):
            _safely(setattr, client, name, _tracing_derivation(derive))
    return True


def _tracing_derivation(derive: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(derive)
    def traced_derive(*args: Any, **kwargs: Any) -> Any:
        return trace_client(derive(*args, **kwargs))

    setattr(traced_derive, TRACED_MARKER, True)
    return traced_derive


def _instrument(client: Any, depth: int = 0) -> bool:
    if _instrument_openai_client(client):
        return True
    # LangChain's ChatOpenAI (and AzureChatOpenAI) keep their openai clients in these fields; `client`
    # and `async_client` are the same `chat.completions` resources as the roots', traced once.
    traced = False
    for name in ("root_client", "root_async_client"):
        traced |= _instrument_openai_client(_get(client, name))
    for name in ("client", "async_client"):
        resource = _get(client, name)
        if resource is not None and callable(getattr(resource, "create", None)):
            traced |= _instrument_completions(resource)
    if traced:
        return True
    # A LangChain binding (`llm.bind_tools(...)`) calls the model it wraps.
    bound = _get(client, "bound")
    return bound is not None and depth < 8 and _instrument(bound, depth + 1)


def trace_client(client: C) -> C:
    """Traces `client` in place, so each chat completion it makes is an `llm.call` span; returns it.

    Works on `openai.OpenAI`/`AsyncOpenAI` (and anything with `.chat.completions.create`), LangChain's
    `ChatOpenAI` and a LangChain binding of one (`llm.bind_tools(...)`). Both Bailian's
    `trace_client(llm)` and `llm = trace_client(llm)` therefore work, and so do bindings made before or
    after the call. Only this object is changed (its own `create`/`parse`, never the class): a client
    it was copied from (like the shared one behind `ModelResource.openai_client()`) stays untraced,
    while clients later derived from it with `with_options`/`copy` are traced as well. Tracing an
    object twice is a no-op.
    """
    if not _safely(_instrument, client):
        logger.warning(
            "trace_client: %s has no OpenAI chat.completions client to trace; its calls record no spans",
            type(client).__qualname__,
        )
    return client
