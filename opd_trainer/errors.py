"""One picklable exception hierarchy for the engine; `api/` alone turns these into HTTP errors.

Ray re-raises an actor's exception in the caller's process, so every error here pickles with its
keyword-only `field` (see `__reduce__`).
"""

from __future__ import annotations

from collections.abc import Iterator


class OPDError(Exception):
    """Base of every error this package raises on purpose."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __reduce__(self) -> tuple[type, tuple[str], dict[str, str | None]]:
        return (self.__class__, (self.message,), {"field": self.field})

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class ConfigError(OPDError):
    """A job or engine setting is invalid; `field` names it."""


class EngineError(OPDError):
    """A vLLM engine failed to start, generate, score or take new weights."""


class WeightSyncError(EngineError):
    """New weights could not be handed to or loaded by an engine."""


class ProcessorLoadError(OPDError):
    """A user processor class could not be found, imported, constructed or set up.

    The message names the classpath and what went wrong (with the user's own traceback frames for
    an exception raised in their code); `field` is e.g. `functions.<component>.fcmodel.classpath`.
    """


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then its causes and contexts, the cause a Ray `RayTaskError` carries (`.cause`: what the
    remote actor raised) and an exception group's members, each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        found = todo.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        yield found
        todo += [found.__cause__, found.__context__, getattr(found, "cause", None)]
        if isinstance(found, BaseExceptionGroup):
            todo += list(found.exceptions)
