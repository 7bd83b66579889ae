"""`nmt serve` (`server`: models loaded, the port bound, uvicorn run): an HTTP translation server with
a LibreTranslate-compatible API and nmt's own (`app`), the requests' fields checked and bounded
(`parse`), dynamic batching of every request's sentences into the search of `nmt translate`
(`batcher`), on a CPU each search thread's search in a process of its own (`processes`), Prometheus
counters (`metrics`), SIGTERM's drain (`drain`), the cross-attention the
page draws (`attention`), and the page itself (page.html, no external assets).

What it may import is ARCHITECTURE.md's Packages table (tests/test_layers.py reads it). It searches
through `inference` only, so its translations are `nmt translate`'s; nothing imports it but the CLI
(by name). FastAPI and uvicorn are an optional extra (`pip install 'nmt-cli[serve]'`).
"""
