"""Stage output folders: done only once the manifest is written; a finished run can be skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_prepare_folder
from nmt_cli.artifacts import StageOutput, is_done, read_manifest
from nmt_cli.config.data import BpeConfig
from nmt_cli.errors import NmtError


def _bpe_folder(out: Path, raw: Path, cfg: BpeConfig) -> None:
    from nmt_cli.artifacts import sha256_file

    with StageOutput(out, "bpe", cfg) as stage:
        stage.inputs["raw"] = {"folder": str(raw), "manifest_sha256": sha256_file(raw / "manifest.json")}
        (out / "train.en").write_text("a b\n")
        stage.add_output("train.en")


def test_failed_run_leaves_no_manifest_and_is_refused(tmp_path: Path) -> None:
    cfg = BpeConfig(raw=tmp_path / "raw", out=tmp_path / "bpe")
    with pytest.raises(RuntimeError), StageOutput(cfg.out, "bpe", cfg):
        (cfg.out / "train.en").write_text("half")
        raise RuntimeError("crash")
    with pytest.raises(NmtError, match="did not finish"):
        read_manifest(cfg.out, "bpe", "nmt bpe")


def test_finished_run_is_skipped_until_config_or_input_changes(tmp_path: Path) -> None:
    raw = make_prepare_folder(tmp_path / "raw", {"train": ("a\n", "b\n"), "valid": ("a\n", "b\n")})
    cfg = BpeConfig(raw=raw, out=tmp_path / "bpe", vocab_size=100)
    _bpe_folder(cfg.out, raw, cfg)
    assert is_done(cfg.out, "bpe", cfg)
    # workers say how, not what: the output is the same
    assert is_done(cfg.out, "bpe", BpeConfig(raw=raw, out=cfg.out, vocab_size=100, workers=7))
    assert not is_done(cfg.out, "bpe", BpeConfig(raw=raw, out=cfg.out, vocab_size=200))
    make_prepare_folder(raw, {"train": ("c\n", "d\n"), "valid": ("a\n", "b\n")})  # the input was redone
    assert not is_done(cfg.out, "bpe", cfg)


def test_truncated_output_is_noticed(tmp_path: Path) -> None:
    raw = make_prepare_folder(tmp_path / "raw", {"train": ("a\n", "b\n"), "valid": ("a\n", "b\n")})
    cfg = BpeConfig(raw=raw, out=tmp_path / "bpe")
    _bpe_folder(cfg.out, raw, cfg)
    (cfg.out / "train.en").write_text("a")
    with pytest.raises(NmtError, match="changed or truncated"):
        read_manifest(cfg.out, "bpe", "nmt bpe")
    assert not is_done(cfg.out, "bpe", cfg)
