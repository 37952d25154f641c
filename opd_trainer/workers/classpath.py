"""Loads a user's rollout or reward processor class from a workspace by classpath; the one loader.

A classpath may also name an `async def` workflow (rollout) or judge (reward, evaluator) function with
AgentScope's tuner signatures; it is wrapped into a processor class (`opd_trainer/sdk/workflow.py`).

A workspace is a directory such as

    functions/__init__.py
    functions/rollout.py        # class MyRollout(AbstractRolloutProcessor)
    requirements.txt            # optional, installed by the worker image/runtime, not here

and a classpath names a class in it, in one of two forms:

- `functions.rollout.MyRollout`: a module imported with the workspace root first on `sys.path`;
  every folder on the way must be a package (hold `__init__.py`).
- `functions/rollout.py:MyRollout`: a file relative to the workspace. If every folder on the way is
  a package it is imported as that dotted module (so its relative imports work), otherwise the file
  is loaded on its own.

Every failure raises `ProcessorLoadError` naming the classpath and the problem, with `field`
`functions.<component>.fcmodel.classpath` when the caller names the component; an exception raised by
the user's code carries its traceback, cut to the frames inside the workspace.

Import isolation: user modules are imported under their real names (`functions.rollout`), so their
absolute imports of each other (`from functions.tools import search`) work exactly as on Bailian.
With `isolate=True` (the default) the loader, under one lock, (1) sets aside any `sys.modules`
entries whose top-level name is a package or module of this workspace, (2) imports with the workspace
first on `sys.path`, then (3) removes from `sys.modules` every module whose file lies in the
workspace, puts the set-aside entries back and restores `sys.path`. The loaded class keeps its module
alive through its functions' globals, so two workspaces that both hold a `functions` package load
side by side in one process. The price: an `import functions.x` that user code runs lazily *inside*
`process()` finds nothing, because the workspace is no longer on `sys.path`. A worker that hosts
exactly one workspace passes `isolate=False`, which leaves the workspace on `sys.path` and its modules
in `sys.modules`, as a plain `python -c "import functions.rollout"` would.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
import traceback
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from opd_trainer.errors import ProcessorLoadError
from opd_trainer.sdk.types import PROCESSOR_KINDS
from opd_trainer.sdk.workflow import judge_processor, workflow_processor

__all__ = ["instantiate_processor", "load_processor_class", "validate_workspace"]

Kind = Literal["rollout", "reward", "beacon"]
BASES: dict[str, type] = {kind: base for kind, (_, _, base) in PROCESSOR_KINDS.items()}

_SKIPPED = frozenset({"__pycache__", "site-packages", "venv", "node_modules"})
_import_lock = threading.RLock()  # sys.path and sys.modules are process-global


@dataclass(frozen=True)
class _Origin:
    workspace: Path
    classpath: str
    field: str | None


# Where each loaded class came from, so `instantiate_processor(cls)` can word its errors alike.
_origins: weakref.WeakKeyDictionary[type, _Origin] = weakref.WeakKeyDictionary()


def _field(component: str | None) -> str:
    return f"functions.{component}.fcmodel.classpath" if component else "fcmodel.classpath"


def _qualified(base: type) -> str:
    """The path users import `base` by: SDK classes by `opd_trainer.sdk`, not the module defining them."""
    module = "opd_trainer.sdk" if base.__module__.startswith("opd_trainer.sdk.") else base.__module__
    return f"{module}.{base.__qualname__}"


def _within(path: str | Path, root: Path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(root)
    except (OSError, ValueError):
        return False


def user_traceback(exc: BaseException, workspace: Path | None) -> str:
    """The exception's traceback cut to frames in `workspace` (all but this package's, if None)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if workspace is not None:
        root = workspace.resolve()
        kept = [f for f in frames if _within(f.filename, root)]
    else:
        package = Path(__file__).resolve().parents[1]  # the whole opd_trainer package
        kept = [f for f in frames if not _within(f.filename, package)]
    lines = ["Traceback (user code, most recent call last):\n", *traceback.format_list(kept)] if kept else []
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()


