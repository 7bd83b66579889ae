"""`nmt translate`: raw text in, raw text out, one output line per input line, in input order.

Everything the model needs (weights, dictionary, sentencepiece model) comes from the model file.
Input is read as bytes and split on LF only; each line is cleaned (`clean_line`) so that nothing in
it (a CR, NUL, form feed, U+2028, invalid UTF-8) can change the line count; an empty or blank line
gives an empty line without running the model. A file is read `chunk_lines` lines at a time,
length-sorted into `max_tokens` batches and written back in order, so memory stays flat for any
size. From a terminal each line is translated as soon as it is entered. On the CPU, `threads`
batches are searched at once, one torch thread each (see `load_translator`).

Output layout: one translation per line; with `nbest` K > 1, K lines per input line, each
``LINE<TAB>SCORE<TAB>TEXT`` (LINE the 1-based input line number, SCORE the length-normalised
log-probability the search ranks by, best first; an empty input line gives K lines with SCORE -inf
and no text).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import IO

import sentencepiece as spm
import torch

from nmt_cli.artifacts import atomic_writer, bounded_lines, check_output_file, count_lines
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.data.bpe import sentencepiece_processor
from nmt_cli.data.clean import Normalization
from nmt_cli.data.dataset import EOS, Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.inference import ct2
from nmt_cli.inference.beams import SearchModel
from nmt_cli.inference.ensemble import Ensemble, check_members
from nmt_cli.inference.replicas import Replicas, describe
from nmt_cli.inference.search import (
    Search,
    compile_decoder,
    cpu_workers,
    joinable,
    padded,
    search_settings,
    translate_ids,
)
from nmt_cli.inference.trees import TreeConstraint, TreeSymbols, as_tree_line
from nmt_cli.model import file as model_file
from nmt_cli.model import int8, kernels, native
from nmt_cli.model.cpu import (
    Cpu,
    keep_freed_memory,
    missing_compiler,
    no_compiler_message,
    slow_bf16_warning,
    this_cpu,
)
from nmt_cli.progress import ProgressReport

# Every character that could end or split a line for some reader (str.splitlines breaks on all
# of them) or that a terminal interprets: C0 and C1 controls, DEL, U+2028/U+2029. Tab included.
_CONTROL = {c: " " for c in [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029]}

Warn = Callable[[str], None]
MIN_GREEDY_BF16_D_MODEL = 256  # `--dtype auto`, greedy search: narrower models decode in fp32


def clean_line(raw: bytes, number: int, warn: Warn) -> str:
    """One input line (without its LF) as text: a CRLF's CR dropped, invalid UTF-8 replaced (and
    reported), every control or line-separating character turned into a space."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        warn(f"line {number}: invalid UTF-8 (byte {e.start + 1}) replaced by U+FFFD")
        text = raw.decode("utf-8", errors="replace")
    return text.translate(_CONTROL)


def clean_output(text: str) -> str:
    """A translation as one line: no character of it can start a new line."""
    return text.translate(_CONTROL).strip()


