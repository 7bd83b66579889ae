"""`nmt serve` as a client sees it: a real server process on a free loopback port, real HTTP.

Two servers per session of this module, each started once: `server` (the limits lowered so that
tests can reach them: at most 100 sentences queued, 50 texts a request, 400 source tokens a search)
and `slow_server` (API keys; a batch waits 4 s for more sentences, a request 0.5 s for its answer,
so time-outs and disconnects happen while sentences wait). Both serve the pipeline test's Multi30k
model (conftest's `multi30k_run`) in fp32, whose `nmt translate --dtype fp32` output of
test_2016_flickr is the reference: in fp32 a line's translation does not depend on its batch; in
bf16 it can (`multi30k_fp32_hyp`), which `--dtype auto` picks on a CPU with native bf16.
The last test drains `slow_server` with SIGTERM.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serving import Server, search_processes, serve_extra_missing
from typer.testing import CliRunner

from conftest import assert_user_error, nmt

KEY = "test-key-1"
# What the server and its search processes may hold in memory together: the model (8 MB) in the server
# twice (its translator's and the attention view's) and once in each of the two search processes
# (serve/processes.py), torch's and Python's own ~350 MB in each of the three, the queue (at most 100
# sentences here) and its batches, and on a CPU with AMX the bf16 kernels and the freed memory the
# search keeps for reuse (keep_freed_memory). Measured: 0.87 GiB idle and 0.98 GiB at most under this
# load on an AVX-512 CPU without AMX (the server alone had held 1.4 GB idle on one with AMX, under 1 GiB
# on AVX2 CPUs). The growth under load is the tighter bound.
RSS_LIMIT_BYTES = 3 << 30
RSS_GROWTH_LIMIT_BYTES = 200 << 20  # over the second of two loads (the first fills the pools)


@pytest.fixture(scope="module")
def model(multi30k_run: dict[str, Path]) -> Path:
    if (why := serve_extra_missing()) is not None:
        pytest.skip(why)
    return multi30k_run["model"]


@pytest.fixture(scope="module")
def lines(multi30k_run: dict[str, Path], multi30k_fp32_hyp: Path) -> tuple[list[str], list[str]]:
    """(test_2016_flickr's source lines, `nmt translate --dtype fp32`'s translation of each)."""
    source = (multi30k_run["raw"] / "test.en").read_text(encoding="utf-8").splitlines()
    reference = multi30k_fp32_hyp.read_text(encoding="utf-8").splitlines()
    assert len(source) == len(reference) == 1000
    return source, reference


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # --max-batch-tokens 400: a running search takes in about 15 sentences, so that 64 clients' 256
    # sentences overflow the queue of 100 (with 6000, the searches took in nearly all of them)
    running = Server([f"en-de={model}", "--dtype", "fp32", "--max-queue", 100, "--max-texts", 50,
                      "--max-chars", 1000, "--max-body-bytes", 100_000, "--max-batch-tokens", 400], log)
    yield running
    running.stop()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def slow_server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("serve_slow")
    (folder / "keys.txt").write_text(f"{KEY}\nsecond-key\n")
    running = Server([f"en-de={model}", "--dtype", "fp32", "--api-keys", folder / "keys.txt",
                      "--max-wait-ms", 4000, "--max-batch-tokens", 1_000_000, "--timeout", 0.5,
                      "--drain-seconds", 60],
                     folder / "server.log")
    yield running
    running.stop()


def libretranslate(server: Server, q: str | list[str], **fields: object) -> tuple[int, dict, dict]:
    return server.post("/translate", {"q": q, "source": "en", "target": "de", "format": "text", **fields})


def test_one_sentence_per_request_from_16_clients_equals_nmt_translate(server, lines) -> None:
    source, reference = lines
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda line: libretranslate(server, line), source))
    assert [status for status, _, _ in answers] == [200] * len(source)
    got = [body["translatedText"] for _, _, body in answers]
    assert got == reference
    # batched: 16 clients at once shared the search's steps (sentences joining the running search),
    # or the equality above says little about batching
    steps = server.metric("nmt_step_sentences_count", pair="en-de")
    assert server.metric("nmt_step_sentences_sum", pair="en-de") > 3 * steps > 0


def test_lists_equal_nmt_translate_through_both_apis(server, lines) -> None:
    source, reference = lines
    chunks = [list(range(i, min(i + 40, 400))) for i in range(0, 400, 40)]  # the first 400 lines

    def ask(chunk: list[int]) -> tuple[list[str], list[str]]:
        status, _, body = libretranslate(server, [source[i] for i in chunk])
        assert status == 200, body
        status, _, own = server.post("/v1/translate", {"text": [source[i] for i in chunk], "source": "en",
                                                       "target": "de", "nbest": 2})
        assert status == 200, own
        assert all(len(t["nbest"]) == 2 and t["nbest"][0]["score"] >= t["nbest"][1]["score"]
                   for t in own["translations"])
        return body["translatedText"], [t["text"] for t in own["translations"]]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for chunk, (lt, own) in zip(chunks, pool.map(ask, chunks), strict=True):
            assert lt == own == [reference[i] for i in chunk]


def test_libretranslate_request_shapes(server, lines) -> None:
    """The shapes LibreTranslate documents: JSON, a form, a string q, alternatives, source auto."""
    source, reference = lines
    status, _, body = libretranslate(server, source[0], alternatives=2)
    assert status == 200 and body["translatedText"] == reference[0]
    assert len(body["alternatives"]) == 2 and reference[0] not in body["alternatives"]
    form = f"q={source[1]}&source=en&target=de&format=text&api_key=".encode()
    status, _, body = server.post("/translate", form, content_type="application/x-www-form-urlencoded")
    assert status == 200 and body["translatedText"] == reference[1]
    status, _, body = server.post("/translate", {"q": source[2], "source": "auto", "target": "de"})
    assert status == 200 and body["translatedText"] == reference[2]
    assert body["detectedLanguage"]["language"] == "en"
    # README.md's curl command, as a user types it
    if shutil.which("curl"):
        curl = subprocess.run(["curl", "-s", f"{server.host}:{server.port}/translate", "-H",
                               "Content-Type: application/json", "-d",
                               json.dumps({"q": source[3], "source": "en", "target": "de"})],
                              capture_output=True, text=True, timeout=120, check=True)
        assert json.loads(curl.stdout) == {"translatedText": reference[3]}  # alternatives: when asked
    assert server.request("GET", "/languages")[2] == [{"code": "en", "name": "English", "targets": ["de"]}]
    assert server.request("GET", "/health")[:3:2] == (200, {"status": "ok", "models": ["en-de"]})


# (what is sent, the status, what the error names; None: a translation, one output per text)
HOSTILE = [
    (b"{not json", 400, "not valid JSON"),
    (b"", 400, "empty"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"q": "\xff\xfe", "source": "en", "target": "de"}', 400, "UTF-8"),
    (b'{"q": NaN, "source": "en", "target": "de"}', 400, "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, 413, "body"),
    (b"[" * 20_000 + b"]" * 20_000, 400, "not valid JSON"),  # nested too deep for the parser
    ({"source": "en", "target": "de"}, 400, "'q'"),
    ({"q": 5, "source": "en", "target": "de"}, 400, "'q'"),
    ({"q": ["a", 5], "source": "en", "target": "de"}, 400, "'q[1]'"),
    ({"q": [], "source": "en", "target": "de"}, 400, "'q'"),
    ({"q": {"a": 1}, "source": "en", "target": "de"}, 400, "'q'"),
    ({"q": "a dog", "source": 7, "target": "de"}, 400, "'source'"),
    ({"q": "a dog", "source": "en"}, 400, "'target'"),
    ({"q": "a dog", "source": "de", "target": "en"}, 400, "'de' to 'en'"),
    ({"q": "a dog", "source": "en", "target": "de", "format": "html"}, 400, "'format'"),
    ({"q": "a dog", "source": "en", "target": "de", "alternatives": "many"}, 400, "'alternatives'"),
    ({"q": "a dog", "source": "en", "target": "de", "alternatives": 99}, 400, "'alternatives'"),
    ({"q": "a dog", "source": "en", "target": "de", "alternatives": True}, 400, "'alternatives'"),
    ({"q": ["a dog"] * 51, "source": "en", "target": "de"}, 413, "'q'"),
    ({"q": "dog " * 300, "source": "en", "target": "de"}, 413, "'q'"),
    ({"q": "", "source": "en", "target": "de"}, 200, None),
    ({"q": ["   ", "\t\n"], "source": "en", "target": "de"}, 200, None),
    ({"q": "A dog\x00 runs\nacross the\u2028 grass.\r", "source": "en", "target": "de"}, 200, None),
    ({"q": ["\ud800 a dog", "\u202e\ufeffa cat"], "source": "en", "target": "de"}, 200, None),
    ({"q": "🐕" * 900, "source": "en", "target": "de"}, 200, None),
]
HOSTILE_V1 = [
    ({"text": "a dog", "source": "en", "target": "de", "beam": 100}, 400, "'beam'"),
    ({"text": "a dog", "source": "en", "target": "de", "beam": 0}, 400, "'beam'"),
    ({"text": "a dog", "source": "en", "target": "de", "beam": 2, "nbest": 3}, 400, "'nbest'"),
    ({"text": "a dog", "source": "en", "target": "de", "beam": 1.5}, 400, "'beam'"),
    ({"text": None, "source": "en", "target": "de"}, 400, "'text'"),
]


@pytest.mark.parametrize(
    "route, body, status, needle",
    [("/translate", *case) for case in HOSTILE] + [("/v1/translate", *case) for case in HOSTILE_V1],
    ids=[f"translate-{i}" for i in range(len(HOSTILE))] + [f"v1-{i}" for i in range(len(HOSTILE_V1))])
def test_hostile_request(server, route: str, body: bytes | dict, status: int, needle: str | None) -> None:
    got, _, answer = server.post(route, body)
    assert got == status, answer
    if needle is None:
        texts = json.loads(body)["q"] if isinstance(body, bytes) else body["q"]
        out = answer["translatedText"]
        assert isinstance(out, str) if isinstance(texts, str) else len(out) == len(texts)
        for text, translation in zip([texts] if isinstance(texts, str) else texts,
                                     [out] if isinstance(out, str) else out, strict=True):
            assert isinstance(translation, str) and "\n" not in translation
            assert (translation == "") == (not text.strip())
    else:
        assert needle in answer["error"], answer


def test_unknown_routes_and_methods_answer_json(server) -> None:
    assert server.request("GET", "/nothing")[::2] == (404, {"error": "Not Found"})
    assert server.request("GET", "/translate")[::2] == (405, {"error": "Method Not Allowed"})


def test_64_clients_every_request_answered_once_right_or_refused_with_retry_after(server, lines) -> None:
    """64 clients, 5 requests of 4 sentences each (up to 256 sentences for a queue of 100): each
    request gets exactly one answer, 200 with `nmt translate`'s translations or 503 with Retry-After;
    the server searches exactly the accepted sentences; memory stays within RSS_LIMIT_BYTES, and a
    second such load grows it by less than RSS_GROWTH_LIMIT_BYTES."""
    source, reference = lines
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], server.rss_bytes())

    def client(c: int) -> list[tuple[int, int]]:
        out = []
        for r in range(5):
            first = (c * 20 + r * 4) % 996
            status, headers, body = libretranslate(server, source[first:first + 4])
            if status == 200:
                assert body["translatedText"] == reference[first:first + 4]
            else:
                assert status == 503 and headers["retry-after"].isdigit(), (status, body)
            out.append((status, first))
        return out

    for load in range(2):  # the first fills the allocator's pools; the second would show a leak
        before_rss, peak[0] = server.rss_bytes(), 0
        translated_before = server.metric("nmt_sentences_total", pair="en-de", outcome="translated")
        stop.clear()
        watcher = threading.Thread(target=watch)
        watcher.start()
        start = time.monotonic()
        try:
            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                answers = [a for found in pool.map(client, range(64)) for a in found]
        finally:
            stop.set()
            watcher.join()
        assert time.monotonic() - start < 300
        assert len(answers) == 320
        accepted = sum(status == 200 for status, _ in answers)
        assert accepted > 0 and any(status == 503 for status, _ in answers)
        translated = (server.metric("nmt_sentences_total", pair="en-de", outcome="translated")
                      - translated_before)
        assert translated == 4 * accepted  # none lost, none searched twice, none of a refused request
        assert peak[0] < RSS_LIMIT_BYTES, (load, peak)
    assert peak[0] - before_rss < RSS_GROWTH_LIMIT_BYTES, (before_rss, peak)  # the second load's growth


def test_api_keys(slow_server) -> None:
    assert libretranslate(slow_server, "a dog")[0::2] == (403, {
        "error": "this server needs an API key: give it as 'api_key'"})
    assert libretranslate(slow_server, "a dog", api_key="wrong")[0::2] == (403, {"error": "Invalid API key"})
    assert slow_server.request("GET", "/languages")[0] == 200  # no key needed to look
    # a right key gets as far as the queue: there, 0.5 s of --timeout against 4 s of waiting
    assert libretranslate(slow_server, "a dog", api_key=KEY)[0] == 504


def test_timeout_answers_504_and_drops_the_waiting_sentences(slow_server) -> None:
    dropped = slow_server.metric("nmt_sentences_total", pair="en-de", outcome="dropped")
    translated = slow_server.metric("nmt_sentences_total", pair="en-de", outcome="translated")
    start = time.monotonic()
    status, _, body = libretranslate(slow_server, ["a dog runs", "two cats"], api_key=KEY)
    assert status == 504 and "--timeout" in body["error"]
    assert 0.4 < time.monotonic() - start < 3.5  # at --timeout, not once the batch is searched
    time.sleep(4.5)  # the batch's 4 s of waiting are over: it found them cancelled
    assert slow_server.metric("nmt_sentences_total", pair="en-de", outcome="dropped") >= dropped + 2
    assert slow_server.metric("nmt_sentences_total", pair="en-de", outcome="translated") == translated


def test_a_client_that_disconnects_has_its_sentences_dropped(slow_server) -> None:
    gone = slow_server.metric("nmt_requests_total", route="/translate", status="499")
    timed_out = slow_server.metric("nmt_requests_total", route="/translate", status="504")
    translated = slow_server.metric("nmt_sentences_total", pair="en-de", outcome="translated")
    body = json.dumps({"q": "a man walks", "source": "en", "target": "de", "api_key": KEY}).encode()
    with socket.create_connection((slow_server.host, slow_server.port)) as sock:
        sock.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.1)
    time.sleep(4.5)
    assert slow_server.metric("nmt_requests_total", route="/translate", status="499") == gone + 1
    assert slow_server.metric("nmt_requests_total", route="/translate", status="504") == timed_out
    assert slow_server.metric("nmt_sentences_total", pair="en-de", outcome="translated") == translated


def test_bad_command_lines_are_clear_errors(model: Path, tmp_path: Path) -> None:
    from nmt_cli.cli import app

    for args, needle in [([str(model)], "en-de="), ([f"en-de={model}", f"en-de={tmp_path}"], str(tmp_path)),
                         ([f"en-de={tmp_path / 'none.pt'}"], "does not exist"),
                         ([f"en-de={model}", "--beam", "9"], "--max-beam"),
                         ([f"en-de={model}", "--api-keys", str(tmp_path / "keys")], "--api-keys")]:
        result = CliRunner().invoke(app, ["serve", *args])
        assert result.exit_code == 2 and needle in result.output, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)
    # without the extra: a shadowing fastapi that cannot be imported, as where it is not installed
    (tmp_path / "fastapi").mkdir()
    (tmp_path / "fastapi" / "__init__.py").write_text("raise ImportError('No module named fastapi')\n")
    proc = subprocess.run([sys.executable, "-m", "nmt_cli", "serve", f"en-de={model}"], capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin"})
    assert_user_error(proc, "pip install 'nmt-cli[serve]'")


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(model, lines, tmp_path) -> None:
    """32 requests of 16 sentences wait in the queue (a batch waits 120 s); SIGTERM: they are searched at
    once and answered 200 with `nmt translate`'s translations, a new request gets 503, exit status 0."""
    source, reference = lines
    server = Server([f"en-de={model}", "--dtype", "fp32", "--max-wait-ms", 120_000,
                     "--max-batch-tokens", 1_000_000, "--drain-seconds", 60], tmp_path / "server.log")
    try:
        def ask(i: int) -> tuple[int, dict]:
            status, _, body = server.post("/v1/translate", {"text": source[i * 16:(i + 1) * 16],
                                                            "source": "en", "target": "de"})
            return status, body

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            pending = [pool.submit(ask, i) for i in range(32)]
            time.sleep(0.5)
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            status, headers, body = libretranslate(server, "a dog")
            health = server.request("GET", "/health")[0]
            answers = [f.result() for f in pending]
        assert status == 503 and "shutting down" in body["error"] and headers["retry-after"].isdigit()
        assert health == 503
        assert server.proc.wait(60) == 0
        assert time.monotonic() - start < 100  # searched at once: not after the batch's 120 s of waiting
    finally:
        server.stop()
    assert "Traceback" not in server.log.read_text()
    assert [s for s, _ in answers] == [200] * 32
    for i, (_, answer) in enumerate(answers):
        assert [t["text"] for t in answer["translations"]] == reference[i * 16:(i + 1) * 16]