@dataclass(frozen=True)
class _Target:
    """Where a parsed classpath points: a dotted module, or a standalone file."""

    class_name: str
    module: str | None = None  # dotted name, imported with the workspace on sys.path
    file: Path | None = None  # loaded on its own when it is not inside packages


def _parse(workspace: Path, classpath: str, field: str) -> _Target:
    """Resolves `classpath` against the workspace, checking files and `__init__.py` on the way."""

    def fail(problem: str) -> ProcessorLoadError:
        return ProcessorLoadError(f"cannot load classpath {classpath!r}: {problem}", field=field)

    text = classpath.strip()
    if ":" in text:
        file_part, _, class_name = text.rpartition(":")
        if not file_part.endswith(".py") or not class_name.isidentifier():
            raise fail("expected `path/file.py:ClassName` or `package.module.ClassName`")
        relative = Path(file_part)
        if relative.is_absolute() or ".." in relative.parts:
            raise fail("the file path must be relative to the workspace and stay inside it")
        path = workspace / relative
        if not path.is_file():
            raise fail(f"file {file_part} not found in workspace {workspace}")
        folders = relative.parent.parts
        dotted = [*folders, relative.stem]
        in_packages = all(
            (workspace.joinpath(*folders[: i + 1]) / "__init__.py").is_file() for i in range(len(folders))
        )
        if in_packages and all(part.isidentifier() for part in dotted):
            return _Target(class_name, module=".".join(dotted))
        return _Target(class_name, file=path)

    parts = text.split(".")
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise fail("expected `package.module.ClassName` or `path/file.py:ClassName`")
    *module_parts, class_name = parts
    for i in range(len(module_parts)):
        folder = workspace.joinpath(*module_parts[: i + 1])
        if not folder.is_dir():
            break  # not a workspace package: maybe an installed one; the import decides
        is_last = i == len(module_parts) - 1
        if is_last and folder.with_suffix(".py").is_file():
            break  # `name.py` next to a plain folder `name/`: Python imports the file
        if not (folder / "__init__.py").is_file():
            raise fail(f"folder {folder.relative_to(workspace)}/ has no __init__.py, so it is not a package")
    return _Target(class_name, module=".".join(module_parts))


def _from_workspace(module: types.ModuleType, workspace: Path) -> bool:
    # The module's own dict, never getattr: a lazy module's `__getattr__` (transformers has them) would
    # import on the lookup of a missing `__file__`, and fail on optional dependencies such as torchvision.
    attributes = getattr(module, "__dict__", None) or {}
    origin = attributes.get("__file__")
    if origin is not None:
        return _within(origin, workspace)
    search = list(attributes.get("__path__") or [])  # a namespace package has no __file__
    return bool(search) and all(_within(entry, workspace) for entry in search)


def _top_level_names(workspace: Path) -> set[str]:
    names = set()
    for entry in workspace.iterdir():
        if entry.is_dir() and entry.name.isidentifier():
            names.add(entry.name)
        elif entry.suffix == ".py" and entry.stem.isidentifier():
            names.add(entry.stem)
    return names


@contextmanager
def _workspace_imports(workspace: Path, isolate: bool) -> Iterator[None]:
    """Imports inside the block see the workspace first; with `isolate`, they leave no trace."""
    with _import_lock:
        shadowed: dict[str, types.ModuleType] = {}
        if isolate:
            names = _top_level_names(workspace)
            for name in list(sys.modules):
                if name.split(".", 1)[0] in names:
                    shadowed[name] = sys.modules.pop(name)
        saved_path = list(sys.path)
        sys.path.insert(0, str(workspace))
        importlib.invalidate_caches()  # the workspace may have been written moments ago
        try:
            yield
        finally:
            if isolate:
                for name, module in list(sys.modules.items()):
                    if _from_workspace(module, workspace):
                        del sys.modules[name]
                sys.modules.update(shadowed)
                sys.path[:] = saved_path
            elif str(workspace) in saved_path:
                sys.path[:] = saved_path  # already there: keep its old position, no duplicate


def _missing_target(exc: ModuleNotFoundError, module: str) -> bool:
    """Whether the import failed on the classpath's own module (not on an import inside it)."""
    return exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))


