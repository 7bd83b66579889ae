"""The `nmt` command: thin Typer commands that build a stage's config and call its `run(cfg)`.

Each command's options are the common fields of its config dataclass (`config/`), with the same
help text; every other field is reachable through `--config FILE.yaml` and `--set key=value`.
Options the user did not give are None here and leave the dataclass/YAML value alone. Stage modules
(and torch) are imported only when a command runs, so `--help` stays fast.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from nmt_cli import __version__
from nmt_cli.config.core import help_of, resolve
from nmt_cli.config.data import BinarizeConfig, BpeConfig, PrepareConfig
from nmt_cli.config.evaluation import AttentionConfig, PlotConfig, ScoreConfig
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.config.train import AverageConfig, train_base
from nmt_cli.config.train import TrainConfig as T
from nmt_cli.errors import NmtError, from_os_error

app = typer.Typer(
    help="Neural machine translation: raw text to trained Transformer to BLEU. "
    "Run the stages in order: prepare, bpe, binarize, train, average, translate, score; "
    "look at a run with plot (training curves) and attention (a model's attention on a sentence).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

ConfigFile = Annotated[
    Optional[Path], typer.Option("--config", help="YAML file of option values (overridden by the command line)")
]
Sets = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="override any config field: --set key=value (repeatable; model.dropout=0.3)"),
]


# The module whose `run(cfg)` each command calls, imported only when the command runs.
STAGE_MODULES = {
    "prepare": "data.prepare", "bpe": "data.bpe", "binarize": "data.binarize", "train": "training.train",
    "average": "training.average", "translate": "inference.translate", "score": "evaluation.score",
    "plot": "evaluation.plot", "attention": "evaluation.attention_maps",
}


def _help(cls: type, name: str) -> str:
    return help_of({f.name: f for f in dataclasses.fields(cls)}[name])


def _opt(cls: type, name: str, *flags: str) -> Any:
    return typer.Option(*flags, help=_help(cls, name), show_default=False)


def fail(error: NmtError) -> typer.Exit:
    """Print a user error as one unwrapped red message (paths stay copyable); exit status 2."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
    return typer.Exit(2)


def _run(stage: str, cfg: Any) -> None:
    """Run `stage`'s `run(cfg)`; a user error becomes one red message and exit status 2."""
    try:
        module = importlib.import_module(f"nmt_cli.{STAGE_MODULES[stage]}")
        module.run(cfg)
    except NmtError as e:
        raise fail(e) from None
    except OSError as e:  # a path that cannot be read or written, a full disk: the user's to fix
        raise fail(from_os_error(e)) from None
    except KeyboardInterrupt:
        Console(stderr=True, soft_wrap=True).print(
            "[yellow]interrupted[/]: finished outputs are kept; run the same command again to continue")
        raise typer.Exit(130) from None


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nmt {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = None,
) -> None:
    pass


