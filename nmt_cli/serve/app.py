"""The HTTP API of `nmt serve` (FastAPI), JSON in and out; layout in README.md, "Serving".

- ``POST /translate``: LibreTranslate's: ``q`` (a string or a list), ``source``, ``target``, ``format``
  (``text``), ``alternatives``, ``api_key``; answers ``translatedText`` (a string or a list, as ``q``
  was) and ``alternatives``; errors ``{"error": "..."}`` with its status codes (400, 403, 429).
- ``POST /v1/translate``: nmt's own: ``text``, ``source``, ``target``, ``beam`` and ``nbest`` up to
  ``--max-beam``; answers each text's n-best with the scores the search ranks by.
- ``POST /v1/attention``: the cross-attention of a source and its translation (a model file only).
- ``GET /languages``, ``/health``, ``/metrics`` (Prometheus text), ``/v1/models``, and the page at ``/``.

Every refusal is ``{"error": ...}``: 400 naming the field, 403 a missing or unknown key, 413 over a
limit, 503 (with Retry-After) a full queue or a server shutting down, 504 past ``--timeout``. A
request's sentences go to its model's `Batcher`; a request that times out, or whose client goes
away, is cancelled there, so its sentences still waiting are never searched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from nmt_cli.serve.attention import AttentionModel
from nmt_cli.serve.batcher import Batcher, Draining, Job, QueueFull, Result, Settings
from nmt_cli.serve.metrics import Metrics
from nmt_cli.serve.parse import Limits, Refused, body_fields, count_field, text_field, texts_of

# LibreTranslate's /languages names each language; a code not listed here is its own name.
LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian",
                  "pt": "Portuguese", "nl": "Dutch", "ro": "Romanian", "cs": "Czech", "ru": "Russian",
                  "zh": "Chinese", "ja": "Japanese", "ar": "Arabic", "pl": "Polish", "tr": "Turkish"}
RETRY_AFTER_SECONDS = "1"  # a full queue empties within a batch or two


@dataclass
class Served:
    """One model the server translates with, keyed by its language pair."""

    source: str
    target: str
    path: Path
    batcher: Batcher
    attention: AttentionModel | None  # None: not a single model file (an exported folder)

    @property
    def pair(self) -> str:
        return f"{self.source}-{self.target}"


@dataclass
class State:
    models: dict[str, Served]
    limits: Limits
    beam: int  # the server's --beam: a request's default
    timeout: float
    keys: frozenset[str] | None
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    in_flight: int = 0


def build_app(state: State, page: str) -> FastAPI:
    app = FastAPI(title="nmt serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:  # 404, 405: as JSON too
        return JSONResponse({"error": str(exc.detail)}, exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:  # never a traceback out
        return JSONResponse({"error": f"internal error ({type(exc).__name__})"}, 500)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    @app.get("/languages")
    async def languages() -> list[dict[str, Any]]:
        targets: dict[str, list[str]] = {}
        for served in state.models.values():
            targets.setdefault(served.source, []).append(served.target)
        return [{"code": code, "name": LANGUAGE_NAMES.get(code, code), "targets": sorted(found)}
                for code, found in sorted(targets.items())]

    @app.get("/v1/models")
    async def models() -> list[dict[str, Any]]:
        return [{"pair": s.pair, "source": s.source, "target": s.target, "model": s.path.name,
                 "attention": s.attention is not None, "beam": state.beam,
                 "max_beam": state.limits.max_beam, "api_key": state.keys is not None}
                for s in state.models.values()]

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok", "models": sorted(state.models)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.post("/translate")
    async def libretranslate(request: Request) -> Response:
        return await _answer(state, request, "/translate", _libretranslate)

    @app.post("/v1/translate")
    async def translate_v1(request: Request) -> Response:
        return await _answer(state, request, "/v1/translate", _translate_v1)

    @app.post("/v1/attention")
    async def attention(request: Request) -> Response:
        return await _answer(state, request, "/v1/attention", _attention)

    return app


Handler = Callable[[State, Request, dict[str, Any]], Awaitable[dict[str, Any]]]


async def _answer(state: State, request: Request, route: str, handler: Handler) -> Response:
    """Run a translation route: the body read and checked, the key checked, refusals as JSON, the
    request counted in the metrics and in the in-flight count that a drain waits for."""
    start = time.perf_counter()
    state.in_flight += 1
    try:
        if state.draining:
            raise Refused(503, "the server is shutting down", {"Retry-After": RETRY_AFTER_SECONDS})
        data = body_fields(await _body(request, state.limits.max_body_bytes),
                           request.headers.get("content-type", ""))
        _check_key(state, data)
        response: Response = JSONResponse(await handler(state, request, data))
    except Refused as refused:
        response = JSONResponse({"error": refused.message}, refused.status, headers=refused.headers)
    finally:
        state.in_flight -= 1
    state.metrics.count_request(route, response.status_code, time.perf_counter() - start)
    return response


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise Refused(413, f"the request body has {int(declared)} bytes; at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"the request body has over {limit} bytes; at most {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_key(state: State, data: dict[str, Any]) -> None:
    if state.keys is None:
        return
    key = data.get("api_key")
    if not isinstance(key, str) or not key:
        raise Refused(403, "this server needs an API key: give it as 'api_key'")
    if key not in state.keys:
        raise Refused(403, "Invalid API key")


def _model(state: State, data: dict[str, Any]) -> tuple[Served, bool]:
    """The model of the request's source and target; (model, whether the source was "auto")."""
    source, target = text_field(data, "source"), text_field(data, "target")
    auto = source == "auto"
    if auto:  # LibreTranslate's language detection: here, the one source that has this target
        found = [s for s in state.models.values() if s.target == target]
        if len(found) == 1:
            return found[0], True
        source = "auto"
    served = state.models.get(f"{source}-{target}")
    if served is None:
        raise Refused(400, f"no model translates '{source}' to '{target}' (source, target); this server "
                           f"has: {', '.join(sorted(state.models))}")
    return served, auto


