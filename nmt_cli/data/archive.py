"""Safe extraction of the few members `nmt prepare` needs from a downloaded tar archive.

An archive is read in one streaming pass. Any member that could write outside the target folder or
is not a plain file or folder (an absolute path, a `..` component, a symbolic or hard link, a device
or pipe) makes the whole archive refused: the official archives have none, so such a member means the
file is not what it claims to be. Wanted members are written with our own code (temporary file, then
rename), never with `tarfile.extract`, so nothing depends on the `filter=` API of Python 3.12.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
import zlib
from pathlib import Path, PurePosixPath

from nmt_cli.artifacts import atomic_writer
from nmt_cli.config.core import read_small_text
from nmt_cli.errors import NmtError, shown

MARKER = ".complete.json"


def unsafe_reason(member: tarfile.TarInfo) -> str | None:
    """Why `member` must not be extracted, or None when it is a plain file or folder inside the archive."""
    name = member.name.replace("\\", "/")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return "has an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "has a '..' component in its path"
    if member.issym():
        return f"is a symbolic link (to {shown(member.linkname)})"
    if member.islnk():
        return f"is a hard link (to {shown(member.linkname)})"
    if member.isdev():
        return "is a device or pipe"
    if not (member.isfile() or member.isdir()):
        return "is not a regular file or folder"
    return None


def member_name(member: tarfile.TarInfo) -> str:
    return str(PurePosixPath(member.name.replace("\\", "/")))  # drops "./" and doubled slashes


def extract(archive: Path, wanted: list[str], target: Path) -> dict[str, Path]:
    """Extract the members named in `wanted` from `archive` into `target`; return name -> path.

    A finished extraction leaves a marker recording the archive's size and modification time, so
    running again with the same archive reads nothing.
    """
    paths = {name: _inside(target, name, archive) for name in wanted}
    if _already_extracted(archive, paths, target):
        return paths
    (target / MARKER).unlink(missing_ok=True)
    found: dict[str, int] = {}
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            for member in tar:
                reason = unsafe_reason(member)
                if reason:
                    raise NmtError(f"{archive}: member {shown(member.name)} {reason}; the archive is refused "
                                   "(it is not an official one): delete it and download it again")
                name = member_name(member)
                if name in paths and member.isfile():
                    _write_member(tar, member, paths[name])
                    found[name] = member.size
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise NmtError(f"{archive} is not a readable tar archive ({e}); delete it and download it "
                       "again") from None
    missing = [name for name in wanted if name not in found]
    if missing:
        raise NmtError(f"{archive} has no member {', '.join(missing)}; it is not the expected archive: "
                       "delete it and download it again")
    stat = archive.stat()
    with atomic_writer(target / MARKER, "w") as f:
        json.dump({"archive": str(archive), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                   "members": found}, f)
    return paths


def _inside(target: Path, name: str, archive: Path) -> Path:
    path = (target / name).resolve()
    if not path.is_relative_to(target.resolve()):
        raise NmtError(f"{archive}: member {shown(name)} would be written outside {target}")
    return target / name


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> None:
    source = tar.extractfile(member)
    assert source is not None  # a regular file always has data
    with source, atomic_writer(path, "wb") as out:
        while block := source.read(1 << 22):
            try:
                out.write(block)
            except OSError as e:
                raise NmtError(f"cannot write {path}: {e.strerror}; free some space or choose "
                               "another --downloads folder") from None


def _already_extracted(archive: Path, paths: dict[str, Path], target: Path) -> bool:
    try:
        marker = json.loads(read_small_text(target / MARKER, "marker"))
    except (OSError, ValueError, NmtError):
        return False
    stat = archive.stat()
    if (marker.get("bytes"), marker.get("mtime_ns")) != (stat.st_size, stat.st_mtime_ns):
        return False
    members = marker.get("members", {})
    return all(name in members and os.path.isfile(path) and os.path.getsize(path) == members[name]
               for name, path in paths.items())
