"""Zip safety (`opd_trainer/storage/zips.py`): hostile archives built in memory are refused
before anything is written, and a failed extraction leaves nothing behind."""

from __future__ import annotations

import io
import random
import struct
import zipfile
from pathlib import Path

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.storage.zips import check_zip, extract_zip, pack_workspace, unpack_workspace

MIB = 1024 * 1024
LIMITS = {"max_files": 50, "max_uncompressed": 64 * MIB, "max_ratio": 200.0}


def build(entries: dict[str, bytes], modes: dict[str, int] | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name, content in entries.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (modes or {}).get(name, 0o100644) << 16
            archive.writestr(info, content)
    return buffer.getvalue()


def check(data: bytes, **limits: float) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return check_zip(archive, **{**LIMITS, **limits})  # type: ignore[arg-type]


def refused(data: bytes, **limits: float) -> str:
    with pytest.raises(ConfigError) as caught:
        check(data, **limits)
    assert caught.value.field == "file"
    return caught.value.message


def test_a_plain_workspace_passes_and_extracts(tmp_path: Path) -> None:
    data = build({"functions/__init__.py": b"", "functions/reward.py": b"x = 1\n", "data/": b""})
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        extract_zip(archive, check_zip(archive, **LIMITS), tmp_path / "ws")  # type: ignore[arg-type]
    assert (tmp_path / "ws" / "functions" / "reward.py").read_bytes() == b"x = 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ws"]  # no staging folder left


def test_one_entry_that_expands_too_far_is_a_zip_bomb() -> None:
    assert "zip bomb" in refused(build({"zeros.bin": b"\0" * (8 * MIB)}))
    # The same entry under a ratio it fits passes: the limit is what refuses it.
    assert check(build({"zeros.bin": b"\0" * (8 * MIB)}), max_ratio=100_000)


def test_many_small_entries_that_expand_too_far_together_are_a_zip_bomb() -> None:
    # Each entry is under the 1 MiB per-entry threshold; together they are 16 MiB of zeros.
    pieces = {f"z/{i}.bin": b"\0" * (MIB // 2) for i in range(32)}
    assert "overall" in refused(build(pieces))


def test_ordinary_compression_is_not_a_zip_bomb() -> None:
    text = b"".join(f"line {i}: the quick brown fox {i * 7919 % 10007}\n".encode() for i in range(60_000))
    assert len(text) > 2 * MIB
    assert check(build({"log.txt": text}))


def test_too_many_entries_and_too_many_bytes_are_refused() -> None:
    assert "the limit is 3" in refused(build({f"{i}.py": b"" for i in range(4)}), max_files=3)
    noise = random.Random(0).randbytes
    big = {"a.bin": noise(MIB), "b.bin": noise(MIB)}  # incompressible, 2 MiB in all
    assert "expands to more than" in refused(build(big), max_uncompressed=MIB)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("/etc/cron.d/x", "absolute"),
        ("\\windows\\x", "absolute"),
        ("C:/x.py", "absolute"),
        ("../evil.py", "'..'"),
        ("a/../../evil.py", "'..'"),
        ("a\\..\\..\\evil.py", "'..'"),
    ],
)
def test_paths_that_leave_the_folder_are_refused(name: str, reason: str) -> None:
    assert reason in refused(build({name: b"x"}))


@pytest.mark.parametrize(
    ("mode", "reason"),
    [(0o120777, "symbolic link"), (0o020644, "not a regular file"), (0o010644, "not a regular file")],
)
def test_links_devices_and_fifos_are_refused(mode: int, reason: str) -> None:
    assert reason in refused(build({"entry": b"/etc/passwd"}, {"entry": mode}))


def _patched(data: bytes, local_offset: int, central_offset: int, value: int, fmt: str = "<I") -> bytes:
    """The zip with one field of its one entry rewritten, in the local and the central header."""
    patched = bytearray(data)
    struct.pack_into(fmt, patched, patched.find(b"PK\x03\x04") + local_offset, value)
    struct.pack_into(fmt, patched, patched.find(b"PK\x01\x02") + central_offset, value)
    return bytes(patched)


def _lie_about_size(data: bytes, declared: int) -> bytes:
    return _patched(data, 22, 24, declared)  # the uncompressed size


def test_encrypted_entries_are_refused() -> None:
    assert "encrypted" in refused(_patched(build({"secret.py": b"x"}), 6, 8, 0x1, "<H"))  # the flag bits


def test_an_entry_larger_than_it_declares_writes_no_more_and_leaves_nothing(tmp_path: Path) -> None:
    data = _lie_about_size(build({"functions/big.bin": b"\0" * (8 * MIB)}), 100)
    infos = check(data)  # 100 bytes declared: nothing to refuse yet
    assert infos[0].file_size == 100
    with (
        zipfile.ZipFile(io.BytesIO(data)) as archive,
        pytest.raises(ConfigError, match="cannot be extracted"),
    ):
        extract_zip(archive, infos, tmp_path / "ws")
    assert list(tmp_path.iterdir()) == []


def test_workers_unpack_with_the_same_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        unpack_workspace(build({"../evil.py": b"x"}), tmp_path / "ws")
    assert caught.value.field == "fcmodel.zipdir"
    assert not (tmp_path / "ws").exists() and not (tmp_path / "evil.py").exists()


def test_pack_workspace_leaves_symlinks_out(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "reward.py").write_text("x = 1\n")
    (tmp_path / "ws" / "passwd").symlink_to("/etc/passwd")
    data = pack_workspace(tmp_path / "ws")
    assert [info.filename for info in check(data)] == ["reward.py"]
