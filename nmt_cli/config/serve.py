"""The config of `nmt serve`: `nmt translate`'s settings (inherited, so each default is written once,
in `TranslateConfig`), the address, and the limits that keep the server bounded under any load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nmt_cli.config.core import opt, required
from nmt_cli.config.inference import TranslateConfig


@dataclass
class ServeConfig(TranslateConfig):
    # Redeclared without their flags: a server reads no input file and writes no output file, and the
    # n-best size is each request's (`alternatives`); the search settings are translate's as they are.
    model: tuple[Path, ...] = required(
        "the models to serve, each a model file, an imported model or an exported CTranslate2 folder, "
        "named by its language pair: en-de=model.pt (one model per pair)", argument=True)
    input: Path | None = opt(None, "not used by the server")
    output: Path | None = opt(None, "not used by the server")
    nbest: int = opt(1, "not used by the server: each request asks for its alternatives", at_least=1)
    chunk_lines: int = opt(20000, "not used by the server", at_least=1)

    host: str = opt("127.0.0.1", "address to listen on (127.0.0.1: this machine only; 0.0.0.0: every "
                    "interface)", flag="--host")
    port: int = opt(8000, "TCP port (0: any free one, printed when listening)", flag="--port", at_least=0,
                    at_most=65535)
    api_keys: Path | None = opt(None, "a file of API keys, one a line: every translation request must "
                                "give one (api_key)", flag="--api-keys")
    max_batch_tokens: int = opt(
        6000, "a batch is searched once its sentences hold this many source tokens, padding included "
        "(or --max-wait-ms after its first sentence), and sentences waiting join a running search after "
        "each step up to this many; 1: one sentence a search (no batching)",
        flag="--max-batch-tokens", at_least=1)
    max_wait_ms: float = opt(10.0, "how long a batch waits for more sentences after its first",
                             flag="--max-wait-ms", at_least=0)
    max_queue: int = opt(4096, "sentences waiting at most, per model; a request beyond it is refused at "
                         "once (503, Retry-After)", flag="--max-queue", at_least=1)
    timeout: float = opt(60.0, "seconds a request may wait for its translations; then 504, and its "
                         "sentences still queued are dropped", flag="--timeout", above=0)
    drain_seconds: float = opt(30.0, "on SIGTERM: new requests get 503, those in flight have this long "
                               "to finish, then the server exits 0", flag="--drain-seconds", at_least=0)
    max_beam: int = opt(8, "the largest beam (and number of alternatives) a request may ask for",
                        flag="--max-beam", at_least=1)
    max_chars: int = opt(5000, "characters per text at most (413 beyond)", flag="--max-chars", at_least=1)
    max_texts: int = opt(128, "texts per request at most (413 beyond)", flag="--max-texts", at_least=1)
    max_body_bytes: int = opt(1 << 20, "request body bytes at most (413 beyond)", flag="--max-body-bytes",
                              at_least=1)
