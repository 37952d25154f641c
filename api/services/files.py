"""Uploaded files: datasets validated line by line, workspace and model zips checked before anything
is extracted (a model must hold one Hugging Face folder: `config.json` at its top or one folder down),
and every upload counted against its tenant's quota (file count and bytes) before it is stored.

A dataset is parsed with the engine's own `parse_jsonl`, so the server and `opd train` accept exactly
the same records, in a bounded child process (`api/services/datasets.py`). A workspace zip is
rejected, before a byte is extracted, for too many entries, absolute paths, `..`, links or other
non-regular entries, encryption, a total uncompressed size over the limit, or a compression ratio
that says "zip bomb"; it is then extracted into a fresh folder under the data dir, each target
checked to stay inside it.

A file's charge against the quota is its upload plus what its zip extracts to (`File.stored_bytes`).
It is checked three times: before the upload is copied into the data dir (its size), before a zip is
extracted (its declared total) and, under a lock, when the record is committed (so two uploads at
once cannot both take the last room); a refused upload leaves nothing behind and touches nothing
already stored.
"""

from __future__ import annotations

import io
import re
import shutil
import threading
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.errors import APIError, not_found
from api.models import File, Job, Tenant
from api.services import datasets
from api.services.ids import new_id
from api.services.states import TERMINAL
from api.settings import Settings
from opd_trainer.errors import ConfigError
from opd_trainer.storage.zips import COPY_CHUNK, check_zip, extract_zip
from opd_trainer.wire.schemas import FilePublic


def safe_filename(name: str | None) -> str:
    base = Path((name or "").replace("\\", "/")).name
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", base)[:128].lstrip(".")
    return cleaned or "upload"


def _public(record: File) -> FilePublic:
    return FilePublic.model_validate(record)


def usage(session: Session, tenant_id: str) -> tuple[int, int]:
    """The tenant's file count and the bytes its files take (`stored_bytes`, else `bytes`)."""
    count, stored = session.execute(
        select(
            func.count(File.id), func.coalesce(func.sum(func.coalesce(File.stored_bytes, File.bytes)), 0)
        ).where(File.tenant_id == tenant_id)
    ).one()
    return int(count), int(stored)


def check_quota(settings: Settings, files: int, stored: int, adding: int) -> None:
    """The 429 (file count) or 413 (bytes) for a tenant holding `files` files of `stored` bytes that
    would add one more of `adding` bytes."""
    if files + 1 > settings.tenant_max_files:
        raise APIError(
            429,
            "file_limit_reached",
            f"tenant already holds {files} files; the limit is {settings.tenant_max_files} "
            "(OPD_TENANT_MAX_FILES): delete files (DELETE /v1/files/{id}) to upload more",
        )
    check_bytes(settings, stored, adding)


def check_bytes(settings: Settings, stored: int, adding: int) -> None:
    """The 413 for a tenant whose files take `stored` bytes adding `adding` more past its quota."""
    if stored + adding > settings.tenant_max_file_bytes:
        raise APIError(
            413,
            "storage_quota_exceeded",
            f"this upload needs {adding} bytes and the tenant's files already take {stored}; the limit is "
            f"{settings.tenant_max_file_bytes} bytes (OPD_TENANT_MAX_FILE_BYTES): delete files "
            "(DELETE /v1/files/{id}) to make room",
            "file",
        )


# Serialises the last quota check and the insert within this process; `FOR UPDATE` on the tenant's
# row does it across replicas on PostgreSQL.
_commit_lock = threading.Lock()


def _size(source: BinaryIO) -> int:
    source.seek(0, io.SEEK_END)
    size = source.tell()
    source.seek(0)
    return size


def upload(
    session: Session, settings: Settings, tenant_id: str, source: BinaryIO, filename: str | None, purpose: str
) -> FilePublic:
    # The multipart parser has spooled the upload to a temporary file: its size is known before a
    # byte reaches the data dir.
    size = _size(source)
    if size > settings.max_upload_bytes:
        raise APIError(413, "file_too_large", f"upload exceeds {settings.max_upload_bytes} bytes", "file")
    files, stored = usage(session, tenant_id)
    check_quota(settings, files, stored, size)
    session.rollback()  # no read transaction held open while the file is copied and checked
    file_id = new_id("file")
    folder = settings.files_dir / file_id
    folder.mkdir(parents=True)
    path = folder / safe_filename(filename)
    extracted: Path | None = None
    try:
        with path.open("wb") as sink:
            shutil.copyfileobj(source, sink, COPY_CHUNK)
        record = File(
            id=file_id, tenant_id=tenant_id, filename=path.name, purpose=purpose, bytes=size, path=str(path)
        )
        # A zip is checked again once its extracted size is known, before it is extracted.
        fits = partial(check_bytes, settings, stored)
        unpacked = 0
        if purpose == "dataset":
            record.samples = datasets.validate(
                path,
                max_line_bytes=settings.dataset_max_line_bytes,
                max_records=settings.dataset_max_records,
                timeout_s=settings.dataset_validate_timeout_s,
                max_memory_bytes=settings.dataset_validate_max_memory_bytes,
            )
        elif purpose == "model":
            extracted = settings.uploaded_models_dir / file_id
            model_dir, unpacked = _extract_model(settings, path, extracted, fits)
            record.extracted_dir = str(model_dir)
        else:
            extracted = settings.workspaces_dir / file_id
            unpacked = _extract_workspace(settings, path, extracted, fits)
            record.extracted_dir = str(extracted)
        record.stored_bytes = size + unpacked
        with _commit_lock:
            session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
            check_quota(settings, *usage(session, tenant_id), record.stored_bytes)
            session.add(record)
            session.commit()
    except BaseException:
        session.rollback()
        shutil.rmtree(folder, ignore_errors=True)
        if extracted is not None:
            shutil.rmtree(extracted, ignore_errors=True)
        raise
    return _public(record)


