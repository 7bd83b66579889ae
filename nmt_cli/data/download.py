"""Downloads for `nmt prepare`: resumed, retried and verified; an unverified file is never used.

A file is streamed to `DIR/NAME.part`. After an interruption the next attempt asks only for the rest
with an HTTP Range request; a server that ignores Range sends the whole file again and the part
starts over. Only a file whose size (and checksum, where one is known) matches is renamed to
`DIR/NAME`, so a name without `.part` is always a complete download that passed verification.

Checksums come with the code (`Remote`) or from a user's file of `HEX  NAME` lines (`read_checksums`),
which replaces the built-in entry of that name: the way to use a verified mirror or test archives.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, TextColumn, TransferSpeedColumn

from nmt_cli import __version__
from nmt_cli.config.core import read_small_text
from nmt_cli.errors import NmtError, shown
from nmt_cli.progress import ProgressReport, log

CHUNK_BYTES = 1 << 20
_STATMT = re.compile(r"^https?://(www\.|data\.)?statmt\.org(?=/)")


@dataclass(frozen=True)
class Remote:
    """A file to download, with what is known about it in advance."""

    name: str  # file name in the downloads folder and in a --from folder
    url: str
    bytes: int | None = None
    sha256: str | None = None
    md5: str | None = None
    origin: str | None = None  # where the size/checksum was published


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows 308 (permanent, method kept) as urllib follows 307 for a GET: Python learnt 308 only in
    3.11, and servers that move files (statmt.org's mirrors among them) may answer with either."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        return super().redirect_request(req, fp, 307 if code == 308 else code, msg, headers, newurl)

    http_error_308 = urllib.request.HTTPRedirectHandler.http_error_302


_OPENER = urllib.request.build_opener(_Redirects)  # the default handlers, with this one for redirects


class _Retry(Exception):
    """A failure that another attempt may not have (network, 5xx, a cut connection)."""


def mirrored(url: str, mirror: str | None) -> str:
    """`url` with http(s)://[www.|data.]statmt.org replaced by `mirror` (a base URL)."""
    return _STATMT.sub(mirror.rstrip("/"), url) if mirror else url


