"""Config resolution: defaults < YAML < command line, typed conversion, helpful errors."""

from pathlib import Path

import pytest

from conftest import assert_user_error, nmt
from nmt_cli.config.core import dump_yaml, flatten, read_yaml, resolve, to_dict
from nmt_cli.config.data import BpeConfig
from nmt_cli.config.model import ARCHS
from nmt_cli.config.train import TrainConfig, train_base
from nmt_cli.errors import NmtError


def test_precedence_defaults_yaml_cli(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("vocab_size: 8000\nworkers: 3\nsample_sentences: 2.5e4\n")
    cfg = resolve(BpeConfig, yaml_file, {"raw": "r", "out": "o", "vocab_size": 500, "workers": None})
    assert cfg.vocab_size == 500  # command line beats YAML
    assert cfg.workers == 3  # YAML beats the default
    assert cfg.sample_sentences == 25000  # "2.5e4" is a string to PyYAML; converted by the field type
    assert cfg.character_coverage == 1.0  # default
    assert isinstance(cfg.raw, Path)


def test_a_yaml_file_includes_another_and_overrides_it_by_section(tmp_path: Path) -> None:
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "base.yaml").write_text("arch: transformer_base\nmodel:\n  dropout: 0.3\n"
                                                   "  heads: 8\nstop:\n  max_update: 100\n")
    row = tmp_path / "recipe" / "row.yaml"
    row.write_text("include: base.yaml\nmodel:\n  heads: 1\n  d_k: 512\n")
    cfg = resolve(TrainConfig, row, {"data": "d", "save_dir": "s"}, ["stop.max_update=7"],
                  base=train_base("transformer_base"))
    assert (cfg.model.heads, cfg.model.d_k, cfg.model.dropout) == (1, 512, 0.3)  # the group merges
    assert cfg.stop.max_update == 7  # the command line beats both files
    (tmp_path / "recipe" / "base.yaml").write_text("include: row.yaml\n")
    with pytest.raises(NmtError, match="includes itself"):
        resolve(TrainConfig, row, {"data": "d", "save_dir": "s"})
    row.write_text("include: [base.yaml]\n")
    with pytest.raises(NmtError, match="takes the path of one YAML file"):
        resolve(TrainConfig, row, {"data": "d", "save_dir": "s"})


def test_set_overrides_nested_and_converts_types() -> None:
    cfg = resolve(TrainConfig, None, {"data": "d", "save_dir": "s", "batch": {"max_tokens": 1000}},
                  ["model.dropout=0.3", "optim.adam_betas=0.9,0.997", "valid.bleu=yes", "optim.lr=5e-4",
                   "batch.tokens_per_update=2e4"],
                  base=train_base("transformer_big"))
    assert cfg.model.dropout == 0.3 and cfg.model.d_model == ARCHS["transformer_big"].d_model
    assert cfg.optim.adam_betas == (0.9, 0.997)
    assert cfg.valid.bleu is True and cfg.optim.lr == 5e-4
    assert (cfg.batch.max_tokens, cfg.batch.tokens_per_update) == (1000, 20000)


@pytest.mark.parametrize("key", ["max_tokens", "validate_interval_updates", "valid_bleu", "log_interval",
                                 "gpus"])
def test_a_flat_key_of_the_old_train_config_names_its_new_place(tmp_path: Path, key: str) -> None:
    new = TrainConfig.RENAMED[key]
    with pytest.raises(NmtError, match=f"the command line: '{key}' is now '{new}'"):
        resolve(TrainConfig, None, {"data": "d", "save_dir": "s"}, [f"{key}=1"])
    yaml_file = tmp_path / "old.yaml"
    yaml_file.write_text(f"{key}: 1\n")
    with pytest.raises(NmtError, match=f"{yaml_file}: '{key}' is now '{new}'"):
        resolve(TrainConfig, yaml_file, {"data": "d", "save_dir": "s"})


def test_every_renamed_key_has_a_field_at_its_new_place() -> None:
    fields = set(flatten(to_dict(train_base("transformer_base"))))
    assert set(TrainConfig.RENAMED.values()) <= fields
    assert not set(TrainConfig.RENAMED) & fields  # an old name is no longer a key of its own


