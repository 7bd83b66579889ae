"""The `nmt` command: one Typer command per stage, generated from the stage's config dataclass.

A command's options are the fields of its config that declare a flag (see `config/options.py`);
every other field is reachable through `--config FILE.yaml` and `--set key=value`. The command
resolves the config (defaults < YAML < command line) and calls its stage module's `run(cfg)`, the
function tests and notebooks call too. Stage modules (and torch) are imported only when a command
runs, so `--help` stays fast.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from nmt_cli import __version__
from nmt_cli.config.convert import Ctranslate2ExportConfig, FairseqImportConfig
from nmt_cli.config.core import resolve
from nmt_cli.config.data import BinarizeConfig, BpeConfig, PrepareConfig
from nmt_cli.config.evaluation import AttentionConfig, PlotConfig, ScoreConfig
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.config.options import command
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

# The module whose `run(cfg)` each command calls, imported only when the command runs.
STAGE_MODULES = {
    "prepare": "data.prepare", "bpe": "data.bpe", "binarize": "data.binarize", "train": "training.train",
    "average": "training.average", "translate": "inference.translate", "score": "evaluation.score",
    "plot": "evaluation.plot", "attention": "evaluation.attention_maps",
    "import fairseq": "model.fairseq", "export ctranslate2": "inference.ct2",
}
# Each command's config and help, in the order `nmt --help` lists them.
COMMANDS = {
    "prepare": (PrepareConfig,
                "Download (or read) and clean a parallel corpus into raw train/valid/test text."),
    "bpe": (BpeConfig, "Train a joint sentencepiece BPE model and split every sentence into pieces."),
    "binarize": (BinarizeConfig, "Build the joint dictionary and write memory-mapped token arrays."),
    "train": (TrainConfig, "Train a Transformer (starts torchrun with one worker per GPU); rerun to resume."),
    "average": (AverageConfig, "Average the weights of the last N checkpoints (the paper's final model)."),
    "translate": (TranslateConfig,
                  "Translate raw text with beam search (file or stdin; output in input order)."),
    "score": (ScoreConfig,
              "Score a translation: sacreBLEU with signature, chrF, and the paper's tokenized BLEU "
              "(--task parse: parse trees, EVALB's labelled F1)."),
    "plot": (PlotConfig, "Draw training curves (loss, perplexity, BLEU, learning rate) of one or more runs."),
    "attention": (AttentionConfig,
                  "Draw a model's attention weights on one sentence as heatmaps (or write them as JSON)."),
}


def fail(error: NmtError) -> typer.Exit:
    """Print a user error as one unwrapped red message (paths stay copyable); exit status 2."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
    return typer.Exit(2)


def _run(stage: str, values: dict[str, Any], config: Path | None, sets: list[str] | None) -> None:
    """Resolve `stage`'s config from `values` (the options given), the YAML file and the --set items,
    and call its module's `run(cfg)`; a user error becomes one red message and exit status 2."""
    try:
        if stage == "train":
            cfg = resolve_train(config, values, sets)
        else:
            cfg = resolve({**COMMANDS, **GROUP_COMMANDS}[stage][0], config, values, sets)
        if stage == "translate":
            # OpenMP threads that spin while waiting burn a core another process needs (translation on
            # shared cores ran many times slower). Read when torch loads; a user's value wins.
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
        Optional[bool],
        typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit"),
    ] = None,
) -> None:
    pass


for _name, (_cls, _help) in COMMANDS.items():
    app.command(_name, help=_help)(command(_cls, functools.partial(_run, _name)))

# Commands in groups, `nmt GROUP NAME`: converters from and to other toolkits' formats.
GROUPS = {"import": "Convert a model trained by another toolkit into an nmt model file.",
          "export": "Convert an nmt model file for another inference engine."}
GROUP_COMMANDS = {
    "import fairseq": (FairseqImportConfig,
                       "Convert a fairseq transformer checkpoint (with its dictionaries and sentencepiece "
                       "model) into an nmt model file that every stage accepts."),
    "export ctranslate2": (Ctranslate2ExportConfig,
                           "Export a model to a CTranslate2 folder (needs the ctranslate2 package) that "
                           "`nmt translate DIR` translates with."),
}
for _group, _help in GROUPS.items():
    _sub = typer.Typer(help=_help, no_args_is_help=True, add_completion=False)
    app.add_typer(_sub, name=_group)
    for _name, (_cls, _help) in GROUP_COMMANDS.items():
        if _name.startswith(f"{_group} "):
            _sub.command(_name.split()[1], help=_help)(command(_cls, functools.partial(_run, _name)))


def main() -> None:
    app(prog_name="nmt")


if __name__ == "__main__":
    sys.exit(main())