class Translator:
    """A loaded model with its dictionary and sentencepiece model: lines of text to translations."""

    def __init__(self, model: SearchModel, dictionary: Dictionary, sp: spm.SentencePieceProcessor,
                 cfg: TranslateConfig, warn: Warn, workers: int = 1,
                 replicas: Replicas | None = None, search: ct2.Search | None = None,
                 normalization: Normalization | None = None,
                 target_sp: spm.SentencePieceProcessor | None = None) -> None:
        self.model, self.dictionary, self.sp, self.cfg, self.warn = model, dictionary, sp, cfg, warn
        self.target_sp = target_sp or sp  # output pieces to text: the target side's own model, if any
        self.search = search  # another engine's search (an exported CTranslate2 folder); None: nmt's
        self.normalization = normalization  # applied to raw source text, as to the training text
        self.workers = workers  # batches searched at once (see `translate_ids`)
        self.replicas = replicas  # worker processes that search instead, if any: `close` stops them
        self.trees, self.repaired, self.repairs = 0, 0, Counter[str]()  # --output-format tree
        self.tree_symbols = self._tree_symbols()

    def _tree_symbols(self) -> TreeSymbols | None:
        """The dictionary's tree symbols, when the search is to be held to well-formed trees."""
        if self.cfg.output_format != "tree" or not self.cfg.constrain:
            return None
        if self.replicas is not None or self.search is not None:
            self.warn(f"the search is not held to well-formed trees with "
                      f"{'--compile' if self.replicas is not None else 'an exported model'}; ill-formed "
                      "outputs are repaired")
            return None
        symbols = TreeSymbols(self.dictionary.symbols)
        if not symbols.usable:
            self.warn("the model's dictionary has no tree symbols (a parsing model's opening, closing and "
                      "word tokens), so the search is not held to well-formed trees")
            return None
        return symbols

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.close()

    def searching(self, beam: int, nbest: int) -> Translator:
        """This translator (the same loaded model) with another beam and n-best, searching one batch at
        a time: a server's search thread with a request's settings."""
        view = copy.copy(self)
        view.cfg = dataclasses.replace(self.cfg, beam=beam, nbest=nbest)
        view.workers = 1
        return view

    def precision(self) -> str:
        """The --dtype this translator runs in, as `auto` decided it: what a copy loaded elsewhere
        must be given to search as this one does (serve/processes.py)."""
        if self.cfg.dtype == "int8":
            return "int8"
        dtype = next(self.model.parameters()).dtype
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")

    def keeping_packed_weights(self) -> contextlib.AbstractContextManager[None]:
        """For a thread that translates with this translator for as long as it runs (a server's search
        thread): inside it, the weights' packed forms (`kernels.packed_weights`) are made once, not
        once a batch, which a server's small batches would pay again and again. Only for a model that
        no longer changes: a translator's never does."""
        return kernels.packed_weights()

    def encode(self, text: str, number: int) -> list[int]:
        """Source ids with EOS, truncated (with a warning) to the model's max_positions."""
        limit = self.model.cfg.max_positions - 1
        ids = self.dictionary.encode(self._pieces(text, limit))
        if len(ids) > limit:
            self.warn(f"line {number}: more pieces than the model's max_positions ({limit + 1} with EOS); "
                      f"translating only the first {limit}")
            ids = ids[:limit]
        return ids + [EOS]

    def _pieces(self, text: str, limit: int) -> list[str]:
        """The pieces of `text`; of a line far longer than the model reads, only those of a prefix of
        whole words that already gives more than `limit` pieces (they equal the first pieces of the
        whole line: sentencepiece splits at spaces), so a 5 MB line costs what a short one does."""
        if self.cfg.input_format == "pieces":
            return text.split()
        budget = 64 * (limit + 1)  # characters: far more than `limit` pieces need
        cut = text.rfind(" ", 0, budget) if len(text) > 2 * budget else -1
        if cut > 0:
            pieces = self.sp.encode(self._normalized(text[:cut]), out_type=str)
            if len(pieces) > limit:
                return pieces
        return self.sp.encode(self._normalized(text), out_type=str)

    def _normalized(self, text: str) -> str:
        return text if self.normalization is None else self.normalization.apply(text)

    def decode(self, tokens: Sequence[int]) -> str:
        pieces = self.dictionary.decode(tokens)
        match self.cfg.output_format:
            case "pieces":
                return clean_output(" ".join(pieces))
            case "raw" | "tree":
                return clean_output(self.target_sp.decode(pieces))

    def as_trees(self, lines: Sequence[str], results: list[list[tuple[float, str]]],
                 first_number: int) -> list[list[tuple[float, str]]]:
        """Each output as a tree over its line's words (`trees.py`); a line with words but no output
        (nothing the model reads) gets the tree repaired from nothing. Repairs are counted."""
        trees = []
        for i, (line, found) in enumerate(zip(lines, results, strict=True)):
            words = line.split()
            found = found or ([(float("-inf"), "")] if words else [])
            built = [(score, *as_tree_line(text, words)) for score, text in found]
            for _, _, repairs in built:
                self.repairs.update(repairs)
                self.repaired += bool(repairs)
                if repairs and self.repaired <= 10:
                    self.warn(f"line {first_number + i}: the output was not a well-formed tree; repaired "
                              f"({', '.join(repairs)})" + ("; further repairs are only counted"
                                                            if self.repaired == 10 else ""))
            self.trees += len(built)
            trees.append([(score, tree) for score, tree, _ in built])
        return trees

    def translate(self, lines: Sequence[str], first_number: int = 1,
                  on_batch: Callable[[int], None] | None = None) -> list[list[tuple[float, str]]]:
        """Each line's n-best (score, text), best first; a line without pieces (blank, or only
        characters the sentencepiece model drops) gets no hypothesis and the model does not run."""
        sources, where = [], []
        for i, text in enumerate(lines):
            ids = self.encode(text, first_number + i) if text.strip() else []
            if len(ids) > 1:  # more than EOS
                sources.append(ids)
                where.append(i)
        constraint = None
        if self.tree_symbols is not None:
            constraint = TreeConstraint.of(self.tree_symbols, [lines[i].split() for i in where])
        try:
            found = (self.search(sources, self.cfg, on_batch) if self.search is not None
                     else translate_ids(self.model, sources, self.cfg, on_batch, self.workers,
                                        replicas=self.replicas, constraint=constraint))
        except BrokenProcessPool:  # only worker processes (--compile) break this way
            raise NmtError(_worker_died("translating")) from None
        results: list[list[tuple[float, str]]] = [[] for _ in lines]
        for i, hypotheses in zip(where, found, strict=True):
            results[i] = [(h.score, self.decode(h.tokens)) for h in hypotheses]
        if self.cfg.output_format == "tree":
            return self.as_trees(lines, results, first_number)
        return results

    def running(self) -> RunningSearch | None:
        """A search that sentences join while it runs, with this translator's settings (a server's
        search thread: serve/batcher.py); None where there is none: another engine's search, worker
        processes, a compiled decoder, an ensemble, trees held to their form."""
        if (self.search is not None or self.replicas is not None or self.tree_symbols is not None
                or self.cfg.output_format == "tree" or not joinable(self.model)):
            return None
        return RunningSearch(self)

    def format(self, results: list[list[tuple[float, str]]], first_number: int) -> str:
        """The output lines of `results` (see the module docstring), each ending in LF."""
        k = self.cfg.nbest
        if k == 1:
            return "".join(f"{found[0][1] if found else ''}\n" for found in results)
        out = []
        for i, found in enumerate(results):
            padded = found + [(float("-inf"), "")] * (k - len(found))
            out += [f"{first_number + i}\t{score:.4f}\t{text}\n" for score, text in padded]
        return "".join(out)


