"""Command-line options generated from the config dataclasses (nmt_cli/config/options.py)."""

import dataclasses
import importlib
import os
import typing
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from conftest import nmt
from nmt_cli.cli import COMMANDS
from nmt_cli.config.core import opt, required
from nmt_cli.config.data import BpeConfig
from nmt_cli.config.options import command, parameters
from nmt_cli.config.train import TrainConfig


@dataclasses.dataclass
class Inner:
    size: int = opt(3, "a size", flag="--size")
    hidden: int = opt(4, "no flag: only --set inner.hidden")


@dataclasses.dataclass
class Outer:
    path: Path = required("the input", argument=True)
    fast: bool = opt(False, "go fast", flag="--fast/--no-fast")
    quiet: bool = opt(False, "say less", flag="--quiet", short="-q")
    inner: Inner = opt(Inner(), "a section")


def given(cls: type, *args: str) -> tuple[dict[str, Any], Path | None, list[str] | None]:
    """What the generated command of `cls` hands its handler for command line `args`."""
    seen = []
    app = typer.Typer()
    app.command()(command(cls, lambda values, config, sets: seen.append((values, config, sets))))
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return seen[0]


def test_only_the_options_given_reach_the_config_as_a_nested_mapping() -> None:
    assert given(Outer, "p") == ({"path": Path("p")}, None, None)
    values, config, sets = given(Outer, "p", "--no-fast", "-q", "--size", "7", "--config", "c.yaml",
                                 "--set", "inner.hidden=5")
    assert values == {"path": Path("p"), "fast": False, "quiet": True, "inner": {"size": 7}}
    assert (config, sets) == (Path("c.yaml"), ["inner.hidden=5"])


def test_the_flags_of_the_train_sections_set_their_fields() -> None:
    values, _, _ = given(TrainConfig, "bin", "--max-tokens", "5", "--valid-bleu", "--gpus", "2",
                         "--seed", "3")
    assert values == {"data": Path("bin"), "seed": 3, "batch": {"max_tokens": 5}, "valid": {"bleu": True},
                      "launch": {"gpus": 2}}


def test_fields_without_a_flag_are_not_options() -> None:
    names = [parameter.name for _, parameter in parameters(Outer)]
    assert names == ["path", "fast", "quiet", "inner__size"]
    bpe = {path[-1] for path, _ in parameters(BpeConfig)}
    assert "character_coverage" not in bpe and "vocab_size" in bpe


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_declares_each_flag_once(name: str) -> None:
    infos = [p.annotation.__metadata__[0] for _, p in parameters(COMMANDS[name].config)]
    flags = ["--config", "--set", "--help", "-h"]  # what every command has besides its config's flags
    flags += [part for info in infos for flag in info.param_decls or () for part in flag.split("/")]
    assert len(flags) == len(set(flags)), flags


def test_help_lists_the_choices_of_a_literal_and_imports_no_torch(tmp_path: Path) -> None:
    blocker = tmp_path / "blocked" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch imported on the --help path')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "blocked"), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "200"}
    out = nmt("translate", "--help", env=env).stdout
    assert "auto|bf16|fp16|fp32" in out and "raw|pieces" in out
    assert "transformer_base|transformer_big" in nmt("train", "--help", env=env).stdout


def test_a_wrong_choice_on_the_command_line_is_the_configs_message(tmp_path: Path) -> None:
    proc = nmt("translate", tmp_path / "model.pt", "--dtype", "fp8", check=False)
    assert proc.returncode == 2
    assert "'dtype' must be one of auto, bf16, fp16, fp32, int8; got 'fp8'" in proc.stderr


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_calls_a_stage_that_runs_its_config(name: str) -> None:
    run = importlib.import_module(f"nmt_cli.{COMMANDS[name].module}").run
    hints = typing.get_type_hints(run)
    assert hints["cfg"] is COMMANDS[name].config, f"{COMMANDS[name].module}.run takes {hints['cfg']}"