def test_a_search_process_that_dies_fails_only_its_requests_and_another_takes_its_place(model, lines,
                                                                                       tmp_path) -> None:
    """Each search thread searches in a process of its own (serve/processes.py). SIGKILL one while 8
    clients send sentences: every request still gets exactly one answer, 200 with `nmt translate`'s
    translation or 500 saying the search failed; a new process takes the dead one's place, and the
    requests after it are all answered right, by both search threads."""
    source, reference = lines
    server = Server([f"en-de={model}", "--dtype", "fp32", "--threads", 2], tmp_path / "server.log")
    try:
        searching = search_processes(server.proc.pid)
        assert len(searching) == 2, searching
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            pending = [pool.submit(libretranslate, server, source[i]) for i in range(200)]
            while sum(f.done() for f in pending) < 20:
                time.sleep(0.01)
            os.kill(searching[0], signal.SIGKILL)
            answers = [f.result() for f in pending]
        for i, (status, _, body) in enumerate(answers):
            if status != 200:
                assert status == 500 and "search failed" in body["error"], (i, status, body)
            else:
                assert body["translatedText"] == reference[i], i
        status, _, body = libretranslate(server, source[200:250])  # both threads take a share of it
        assert status == 200 and body["translatedText"] == reference[200:250]
        now = search_processes(server.proc.pid)
        assert len(now) == 2 and searching[0] not in now and searching[1] in now, (searching, now)
    finally:
        server.stop()
    assert re.search(r"search process en-de-[01] stopped \(exit code -9\); starting another",
                     server.log.read_text()), server.log.read_text()


