"""The `nmt` command: one Typer command per stage, generated from the stage's config dataclass.

`COMMANDS` is the one table of commands: adding one is adding a `Command` (a config class in
`config/`, a module with `run(cfg)`, a help line). A command's options are the fields of its config
that declare a flag (see `config/options.py`); every other field is reachable through `--config
FILE.yaml` and `--set key=value`. The command resolves the config (defaults < YAML < command line)
and calls its module's `run(cfg)`, the function tests and notebooks call too. Stage modules (and
torch) are imported only when a command runs, so `--help` stays fast.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from nmt_cli import __version__
from nmt_cli.config.convert import (
    Ctranslate2ExportConfig,
    FairseqImportConfig,
    HuggingfaceExportConfig,
    HuggingfaceImportConfig,
)
from nmt_cli.config.core import resolve
from nmt_cli.config.data import BinarizeConfig, BpeConfig, PrepareConfig
from nmt_cli.config.evaluation import AttentionConfig, PlotConfig, ScoreConfig
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.config.options import command
from nmt_cli.config.serve import ServeConfig
from nmt_cli.config.train import AverageConfig, TrainConfig, resolve_train
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

@dataclass(frozen=True)
class Command:
    """One `nmt` command: its config class (whose fields are its options), the module whose `run(cfg)`
    it calls (imported only when it runs) and its help. `nmt GROUP NAME` commands are named so."""

    name: str
    config: type
    module: str
    help: str
    # how the config is resolved, when not by `config.core.resolve` alone (train: the arch preset first)
    resolve: Callable[[Path | None, dict[str, Any], list[str] | None], Any] | None = None
    # OpenMP threads that spin while waiting burn a core another process needs (translation on shared
    # cores ran many times slower); set before torch loads, a user's own value wins
    passive_threads: bool = False


# Every command, in the order `nmt --help` lists them.
COMMANDS = {c.name: c for c in [
    Command("prepare", PrepareConfig, "data.prepare",
            "Download (or read) and clean a parallel corpus into raw train/valid/test text."),
    Command("bpe", BpeConfig, "data.bpe",
            "Train a joint sentencepiece BPE model and split every sentence into pieces."),
    Command("binarize", BinarizeConfig, "data.binarize",
            "Build the joint dictionary and write memory-mapped token arrays."),
    Command("train", TrainConfig, "training.train",
            "Train a Transformer (starts torchrun with one worker per GPU); rerun to resume.",
            resolve=resolve_train),
    Command("average", AverageConfig, "training.average",
            "Average the weights of the last N checkpoints (the paper's final model)."),
    Command("translate", TranslateConfig, "inference.translate",
            "Translate raw text with beam search (file or stdin; output in input order).",
            passive_threads=True),
    Command("serve", ServeConfig, "serve.server",
            "Serve models over HTTP: a LibreTranslate-compatible API, dynamic batching, a web page "
            "(needs pip install 'nmt-cli\\[serve]').",
            passive_threads=True),
    Command("score", ScoreConfig, "evaluation.score",
            "Score a translation: sacreBLEU with signature, chrF, and the paper's tokenized BLEU "
            "(--task parse: parse trees, EVALB's labelled F1)."),
    Command("plot", PlotConfig, "evaluation.plot",
            "Draw training curves (loss, perplexity, BLEU, learning rate) of one or more runs."),
    Command("attention", AttentionConfig, "evaluation.attention_maps",
            "Draw a model's attention weights on one sentence as heatmaps (or write them as JSON)."),
    Command("import fairseq", FairseqImportConfig, "model.fairseq",
            "Convert a fairseq transformer checkpoint (with its dictionaries and sentencepiece model) into "
            "an nmt model file that every stage accepts."),
    Command("export ctranslate2", Ctranslate2ExportConfig, "inference.ct2",
            "Export a model to a CTranslate2 folder (needs the ctranslate2 package) that "
            "`nmt translate DIR` translates with."),
    Command("import huggingface", HuggingfaceImportConfig, "model.huggingface",
            "Convert a MarianMT folder (an OPUS-MT model from the Hugging Face Hub) into an nmt model file "
            "that every stage accepts."),
    Command("export huggingface", HuggingfaceExportConfig, "inference.huggingface",
            "Export a model as a MarianMT folder (needs transformers and safetensors) that transformers "
            "loads and the Hugging Face Hub takes."),
]}
# The groups of `nmt GROUP NAME` commands: converters from and to other toolkits' formats.
GROUPS = {"import": "Convert a model trained by another toolkit into an nmt model file.",
          "export": "Convert an nmt model file for another inference engine."}


def fail(error: NmtError) -> typer.Exit:
    """Print a user error as one unwrapped red message (paths stay copyable); exit status 2."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
    return typer.Exit(2)


def _run(name: str, values: dict[str, Any], config: Path | None, sets: list[str] | None) -> None:
    """Resolve command `name`'s config from `values` (the options given), the YAML file and the --set
    items, and call its module's `run(cfg)`; a user error becomes one red message and exit status 2."""
    cmd = COMMANDS[name]
    try:
        cfg = (cmd.resolve(config, values, sets) if cmd.resolve
               else resolve(cmd.config, config, values, sets))
        if cmd.passive_threads:
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        importlib.import_module(f"nmt_cli.{cmd.module}").run(cfg)
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
        Optional[bool],
        typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit"),
    ] = None,
) -> None:
    pass


_groups: dict[str, typer.Typer] = {}
for _group, _help in GROUPS.items():
    _groups[_group] = typer.Typer(help=_help, no_args_is_help=True, add_completion=False)
    app.add_typer(_groups[_group], name=_group)
for _cmd in COMMANDS.values():
    _where, _, _sub = _cmd.name.rpartition(" ")
    (_groups[_where] if _where else app).command(_sub, help=_cmd.help)(
        command(_cmd.config, functools.partial(_run, _cmd.name)))


def main() -> None:
    app(prog_name="nmt")


if __name__ == "__main__":
    sys.exit(main())
