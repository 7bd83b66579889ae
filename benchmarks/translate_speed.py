"""Translation speed: sentences/s and target tokens/s of `nmt translate`'s search on newstest2014 en->de.

    python benchmarks/translate_speed.py --model MODEL.pt [--sentences 1000] [--threads 2]

MODEL.pt should be a trained en->de model (e.g. transformer_small) so that output lengths are
realistic. Rows: beam 4 and greedy, fp32 and bf16, with the incremental decoder (what `nmt
translate` runs) and without any cache (every step re-runs the full model over the whole prefix,
the slow reference), measured in the same run, both with `--threads` batches searched at
once on one torch thread each, as `nmt translate` does on the CPU. The uncached search is timed on the first
`--reference-sentences` sentences only (it is quadratic); its rates are per sentence all the same.
With `--ctranslate2`, also rows of the model exported to CTranslate2, and rows of nmt's search run as
CTranslate2's is (`--length-penalty fairseq --stop beam`, in the default dtype and, where that is bf16,
in fp32), each with its share of lines identical to CTranslate2 float32's, and (with `--stop bound`) a
row of the same search with fairseq's stopping rule (`--stop beam`), with its share of lines identical to
the default's. With `--transformers`, also a row of the model exported by `nmt export huggingface`,
translated by transformers' `generate` with the folder's defaults (beam 4, |Y|^0.6, early stopping: the
search of the "as CT2" rows) on `--threads` torch threads, with its share of lines identical to the
fp32 "as CT2" row's. With `--compile`, also rows of the decoder step compiled as `nmt translate
--compile` runs it (`--threads` worker processes, each with its own copy of the model compiled on one
thread), timed after compiling;
how long starting them and compiling took is printed below each such row. Times cover the search and
sentencepiece encoding/decoding, not model loading; `cpu s` is the CPU time of all threads (well below
seconds x threads when other processes share the cores; not shown for the worker processes). `rows/sent`: the
decoder rows the search computed (one per live hypothesis and step), per sentence, where they can be
counted (nmt's incremental search in this process). Also prints sacreBLEU of each output, as a check of
what the model is.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `nmt translate` does; must precede `import torch`

import sacrebleu
import sentencepiece as spm
import torch
from machine import describe

from nmt_cli.config.inference import TranslateConfig
from nmt_cli.inference.replicas import Replicas
from nmt_cli.inference.search import IncrementalDecoder, translate_ids
from nmt_cli.inference.translate import Translator, auto_cpu_dtype
from nmt_cli.model import file as model_file
from nmt_cli.model import int8
from nmt_cli.model.cpu import keep_freed_memory, this_cpu

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wmt14-newstest2014" / "en-de"


ROWS: list[int] = []  # the decoder rows of each incremental step since `measure` began (any thread)
_step = IncrementalDecoder.step
IncrementalDecoder.step = lambda self, tokens, *rest: ROWS.append(len(tokens)) or _step(self, tokens, *rest)


def measure(translator: Translator, lines: list[str],
            cached: bool) -> tuple[float, float | None, int, list[str]]:
    """(wall seconds, CPU seconds of all threads, target tokens with EOS, detokenized outputs)."""
    ROWS.clear()
    start, cpu_start = time.perf_counter(), time.process_time()
    sources = [translator.encode(line, i + 1) for i, line in enumerate(lines)]
    found = translate_ids(translator.model, sources, translator.cfg, workers=translator.workers,
                          cached=cached, replicas=translator.replicas)
    outputs = [translator.decode(h[0].tokens) for h in found]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if translator.replicas is not None:
        cpu_seconds = None  # spent in the worker processes
    return seconds, cpu_seconds, sum(len(h[0].tokens) + 1 for h in found), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--source", type=Path, default=DATA / "newstest2014.en")
    parser.add_argument("--reference", type=Path, default=DATA / "newstest2014.de")
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--reference-sentences", type=int, default=100,
                        help="sentences for the uncached search")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=TranslateConfig.max_tokens)
    parser.add_argument("--dtypes", default="fp32,bf16", help="of fp32, bf16, int8")
    parser.add_argument("--beam-style", choices=("paper", "shrinking"), default="paper",
                        help="nmt's search (CTranslate2 has its own)")
    parser.add_argument("--stop", choices=("bound", "beam"), default="bound",
                        help="nmt's stopping rule (CTranslate2 has its own)")
    parser.add_argument("--compile", action="store_true",
                        help="also time the search with the decoder step compiled")
    parser.add_argument("--ctranslate2", action="store_true",
                        help="also rows of the model exported by `nmt export ctranslate2` (float32, int8, "
                             "bfloat16 where the CPU has it), translated by CTranslate2 on --threads threads")
    parser.add_argument("--transformers", action="store_true",
                        help="also a row of the model exported by `nmt export huggingface`, translated by "
                             "transformers' generate (beam 4) on --threads threads")
    parser.add_argument("--transformers-batch", type=int, default=64,
                        help="sentences a generate call (sorted by length)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="instead of the table: torch's profile of beam 4 (first dtype) "
                             "on N sentences, one thread")
    args = parser.parse_args()
    keep_freed_memory()  # as `nmt translate` does on the CPU: one torch thread per batch searched at once
    torch.set_num_threads(1)
    lines = args.source.read_text(encoding="utf-8").splitlines()[: args.sentences]
    refs = args.reference.read_text(encoding="utf-8").splitlines()[: args.sentences]
    model, dictionary, spm_bytes = model_file.load_model(args.model)
    sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
    print(describe())
    print(f"model {args.model}: {model.cfg.encoder_layers}+{model.cfg.decoder_layers} layers, d_model "
          f"{model.cfg.d_model}, vocabulary {len(dictionary)}; {len(lines)} sentences of {args.source.name}, "
          f"{args.threads} threads, torch {torch.__version__}")
    if args.profile:
        return profile(model, dictionary, sp, lines[: args.profile], args)
    print(f"{'search':<8} {'dtype':<5} {'decoder':<13} {'sentences':>9} {'seconds':>8} {'cpu s':>7} "
          f"{'sent/s':>8} {'tok/s':>8} {'out len':>7} {'rows/sent':>9} {'BLEU':>6}")

    def in_dtype(name: str) -> torch.nn.Module:
        """A copy of the model as its file holds it (fp32) in dtype `name`: never the model itself
        converted, as a model turned to bf16 and back to fp32 would search with bf16-rounded weights."""
        return converted(copy.deepcopy(model), name)

    for dtype_name in args.dtypes.split(","):
        searched = in_dtype(dtype_name)
        for beam in (4, 1):
            cfg = TranslateConfig(model=args.model, beam=beam, max_tokens=args.max_tokens,
                                  beam_style=args.beam_style, stop=args.stop)
            translator = Translator(searched, dictionary, sp, cfg, lambda _: None, workers=args.threads)
            measure(translator, lines[:20], cached=True)  # warm-up: thread pools, kernel selection
            for cached in (True, False):
                subset = lines if cached else lines[: args.reference_sentences]
                print_row(beam, dtype_name, "incremental" if cached else "full forward", subset,
                          *measure(translator, subset, cached), refs)
            if args.compile and dtype_name != "int8":  # int8 runs eagerly
                measure_compiled(translator, beam, dtype_name, lines, refs, args.threads)
    if args.ctranslate2 or args.transformers:
        default = "bf16" if auto_cpu_dtype(this_cpu(), model.cfg.d_model, 4) == torch.bfloat16 else "fp32"
        # nmt's search as CTranslate2 and transformers run it (fairseq's): the like-for-like row
        cfg = TranslateConfig(model=args.model, beam=4, max_tokens=args.max_tokens, length_penalty="fairseq",
                              stop="beam")
        as_ct2 = {}
        # in the default dtype, and in fp32 as CTranslate2 and transformers compute where that is bf16
        for name in dict.fromkeys([default, "fp32"]):
            translator = Translator(in_dtype(name), dictionary, sp, cfg, lambda _: None,
                                    workers=args.threads)
            measure(translator, lines[:20], cached=True)
            as_ct2[name] = measure(translator, lines, cached=True)
            print_row(4, name, "as CT2", lines, *as_ct2[name], refs)
    if args.transformers:
        hf_outputs = measure_transformers(args, lines, refs)
        same = sum(a == b for a, b in zip(as_ct2["fp32"][3], hf_outputs, strict=True)) / len(lines)
        hf_rate, nmt_rate = BEAM4["transformers", "fp32"], BEAM4["as CT2", "fp32"]
        print(f"transformers generate (the MarianMT export, beam 4, {args.threads} threads): {hf_rate:.1f} "
              f"sent/s; nmt searching as it does (--length-penalty fairseq --stop beam, fp32): "
              f"{nmt_rate:.1f} sent/s, {nmt_rate / hf_rate:.2f}x; {same:.1%} of the lines the same")
    if args.ctranslate2:
        if args.stop == "bound":  # the same search but for its stopping rule: what `--stop beam` changes
            cfg = TranslateConfig(model=args.model, beam=4, max_tokens=args.max_tokens,
                                  beam_style=args.beam_style, stop="beam")
            translator = Translator(in_dtype(default), dictionary, sp, cfg, lambda _: None,
                                    workers=args.threads)
            stop_beam = measure(translator, lines, cached=True)
            print_row(4, default, "stop beam", lines, *stop_beam, refs)
        ct2_outputs = measure_ctranslate2(args, lines, refs)
        if ("incremental", default) in BEAM4 and ("ctranslate2", "fp32") in BEAM4:
            nmt_rate, ct2_rate = BEAM4["incremental", default], BEAM4["ctranslate2", "fp32"]
            print(f"nmt translate's default here (--dtype auto: {default}; --beam-style {args.beam_style}, "
                  f"--stop {args.stop}), beam 4: {nmt_rate:.1f} sent/s, {nmt_rate / ct2_rate:.2f}x "
                  f"CTranslate2 float32's {ct2_rate:.1f}")
            for name, (*_, outputs) in as_ct2.items():
                same = sum(a == b for a, b in zip(outputs, ct2_outputs, strict=True)) / len(lines)
                print(f"nmt as CTranslate2 searches (--length-penalty fairseq --stop beam), beam 4, {name}: "
                      f"{BEAM4['as CT2', name]:.1f} sent/s, {BEAM4['as CT2', name] / ct2_rate:.2f}x; "
                      f"{same:.1%} of its lines the same as CTranslate2 float32's")
            if args.stop == "bound":
                same = sum(a == b for a, b in zip(stop_beam[3], OUTPUTS[default], strict=True)) / len(lines)
                print(f"the same search with --stop beam, beam 4: {BEAM4['stop beam', default]:.1f} sent/s, "
                      f"{BEAM4['stop beam', default] / ct2_rate:.2f}x; {same:.1%} of its lines the same as "
                      f"the default's")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def converted(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """`model` in dtype `name`, in place: fp32, bf16, or int8 as `nmt translate --dtype int8` runs it."""
    return int8.quantize(model) if name == "int8" else model.to(DTYPES[name])

BEAM4: dict[tuple[str, str], float] = {}  # (decoder, dtype) -> sentences/s of the beam 4 rows printed
OUTPUTS: dict[str, list[str]] = {}  # dtype -> the outputs of its beam 4 incremental row


def print_row(beam: int, dtype_name: str, decoder: str, subset: list[str], seconds: float,
              cpu_seconds: float | None, tokens: int, outputs: list[str], refs: list[str]) -> None:
    bleu = sacrebleu.corpus_bleu(outputs, [refs[: len(subset)]]).score
    if beam == 4:
        BEAM4[decoder, dtype_name] = len(subset) / seconds
        if decoder == "incremental":
            OUTPUTS[dtype_name] = outputs
    cpu = "-" if cpu_seconds is None else f"{cpu_seconds:.1f}"
    rows = f"{sum(ROWS) / len(subset):.1f}" if ROWS else "-"
    print(f"{'beam 4' if beam == 4 else 'greedy':<8} {dtype_name:<5} {decoder:<13} {len(subset):>9} "
          f"{seconds:>8.2f} {cpu:>7} {len(subset) / seconds:>8.1f} {tokens / seconds:>8.0f} "
          f"{tokens / len(subset):>7.1f} {rows:>9} {bleu:>6.2f}", flush=True)


def measure_compiled(translator: Translator, beam: int, dtype_name: str, lines: list[str], refs: list[str],
                     threads: int) -> None:
    """The row of the compiled decoder step as `nmt translate --compile` runs it: `threads` worker
    processes, each with its own compiled copy of the model on one thread."""
    dtype = next(translator.model.parameters()).dtype
    # The rows before kept GBs of freed memory in this process (keep_freed_memory; the full forward
    # rows most); `nmt translate --compile` holds none while its workers search, and with it held
    # here they ran 150 instead of 178 sentences/s (bf16, beam 4). Give it back first.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = time.perf_counter()
    with Replicas(translator.cfg, dtype, threads) as replicas:
        compiling = time.perf_counter() - start
        compiled = Translator(translator.model, translator.dictionary, translator.sp, translator.cfg,
                              lambda _: None, threads, replicas)
        measure(compiled, lines[:20], cached=True)  # warm-up
        print_row(beam, dtype_name, "compiled", lines, *measure(compiled, lines, cached=True), refs)
    print(f"{'':<8} (starting {threads} processes and compiling took {compiling:.1f} s, not counted above)",
          flush=True)


def measure_ctranslate2(args: argparse.Namespace, lines: list[str], refs: list[str]) -> list[str]:
    """Rows of the exported model, as `nmt translate DIR` runs it (CTranslate2's search with
    `--threads` intra-op threads; its length penalty is fairseq's |Y|^alpha, alpha 0.6). Returns
    float32's beam 4 outputs."""
    import tempfile

    import ctranslate2

    from nmt_cli.config.convert import Ctranslate2ExportConfig
    from nmt_cli.inference import ct2

    available = ctranslate2.get_supported_compute_types("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        for quantization in ("float32", "int8", "bfloat16"):
            if quantization not in available:
                print(f"(ctranslate2 {quantization}: not supported on this CPU)")
                continue
            out = Path(tmp) / quantization
            ct2.run(Ctranslate2ExportConfig(model=args.model, out=out, quantization=quantization))
            for beam in (4, 1):
                cfg = TranslateConfig(model=out, beam=beam, max_tokens=args.max_tokens, threads=args.threads,
                                      device="cpu", length_penalty="fairseq", stop="beam")
                engine = ct2.Engine(cfg, lambda _: None)
                sp = spm.SentencePieceProcessor(model_proto=engine.spm_bytes)
                translator = Translator(engine.model, engine.dictionary, sp, cfg, lambda _: None,
                                        search=engine.search)
                measure_search(translator, lines[:20])  # warm-up
                row = measure_search(translator, lines)
                print_row(beam, {"float32": "fp32", "bfloat16": "bf16"}.get(quantization, quantization),
                          "ctranslate2", lines, *row, refs)
                if (quantization, beam) == ("float32", 4):
                    float32_outputs = row[3]
    return float32_outputs


def measure_transformers(args: argparse.Namespace, lines: list[str], refs: list[str]) -> list[str]:
    """The row of the model exported by `nmt export huggingface`, searched by transformers' `generate`
    with the folder's defaults (beam 4) on `--threads` torch threads, in batches of
    `--transformers-batch` sentences of similar length, each with nmt's output-length limit (source
    length + 50) of its longest; times cover tokenizing, the search and detokenizing, as above.
    Returns its outputs."""
    import tempfile

    import transformers

    from nmt_cli.config.convert import HuggingfaceExportConfig
    from nmt_cli.inference import huggingface

    with tempfile.TemporaryDirectory() as tmp:
        huggingface.run(HuggingfaceExportConfig(model=args.model, out=Path(tmp) / "marian"))
        model = transformers.MarianMTModel.from_pretrained(Path(tmp) / "marian").eval()
        tokenizer = transformers.MarianTokenizer.from_pretrained(Path(tmp) / "marian")

    eos = model.config.eos_token_id

    def search(subset: list[str]) -> tuple[float, float, int, list[str]]:
        start, cpu_start = time.perf_counter(), time.process_time()
        encoded = tokenizer(subset)["input_ids"]
        order = sorted(range(len(subset)), key=lambda i: len(encoded[i]))
        outputs, tokens = [""] * len(subset), 0
        for first in range(0, len(order), args.transformers_batch):
            rows = order[first : first + args.transformers_batch]
            batch = tokenizer.pad({"input_ids": [encoded[i] for i in rows]}, return_tensors="pt")
            longest = max(len(encoded[i]) for i in rows) - 1 + 50
            with torch.no_grad():
                found = model.generate(**batch, max_new_tokens=longest + 1)
            # the pieces up to each output's first EOS (generate pads the finished ones)
            tokens += sum(row.index(eos) if eos in row else len(row) for row in found[:, 1:].tolist())
            for i, text in zip(rows, tokenizer.batch_decode(found, skip_special_tokens=True), strict=True):
                outputs[i] = text
        return time.perf_counter() - start, time.process_time() - cpu_start, tokens, outputs

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        search(lines[:20])  # warm-up
        row = search(lines)
    finally:
        torch.set_num_threads(threads)
    ROWS.clear()
    print_row(4, "fp32", "transformers", lines, *row, refs)
    return row[3]


def measure_search(translator: Translator, lines: list[str]) -> tuple[float, float, int, list[str]]:
    """`measure` for a translator whose search is another engine's."""
    ROWS.clear()
    start, cpu_start = time.perf_counter(), time.process_time()
    found = translator.search([translator.encode(line, i + 1) for i, line in enumerate(lines)],
                              translator.cfg)
    outputs = [translator.decode(h[0].tokens) for h in found]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return seconds, cpu_seconds, sum(len(h[0].tokens) + 1 for h in found), outputs


def profile(model: torch.nn.Module, dictionary, sp: spm.SentencePieceProcessor, lines: list[str],
            args: argparse.Namespace) -> None:
    """Where beam search spends its time, by torch operation (self CPU time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    searched = converted(model, args.dtypes.split(",")[0])
    cfg = TranslateConfig(model=args.model, beam=4, max_tokens=args.max_tokens)
    translator = Translator(searched, dictionary, sp, cfg, lambda _: None, workers=1)
    measure(translator, lines[:20], cached=True)  # warm-up
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        measure(translator, lines, cached=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