def test_unknown_key_names_the_closest(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("vocab_sise: 8000\n")
    with pytest.raises(NmtError, match="did you mean 'vocab_size'"):
        resolve(BpeConfig, yaml_file, {"raw": "r", "out": "o"})
    with pytest.raises(NmtError, match="did you mean 'model.dropout'"):
        resolve(TrainConfig, None, {"data": "d", "save_dir": "s"}, ["model.dropuot=0.1"])


@pytest.mark.parametrize("text, message", [
    ("vocab_size: [1, 2]\n", "whole number"),
    ("vocab_size: 8000.5\n", "whole number"),
    ("vocab_size: true\n", "whole number"),
    ("character_coverage: lots\n", "number"),
    ("- a list\n", "mapping"),
    ("vocab_size: [unclosed\n", "not valid YAML"),
])
def test_yaml_with_wrong_types_is_refused(tmp_path: Path, text: str, message: str) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(text)
    with pytest.raises(NmtError, match=message):
        resolve(BpeConfig, yaml_file, {"raw": "r", "out": "o"})


@pytest.mark.parametrize("sets, message", [
    (["optim.lr=nan"], "'optim.lr' must be a finite number"),
    (["stop.max_time_hours=inf"], "finite"),
    (["batch.max_tokens=0"], "'batch.max_tokens' must be at least 1; got 0"),
    (["model.dropout=1"], "'model.dropout' must be below 1"),
    (["optim.adam_betas=0.9,1.5"], "'optim.adam_betas' must be below 1"),
    (["model.heads=3"], "divisible by model.heads"),
    (["model.d_model=25", "model.heads=5"], "must be even"),
])
def test_values_outside_their_range_are_refused(sets: list[str], message: str) -> None:
    with pytest.raises(NmtError, match=message):
        resolve(TrainConfig, None, {"data": "d", "save_dir": "s"}, sets)


def test_yaml_keys_must_be_words_and_a_group_is_checked_once_complete(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("1: 2\n")
    with pytest.raises(NmtError, match="option names are words, got 1"):
        resolve(BpeConfig, yaml_file, {"raw": "r", "out": "o"})
    yaml_file.write_text("model:\n  heads: 6\n")  # 512 % 6 != 0 alone, fine with the d_model set below
    cfg = resolve(TrainConfig, yaml_file, {"data": "d", "save_dir": "s"}, ["model.d_model=768"])
    assert (cfg.model.d_model, cfg.model.heads) == (768, 6)


def test_literal_choices_are_checked() -> None:
    with pytest.raises(NmtError, match="must be one of"):
        resolve(TrainConfig, None, {"data": "d", "save_dir": "s", "precision": "fp8"})


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = resolve(TrainConfig, None, {"data": "d", "save_dir": "s"}, ["model.norm=pre", "optim.lr=1e-3"],
                  base=train_base("transformer_tiny"))
    (tmp_path / "c.yaml").write_text(dump_yaml(cfg))
    written = read_yaml(tmp_path / "c.yaml")
    assert written["optim"]["lr"] == 1e-3 and written["batch"]["max_tokens"] == 4096  # in sections
    again = resolve(TrainConfig, tmp_path / "c.yaml", {})
    assert again == cfg


def test_cli_help_lists_every_stage_and_version() -> None:
    out = nmt("--help").stdout
    for command in ("prepare", "bpe", "binarize", "train", "average", "translate", "score"):
        assert command in out
    assert nmt("--version").stdout.startswith("nmt ")


def test_cli_help_does_not_import_torch() -> None:
    import subprocess
    import sys
    code = ("import sys; from nmt_cli.cli import app; "
            "assert 'torch' not in sys.modules, 'torch imported on the --help path'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_config_errors_are_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("vocab_size: many\n")
    assert_user_error(nmt("bpe", tmp_path, "--out", tmp_path / "o", "--config", bad, check=False),
                      "vocab_size")
    assert_user_error(nmt("bpe", tmp_path, "--out", tmp_path / "o", "--set", "vocab=1", check=False),
                      "vocab_size")
    assert_user_error(nmt("bpe", tmp_path, "--out", tmp_path / "o", "--config", tmp_path / "missing.yaml",
                          check=False), "does not exist")
    assert read_yaml(bad) == {"vocab_size": "many"}
