"""A stand-in for statmt.org on 127.0.0.1, and WMT14 archives in the layout of the real ones.

`FakeStatmt` serves bytes by URL path with HTTP Range support, records every request, and can be
told to fail the next requests for a path in scripted ways (see FAULTS), and redirects paths.
`wmt14_archives` builds small archives with the real archive names and member paths (training text
from the shared data, the real newstest2014 SGML files, newstest2013 as in dev.tgz).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import tarfile
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# cut: half the promised bytes, then close; 500/404: that status; drop: close without an answer;
# ignore-range: the whole file (200) to a range request; wrong: the right size, one byte changed;
# stall: answer after 1 s; stall-body: half the body, then 1 s of silence; no-length: no Content-Length,
# half the body, then close (the client cannot tell it is short); bad-range: a range request answered
# with 206 for a range that starts elsewhere.
FAULTS = ("cut", "500", "404", "drop", "ignore-range", "wrong", "stall", "stall-body", "no-length",
          "bad-range")


class FakeStatmt:
    def __init__(self, files: dict[str, bytes], redirects: dict[str, str] | None = None,
                 redirect_status: int = 302) -> None:
        self.files = dict(files)  # URL path (e.g. /wmt14/dev.tgz) -> content
        self.redirects = dict(redirects or {})  # URL path -> where a 302 sends the client
        self.redirect_status = redirect_status  # or 301, 303, 307, 308
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.faults: dict[str, list[str]] = defaultdict(list)  # path -> faults for its next requests
        self.lock = threading.Lock()
        self.server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def fail(self, path: str, *faults: str) -> None:
        assert all(f in FAULTS for f in faults)
        self.faults[path].extend(faults)

    def requests_for(self, path: str) -> list[str | None]:
        return [rng for p, rng in self.requests if p == path]

    def __enter__(self) -> FakeStatmt:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that gave up on a stalled or cut answer is part of the tests


def _handler(site: FakeStatmt) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep the test output clean
            pass

        def do_GET(self) -> None:
            with site.lock:
                site.requests.append((self.path, self.headers.get("Range")))
                fault = site.faults[self.path].pop(0) if site.faults[self.path] else None
            if self.path in site.redirects:
                self.send_response(site.redirect_status)
                self.send_header("Location", site.redirects[self.path])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = site.files.get(self.path)
            if body is None or fault == "404":
                self.send_error(404)
                return
            if fault == "500":
                self.send_error(500, "scripted failure")
                return
            if fault == "stall":  # answer only after the client's timeout
                time.sleep(1.0)
            if fault == "drop":  # no answer at all: the client sees the connection close
                self.close_connection = True
                return
            if fault == "wrong":  # same size, one byte changed: only a checksum notices
                middle = len(body) // 2
                body = body[:middle] + bytes([body[middle] ^ 0xFF]) + body[middle + 1:]
            self._send(body, _range_start(self.headers.get("Range")), fault)

        def _send(self, body: bytes, start: int | None, fault: str | None) -> None:
            if start is not None and fault == "bad-range":  # 206, but for the whole file
                self.send_response(206)
                self.send_header("Content-Range", f"bytes 0-{len(body) - 1}/{len(body)}")
            elif start is not None and fault != "ignore-range":
                if start >= len(body):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(body)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                body = body[start:]
            else:
                self.send_response(200)
            if fault != "no-length":
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if fault in ("cut", "no-length", "stall-body"):  # half the bytes, then close (after a pause)
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                if fault == "stall-body":
                    time.sleep(1.0)
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


def _range_start(header: str | None) -> int | None:
    match = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------------------------------------
# Archives


def tar_bytes(members: dict[str, bytes], compress: bool = True) -> bytes:
    """A tar (gzip-compressed unless `compress` is false) holding `members` (path -> content)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if compress else "w") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(content), 1400000000, 0o644
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def lines_bytes(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


# Pairs that each training corpus gets on top of real text, to exercise every cleaning step.
NOISE = [("", "Leer."), ("one two three", " "), (" ".join(["word"] * 260), " ".join(["Wort"] * 260)),
         ("a b c d e f g h i j", "a b"), ("Same pair .", "Gleiches Paar ."),
         ("Same pair .", "Gleiches Paar .")]


def training_pairs(data: Path, other: str, start: int, count: int) -> list[tuple[str, str]]:
    """`count` real pairs (en, other) starting at line `start`, then the NOISE pairs."""
    if other == "de":
        en, xx = data / "wmt-train-sample-10k/train.en", data / "wmt-train-sample-10k/train.de"
    else:
        en, xx = data / "multi30k/en-fr/train.en", data / "multi30k/en-fr/train.fr"
    real = list(zip(read_lines(en), read_lines(xx), strict=True))[start:start + count]
    return real + NOISE


def wmt14_archives(data: Path, pairs_per_corpus: int = 200) -> dict[str, dict]:
    """URL path -> {"bytes": archive, "train": {corpus: {lang: lines}}} for every WMT14 archive.

    The layout is the real one: training/europarl-v7.de-en.de, commoncrawl.fr-en.en (top level),
    un/undoc.2000.fr-en.fr, giga-fren.release2.fixed.en.gz inside an uncompressed tar,
    dev/newstest2013.de, test-full/newstest2014-deen-src.en.sgm, ...
    """
    corpora = {  # URL path -> member template (with {pair} and {lang}) per language pair
        "/wmt13/training-parallel-europarl-v7.tgz": {"de": "training/europarl-v7.{pair}.{lang}",
                                                     "fr": "training/europarl-v7.{pair}.{lang}"},
        "/wmt13/training-parallel-commoncrawl.tgz": {"de": "commoncrawl.{pair}.{lang}",
                                                     "fr": "commoncrawl.{pair}.{lang}"},
        "/wmt14/training-parallel-nc-v9.tgz": {"de": "training/news-commentary-v9.{pair}.{lang}",
                                               "fr": "training/news-commentary-v9.{pair}.{lang}"},
        "/wmt13/training-parallel-un.tgz": {"fr": "un/undoc.2000.{pair}.{lang}"},
        "/wmt10/training-giga-fren.tar": {"fr": "giga-fren.release2.fixed.{lang}.gz"},
    }
    archives: dict[str, dict] = {}
    for number, (path, templates) in enumerate(corpora.items()):
        members: dict[str, bytes] = {"README": b"a decoy member that prepare must not need\n"}
        train: dict[str, dict[str, list[str]]] = {}
        for other, template in templates.items():
            pairs = training_pairs(data, other, number * pairs_per_corpus, pairs_per_corpus)
            train[other] = {"en": [a for a, _ in pairs], other: [b for _, b in pairs]}
            for lang, lines in train[other].items():
                content = lines_bytes(lines)
                if "commoncrawl" in path:  # web text: one Latin-1 line, CRLF endings
                    content += b"Cafe ole\r\n" if lang == "en" else b"Caf\xe9 ol\xe9\r\n"
                name = template.format(pair=f"{other}-en", lang=lang)
                members[name] = gzip.compress(content, mtime=0) if name.endswith(".gz") else content
        archives[path] = {"bytes": tar_bytes(members, compress=not path.endswith(".tar")), "train": train}
    dev = {f"dev/newstest2013.{lang}": (data / f"wmt13-newstest2013/en-{'de' if lang == 'de' else 'fr'}"
                                        / f"newstest2013.{lang}").read_bytes() for lang in ("en", "de", "fr")}
    dev["dev/newstest2012.en"] = b"a decoy\n"
    archives["/wmt14/dev.tgz"] = {"bytes": tar_bytes(dev), "train": {}}
    sgm = {f"test-full/{p.name}": p.read_bytes()
           for p in sorted((data / "wmt14-newstest2014/sgm").glob("*.sgm"))}
    archives["/wmt14/test-full.tgz"] = {"bytes": tar_bytes(sgm), "train": {}}
    return archives


def checksums_file(archives: dict[str, dict], path: Path) -> Path:
    """A sha256sum-style file for the test archives (they replace the built-in checksums)."""
    path.write_text("".join(f"{hashlib.sha256(a['bytes']).hexdigest()}  {Path(p).name}\n"
                            for p, a in archives.items()))
    return path
