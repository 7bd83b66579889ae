"""The server's counters, as Prometheus text (`GET /metrics`): requests by route and status,
sentences by outcome, queue depth, batch sizes and request latency as histograms.

Plain counters under one lock rather than a client library: the exposition format is a few lines of
text, and the server then needs nothing beyond FastAPI and uvicorn."""

from __future__ import annotations

import bisect
import threading
from collections import Counter

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # sentences


class Histogram:
    """Cumulative bucket counts, their sum and count, as Prometheus reads a histogram."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        first = bisect.bisect_left(self.bounds, value)
        for i in range(first, len(self.bounds)):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b:g}"}} {c}' for b, c in zip(self.bounds, self.counts,
                                                                               strict=True)]
        out += [f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}',
                f"{name}_sum{{{labels}}} {self.sum:.6f}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, status)
        self.sentences: Counter[tuple[str, str]] = Counter()  # (pair, outcome)
        self.queue_depth: dict[str, int] = {}  # pair -> sentences waiting (set under the batcher's lock)
        self.batches: dict[str, Histogram] = {}
        self.steps: dict[str, Histogram] = {}  # sentences in each step of a running search
        self.search_seconds: Counter[str] = Counter()
        self.latency: dict[str, Histogram] = {}  # route -> seconds from request to response

    def count_request(self, route: str, status: int, seconds: float) -> None:
        with self.lock:
            self.requests[(route, status)] += 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def count_sentences(self, pair: str, outcome: str, n: int) -> None:
        with self.lock:
            self.sentences[(pair, outcome)] += n

    def observe_batch(self, pair: str, size: int, seconds: float) -> None:
        """A batch of `size` sentences searched, or joining a running search (`seconds` 0)."""
        with self.lock:
            self.batches.setdefault(pair, Histogram(BATCH_BUCKETS)).observe(size)
            self.search_seconds[pair] += seconds

    def observe_step(self, pair: str, sentences: int, seconds: float) -> None:
        """A step of a running search that held `sentences`, in `seconds`."""
        with self.lock:
            self.steps.setdefault(pair, Histogram(BATCH_BUCKETS)).observe(sentences)
            self.search_seconds[pair] += seconds

    def text(self) -> str:
        with self.lock:
            out = ["# HELP nmt_requests_total HTTP requests answered, by route and status",
                   "# TYPE nmt_requests_total counter"]
            out += [f'nmt_requests_total{{route="{r}",status="{s}"}} {n}'
                    for (r, s), n in sorted(self.requests.items())]
            out += ["# HELP nmt_sentences_total sentences by outcome: translated, dropped (their request "
                    "timed out or its client went away), failed", "# TYPE nmt_sentences_total counter"]
            out += [f'nmt_sentences_total{{pair="{p}",outcome="{o}"}} {n}'
                    for (p, o), n in sorted(self.sentences.items())]
            out += ["# HELP nmt_queue_depth sentences waiting to be searched",
                    "# TYPE nmt_queue_depth gauge"]
            out += [f'nmt_queue_depth{{pair="{p}"}} {n}' for p, n in sorted(self.queue_depth.items())]
            out += ["# HELP nmt_batch_sentences sentences per batch: searched together, or joining a "
                    "running search",
                    "# TYPE nmt_batch_sentences histogram"]
            for pair, histogram in sorted(self.batches.items()):
                out += histogram.lines("nmt_batch_sentences", f'pair="{pair}"')
            out += ["# HELP nmt_step_sentences sentences in each step of a running search",
                    "# TYPE nmt_step_sentences histogram"]
            for pair, histogram in sorted(self.steps.items()):
                out += histogram.lines("nmt_step_sentences", f'pair="{pair}"')
            out += ["# HELP nmt_search_seconds_total time spent searching batches",
                    "# TYPE nmt_search_seconds_total counter"]
            out += [f'nmt_search_seconds_total{{pair="{p}"}} {s:.6f}'
                    for p, s in sorted(self.search_seconds.items())]
            out += ["# HELP nmt_request_seconds time from a request to its response",
                    "# TYPE nmt_request_seconds histogram"]
            for route, histogram in sorted(self.latency.items()):
                out += histogram.lines("nmt_request_seconds", f'route="{route}"')
        return "\n".join(out) + "\n"