def read_checksums(path: Path) -> dict[str, tuple[str, str]]:
    """`{name: (algorithm, hex)}` from lines `HEX  NAME` (the output of sha256sum or md5sum)."""
    try:
        text = read_small_text(Path(path), "checksums file")
    except (OSError, UnicodeDecodeError) as e:
        raise NmtError(f"cannot read the checksums file {path}: {e}") from None
    table: dict[str, tuple[str, str]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = re.fullmatch(r"\s*([0-9a-fA-F]{32}|[0-9a-fA-F]{64})\s+\*?(\S.*?)\s*", line)
        if not match:
            raise NmtError(f"{path}, line {number}: expected 'MD5-OR-SHA256  FILENAME' (as sha256sum "
                           f"prints it), got {shown(line)}")
        digest, name = match.group(1).lower(), Path(match.group(2)).name
        table[name] = ("md5" if len(digest) == 32 else "sha256", digest)
    return table


def with_checksums(remote: Remote, table: dict[str, tuple[str, str]], origin: str) -> Remote:
    """`remote` with its built-in size and checksum replaced by the user's entry, if there is one."""
    if remote.name not in table:
        return remote
    algorithm, digest = table[remote.name]
    known: dict[str, Any] = {"bytes": None, "sha256": None, "md5": None, algorithm: digest}
    return dataclasses.replace(remote, origin=origin, **known)


# ---------------------------------------------------------------------------------------------
# Verification


def verify(path: Path, remote: Remote, fix: str) -> dict[str, Any]:
    """Check `path` against what `remote` knows; return its manifest record. `fix` says what to do."""
    size = path.stat().st_size
    if remote.bytes is not None and size != remote.bytes:
        raise NmtError(f"{path} has {size} bytes but {remote.name} has {remote.bytes} "
                       f"(published by {remote.origin}): {fix}")
    digests = hash_file(path, md5=remote.md5 is not None)
    for algorithm in ("sha256", "md5"):
        expected = getattr(remote, algorithm)
        if expected is not None and digests[algorithm] != expected:
            raise NmtError(f"{path} does not match the known {algorithm} of {remote.name}: expected "
                           f"{expected} ({remote.origin}), got {digests[algorithm]}; {fix}")
    checked = [k for k in ("sha256", "md5", "bytes") if getattr(remote, k) is not None]
    return {"url": remote.url, "path": str(path), "bytes": size, **digests,
            "verified": f"{'+'.join(checked)} from {remote.origin}" if checked
            else "no published size or checksum"}


def hash_file(path: Path, md5: bool = False) -> dict[str, str]:
    digests = {"sha256": hashlib.sha256()} | ({"md5": hashlib.md5(usedforsecurity=False)} if md5 else {})
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            for digest in digests.values():
                digest.update(block)
    return {name: digest.hexdigest() for name, digest in digests.items()}


def from_folder(remotes: list[Remote], folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The archives of `remotes` taken from `folder` (no network), each verified."""
    missing = [r for r in remotes if not (folder / r.name).is_file()]
    if missing:
        listing = "; ".join(f"{r.name} ({r.url})" for r in missing)
        raise NmtError(f"--from {folder} lacks {len(missing)} file(s): {listing}. Download them into "
                       f"{folder}, or leave out --from to download them")
    return [(folder / r.name, verify(folder / r.name, r, f"replace it with a fresh copy from {r.url}"))
            for r in remotes]


# ---------------------------------------------------------------------------------------------
# Downloading


@dataclass(frozen=True)
class Retries:
    attempts: int
    timeout_seconds: float
    wait_seconds: float  # before the 2nd attempt; doubles for each further one


def download(remote: Remote, folder: Path, retries: Retries, mirror: str | None = None) -> tuple[Path, dict]:
    """Download `remote` into `folder` (or reuse a finished download); return its path and record."""
    final = folder / remote.name
    if final.exists():
        return final, verify(final, remote, f"delete {final} and run again to download it anew")
    folder.mkdir(parents=True, exist_ok=True)
    url, part = mirrored(remote.url, mirror), folder / f"{remote.name}.part"
    _fetch_with_retries(url, part, remote, retries)
    try:
        record = verify(part, remote, f"{part} was deleted; run again to download it anew, and if this "
                        f"repeats, {url} serves another file (check --mirror, or give its checksum "
                        "with --checksums if you trust it)")
    except NmtError:
        part.unlink(missing_ok=True)
        raise
    part.replace(final)
    return final, record | {"path": str(final), "downloaded_from": url}


def _fetch_with_retries(url: str, part: Path, remote: Remote, retries: Retries) -> None:
    failures = 0
    while True:
        before = _size(part)
        try:
            with _progress(remote.name) as progress:
                _transfer(url, part, remote, retries.timeout_seconds, progress)
            return
        except _Retry as e:
            failures = 0 if _size(part) > before else failures  # progress was made: not a failed try
            failures += 1
            if failures >= retries.attempts:
                raise NmtError(f"could not download {url} after {failures} attempts ({e}); check the "
                               f"network or --mirror, or download it by hand into a folder and pass "
                               f"--from FOLDER (the {_size(part)} bytes so far are kept in {part})") from None
            wait = retries.wait_seconds * 2 ** (failures - 1)
            log(f"{remote.name}: {e}; attempt {failures + 1} of {retries.attempts} in {wait:g} s")
            time.sleep(wait)


def _transfer(url: str, part: Path, remote: Remote, timeout: float, progress: ProgressReport) -> None:
    """One attempt: continue `part` from where it stops. Raises _Retry for what may pass."""
    offset, expected_bytes = _size(part), remote.bytes
    if expected_bytes is not None and offset == expected_bytes:
        return  # a finished part whose rename was interrupted
    headers = {"User-Agent": f"nmt/{__version__}", "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = _OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        _http_error(e, url, part, offset)
        return
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
        raise _Retry(_reason(e)) from None
    with response:
        offset, total = _start_offset(response, offset, url, part)
        if expected_bytes is not None and total is not None and total != expected_bytes:
            raise NmtError(f"{url} offers {total} bytes but {remote.name} has "
                           f"{expected_bytes}: the server has another file; check the URL or --mirror")
        _copy_body(response, part, offset, total, progress)
        checkable = any(v is not None for v in (remote.bytes, remote.sha256, remote.md5))
        if total is None and not getattr(response, "chunked", False) and not checkable:
            raise NmtError(f"{url} did not say how long {remote.name} is and no size or checksum of it is "
                           f"known, so the {_size(part)} bytes received (kept in {part}) may be cut short; "
                           f"give its sha256 with --checksums (a line 'HEX  {remote.name}') and run again, "
                           "or download it by hand and pass --from FOLDER")


def _http_error(e: urllib.error.HTTPError, url: str, part: Path, offset: int) -> None:
    if e.code == 416 and offset:  # asked past the end: the part is complete, or longer than the file
        match = re.search(r"/(\d+)", e.headers.get("Content-Range", ""))
        if match and int(match.group(1)) == offset:
            return
        part.unlink(missing_ok=True)
        raise _Retry("the partial download did not fit the file on the server; starting over")
    reason = " ".join(str(e.reason).split())  # urllib's text for a redirect loop spans lines
    if e.code in (408, 429) or e.code >= 500:
        raise _Retry(f"HTTP {e.code} {reason}")
    raise NmtError(f"{url}: HTTP {e.code} {reason}; check the URL (or --mirror), or download the "
                   "file by hand into a folder and pass --from FOLDER")


def _start_offset(response: Any, offset: int, url: str, part: Path) -> tuple[int, int | None]:
    """Where the body starts in the file and the file's full size (None: not said)."""
    if offset and response.status == 206:
        match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", response.headers.get("Content-Range", "").strip())
        if match and int(match.group(1)) == offset:
            return offset, None if match.group(3) == "*" else int(match.group(3))
        part.unlink(missing_ok=True)  # asking again would get the same answer
        raise _Retry(f"{url} answered the range request with another range; starting over")
    length = response.headers.get("Content-Length")
    return 0, int(length) if length and length.isdigit() else None  # 200: the whole file again


def _copy_body(response: Any, part: Path, offset: int, total: int | None, progress: ProgressReport) -> None:
    if offset == 0:
        part.unlink(missing_ok=True)
    progress.advance(offset, total)
    try:
        with open(part, "ab") as f:
            while True:
                try:
                    chunk = response.read1(CHUNK_BYTES)  # what has arrived: a stall loses nothing received
                except (http.client.HTTPException, ConnectionError, TimeoutError, OSError) as e:
                    raise _Retry(_reason(e)) from None
                if not chunk:
                    break
                f.write(chunk)
                progress.advance(len(chunk))
    except OSError as e:
        raise NmtError(f"cannot write {part}: {e.strerror}; free some space or choose --downloads") from None
    size = _size(part)
    if total is not None and size != total:
        raise _Retry(f"the connection closed after {size} of {total} bytes")


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        return f"cannot connect: {e.reason}"
    if isinstance(e, http.client.IncompleteRead):
        return "the connection closed before the end of the file"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _progress(name: str) -> ProgressReport:
    """A byte progress bar on a terminal, a start and an end line otherwise."""
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    return ProgressReport(name, None, lambda p: f"downloaded {name}: {p.done} bytes", columns=columns,
                          first_line=f"downloading {name}")