def _extract(
    path: Path, target: Path, what: str, limits: tuple[int, int, float], fits: Callable[[int], None]
) -> int:
    """Checks the zip at `path` (`check_zip` with `limits`: max entries, max uncompressed bytes, max
    ratio) and that the upload plus its contents `fits` the tenant's quota, then extracts it into the
    new folder `target`; returns the bytes extracted."""
    max_files, max_uncompressed, max_ratio = limits
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        raise ConfigError(f"{path.name}: a {what} must be a zip archive", field="file") from None
    with archive:
        infos = check_zip(
            archive, max_files=max_files, max_uncompressed=max_uncompressed, max_ratio=max_ratio
        )
        # ZipExtFile stops at each entry's declared size, so this is what extraction can write.
        unpacked = sum(info.file_size for info in infos)
        fits(path.stat().st_size + unpacked)
        target.parent.mkdir(parents=True, exist_ok=True)
        extract_zip(archive, infos, target)
    return unpacked


def _extract_workspace(settings: Settings, path: Path, target: Path, fits: Callable[[int], None]) -> int:
    limits = (
        settings.workspace_max_files,
        settings.workspace_max_uncompressed_bytes,
        settings.workspace_max_compression_ratio,
    )
    return _extract(path, target, "workspace", limits, fits)


def _extract_model(
    settings: Settings, path: Path, target: Path, fits: Callable[[int], None]
) -> tuple[Path, int]:
    """A zipped Hugging Face model folder (its files at the top, or under one folder), checked like a
    workspace with the model limits, extracted; returns the folder holding `config.json` and the
    bytes extracted."""
    limits = (
        settings.model_max_files,
        settings.model_max_uncompressed_bytes,
        settings.workspace_max_compression_ratio,
    )
    unpacked = _extract(path, target, "model", limits, fits)
    configs = sorted(target.glob("config.json")) or sorted(target.glob("*/config.json"))
    if len(configs) != 1:
        shutil.rmtree(target, ignore_errors=True)
        found = "no config.json" if not configs else "several model folders"
        raise ConfigError(
            f"{path.name}: not a Hugging Face model folder ({found} at its top or one folder down)",
            field="file",
        )
    return configs[0].parent, unpacked


def get_owned(session: Session, tenant_id: str, file_id: str, param: str | None = None) -> File:
    record = session.get(File, file_id)
    if record is None or record.tenant_id != tenant_id:
        raise not_found("file", file_id, param)
    return record


def get(session: Session, tenant_id: str, file_id: str) -> FilePublic:
    return _public(get_owned(session, tenant_id, file_id, "file_id"))


def list_files(session: Session, tenant_id: str, purpose: str | None) -> list[FilePublic]:
    query = select(File).where(File.tenant_id == tenant_id).order_by(File.created_at.desc(), File.id)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    return [_public(f) for f in session.scalars(query)]


def delete(session: Session, tenant_id: str, file_id: str) -> None:
    record = get_owned(session, tenant_id, file_id, "file_id")
    active = session.scalars(select(Job).where(Job.tenant_id == tenant_id, Job.status.not_in(TERMINAL))).all()
    users = [job.id for job in active if file_id in job.file_ids]
    if users:
        raise APIError(409, "file_in_use", f"file is used by unfinished job(s) {', '.join(users)}", "file_id")
    session.delete(record)
    session.commit()
    shutil.rmtree(Path(record.path).parent, ignore_errors=True)
    if record.extracted_dir:
        extracted = Path(record.extracted_dir)
        # An uploaded model's folder may sit one level under its file id's folder: remove that.
        root = next((p for p in (extracted, *extracted.parents) if p.name == record.id), extracted)
        shutil.rmtree(root, ignore_errors=True)