class RunningSearch:
    """`search.Search` over source ids (`Translator.encode`), answering with texts as `translate` does."""

    def __init__(self, translator: Translator) -> None:
        self.translator, self.device = translator, next(translator.model.parameters()).device
        self.search = Search(translator.model, **search_settings(translator.cfg))

    def __len__(self) -> int:
        return len(self.search)

    def join(self, keys: Sequence[int], sources: Sequence[Sequence[int]]) -> None:
        """Sources (each more than EOS) start at the next step, `keys` naming them."""
        self.search.join(padded(sources).to(self.device), keys)

    def step(self) -> list[tuple[int, list[tuple[float, str]]]]:
        """One step: (key, n-best (score, text), best first) of the sentences it settles."""
        return [(key, [(h.score, self.translator.decode(h.tokens)) for h in found])
                for key, found in self.search.step()]


def _stderr_warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


# -- the stage ----------------------------------------------------------------------------------


def _device_and_dtype(cfg: TranslateConfig) -> tuple[torch.device, torch.dtype]:
    match cfg.device:
        case "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        case "cuda":
            if not torch.cuda.is_available():
                raise NmtError("--device cuda was asked for but no CUDA device is available; "
                               "use --device cpu")
            device = torch.device("cuda")
        case _:
            device = torch.device("cpu")
    match cfg.dtype:
        case "auto":  # on the CPU decided once the model is loaded (`auto_cpu_dtype`)
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        case "bf16":
            dtype = torch.bfloat16
        case "fp16":
            if device.type != "cuda":
                raise NmtError("--dtype fp16 needs a CUDA device; on the CPU use bf16 (fast where the CPU "
                               "supports it) or fp32")
            dtype = torch.float16
        case "int8":  # the linear layers in int8, the rest in float32 (`model/int8.py`)
            if device.type != "cpu":
                raise NmtError("--dtype int8 runs on a CPU (torch's int8 matrix product); on cuda use "
                               "bf16 or fp16")
            dtype = torch.float32
        case _:
            dtype = torch.float32
    return device, dtype


