"""Uploaded datasets validated outside the API process, bounded: the engine's own `parse_jsonl` run in
a child process with a line-length cap, a record-count cap, a wall-clock timeout and an address-space
limit.

The API process never holds a dataset's parsed records (a 256 MiB upload is gigabytes of Python
objects) and a pathological file (one huge line, deeply nested JSON) costs the child, not the server.
The child reads the file and prints one JSON line, `{"samples": N}` or `{"error": "..."}`; it is
started as `python -I -m api.services.datasets PATH MAX_LINE_BYTES MAX_RECORDS TIMEOUT_S MAX_MEMORY`
with an environment of a few allowlisted variables. At most `VALIDATIONS_AT_ONCE` run at a time, so
concurrent uploads cannot multiply the memory bound.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.dataset import parse_jsonl

logger = logging.getLogger(__name__)

VALIDATIONS_AT_ONCE = 2
_validations = threading.BoundedSemaphore(VALIDATIONS_AT_ONCE)
# What the child may see of the server's environment: enough to start Python, no settings or secrets.
CHILD_ENV_ALLOWLIST = ("PATH", "LD_LIBRARY_PATH", "LANG", "LC_ALL", "TMPDIR")


def validate(
    path: Path, *, max_line_bytes: int, max_records: int, timeout_s: float, max_memory_bytes: int
) -> int:
    """The number of records of the JSONL dataset at `path`; raises `ConfigError(field="file")` naming
    the bad lines or the bound it broke."""
    command = [
        sys.executable,
        "-I",
        "-m",
        __name__,
        str(path),
        str(max_line_bytes),
        str(max_records),
        repr(timeout_s),
        str(max_memory_bytes),
    ]
    env = {name: os.environ[name] for name in CHILD_ENV_ALLOWLIST if name in os.environ}
    timed_out = ConfigError(
        f"{path.name}: not validated within {timeout_s:g} s (OPD_DATASET_VALIDATE_TIMEOUT_S); "
        "split it into smaller files",
        field="file",
    )
    with _validations:
        try:
            done = subprocess.run(
                command, capture_output=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise timed_out from None
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if isinstance(answer.get("samples"), int):
        return int(answer["samples"])
    if isinstance(answer.get("error"), str):
        raise ConfigError(answer["error"], field="file")
    if done.returncode == -signal.SIGXCPU:
        raise timed_out
    logger.warning(
        "dataset validator exited with %s: %s", done.returncode, done.stderr.decode(errors="replace")[-2000:]
    )
    raise ConfigError(
        f"{path.name}: could not be validated within the server's bounds "
        "(OPD_DATASET_VALIDATE_MAX_MEMORY_BYTES, OPD_DATASET_VALIDATE_TIMEOUT_S)",
        field="file",
    )


def check_text(text: str, name: str, max_line_bytes: int, max_records: int) -> int:
    """The record count of one JSONL text: the caps first (no record is parsed before they pass), then
    `parse_jsonl`, exactly what `opd train` and the job driver accept."""
    records = 0
    for number, line in enumerate(text.splitlines(), start=1):
        # A character is 1-4 bytes in UTF-8: encode only the lines that might be over.
        if len(line) > max_line_bytes // 4 and len(line.encode()) > max_line_bytes:
            raise ConfigError(
                f"{name}: line {number} is longer than {max_line_bytes} bytes (OPD_DATASET_MAX_LINE_BYTES)"
            )
        if line.strip():
            records += 1
            if records > max_records:
                raise ConfigError(
                    f"{name}: more than {max_records} records (OPD_DATASET_MAX_RECORDS); split it into "
                    "smaller files"
                )
    try:
        return len(parse_jsonl(text, name))
    except RecursionError:
        raise ConfigError(f"{name}: a record is nested too deeply to parse") from None


def _limit_self(timeout_s: float, max_memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, max_memory_bytes))
    cpu_s = math.ceil(timeout_s) + 1  # a second bound on time, should the parent's timer not fire
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))


def _main(argv: list[str]) -> int:
    path, max_line_bytes, max_records, timeout_s, max_memory_bytes = argv
    _limit_self(float(timeout_s), int(max_memory_bytes))
    name = Path(path).name
    try:
        data = Path(path).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{name}: not UTF-8 text (byte {exc.start})") from None
        del data
        answer: dict[str, object] = {"samples": check_text(text, name, int(max_line_bytes), int(max_records))}
    except ConfigError as exc:
        answer = {"error": exc.message}
    except MemoryError:
        answer = {
            "error": f"{name}: too large to validate within {int(max_memory_bytes)} bytes of memory "
            "(OPD_DATASET_VALIDATE_MAX_MEMORY_BYTES); split it into smaller files"
        }
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