def _import(workspace: Path, target: _Target, classpath: str, field: str, isolate: bool) -> types.ModuleType:
    try:
        with _workspace_imports(workspace, isolate):
            if target.module is not None:
                return importlib.import_module(target.module)
            assert target.file is not None
            digest = hashlib.sha1(str(target.file).encode()).hexdigest()[:12]
            name = f"_opd_workspace_{digest}_{target.file.stem}"
            spec = importlib.util.spec_from_file_location(name, target.file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses and pickling look the module up while it runs
            try:
                spec.loader.exec_module(module)
            finally:
                if isolate:
                    sys.modules.pop(name, None)
            return module
    except ModuleNotFoundError as exc:
        if target.module is not None and _missing_target(exc, target.module):
            detail = "" if exc.name == target.module else f" (no module named {exc.name!r})"
            raise ProcessorLoadError(
                f"cannot load classpath {classpath!r}: module {target.module} not found in workspace "
                f"{workspace}{detail}",
                field=field,
            ) from None
        raise ProcessorLoadError(
            f"cannot load classpath {classpath!r}: it imports {exc.name!r}, which is not installed "
            f"(add it to the workspace's requirements.txt)\n{user_traceback(exc, workspace)}",
            field=field,
        ) from None
    except (Exception, SystemExit) as exc:  # a stray sys.exit() at import must not end the worker
        raise ProcessorLoadError(
            f"cannot load classpath {classpath!r}: importing it raised {type(exc).__name__}\n"
            f"{user_traceback(exc, workspace)}",
            field=field,
        ) from None


def _check_class(
    obj: Any, module: types.ModuleType, target: _Target, classpath: str, kind: Kind, field: str
) -> type:
    base = BASES[kind]
    where = f"cannot load classpath {classpath!r}"
    if obj is None:
        candidates = sorted(
            name
            for name, value in vars(module).items()
            if isinstance(value, type) and issubclass(value, base) and value is not base
        )
        hint = f"; {kind} processor classes there: {', '.join(candidates)}" if candidates else ""
        raise ProcessorLoadError(
            f"{where}: class {target.class_name} not found in module {target.module or target.file}{hint}",
            field=field,
        )
    if inspect.isfunction(obj):
        return _function_processor(obj, target, where, kind, field)
    if not isinstance(obj, type):
        raise ProcessorLoadError(
            f"{where}: {target.class_name} is a {type(obj).__name__}, not a class; expected a subclass of "
            f"{_qualified(base)}",
            field=field,
        )
    if not issubclass(obj, base):
        other = next((k for k, b in BASES.items() if k != kind and issubclass(obj, b)), None)
        found = f" (it is a {other} processor)" if other else ""
        raise ProcessorLoadError(
            f"{where}: class {target.class_name} is not a subclass of {_qualified(base)}{found}",
            field=field,
        )
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise ProcessorLoadError(
            f"{where}: class {target.class_name} is abstract: implement {missing}", field=field
        )
    return obj


def _function_processor(function: Any, target: _Target, where: str, kind: Kind, field: str) -> type:
    """A workflow (rollout) or judge (reward) function wrapped as a processor class (sdk/workflow.py).
    A beacon component is a class only."""
    if kind == "beacon":
        raise ProcessorLoadError(
            f"{where}: {target.class_name} is a function, not a class: name a subclass of "
            f"{_qualified(BASES[kind])}",
            field=field,
        )
    shape = "(task, model, auxiliary_models)" if kind == "rollout" else "(task, response, auxiliary_models)"
    if not inspect.iscoroutinefunction(function):
        raise ProcessorLoadError(
            f"{where}: {target.class_name} is a function, not a class: name a subclass of "
            f"{_qualified(BASES[kind])}, or make it an `async def {target.class_name}{shape}` "
            f"{'workflow' if kind == 'rollout' else 'judge'} function",
            field=field,
        )
    try:
        inspect.signature(function).bind(None, None, {})
    except TypeError:
        raise ProcessorLoadError(
            f"{where}: {target.class_name}{inspect.signature(function)} cannot be called as {shape}",
            field=field,
        ) from None
    return workflow_processor(function) if kind == "rollout" else judge_processor(function)


def _check_workspace(workspace: Path, classpath: str, component: str | None) -> Path:
    field = f"functions.{component}.fcmodel" if component else "fcmodel"
    if not workspace.exists():
        raise ProcessorLoadError(
            f"cannot load classpath {classpath!r}: workspace {workspace} does not exist", field=field
        )
    if not workspace.is_dir():
        raise ProcessorLoadError(
            f"cannot load classpath {classpath!r}: workspace {workspace} is not a directory", field=field
        )
    return workspace.resolve()


def load_processor_class(
    workspace: Path,
    classpath: str,
    kind: Kind,
    *,
    component: str | None = None,
    isolate: bool = True,
) -> type:
    """Imports the processor class `classpath` from `workspace`, checking it subclasses the `kind` base.

    `component` (the job's component name) sets the error's `field`; `isolate` is explained in the
    module docstring (False for a worker process that hosts this one workspace).
    """
    field = _field(component)
    root = _check_workspace(Path(workspace), classpath, component)
    target = _parse(root, classpath, field)
    module = _import(root, target, classpath, field, isolate)
    cls = _check_class(getattr(module, target.class_name, None), module, target, classpath, kind, field)
    _origins[cls] = _Origin(root, classpath, field)
    return cls


def validate_workspace(workspace: Path, classpath: str | None = None) -> list[str]:
    """Problems a workspace shows without running its code; empty when none are found.

    Flags a missing or non-directory workspace, folders that hold `.py` files but no `__init__.py`
    (they cannot be imported as packages), and, given a classpath, a missing module
    file or package marker on its way. Nothing is imported.
    """
    workspace = Path(workspace)
    if not workspace.is_dir():
        return [f"workspace {workspace} {'is not a directory' if workspace.exists() else 'does not exist'}"]
    problems = []
    folders = {
        source.parent
        for source in workspace.rglob("*.py")
        if not _SKIPPED.intersection(source.relative_to(workspace).parts)
        and not any(part.startswith(".") for part in source.relative_to(workspace).parts)
    }
    for folder in sorted(folders - {workspace}):
        if not (folder / "__init__.py").is_file():
            relative = folder.relative_to(workspace)
            problems.append(
                f"folder {relative}/ holds .py files but has no __init__.py, so it is not a package"
            )
    if classpath is not None:
        try:
            target = _parse(workspace.resolve(), classpath, _field(None))
        except ProcessorLoadError as exc:
            problems.append(exc.message)
        else:
            if target.module is not None:
                base = workspace.joinpath(*target.module.split("."))
                top = workspace / target.module.split(".")[0]
                in_workspace = top.is_dir() or top.with_suffix(".py").is_file()
                if in_workspace and not (
                    base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
                ):
                    problems.append(f"classpath {classpath!r}: module {target.module} not found in workspace")
    return problems


def instantiate_processor(cls: type, *, component: str | None = None) -> Any:
    """Builds `cls()` and runs its `setup()`; any exception becomes a `ProcessorLoadError`.

    An `async def setup` is run to completion here, which needs a thread without a running event
    loop: call this through `asyncio.to_thread` from async code (a slow setup should not stall the
    loop anyway).
    """
    origin = _origins.get(cls)
    classpath = origin.classpath if origin else f"{cls.__module__}.{cls.__qualname__}"
    field = _field(component) if component else (origin.field if origin else None)
    workspace = origin.workspace if origin else None
    step = "constructing"
    try:
        processor = cls()
        step = "setup() of"
        result = processor.setup()
        if inspect.isawaitable(result):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                asyncio.run(_await(result))
            else:
                if inspect.iscoroutine(result):
                    result.close()
                raise RuntimeError(
                    "async setup() cannot run inside a running event loop; "
                    "call instantiate_processor via asyncio.to_thread"
                )
    except Exception as exc:
        raise ProcessorLoadError(
            f"{step} {classpath!r} raised {type(exc).__name__}\n{user_traceback(exc, workspace)}",
            field=field,
        ) from None
    return processor


async def _await(awaitable: Any) -> Any:
    return await awaitable