def _check(cfg: TranslateConfig) -> None:
    if cfg.beam < 1:
        raise NmtError(f"--beam must be at least 1, got {cfg.beam}")
    if not 1 <= cfg.nbest <= cfg.beam:
        raise NmtError(f"--nbest must be between 1 and the beam size ({cfg.beam}), got {cfg.nbest}")
    if cfg.max_tokens < 1 or cfg.chunk_lines < 1:
        raise NmtError("max_tokens and chunk_lines must be at least 1")
    if cfg.input is not None and not Path(cfg.input).is_file():
        what = "is a folder" if Path(cfg.input).is_dir() else "does not exist"
        raise NmtError(f"input file {cfg.input} {what}; give a text file "
                       "(or leave --input out to read stdin)")
    if cfg.output is not None:
        check_output_file(cfg.output, "--output")
    if cfg.compile and len(cfg.model) > 1:
        raise NmtError("--compile translates with one model: leave it out for an ensemble")
    if cfg.compile and cfg.dtype == "int8":
        raise NmtError("--dtype int8 runs eagerly: leave out --compile (or use fp32 or bf16 with it)")


def load_translator(cfg: TranslateConfig, warn: Warn, cpu: Cpu | None = None) -> Translator:
    """The model of `cfg.model` on its device and dtype. On the CPU, `threads` batches are searched
    at once, each on one torch thread: that keeps the cores busier than torch's threads inside each
    (small) operation of a decoding step. A compiled decoder (`cfg.compile`) on the CPU does the
    same in `threads` worker processes (`Replicas`: dynamo must not run in two threads); on a GPU it
    searches one batch at a time. `cpu`: what this CPU can do (detected when not given). Close the
    translator when done."""
    if len(cfg.model) == 1 and (Path(cfg.model[0]) / "nmt.json").is_file():  # by `nmt export ctranslate2`
        engine = ct2.Engine(cfg, warn)
        sp = sentencepiece_processor(engine.spm_bytes, f"{cfg.model[0]}/spm.model", "export the model again")
        return Translator(engine.model, engine.dictionary, sp, cfg, warn, search=engine.search,
                          normalization=engine.normalization if cfg.normalize == "model" else None)
    device, dtype = _device_and_dtype(cfg)
    workers = 1
    if device.type == "cpu":
        keep_freed_memory()
        workers = cpu_workers(cfg.threads)
        torch.set_num_threads(1)
    elif cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    on_cpu_in_bf16 = dtype == torch.bfloat16 and device.type == "cpu"
    if on_cpu_in_bf16 and (message := slow_bf16_warning("--dtype bf16", "--dtype auto", cpu)) is not None:
        warn(message)
    if cfg.compile and device.type == "cpu" and (compiler := missing_compiler()) is not None:
        raise NmtError(no_compiler_message(compiler, "translate"))
    loaded = [model_file.load_text_model(path, device) for path in cfg.model]
    for spm_models in ([m.spm_model for m in loaded], [m.target_spm_model for m in loaded]):
        check_members(list(cfg.model), [m.dictionary for m in loaded], spm_models)
    if cfg.dtype == "int8":
        for member in loaded:
            int8.quantize(member.model)
    model, dictionary, spm_bytes, normalization, target_spm = loaded[0]
    if len(loaded) > 1:
        model = Ensemble([m.model for m in loaded])
    sp = sentencepiece_processor(spm_bytes, f"the sentencepiece model inside {cfg.model[0]}",
                                 "the file is damaged or was not written by nmt")
    target_sp = None if target_spm == spm_bytes else sentencepiece_processor(
        target_spm, f"the target sentencepiece model inside {cfg.model[0]}", "the file is damaged")
    if cfg.dtype == "auto" and device.type == "cpu":
        dtype = auto_cpu_dtype(cpu or this_cpu(), model.cfg.d_model, cfg.beam)
    if cfg.dtype != "int8":
        model = model.to(dtype)
    without_kernel = device.type == "cpu" and not cfg.compile and native.library() is None
    if without_kernel and (why := native.why_not()) != "NMT_NATIVE=0":
        warn(f"the search's C kernel is not available ({why}); the search picks its best tokens in "
             "torch instead, more slowly")
    replicas = None
    if cfg.compile:
        try:
            if workers > 1:
                replicas = Replicas(cfg, dtype, workers)
            else:
                compile_decoder(model, cfg.beam)
        except BrokenProcessPool:
            raise NmtError(_worker_died("compiling")) from None
        except Exception as e:  # torch.compile fails in many ways (no compiler, an unsupported platform)
            raise NmtError(f"--compile: torch.compile could not compile the decoder ({describe(e)}); "
                           "install a C++ compiler (g++, or name yours in $CXX), "
                           "or translate without --compile") from None
    return Translator(model, dictionary, sp, cfg, warn, workers, replicas,
                      normalization=normalization if cfg.normalize == "model" else None, target_sp=target_sp)


