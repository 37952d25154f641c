"""A workspace's `requirements.txt`, read as package specifiers and nothing else.

Its lines become arguments of `pip install` (inside the sandbox, `processor_channel`), so a line is
argv from a tenant: `--requirement=/etc/passwd` makes pip quote a server file into the job's error,
`--report=PATH` writes one, `--index-url` fetches from anywhere, a local path runs a build backend,
`pkg @ https://...` downloads an archive. So a line is accepted only as a PEP 508 requirement that
`packaging.requirements.Requirement` parses: a name, optional extras, an optional version specifier
and optional standard environment markers (`; python_version < "3.12"`); no options, no URLs, no
paths, and no name that pip would take for an archive file in its folder (`evil.tar.gz` is a valid
PEP 508 name). What the caller passes to pip is `packaging`'s own rendering of what it parsed, so
nothing on a line reaches pip unparsed.

Comment lines, trailing ` # comments` and blank lines are skipped; a file holds at most `MAX_LINES`
lines of at most `MAX_LINE_CHARS` characters. An error names the field and the line's number, and
quotes nothing of the line but the package's name once that parsed: the file may not be what it claims
(a link, a copy of a server file), and its content is not echoed into a job's error.

    parse_requirements("numpy>=1.26\\nrich[jupyter]==13.7 ; python_version >= '3.11'", "f")
    # -> ['numpy>=1.26', 'rich[jupyter]==13.7; python_version >= "3.11"']
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from opd_trainer.errors import ConfigError

FILE_NAME = "requirements.txt"
MAX_LINES = 200
MAX_LINE_CHARS = 1000
MAX_BYTES = 64 * 1024
# Names pip installs as a local archive file when one of them ends so (pip's ARCHIVE_EXTENSIONS).
ARCHIVE_SUFFIXES = (".zip", ".whl", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz")
ARCHIVE_SUFFIXES += (".tlz", ".tar.lz", ".tar.lzma")
# pip's comment rule: `#` at the start of a line or after whitespace starts a comment.
_COMMENT = re.compile(r"(^|\s)#.*$")


def parse_requirements(text: str, field: str) -> list[str]:
    """The package specifiers of a requirements.txt `text`, normalised by `packaging`; raises
    `ConfigError(field=field)` naming the first bad line by its number."""
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise ConfigError(f"{FILE_NAME} has {len(lines)} lines; at most {MAX_LINES} are read", field=field)
    requirements = []
    for number, raw in enumerate(lines, start=1):
        where = f"{FILE_NAME} line {number}"
        if len(raw) > MAX_LINE_CHARS:
            raise ConfigError(f"{where} is longer than {MAX_LINE_CHARS} characters", field=field)
        line = _COMMENT.sub("", raw).strip()
        if not line:
            continue
        if line.startswith("-"):
            raise ConfigError(
                f"{where} is a pip option: only package specifiers (name[extras] version; markers) are "
                "installed, from the operator's index",
                field=field,
            )
        if line.endswith("\\"):
            raise ConfigError(
                f"{where} continues on the next line: give each requirement on one line", field=field
            )
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            raise ConfigError(
                f"{where} is not a package specifier (name[extras] version; markers): paths, URLs and "
                "archive files are not installed",
                field=field,
            ) from None
        if requirement.url is not None or requirement.name.lower().endswith(ARCHIVE_SUFFIXES):
            raise ConfigError(
                f"{where} ({requirement.name}): a URL, path or archive file is not installed; name the "
                "package and a version instead",
                field=field,
            )
        requirements.append(str(requirement))
    return requirements


def requirements_of(workspace: Path, field: str = "fcmodel.requirements.txt") -> list[str]:
    """The validated requirements of the workspace's requirements.txt (a folder or a .zip); [] when it
    has none. A file that is a link, larger than `MAX_BYTES` or not UTF-8 is refused unread."""
    if workspace.is_file():
        with zipfile.ZipFile(workspace) as archive:
            try:
                info = archive.getinfo(FILE_NAME)
            except KeyError:
                return []
            _check_size(info.file_size, field)
            data = archive.read(info)
    else:
        file = workspace / FILE_NAME
        if file.is_symlink():
            raise ConfigError(f"{FILE_NAME} is a symbolic link: give the file itself", field=field)
        if not file.is_file():
            return []
        _check_size(file.stat().st_size, field)
        data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{FILE_NAME} is not UTF-8 text", field=field) from None
    return parse_requirements(text, field)


def _check_size(size: int, field: str) -> None:
    if size > MAX_BYTES:
        raise ConfigError(f"{FILE_NAME} is larger than {MAX_BYTES // 1024} KiB", field=field)
