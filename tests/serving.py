"""A real `nmt serve` process on a free loopback port, and plain HTTP clients for it (the standard
library's http.client: what any client sends, nothing the server's own stack provides). Shared by
test_serve.py and test_serve_page.py."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SERVE_EXTRA = "fastapi and uvicorn (pip install 'nmt-cli[serve]')"


def serve_extra_missing() -> str | None:
    """Why the server cannot run here (its optional extra is not installed), or None."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return f"nmt serve needs {SERVE_EXTRA}"
    return None


class Server:
    """`nmt serve ARGS --port 0` started, its URL read from its first stdout line; stderr to a file."""

    def __init__(self, args: list[object], log: Path, startup_seconds: float = 300) -> None:
        self.log = log
        with open(log, "wb") as stderr:  # the child holds its own copy of the file
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nmt_cli", "serve", *map(str, args), "--port", "0"],
                stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + startup_seconds
        line = self.proc.stdout.readline()  # the server prints this once it listens (or exits)
        found = re.search(r"listening on http://([\d.]+):(\d+)", line)
        if found is None or time.monotonic() > deadline:
            self.proc.kill()
            raise AssertionError(f"nmt serve did not start: {line!r}\n{log.read_text()}")
        self.host, self.port = found.group(1), int(found.group(2))

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                timeout: float = 120) -> tuple[int, dict[str, str], Any]:
        """(status, headers, JSON body or text) of one request on a new connection."""
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": content_type} if body else {})
            response = conn.getresponse()
            raw = response.read().decode()
            headers = {k.lower(): v for k, v in response.getheaders()}
        finally:
            conn.close()
        is_json = headers.get("content-type", "").startswith("application/json")
        return response.status, headers, json.loads(raw) if is_json else raw

    def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, dict[str, str], Any]:
        return self.request("POST", path, body, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one Prometheus sample of /metrics (0 when absent)."""
        _, _, text = self.request("GET", "/metrics")
        wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(f"{name}{{{wanted}}} "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def rss_bytes(self) -> int:
        """The resident memory of the server and its search processes (serve/processes.py) together."""
        return sum(_rss(pid) for pid in [self.proc.pid, *child_processes(self.proc.pid)])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def child_processes(pid: int) -> list[int]:
    """The processes `pid` started that are still running (the server's search processes)."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def _rss(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:  # it ended since it was listed
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def search_processes(pid: int) -> list[int]:
    """Of the processes `pid` started, the search processes (multiprocessing's spawned workers, not its
    resource tracker)."""
    found = []
    for child in child_processes(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in command:
            found.append(child)
    return found