def auto_cpu_dtype(cpu: Cpu, d_model: int, beam: int) -> torch.dtype:
    """`--dtype auto` on the CPU: bf16 where the CPU has fast bf16 matrix products (`Cpu.fast_bf16`:
    its flags, and a product measured faster), else fp32; and fp32 for greedy search with a model
    narrower than MIN_GREEDY_BF16_D_MODEL. BLEU is the same either way; the speed is not: on such a
    CPU bf16 speeds up a beam search and a decoding step at every width, but not greedy search with a
    narrow model, one row a sentence (benchmarks/README.md, "bf16 and fp32: what each costs in
    quality" and "Translation"; `benchmarks/decode_precision.py`, `benchmarks/translate_speed.py`)."""
    narrow_greedy = beam == 1 and d_model < MIN_GREEDY_BF16_D_MODEL
    return torch.bfloat16 if cpu.fast_bf16 and not narrow_greedy else torch.float32


def _worker_died(doing: str) -> str:
    return (f"--compile: a worker process stopped while {doing} (killed, or out of memory: each holds "
            "a copy of the model); give fewer --threads, or translate without --compile")


def _chunks(stream: IO[bytes], size: int, name: str) -> Iterator[list[bytes]]:
    chunk: list[bytes] = []
    for raw in bounded_lines(stream, name):  # a binary stream splits on LF only
        chunk.append(raw[:-1] if raw.endswith(b"\n") else raw)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def translate_stream(translator: Translator, stream: IO[bytes], out: IO[bytes], interactive: bool,
                     progress: Callable[[int], None] | None = None, name: str = "the input") -> int:
    """Translate every line of `stream` to `out`, in order; returns the number of lines."""
    size = 1 if interactive else translator.cfg.chunk_lines
    number = 1
    for chunk in _chunks(stream, size, name):
        lines = [clean_line(raw, number + i, translator.warn) for i, raw in enumerate(chunk)]
        results = translator.translate(lines, number, progress)
        blank = sum(1 for line in lines if not line.strip())
        if progress is not None and blank:
            progress(blank)
        out.write(translator.format(results, number).encode("utf-8"))
        out.flush()
        number += len(chunk)
    return number - 1


def run(cfg: TranslateConfig) -> None:
    _check(cfg)
    if cfg.compile:
        print("translate: compiling the decoder step with torch.compile (a minute or more the first time, "
              "less once cached)", file=sys.stderr, flush=True)
    translator = load_translator(cfg, _stderr_warn)
    interactive = cfg.input is None and sys.stdin.isatty()
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.callback(translator.close)
        stream = sys.stdin.buffer if cfg.input is None else stack.enter_context(open(cfg.input, "rb"))
        out = sys.stdout.buffer if cfg.output is None else stack.enter_context(atomic_writer(cfg.output))
        # a pipe or a device has no end to count to
        total = count_lines(cfg.input) if cfg.input is not None and cfg.input.is_file() else None
        bar = sys.stderr.isatty() and (cfg.output is not None or not sys.stdout.isatty())
        progress = None if interactive else stack.enter_context(_progress(total, bar))
        name = "standard input" if cfg.input is None else str(cfg.input)
        lines = translate_stream(translator, stream, out, interactive, progress, name)
    if not interactive:
        seconds = time.perf_counter() - start
        print(f"translate: {lines} lines in {seconds:.1f} s ({lines / max(seconds, 1e-9):.1f} lines/s)",
              file=sys.stderr)
    if cfg.output_format == "tree":
        kinds = ", ".join(f"{kind} {count}" for kind, count in translator.repairs.most_common())
        print(f"translate: {translator.trees} trees, {translator.repaired} repaired"
              + (f" ({kinds})" if kinds else ""), file=sys.stderr)


@contextlib.contextmanager
def _progress(total: int | None, bar: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (`bar`: a terminal that translations do not go to); otherwise
    a plain log line every 10 s."""
    of = f"/{total}" if total is not None else ""
    with ProgressReport("translating", total, lambda p: f"translate: {p.done}{of} lines", every_seconds=10,
                        at_end=False, transient=True, bar=bar) as report:
        yield report.advance
