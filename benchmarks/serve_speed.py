"""Server throughput and latency: `nmt serve` under 1, 8 and 64 concurrent clients, beside `nmt translate`.

    python benchmarks/serve_speed.py --model MODEL.pt [--source test_2016_flickr.en] [--threads 2]

Every sentence of the file is sent as its own request (LibreTranslate's POST /translate, one `q`)
by N client threads, each on its own keep-alive connection, taking the next sentence as soon as its
last one is answered, to a real `nmt serve` process on a loopback port. Rows:

- `nmt translate, file`: the whole file through `nmt translate`'s translator (the same settings, in
  this process before any server starts): the batch job's throughput, the target at 64 clients.
- `nmt translate, one line`: each of the first `--single` lines translated alone: the latency of one
  sentence, the target of the 1-client p50.
- `translate, N a batch`: the translator on one thread, the lines shuffled and N at a time: a search
  thread's rate with the batches N one-sentence clients can give it (`--batches`).
- `serve, batched`: the server as it starts by default (dynamic batching).
- `serve, unbatched`: the same server with `--max-batch-tokens 1` (each sentence searched alone,
  as LibreTranslate and OpenNMT-py's server search).

Each server row checks its translations against `nmt translate`'s (`same`: lines identical). The
client threads share the machine's cores with the server, as a client on the same host would.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `nmt translate` does; must precede `import torch`

from machine import describe

from nmt_cli.config.inference import TranslateConfig
from nmt_cli.inference.translate import load_translator

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k" / "en-de"


def translate_rows(model: Path, lines: list[str], threads: int,
                   single: int) -> tuple[list[str], float, list[float]]:
    """(`nmt translate`'s output of `lines`, its wall seconds, the seconds of each of the first
    `single` lines translated alone)."""
    cfg = TranslateConfig(model=(model,), threads=threads)
    translator = load_translator(cfg, lambda message: print(f"warning: {message}", file=sys.stderr))
    try:
        translator.translate(lines[:20])  # warm-up, as the server translates one sentence before /health
        start = time.perf_counter()
        found = translator.translate(lines)
        seconds = time.perf_counter() - start
        alone = []
        for line in lines[:single]:
            start = time.perf_counter()
            translator.translate([line])
            alone.append(time.perf_counter() - start)
    finally:
        translator.close()
    return [hyps[0][1] if hyps else "" for hyps in found], seconds, alone


def batch_rows(model: Path, lines: list[str], sizes: list[int]) -> list[tuple[int, float]]:
    """(N, sentences/s) of `nmt translate`'s translator on one thread, the lines shuffled (as requests
    arrive) and translated N at a time: what one search thread of the server could do with batches
    of N, the bound of `clients` one-sentence clients."""
    translator = load_translator(TranslateConfig(model=(model,), threads=1), lambda message: None)
    shuffled = lines[:]
    random.Random(0).shuffle(shuffled)
    found = []
    try:
        translator.translate(lines[:20])
        for size in sizes:
            start = time.perf_counter()
            for i in range(0, len(shuffled), size):
                translator.translate(shuffled[i:i + size])
            found.append((size, len(shuffled) / (time.perf_counter() - start)))
    finally:
        translator.close()
    return found


class Serve:
    """`nmt serve` on a free loopback port, for the length of a `with`."""

    def __init__(self, model: Path, threads: int, extra: list[str]) -> None:
        self.args = [sys.executable, "-m", "nmt_cli", "serve", f"en-de={model}", "--port", "0",
                     "--threads", str(threads), "--max-queue", "100000", *extra]

    def __enter__(self) -> Serve:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        found = re.search(r"listening on http://([\d.]+):(\d+)", line)
        if found is None:
            self.proc.kill()
            raise SystemExit(f"nmt serve did not start: {line!r}")
        self.host, self.port = found.group(1), int(found.group(2))
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def load(server: Serve, lines: list[str], clients: int) -> tuple[float, list[float], list[str]]:
    """(wall seconds, each request's seconds, each line's translation) with `clients` threads."""
    out: list[str | None] = [None] * len(lines)
    latency: list[float] = []
    lock, queue = threading.Lock(), iter(range(len(lines)))

    def client() -> None:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                break
            body = json.dumps({"q": lines[i], "source": "en", "target": "de", "format": "text"})
            start = time.perf_counter()
            conn.request("POST", "/translate", body=body, headers={"Content-Type": "application/json"})
            answer = conn.getresponse()
            data = json.loads(answer.read())
            seconds = time.perf_counter() - start
            if answer.status != 200:
                raise SystemExit(f"line {i + 1}: {answer.status} {data}")
            out[i] = data["translatedText"]
            with lock:
                latency.append(seconds)
        conn.close()

    workers = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start, latency, out  # type: ignore[return-value]


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--source", type=Path, default=DATA / "test_2016_flickr.en")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--unbatched-clients", default="64", help="client counts of the unbatched server")
    parser.add_argument("--single", type=int, default=200, help="lines translated alone (latency of one)")
    parser.add_argument("--batches", default="32,64",
                        help="`nmt translate` on one thread, the lines shuffled, in batches of these sizes")
    args = parser.parse_args()
    lines = args.source.read_text(encoding="utf-8").splitlines()[: args.sentences]
    print(describe())
    print(f"model {args.model}; {len(lines)} sentences of {args.source.name}, one a request; --threads "
          f"{args.threads}; defaults of nmt translate (beam {TranslateConfig.beam})")
    reference, file_seconds, alone = translate_rows(args.model, lines, args.threads, args.single)
    header = f"{'run':<24} {'clients':>7} {'sent/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'x file':>7} {'same':>6}"
    print(header)
    file_rate = len(lines) / file_seconds
    print(f"{'nmt translate, file':<24} {'-':>7} {file_rate:8.1f} {'-':>8} {'-':>8} {1.0:7.2f} {'-':>6}")
    print(f"{'nmt translate, one line':<24} {'-':>7} {len(alone) / sum(alone):8.1f} "
          f"{quantile(alone, 0.5) * 1000:8.1f} {quantile(alone, 0.99) * 1000:8.1f} "
          f"{len(alone) / sum(alone) / file_rate:7.2f} {'-':>6}")
    for size, rate in batch_rows(args.model, lines, [int(n) for n in args.batches.split(",") if n]):
        name = f"translate, {size} a batch"  # on 1 thread
        print(f"{name:<24} {'-':>7} {rate:8.1f} {'-':>8} {'-':>8} {rate / file_rate:7.2f} {'-':>6}")
    runs = [("serve, batched", [], args.clients), ("serve, unbatched", ["--max-batch-tokens", "1"],
                                                   args.unbatched_clients)]
    for name, extra, clients in runs:
        counts = [int(n) for n in clients.split(",") if n]  # none: that server is not started
        if not counts:
            continue
        with Serve(args.model, args.threads, extra) as server:
            for count in counts:
                seconds, latency, out = load(server, lines, count)
                same = sum(a == b for a, b in zip(out, reference, strict=True)) / len(lines)
                rate = len(lines) / seconds
                print(f"{name:<24} {count:7d} {rate:8.1f} {quantile(latency, 0.5) * 1000:8.1f} "
                      f"{quantile(latency, 0.99) * 1000:8.1f} {rate / file_rate:7.2f} "
                      f"{same:6.1%}", flush=True)


if __name__ == "__main__":
    main()
