"""`nmt serve`: load each model, translate one sentence with it, then listen (uvicorn) until SIGTERM.

The port is bound before uvicorn starts, so `--port 0` takes any free port and the line
``serve: listening on http://HOST:PORT`` (stdout) names it; /health answers only then. SIGTERM
drains: the server answers new requests 503, searches what is queued at once, waits for the
requests in flight (at most `--drain-seconds`) and exits 0. SIGINT (Ctrl-C) stops it as uvicorn
does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

from nmt_cli.config.serve import ServeConfig
from nmt_cli.errors import NmtError, shown

PAIR = re.compile(r"([A-Za-z]{2,8}(?:_[A-Za-z0-9]+)?)-([A-Za-z]{2,8}(?:_[A-Za-z0-9]+)?)=(.+)")
MISSING_EXTRA = "nmt serve needs FastAPI and uvicorn: pip install 'nmt-cli[serve]'"


def model_specs(models: tuple[Path, ...]) -> list[tuple[str, str, Path]]:
    """(source, target, path) of each SRC-TGT=PATH argument; two for one pair are refused."""
    specs, seen = [], {}
    for given in models:
        match = PAIR.fullmatch(str(given))
        if match is None:
            raise NmtError(f"{shown(str(given))}: name the model's language pair, as en-de={given} "
                           "(a model file does not record its languages)")
        source, target, path = match.group(1), match.group(2), Path(match.group(3))
        pair = f"{source}-{target}"
        if pair in seen:
            raise NmtError(f"two models for {pair}: {seen[pair]} and {path}; serve one model per pair")
        seen[pair] = path
        if not path.exists():
            raise NmtError(f"model {path} ({pair}) does not exist")
        specs.append((source, target, path))
    return specs


def read_keys(path: Path | None) -> frozenset[str] | None:
    if path is None:
        return None
    from nmt_cli.config.core import read_small_text

    try:
        keys = frozenset(line.strip() for line in read_small_text(path, "API keys file").splitlines())
    except FileNotFoundError:
        raise NmtError(f"--api-keys {path} does not exist") from None
    except UnicodeDecodeError:
        raise NmtError(f"--api-keys {path} is not UTF-8 text (one key a line)") from None
    keys -= {""}
    if not keys:
        raise NmtError(f"--api-keys {path} holds no key (one key a line)")
    return keys


def _check(cfg: ServeConfig) -> None:
    if cfg.beam > cfg.max_beam:
        raise NmtError(f"--beam {cfg.beam} is over --max-beam {cfg.max_beam}")
    if cfg.compile:
        raise NmtError("nmt serve searches with the eager decoder: leave out --compile")


def run(cfg: ServeConfig) -> None:
    try:
        import uvicorn

        from nmt_cli.serve import app as api
        from nmt_cli.serve.drain import DrainingServer
    except ImportError:
        raise NmtError(MISSING_EXTRA) from None
    _check(cfg)
    specs, keys = model_specs(cfg.model), read_keys(cfg.api_keys)
    state = api.State({}, api.Limits(cfg.max_chars, cfg.max_texts, cfg.max_body_bytes, cfg.max_beam),
                      cfg.beam, cfg.timeout, keys)
    with contextlib.ExitStack() as stack:
        for source, target, path in specs:
            state.models[f"{source}-{target}"] = _load(cfg, source, target, path, state, stack)
        sock = _bind(cfg.host, cfg.port)
        page = Path(__file__).with_name("page.html").read_text(encoding="utf-8")
        config = uvicorn.Config(api.build_app(state, page), log_level="warning", access_log=False,
                                timeout_graceful_shutdown=1, backlog=2048, lifespan="off")
        server = DrainingServer(config, state, cfg.drain_seconds, list(state.models.values()))
        host, port = sock.getsockname()[:2]
        print(f"serve: listening on http://{host}:{port} ({', '.join(state.models)})", flush=True)
        server.run(sockets=[sock])
    print("serve: stopped", file=sys.stderr, flush=True)


def _load(cfg: ServeConfig, source: str, target: str, path: Path, state: Any,
          stack: contextlib.ExitStack) -> Any:
    """One model's translator, its batcher and (a model file) its attention, after a first sentence."""
    from nmt_cli.inference.translate import load_translator
    from nmt_cli.serve import app as api
    from nmt_cli.serve.attention import AttentionModel
    from nmt_cli.serve.batcher import Batcher
    from nmt_cli.serve.processes import SearchProcess

    def warn(message: str) -> None:
        print(f"warning: {source}-{target}: {message}", file=sys.stderr, flush=True)

    translator = load_translator(dataclasses.replace(cfg, model=(path,)), warn)
    stack.callback(translator.close)
    start = time.perf_counter()
    translator.translate(["Hello."])  # ready means searched once: the first search pays for set-up
    print(f"serve: {source}-{target} loaded from {path}, first sentence in "
          f"{time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
    processes = []
    if translator.running() is not None and next(translator.model.parameters()).device.type == "cpu":
        start = time.perf_counter()
        processes = [SearchProcess(translator.cfg, translator.precision(), f"{source}-{target}-{i}")
                     for i in range(translator.workers)]
        for process in processes:
            stack.callback(process.close)
        for process in processes:
            process.ready()
        print(f"serve: {source}-{target}: {len(processes)} search processes ready in "
              f"{time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
    batcher = Batcher(translator, cfg.max_batch_tokens, cfg.max_wait_ms / 1000, cfg.max_queue,
                      state.metrics, f"{source}-{target}", processes)
    attention = AttentionModel(path, translator) if path.is_file() else None
    return api.Served(source, target, path, batcher, attention)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    # that say they are TCP, and the connections accepted here inherit it; with Nagle on, a response
    # written in two parts waits for the client's delayed ACK on every request
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise NmtError(f"cannot listen on {host}:{port} ({e.strerror}); give another --port "
                       "(0: any free one)") from None
    sock.listen(2048)
    return sock
