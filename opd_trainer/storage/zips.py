"""A workspace (the user's processors and files) as it travels: packed by the client, checked and
extracted once by the server, shipped to the pool's workers as zip bytes and unpacked there.

One packer and one extractor for every role, so what the client uploads, what the server keeps and
what a worker imports are the same files. `pack_workspace` skips what is not part of a workspace
(caches, VCS folders, local environments, compiled files, symbolic links) and is deterministic: the
same folder gives the same bytes. `check_zip` refuses, before a byte is written, an archive that is
too large, holds too many entries, escapes its folder, links out, is encrypted or looks like a zip
bomb (an entry over 1 MiB, or the entries together, expanding more than `max_ratio` times);
`extract_zip` writes the checked entries into a fresh folder, all or nothing.
"""

from __future__ import annotations

import io
import re
import shutil
import stat
import zipfile
from pathlib import Path

from opd_trainer.errors import ConfigError

# Not part of a workspace: caches, VCS folders, local environments.
SKIPPED_FOLDERS = frozenset(
    {"__pycache__", ".git", ".hg", ".svn", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache"}
)
COPY_CHUNK = 1024 * 1024
# Entries smaller than this are not ratio-checked (tiny files compress absurdly well and are harmless).
RATIO_CHECK_MIN_BYTES = 1024 * 1024
# What a worker accepts from the pool: the server has checked uploads against its own (lower) limits.
WORKER_MAX_FILES = 100_000
WORKER_MAX_UNCOMPRESSED = 8 * 1024**3
WORKER_MAX_RATIO = 1000.0


def pack_workspace(workspace: Path) -> bytes:
    """The workspace as zip bytes: a folder is zipped in a stable order, a `.zip` file is read as is."""
    if workspace.is_file():
        return workspace.read_bytes()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(workspace.rglob("*")):
            relative = path.relative_to(workspace)
            if SKIPPED_FOLDERS.intersection(relative.parts) or path.suffix == ".pyc" or path.is_symlink():
                continue
            if path.is_file():
                info = zipfile.ZipInfo(relative.as_posix(), date_time=(2020, 1, 1, 0, 0, 0))
                info.external_attr = 0o100644 << 16  # a regular file, rw-r--r--
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, path.read_bytes())
    return buffer.getvalue()


def unpack_workspace(data: bytes, target: Path, *, field: str = "fcmodel.zipdir") -> None:
    """Checks and extracts zip bytes into `target` (a new folder, or an empty one that is replaced)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = check_zip(
            archive,
            max_files=WORKER_MAX_FILES,
            max_uncompressed=WORKER_MAX_UNCOMPRESSED,
            max_ratio=WORKER_MAX_RATIO,
            field=field,
        )
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        extract_zip(archive, infos, target, field=field)


def check_zip(
    archive: zipfile.ZipFile,
    *,
    max_files: int,
    max_uncompressed: int,
    max_ratio: float,
    field: str = "file",
) -> list[zipfile.ZipInfo]:
    """The archive's entries if it is safe to extract; raises `ConfigError(field=field)` otherwise."""
    infos = archive.infolist()
    if len(infos) > max_files:
        raise ConfigError(f"workspace zip holds {len(infos)} entries; the limit is {max_files}", field=field)
    total = 0
    for info in infos:
        name = info.filename
        parts = re.split(r"[\\/]", name)
        if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
            raise ConfigError(f"zip entry {name!r} has an absolute path", field=field)
        if ".." in parts:
            raise ConfigError(f"zip entry {name!r} leaves the workspace ('..')", field=field)
        if "\x00" in name:
            raise ConfigError("zip entry name holds a NUL byte", field=field)
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise ConfigError(f"zip entry {name!r} is a symbolic link; links are not allowed", field=field)
        # Type bits of 0 (zips made on Windows, or permission bits only) mean a plain entry.
        if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ConfigError(f"zip entry {name!r} is not a regular file or folder", field=field)
        if info.flag_bits & 0x1:
            raise ConfigError(f"zip entry {name!r} is encrypted", field=field)
        total += info.file_size
        if total > max_uncompressed:
            raise ConfigError(
                f"workspace zip expands to more than {max_uncompressed} bytes (the limit)", field=field
            )
        ratio = info.file_size / max(info.compress_size, 1)
        if info.file_size >= RATIO_CHECK_MIN_BYTES and ratio > max_ratio:
            raise ConfigError(
                f"zip entry {name!r} expands {ratio:.0f}x (limit {max_ratio:.0f}x): refusing a zip bomb",
                field=field,
            )
    # Entries under the per-entry threshold are checked together: thousands of small, highly
    # compressed entries are the same bomb split into pieces.
    compressed = sum(info.compress_size for info in infos)
    ratio = total / max(compressed, 1)
    if total >= RATIO_CHECK_MIN_BYTES and ratio > max_ratio:
        raise ConfigError(
            f"zip expands {ratio:.0f}x overall (limit {max_ratio:.0f}x): refusing a zip bomb", field=field
        )
    return infos


def extract_zip(
    archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo], target: Path, *, field: str = "file"
) -> None:
    """Extracts checked entries under `target` (new); a failure leaves nothing behind."""
    staging = target.with_name(f".staging-{target.name}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    root = staging.resolve()
    try:
        for info in infos:
            destination = (root / info.filename).resolve()
            if not destination.is_relative_to(root):
                raise ConfigError(f"zip entry {info.filename!r} leaves the workspace", field=field)
            if info.is_dir():
                destination.mkdir(parents=True, exist_ok=True)
                continue
            destination.parent.mkdir(parents=True, exist_ok=True)
            # ZipExtFile stops at the declared size, so the checked total bounds what is written.
            with archive.open(info) as source, destination.open("wb") as sink:
                shutil.copyfileobj(source, sink, COPY_CHUNK)
        staging.rename(target)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(f"workspace zip cannot be extracted: {exc}", field=field) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
