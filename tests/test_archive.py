"""Safe extraction: hostile members are refused and nothing is written outside the target folder."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from fake_statmt import tar_bytes
from nmt_cli.data.archive import MARKER, extract
from nmt_cli.errors import NmtError

HOSTILE_NAMES = {"absolute": "/tmp/nmt-evil-absolute", "dotdot": "training/../../escaped.txt",
                 "backslash": "training\\..\\..\\escaped.txt", "drive": "C:/nmt-evil.txt",
                 "pax-dotdot": "training/harmless.txt", "symlink": "training/link",
                 "symlink-absolute": "training/abs", "hardlink": "training/hard",
                 "hardlink-inside": "training/twin", "device": "training/dev", "fifo": "training/fifo"}


def hostile_tar(path: Path, kind: str) -> Path:
    """A tarball with the wanted member first, then one hostile member of `kind`."""
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        good = tarfile.TarInfo("training/wanted.en")
        good.size = 6
        tar.addfile(good, io.BytesIO(b"hello\n"))
        evil = tarfile.TarInfo(HOSTILE_NAMES[kind])
        match kind:
            case "symlink" | "symlink-absolute":
                evil.type = tarfile.SYMTYPE
                evil.linkname = "../../outside.txt" if kind == "symlink" else "/etc"
            case "hardlink" | "hardlink-inside":
                evil.type = tarfile.LNKTYPE
                evil.linkname = "/etc/passwd" if kind == "hardlink" else "training/wanted.en"
            case "device":
                evil.type = tarfile.CHRTYPE
            case "fifo":
                evil.type = tarfile.FIFOTYPE
            case "pax-dotdot":  # a harmless ustar name, overridden by the PAX header's path on reading
                evil.size, evil.pax_headers = 5, {"path": "../../pax-escaped.txt"}
            case _:
                evil.size = 5
        tar.addfile(evil, io.BytesIO(b"evil\n") if evil.isfile() else None)
    return path


@pytest.mark.parametrize("kind, reason", [
    ("absolute", "absolute path"), ("dotdot", "'..' component"), ("backslash", "'..' component"),
    ("drive", "absolute path"), ("pax-dotdot", "'..' component"), ("symlink", "symbolic link"),
    ("symlink-absolute", "symbolic link"), ("hardlink", "hard link"), ("hardlink-inside", "hard link"),
    ("device", "device"), ("fifo", "device or pipe"),
])
def test_hostile_members_are_refused_and_nothing_escapes(tmp_path: Path, kind: str, reason: str) -> None:
    archive = hostile_tar(tmp_path / "evil.tgz", kind)
    target = tmp_path / "deep" / "down" / "extracted"
    before = set(tmp_path.rglob("*"))
    with pytest.raises(NmtError) as error:
        extract(archive, ["training/wanted.en"], target)
    message = str(error.value)
    assert str(archive) in message and reason in message and "refused" in message
    assert "member '" in message  # the member is named
    written = set(tmp_path.rglob("*")) - before
    assert all(p == target or target in p.parents or p in target.parents for p in written), written
    assert not (target / MARKER).exists()  # not marked complete: a rerun will check again
    assert not Path("/tmp/nmt-evil-absolute").exists()


def test_only_wanted_members_are_extracted_and_a_second_run_reads_nothing(tmp_path: Path) -> None:
    archive = tmp_path / "a.tgz"
    archive.write_bytes(tar_bytes({"./training/a.en": b"a\n", "training/b.en": b"b\n", "other": b"o\n"}))
    target = tmp_path / "x"
    paths = extract(archive, ["training/a.en"], target)
    assert paths["training/a.en"].read_bytes() == b"a\n"
    assert sorted(p.name for p in target.rglob("*") if p.is_file()) == [MARKER, "a.en"]
    stat = archive.stat()  # garbage of the same size and time: a second run must not read it
    archive.write_bytes(b"\0" * stat.st_size)
    os.utime(archive, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert extract(archive, ["training/a.en"], target) == paths
    os.utime(archive, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a changed archive is read again
    with pytest.raises(NmtError, match="not a readable tar archive"):
        extract(archive, ["training/a.en"], target)


def test_a_missing_member_or_a_broken_archive_is_a_clear_error(tmp_path: Path) -> None:
    archive = tmp_path / "a.tgz"
    archive.write_bytes(tar_bytes({"training/a.en": b"a\n"}))
    with pytest.raises(NmtError, match="has no member training/b.en"):
        extract(archive, ["training/b.en"], tmp_path / "x")
    archive.write_bytes(archive.read_bytes()[:40])
    with pytest.raises(NmtError, match="not a readable tar archive"):
        extract(archive, ["training/a.en"], tmp_path / "y")


def test_a_symlink_planted_in_the_target_folder_is_not_followed(tmp_path: Path) -> None:
    """A benign archive, but the extraction folder already holds a link out of it (left by another
    tool or a hostile earlier archive): nothing is written through the link."""
    archive = tmp_path / "a.tgz"
    archive.write_bytes(tar_bytes({"training/a.en": b"a\n"}))
    outside, target = tmp_path / "outside", tmp_path / "x"
    outside.mkdir()
    target.mkdir()
    (target / "training").symlink_to(outside)
    with pytest.raises(NmtError, match="would be written outside"):
        extract(archive, ["training/a.en"], target)
    assert list(outside.iterdir()) == []