async def _search(state: State, request: Request, served: Served, texts: list[str],
                  settings: Settings) -> list[Result]:
    """The n-best of each text, through the model's batcher; 503 when its queue is full, 504 past the
    timeout; a client that disconnects has its waiting sentences dropped."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[list[Result] | None] = loop.create_future()

    def done(results: list[Result] | None) -> None:
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(results))

    job = Job(texts, settings, done)
    try:
        served.batcher.submit(job)
    except QueueFull:
        raise Refused(503, f"the queue of {served.pair} is full: try again shortly",
                      {"Retry-After": RETRY_AFTER_SECONDS}) from None
    except Draining:
        raise Refused(503, "the server is shutting down", {"Retry-After": RETRY_AFTER_SECONDS}) from None
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        finished, _ = await asyncio.wait({future, gone}, timeout=state.timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if future not in finished:
        job.cancel()
        if gone in finished:
            raise Refused(499, "the client went away")
        raise Refused(504, f"no translation within --timeout ({state.timeout:g} s); its sentences were "
                           "dropped")
    results = future.result()
    if results is None:
        raise Refused(500, "the search failed (the server's log says why)")
    return results


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _libretranslate(state: State, request: Request, data: dict[str, Any]) -> dict[str, Any]:
    texts, single = texts_of(data, "q", state.limits)
    fmt = data.get("format", "text")
    if fmt != "text":
        raise Refused(400, f"'format' {fmt!r} is not supported: this server translates plain text "
                           "(format: text)")
    alternatives = count_field(data, "alternatives", 0, 0, state.limits.max_beam - 1)
    served, auto = _model(state, data)
    settings = Settings(beam=max(state.beam, alternatives + 1), nbest=alternatives + 1)
    results = await _search(state, request, served, texts, settings)
    best = [found[0][1] if found else "" for found in results]
    others = [[text for _, text in found[1:]] for found in results]
    answer: dict[str, Any] = {"translatedText": best[0] if single else best}
    if alternatives:  # as LibreTranslate answers: the field only when they were asked for
        answer["alternatives"] = others[0] if single else others
    if auto:
        detected = {"confidence": 100, "language": served.source}
        answer["detectedLanguage"] = detected if single else [detected] * len(texts)
    return answer


async def _translate_v1(state: State, request: Request, data: dict[str, Any]) -> dict[str, Any]:
    texts, single = texts_of(data, "text", state.limits)
    beam = count_field(data, "beam", state.beam, 1, state.limits.max_beam)
    nbest = count_field(data, "nbest", 1, 1, beam)
    served, _ = _model(state, data)
    start = time.perf_counter()
    results = await _search(state, request, served, texts, Settings(beam, nbest))
    return {"pair": served.pair, "beam": beam, "seconds": round(time.perf_counter() - start, 4),
            "translations": [{"text": found[0][1] if found else "",
                              "nbest": [{"text": text, "score": score} for score, text in found]}
                             for found in results]}


async def _attention(state: State, request: Request, data: dict[str, Any]) -> dict[str, Any]:
    """The cross-attention of the source and its translation (given, or the server's own)."""
    served, _ = _model(state, data)
    if served.attention is None:
        raise Refused(400, f"the model of {served.pair} is not a model file (an exported folder): its "
                           "attention cannot be shown")
    (text,), _ = texts_of({"text": data.get("text")}, "text", state.limits)
    if not text.strip():
        raise Refused(400, "'text' is blank: give a sentence")
    if "translation" in data:
        (translation,), _ = texts_of({"translation": data["translation"]}, "translation", state.limits)
    else:
        results = await _search(state, request, served, [text], Settings(state.beam, 1))
        translation = results[0][0][1] if results[0] else ""
    return await asyncio.to_thread(served.attention.cross, text, translation)
