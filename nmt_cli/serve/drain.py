"""SIGTERM as an orchestrator sends it before it kills a server: finish what was accepted, then exit 0.

uvicorn's own handling stops listening at once (a new request's connection is refused, not
answered) and re-raises the signal after shutting down, so the process ends by SIGTERM rather than
with status 0. Here the first SIGTERM starts a drain: new requests get 503 with Retry-After (a load
balancer retries them elsewhere), each model's batcher searches what is queued without waiting for
fuller batches, and once no request is in flight, or `drain_seconds` have passed, uvicorn is told to
stop. A second SIGTERM, or SIGINT, stops at once as uvicorn does.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import uvicorn


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, drain_seconds: float, served: list[Any]) -> None:
        super().__init__(config)
        self.state, self.drain_seconds, self.served = state, drain_seconds, served

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            self.state.draining = True
            threading.Thread(target=self._drain, name="drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        print(f"serve: SIGTERM: draining ({self.state.in_flight} requests in flight, at most "
              f"{self.drain_seconds:g} s)", file=sys.stderr, flush=True)
        for served in self.served:
            served.batcher.drain()
        deadline = time.monotonic() + self.drain_seconds
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.state.in_flight:
            print(f"serve: {self.state.in_flight} requests still in flight after --drain-seconds; "
                  "stopping", file=sys.stderr, flush=True)
        self.should_exit = True
