"""TensorBoard logging of `nmt train`: the event files hold the numbers of train.jsonl, also after a
resume."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from conftest import assert_user_error, nmt
from synthetic_binarized import build

TINY = ["--arch", "transformer_tiny", "--precision", "fp32", "--max-tokens", "256",
        "--save-interval-minutes", "0", "--set", "model.d_model=32", "--set", "model.d_ff=64",
        "--set", "model.heads=2", "--set", "threads=1", "--set", "log.interval=1",
        "--save-interval-updates", "3", "--valid-bleu", "--set", "valid.bleu_sentences=10"]


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in `folder`, as TensorBoard reads them: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _expected(save_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """What train.jsonl says TensorBoard should show: KIND/FIELD -> [(update, value)]."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for line in (save_dir / "train.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        for name, value in record.items():
            if name not in ("kind", "update") and isinstance(value, (int, float)):
                expected.setdefault(f"{record['kind']}/{name}", []).append((record["update"], value))
    return expected


def _assert_same(scalars: dict, expected: dict) -> None:
    assert set(scalars) == set(expected)
    for tag, points in expected.items():
        assert [s for s, _ in scalars[tag]] == [s for s, _ in points], tag  # each update once, in order
        for (_, got), (_, want) in zip(scalars[tag], points, strict=True):
            assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-30), (tag, got, want)  # stored as float32


@pytest.mark.slow
def test_tensorboard_scalars_match_train_jsonl_also_after_a_resume(tmp_path: Path) -> None:
    data = build(tmp_path / "bin", train=120, valid=20)
    save, board = tmp_path / "run", tmp_path / "board"
    nmt("train", data, "--save-dir", save, *TINY, "--max-update", "6", "--tensorboard-dir", board)
    scalars, expected = _scalars(board), _expected(save)
    for tag in ("train/loss", "train/nll", "train/ppl", "train/lr", "train/gnorm", "train/tokens_per_second",
                "valid/loss", "valid/ppl", "valid/bleu"):
        assert tag in expected, tag
    assert [s for s, _ in expected["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in expected["valid/bleu"]] == [3, 6]
    _assert_same(scalars, expected)

    # As after a crash just before the save at update 6: resume from 3, train 4-6 again. TensorBoard
    # must drop the first run's 4-6, as train.jsonl does, instead of showing them twice.
    shutil.copyfile(save / "checkpoint_3.pt", save / "checkpoint_last.pt")
    (save / "checkpoint_6.pt").unlink()
    again = nmt("train", data, "--save-dir", save, *TINY, "--max-update", "6", "--tensorboard-dir", board)
    assert "at update 3" in again.stderr
    assert len(list(board.glob("events.out.tfevents.*"))) == 2
    _assert_same(_scalars(board), _expected(save))


@pytest.mark.slow
def test_missing_tensorboard_is_named_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "blocked" / "tensorboard"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('tensorboard is not installed here')\n")
    data = build(tmp_path / "bin", train=40, valid=10)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "blocked"), os.environ.get("PYTHONPATH", "")])}
    proc = nmt("train", data, "--save-dir", tmp_path / "run", *TINY, "--max-update", "2",
               "--tensorboard-dir", tmp_path / "board", check=False, env=env)
    assert_user_error(proc, "--tensorboard-dir needs the tensorboard package",
                      "pip install 'nmt-cli[tensorboard]'")
    assert not list((tmp_path / "run").glob("checkpoint*.pt"))