def test_an_exported_ctranslate2_folder_serves_as_nmt_translate_reads_it(model, lines, tmp_path) -> None:
    """The server takes what `nmt translate` takes: here a CTranslate2 folder, searched by CTranslate2
    with each request's n-best (the attention view is a model file's only)."""
    pytest.importorskip("ctranslate2", reason="the optional ctranslate2 package is not installed")
    source, _ = lines
    folder, text = tmp_path / "ct2", tmp_path / "head.en"
    nmt("export", "ctranslate2", model, "--out", folder)
    text.write_text("\n".join(source[:40]) + "\n", encoding="utf-8")
    expected = nmt("translate", folder, "--input", text).stdout.splitlines()
    server = Server([f"en-de={folder}"], tmp_path / "server.log")
    try:
        status, _, body = libretranslate(server, source[:40])
        assert status == 200 and body["translatedText"] == expected
        status, _, body = libretranslate(server, source[0], alternatives=2)
        assert status == 200 and body["translatedText"] == expected[0] and len(body["alternatives"]) == 2
        status, _, body = server.post("/v1/attention", {"text": source[0], "source": "en", "target": "de"})
        assert status == 400 and "not a model file" in body["error"]
    finally:
        server.stop()


def test_int8_serves_as_nmt_translate_dtype_int8(model, lines, tmp_path) -> None:
    source, _ = lines
    text = tmp_path / "head.en"
    text.write_text("\n".join(source[:30]) + "\n", encoding="utf-8")
    expected = nmt("translate", model, "--dtype", "int8", "--input", text).stdout.splitlines()
    server = Server([f"en-de={model}", "--dtype", "int8"], tmp_path / "server.log")
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # one a request, batched together
            answers = list(pool.map(lambda line: libretranslate(server, line), source[:30]))
    finally:
        server.stop()
    assert [body["translatedText"] for _, _, body in answers] == expected


def test_the_listening_socket_says_it_is_tcp_so_asyncio_turns_nagle_off() -> None:
    """With proto 0, asyncio leaves Nagle's algorithm on for the accepted connections, and each
    response written in two parts waited for the client's delayed ACK (44 ms a request, measured)."""
    from nmt_cli.serve.server import _bind

    with _bind("127.0.0.1", 0) as sock:
        assert sock.proto == socket.IPPROTO_TCP
        client = socket.create_connection(sock.getsockname())
        accepted, _ = sock.accept()
        with client, accepted:
            assert accepted.proto == socket.IPPROTO_TCP