@app.command()
def prepare(
    dataset: Annotated[str, typer.Argument(help=_help(PrepareConfig, "dataset"), show_default=False)],
    out: Annotated[Optional[Path], _opt(PrepareConfig, "out", "--out", "-o")] = None,
    src_lang: Annotated[Optional[str], _opt(PrepareConfig, "src_lang", "--src-lang", "-s")] = None,
    tgt_lang: Annotated[Optional[str], _opt(PrepareConfig, "tgt_lang", "--tgt-lang", "-t")] = None,
    downloads: Annotated[Optional[Path], _opt(PrepareConfig, "downloads", "--downloads")] = None,
    from_dir: Annotated[Optional[Path], _opt(PrepareConfig, "from_dir", "--from")] = None,
    mirror: Annotated[Optional[str], _opt(PrepareConfig, "mirror", "--mirror")] = None,
    checksums: Annotated[Optional[Path], _opt(PrepareConfig, "checksums", "--checksums")] = None,
    train: Annotated[Optional[str], _opt(PrepareConfig, "train", "--train")] = None,
    valid: Annotated[Optional[str], _opt(PrepareConfig, "valid", "--valid")] = None,
    test: Annotated[Optional[str], _opt(PrepareConfig, "test", "--test")] = None,
    dedup: Annotated[Optional[bool], _opt(PrepareConfig, "dedup", "--dedup/--no-dedup")] = None,
    seed: Annotated[Optional[int], _opt(PrepareConfig, "seed", "--seed")] = None,
    workers: Annotated[Optional[int], _opt(PrepareConfig, "workers", "--workers")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """Download (or read) and clean a parallel corpus into raw train/valid/test text."""
    values = dict(dataset=dataset, out=out, src_lang=src_lang, tgt_lang=tgt_lang, downloads=downloads,
                  from_dir=from_dir, mirror=mirror, checksums=checksums, train=train, valid=valid, test=test, dedup=dedup,
                  seed=seed, workers=workers)
    _run("prepare", _resolve(PrepareConfig, config, values, sets))


@app.command()
def bpe(
    raw: Annotated[Path, typer.Argument(help=_help(BpeConfig, "raw"), show_default=False)],
    out: Annotated[Optional[Path], _opt(BpeConfig, "out", "--out", "-o")] = None,
    vocab_size: Annotated[Optional[int], _opt(BpeConfig, "vocab_size", "--vocab-size")] = None,
    model: Annotated[Optional[Path], _opt(BpeConfig, "model", "--model")] = None,
    sample_sentences: Annotated[Optional[int], _opt(BpeConfig, "sample_sentences", "--sample-sentences")] = None,
    workers: Annotated[Optional[int], _opt(BpeConfig, "workers", "--workers")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """Train a joint sentencepiece BPE model and split every sentence into pieces."""
    values = dict(raw=raw, out=out, vocab_size=vocab_size, model=model, sample_sentences=sample_sentences,
                  workers=workers)
    _run("bpe", _resolve(BpeConfig, config, values, sets))


@app.command()
def binarize(
    bpe_dir: Annotated[Path, typer.Argument(help=_help(BinarizeConfig, "bpe"), show_default=False)],
    out: Annotated[Optional[Path], _opt(BinarizeConfig, "out", "--out", "-o")] = None,
    dictionary: Annotated[Optional[Path], _opt(BinarizeConfig, "dictionary", "--dictionary")] = None,
    workers: Annotated[Optional[int], _opt(BinarizeConfig, "workers", "--workers")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """Build the joint dictionary and write memory-mapped token arrays."""
    values = dict(bpe=bpe_dir, out=out, dictionary=dictionary, workers=workers)
    _run("binarize", _resolve(BinarizeConfig, config, values, sets))


@app.command(context_settings={"allow_extra_args": False})
def train(
    data: Annotated[Path, typer.Argument(help=_help(T, "data"), show_default=False)],
    save_dir: Annotated[Optional[Path], _opt(T, "save_dir", "--save-dir")] = None,
    arch: Annotated[Optional[str], _opt(T, "arch", "--arch")] = None,
    gpus: Annotated[Optional[int], _opt(T, "gpus", "--gpus")] = None,
    nproc: Annotated[Optional[int], _opt(T, "nproc", "--nproc")] = None,
    nnodes: Annotated[Optional[int], _opt(T, "nnodes", "--nnodes")] = None,
    node_rank: Annotated[Optional[int], _opt(T, "node_rank", "--node-rank")] = None,
    rdzv_endpoint: Annotated[Optional[str], _opt(T, "rdzv_endpoint", "--rdzv-endpoint")] = None,
    max_restarts: Annotated[Optional[int], _opt(T, "max_restarts", "--max-restarts")] = None,
    max_tokens: Annotated[Optional[int], _opt(T, "max_tokens", "--max-tokens")] = None,
    tokens_per_update: Annotated[Optional[int], _opt(T, "tokens_per_update", "--tokens-per-update")] = None,
    max_update: Annotated[Optional[int], _opt(T, "max_update", "--max-update")] = None,
    max_epoch: Annotated[Optional[int], _opt(T, "max_epoch", "--max-epoch")] = None,
    max_time_hours: Annotated[Optional[float], _opt(T, "max_time_hours", "--max-time-hours")] = None,
    precision: Annotated[Optional[str], _opt(T, "precision", "--precision")] = None,
    device: Annotated[Optional[str], _opt(T, "device", "--device")] = None,
    seed: Annotated[Optional[int], _opt(T, "seed", "--seed")] = None,
    save_interval_minutes: Annotated[
        Optional[float], _opt(T, "save_interval_minutes", "--save-interval-minutes")] = None,
    save_interval_updates: Annotated[
        Optional[int], _opt(T, "save_interval_updates", "--save-interval-updates")] = None,
    keep_last: Annotated[Optional[int], _opt(T, "keep_last", "--keep-last")] = None,
    valid_bleu: Annotated[Optional[bool], _opt(T, "valid_bleu", "--valid-bleu/--no-valid-bleu")] = None,
    tensorboard_dir: Annotated[Optional[Path], _opt(T, "tensorboard_dir", "--tensorboard-dir")] = None,
    dry_run: Annotated[Optional[bool], _opt(T, "dry_run", "--dry-run")] = None,
    try_largest_batch: Annotated[Optional[bool], _opt(T, "try_largest_batch", "--try-largest-batch")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """Train a Transformer (starts torchrun with one worker per GPU); rerun to resume."""
    values = dict(data=data, save_dir=save_dir, arch=arch, gpus=gpus, nproc=nproc, nnodes=nnodes,
                  node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, max_restarts=max_restarts,
                  max_tokens=max_tokens, tokens_per_update=tokens_per_update, max_update=max_update,
                  max_epoch=max_epoch, max_time_hours=max_time_hours, precision=precision, device=device,
                  seed=seed, save_interval_minutes=save_interval_minutes,
                  save_interval_updates=save_interval_updates, keep_last=keep_last, valid_bleu=valid_bleu,
                  tensorboard_dir=tensorboard_dir, dry_run=dry_run, try_largest_batch=try_largest_batch)
    _run("train", _resolve(T, config, values, sets))


@app.command()
def average(
    checkpoints: Annotated[list[Path], typer.Argument(help=_help(AverageConfig, "checkpoints"), show_default=False)],
    out: Annotated[Optional[Path], _opt(AverageConfig, "out", "--out", "-o")] = None,
    last: Annotated[Optional[int], _opt(AverageConfig, "last", "--last")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """Average the weights of the last N checkpoints (the paper's final model)."""
    values = dict(checkpoints=checkpoints, out=out, last=last)
    _run("average", _resolve(AverageConfig, config, values, sets))


@app.command()
def translate(
    model: Annotated[Path, typer.Argument(help=_help(TranslateConfig, "model"), show_default=False)],
    input: Annotated[Optional[Path], _opt(TranslateConfig, "input", "--input", "-i")] = None,
    output: Annotated[Optional[Path], _opt(TranslateConfig, "output", "--output", "-o")] = None,
    beam: Annotated[Optional[int], _opt(TranslateConfig, "beam", "--beam")] = None,
    nbest: Annotated[Optional[int], _opt(TranslateConfig, "nbest", "--nbest")] = None,
    lenpen: Annotated[Optional[float], _opt(TranslateConfig, "lenpen", "--lenpen")] = None,
    max_tokens: Annotated[Optional[int], _opt(TranslateConfig, "max_tokens", "--max-tokens")] = None,
    input_format: Annotated[Optional[str], _opt(TranslateConfig, "input_format", "--input-format")] = None,
    output_format: Annotated[Optional[str], _opt(TranslateConfig, "output_format", "--output-format")] = None,
    device: Annotated[Optional[str], _opt(TranslateConfig, "device", "--device")] = None,
    dtype: Annotated[Optional[str], _opt(TranslateConfig, "dtype", "--dtype")] = None,
    threads: Annotated[Optional[int], _opt(TranslateConfig, "threads", "--threads")] = None,
    compile: Annotated[Optional[bool], _opt(TranslateConfig, "compile", "--compile/--no-compile")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """Translate raw text with beam search (file or stdin; output in input order)."""
    values = dict(model=model, input=input, output=output, beam=beam, nbest=nbest, lenpen=lenpen,
                  max_tokens=max_tokens, input_format=input_format, output_format=output_format,
                  device=device, dtype=dtype, threads=threads, compile=compile)
    cfg = _resolve(TranslateConfig, config, values, sets)
    # OpenMP threads that spin while waiting burn the time of a core another process needs: with 2
    # threads on 2 shared cores translation ran 10x slower. Read when torch loads; a user's value wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _run("translate", cfg)


@app.command()
def score(
    hyp: Annotated[Optional[Path], _opt(ScoreConfig, "hyp", "--hyp")] = None,
    ref: Annotated[Optional[Path], _opt(ScoreConfig, "ref", "--ref")] = None,
    test_set: Annotated[Optional[str], _opt(ScoreConfig, "test_set", "--test-set")] = None,
    langpair: Annotated[Optional[str], _opt(ScoreConfig, "langpair", "--langpair", "-l")] = None,
    out_json: Annotated[Optional[Path], _opt(ScoreConfig, "out_json", "--json")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """Score a translation: sacreBLEU with signature, chrF, and the paper's tokenized BLEU."""
    values = dict(hyp=hyp, ref=ref, test_set=test_set, langpair=langpair, out_json=out_json)
    _run("score", _resolve(ScoreConfig, config, values, sets))


@app.command()
def plot(
    runs: Annotated[list[Path], typer.Argument(help=_help(PlotConfig, "runs"), show_default=False)],
    out: Annotated[Optional[Path], _opt(PlotConfig, "out", "--out", "-o")] = None,
    x: Annotated[Optional[str], _opt(PlotConfig, "x", "--x")] = None,
    dpi: Annotated[Optional[int], _opt(PlotConfig, "dpi", "--dpi")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """Draw training curves (loss, perplexity, BLEU, learning rate) of one or more runs."""
    values = dict(runs=runs, out=out, x=x, dpi=dpi)
    _run("plot", _resolve(PlotConfig, config, values, sets))


@app.command()
def attention(
    model: Annotated[Path, typer.Argument(help=_help(AttentionConfig, "model"), show_default=False)],
    source: Annotated[Optional[str], _opt(AttentionConfig, "source", "--source")] = None,
    target: Annotated[Optional[str], _opt(AttentionConfig, "target", "--target")] = None,
    out: Annotated[Optional[Path], _opt(AttentionConfig, "out", "--out", "-o")] = None,
    kind: Annotated[Optional[str], _opt(AttentionConfig, "kind", "--kind")] = None,
    layer: Annotated[Optional[int], _opt(AttentionConfig, "layer", "--layer")] = None,
    head: Annotated[Optional[int], _opt(AttentionConfig, "head", "--head")] = None,
    style: Annotated[Optional[str], _opt(AttentionConfig, "style", "--style")] = None,
    query: Annotated[Optional[str], _opt(AttentionConfig, "query", "--query")] = None,
    fmt: Annotated[Optional[str], _opt(AttentionConfig, "format", "--format")] = None,
    beam: Annotated[Optional[int], _opt(AttentionConfig, "beam", "--beam")] = None,
    dpi: Annotated[Optional[int], _opt(AttentionConfig, "dpi", "--dpi")] = None,
    config: ConfigFile = None,
    sets: Sets = None,
) -> None:
    """Draw a model's attention weights on one sentence as heatmaps (or write them as JSON)."""
    values = dict(model=model, source=source, target=target, out=out, kind=kind, layer=layer, head=head,
                  style=style, query=query, format=fmt, beam=beam, dpi=dpi)
    _run("attention", _resolve(AttentionConfig, config, values, sets))


def _resolve(cls: type, config: Path | None, values: dict[str, Any], sets: list[str] | None) -> Any:
    try:
        cfg = resolve(cls, config, values, sets)
        if cls is T:  # the arch preset fills `model` first; YAML and command line then override it
            cfg = resolve(cls, config, values, sets, base=train_base(cfg.arch))
        return cfg
    except NmtError as e:
        raise fail(e) from None


def main() -> None:
    app(prog_name="nmt")


if __name__ == "__main__":
    sys.exit(main())
