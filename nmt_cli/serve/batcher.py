"""Dynamic batching: the sentences of every request for one model in one bounded queue, searched in
batches as `nmt translate` searches a file, and joining the searches that run (iteration-level
batching).

Why: a beam-search step costs nearly the same for one sentence as for dozens (the batch's rows run
through the same matrix products), so a server that searches each request alone, as LibreTranslate
and OpenNMT-py's server do, gets a fraction of a batch job's throughput under load. Here a batch is
formed once it holds `max_batch_tokens` source tokens, padding included, or `max_wait` seconds after
its oldest sentence, whichever comes first, and is searched by `nmt translate`'s search
(`inference.search.Search`, which its `beam_search` steps through). On a CPU, `nmt translate`
searches `threads` batches at once, one torch thread each; here so do `threads` search threads, each
taking its own batch from the queue (an equal share of what waits when several are idle). A search
does not wait for its batch's longest sentence before answering the others, and does not end with
it: each sentence is answered as soon as its n-best is settled, and after every step the sentences
waiting join the running search (up to the thread's share of all in flight and `max_batch_tokens`;
`inference.search.Search`), so its rows stay full while one-sentence clients come and go. On a CPU
that search runs in the thread's own process (`processes.SearchProcess`: the searches' Python would
otherwise share the server's interpreter lock); the thread decides who joins and steps it. Where a
translator has no such search (an exported CTranslate2 model, an ensemble, a compiled decoder), its
batches are searched whole by `Translator.translate`. A sentence's search does not depend on what it
is batched with (padding is masked), so its translation is `nmt translate`'s: exactly in fp32 and
int8; in bf16 the matrix products round with the number of rows, so a near-tie may go otherwise, as
in `nmt translate` itself when its batches change (README.md, "Serving").

Bounded: at most `max_queue` sentences wait (`submit` refuses a request beyond that at once); a job
that is cancelled (its client timed out or went away) has its waiting sentences dropped before they
are searched.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nmt_cli.inference.translate import RunningSearch, Translator
from nmt_cli.serve.metrics import Metrics
from nmt_cli.serve.processes import RemoteSearch, SearchProcess

Result = list[tuple[float, str]]  # a text's n-best (score, translation), best first


@dataclass(frozen=True)
class Settings:
    """The search settings a request may choose (lower than the server's limits): sentences are
    batched only with sentences of the same settings."""

    beam: int
    nbest: int


class QueueFull(Exception):
    """The queue has no room for a request's sentences: refuse it now rather than let it wait."""


class Draining(Exception):
    """The server is shutting down: no new work."""


@dataclass(eq=False)
class Job:
    """One request's texts. `done(results)` is called once, from the batching thread, when every
    text has its n-best (None: the search failed); never after `cancel`."""

    texts: list[str]
    settings: Settings
    done: Callable[[list[Result] | None], None]
    results: list[Result | None] = field(default_factory=list)
    left: int = 0
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Item:
    job: Job
    index: int
    ids: list[int]  # source ids with EOS (`Translator.encode`)
    arrived: float

    @property
    def tokens(self) -> int:  # what the sentence costs in a batch
        return len(self.ids)


class Batcher:
    """The queue and batching thread of one model (see the module docstring)."""

    def __init__(self, translator: Translator, max_batch_tokens: int, max_wait: float, max_queue: int,
                 metrics: Metrics, pair: str, processes: Sequence[SearchProcess] = ()) -> None:
        self.translator, self.metrics, self.pair = translator, metrics, pair
        self.processes = processes  # each search thread's process, if its searches run in one
        self.max_batch_tokens, self.max_wait, self.max_queue = max_batch_tokens, max_wait, max_queue
        self.pending: list[_Item] = []
        self.lock = threading.Condition()
        self.draining = False
        self.views: dict[Settings, Translator] = {}  # the translator with each request's settings
        # the batches `nmt translate` searches at once (on a CPU, `threads`), each by its own thread
        self.searchers, self.idle = translator.workers, translator.workers
        self.load = [0] * self.searchers  # the sentences each search thread's running search holds
        for i in range(self.searchers):
            threading.Thread(target=self._loop, args=(i,), name=f"search-{pair}-{i}", daemon=True).start()

    def submit(self, job: Job) -> None:
        """Queue `job`'s texts (blank ones are answered at once, as `nmt translate` answers them: no
        hypothesis); QueueFull when they do not fit, Draining after `drain`."""
        job.results = [None] * len(job.texts)
        now = time.monotonic()
        items = []
        for i, text in enumerate(job.texts):
            if text.strip():
                items.append(_Item(job, i, self.translator.encode(text, i + 1), now))
            else:
                job.results[i] = []
        job.left = len(items)
        with self.lock:
            if self.draining:
                raise Draining()
            if len(self.pending) + len(items) > self.max_queue:
                raise QueueFull()
            self.pending += items
            self.metrics.queue_depth[self.pair] = len(self.pending)
            self.lock.notify()
        if not items:
            job.done(job.results)  # type: ignore[arg-type]

    def depth(self) -> int:
        with self.lock:
            return len(self.pending)

    def drain(self) -> None:
        """Take no new jobs and search what waits at once, without waiting for fuller batches."""
        with self.lock:
            self.draining = True
            self.lock.notify()

    def _loop(self, index: int) -> None:
        with self.translator.keeping_packed_weights(), torch.inference_mode():
            while True:
                batch = self._next_batch()
                try:
                    settings = batch[0].job.settings
                    running = self._view(settings).running()
                    if running is None:
                        self._search(batch)
                        continue
                    if self.processes:
                        try:
                            running = self.processes[index].running(settings.beam, settings.nbest)
                        except Exception:  # no process could be started: these requests fail (500)
                            self._fail(batch)
                            continue
                    self._run(batch, running, index)
                finally:
                    with self.lock:
                        self.idle += 1
                        self.lock.notify_all()

    def _next_batch(self) -> list[_Item]:
        """Wait for a batch: full, or as old as `max_wait`, or anything while draining."""
        with self.lock:
            while True:
                self._drop_cancelled()
                if self.pending:
                    wait = self.pending[0].arrived + self.max_wait - time.monotonic()
                    full, size = self._fill(-(-len(self.pending) // self.idle))  # a share, rounded up
                    if full or wait <= 0 or self.draining:
                        batch, self.pending = self.pending[:size], self.pending[size:]
                        self.metrics.queue_depth[self.pair] = len(self.pending)
                        self.idle -= 1
                        self.lock.notify_all()  # another idle searcher may take what is left
                        return batch
                    self.lock.wait(wait)
                else:
                    self.lock.wait()

    def _fill(self, share: int) -> tuple[bool, int]:
        """(whether the oldest waiting sentences fill a batch, how many of them go in it): in order of
        arrival, as many as fit `max_batch_tokens` padded tokens (the longest times the count, as the
        search pads them), at least one, at most `share`, all of one request's settings."""
        first = self.pending[0].job.settings
        longest, size = 0, 0
        for item in self.pending:
            if item.job.settings != first:
                return True, size
            if size == share:  # the rest is another idle searcher's: full only if the share is
                break
            longest = max(longest, item.tokens)
            if size and longest * (size + 1) > self.max_batch_tokens:
                return True, size
            size += 1
        return longest * size >= self.max_batch_tokens, size

    def _drop_cancelled(self) -> None:
        kept = [item for item in self.pending if not item.job.cancelled]
        if len(kept) != len(self.pending):
            self.metrics.count_sentences(self.pair, "dropped", len(self.pending) - len(kept))
            self.pending = kept
            self.metrics.queue_depth[self.pair] = len(kept)

    def _search(self, batch: list[_Item]) -> None:
        """The batch through `Translator.translate`, all of it answered when its search ends."""
        translator = self._view(batch[0].job.settings)
        start = time.perf_counter()
        try:
            found = translator.translate([item.job.texts[item.index] for item in batch])
        except Exception:  # a bug or out of memory: its requests fail (500), the server goes on
            self._fail(batch)
            return
        self.metrics.observe_batch(self.pair, len(batch), time.perf_counter() - start)
        for item, result in zip(batch, found, strict=True):
            self._deliver(item, result)
        self.metrics.count_sentences(self.pair, "translated", len(batch))

    def _run(self, batch: list[_Item], running: RunningSearch | RemoteSearch, index: int) -> None:
        """The batch in a running search that the waiting sentences of its settings join after every
        step, up to this thread's share of the sentences in flight and `max_batch_tokens` padded
        tokens (iteration-level batching); each answered as soon as its n-best is settled."""
        settings, members, keys = batch[0].job.settings, dict[int, _Item](), itertools.count()
        items, joining = batch, []
        try:
            while True:
                joining = [item for item in items if len(item.ids) > 1]  # more than EOS
                for item in items:
                    if len(item.ids) <= 1:  # no piece the model reads: no hypothesis, as `translate` gives
                        self._deliver(item, [])
                if joining:
                    numbered = [(next(keys), item) for item in joining]
                    running.join([key for key, _ in numbered], [item.ids for item in joining])
                    members.update(numbered)
                    self.metrics.observe_batch(self.pair, len(joining), 0.0)
                joining = []
                if not members:
                    return
                start = time.perf_counter()
                settled = running.step()
                self.metrics.observe_step(self.pair, len(members), time.perf_counter() - start)
                for key, result in settled:
                    self._deliver(members.pop(key), result)
                self.metrics.count_sentences(self.pair, "translated", len(settled))
                with self.lock:
                    self.load[index] = len(members)
                    items = self._joining(settings, list(members.values()), index)
                if not members and not items:
                    return
        except Exception:  # a bug or out of memory: its requests fail (500), the server goes on
            self._fail([*members.values(), *joining])
        finally:
            with self.lock:
                self.load[index] = 0

    def _joining(self, settings: Settings, members: list[_Item], index: int) -> list[_Item]:
        """Of the sentences waiting, in order of arrival, those that join this thread's running search
        (of `members`) now: of its `settings`, while it holds fewer than its share of all in flight
        and fits `max_batch_tokens` (the longest source times the count, as `_fill` counts)."""
        self._drop_cancelled()
        share = -(-(sum(self.load) + len(self.pending)) // self.searchers)
        longest, size, taken = max((item.tokens for item in members), default=0), len(members), 0
        for item in self.pending:
            if item.job.settings != settings or size >= share:
                break
            if size and max(longest, item.tokens) * (size + 1) > self.max_batch_tokens:
                break
            longest, size, taken = max(longest, item.tokens), size + 1, taken + 1
        joining, self.pending = self.pending[:taken], self.pending[taken:]
        self.metrics.queue_depth[self.pair] = len(self.pending)
        return joining

    def _deliver(self, item: _Item, result: Result) -> None:
        job = item.job
        with self.lock:  # a request's texts may be searched by several threads
            job.results[item.index] = result
            job.left -= 1
            last = job.left == 0
        if last and not job.cancelled:
            job.done(job.results)  # type: ignore[arg-type]

    def _fail(self, items: list[_Item]) -> None:
        traceback.print_exc()
        for job in {item.job for item in items}:
            if not job.cancelled:
                job.cancel()
                job.done(None)
        self.metrics.count_sentences(self.pair, "failed", len(items))

    def _view(self, settings: Settings) -> Translator:
        """The translator searching with `settings`: the same loaded model, its config with the
        request's beam and n-best (the translator reads both from its config)."""
        with self.lock:
            return self._view_locked(settings)

    def _view_locked(self, settings: Settings) -> Translator:
        if settings not in self.views:
            self.views[settings] = self.translator.searching(settings.beam, settings.nbest)
        return self.views[settings]
