"""`nmt plot`: pictures of real training logs, and clear refusals of logs it cannot read."""

from __future__ import annotations

import json
import os
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import assert_user_error, nmt
from nmt_cli.errors import NmtError
from nmt_cli.evaluation.plot import read_log, run_labels
from synthetic_binarized import build

TINY = ["--arch", "transformer_tiny", "--precision", "fp32", "--max-tokens", "256",
        "--save-interval-minutes", "0", "--set", "model.d_model=32", "--set", "model.d_ff=64",
        "--set", "model.heads=2", "--set", "threads=1", "--set", "log.interval=1", "--max-update", "6",
        "--save-interval-updates", "3"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two real `nmt train` runs of a few updates on a synthetic corpus, one with validation BLEU."""
    root = tmp_path_factory.mktemp("plot")
    data = build(root / "bin", train=120, valid=20)
    nmt("train", data, "--save-dir", root / "base", *TINY)
    nmt("train", data, "--save-dir", root / "bleu", *TINY, "--seed", "2", "--valid-bleu",
        "--set", "valid.bleu_sentences=10")
    return root / "base", root / "bleu"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_plot_of_two_real_runs(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    import matplotlib.image

    base, bleu = two_runs
    assert any("bleu" in json.loads(line) for line in (bleu / "train.jsonl").read_text().splitlines())
    proc = nmt("plot", base, bleu, "--out", tmp_path / "curves.png", "--dpi", 40)
    assert "2 run(s)" in proc.stderr
    assert _png_size(tmp_path / "curves.png") == (600, 340)  # the figure's 15 x 8.5 inches
    assert matplotlib.image.imread(tmp_path / "curves.png").std() > 0.05, "the picture is blank"
    nmt("plot", base / "train.jsonl", "--x", "hours", "--out", tmp_path / "curves.svg")
    root = ET.parse(tmp_path / "curves.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"


@pytest.mark.slow
def test_plot_refuses_empty_and_malformed_logs_and_tolerates_a_torn_last_line(
        two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    base, _ = two_runs
    good = (base / "train.jsonl").read_text(encoding="utf-8")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.jsonl").write_text("", encoding="utf-8")
    assert_user_error(nmt("plot", empty, "--out", tmp_path / "a.png", check=False),
                      "empty/train.jsonl holds no training or validation records")
    broken = tmp_path / "broken"
    broken.mkdir()
    lines = good.splitlines()
    (broken / "train.jsonl").write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n",
                                        encoding="utf-8")
    assert_user_error(nmt("plot", base, broken, "--out", tmp_path / "a.png", check=False),
                      "broken/train.jsonl, line 2: not a JSON record")
    assert not (tmp_path / "a.png").exists()
    assert_user_error(nmt("plot", tmp_path / "nowhere", "--out", tmp_path / "a.png", check=False),
                      "nowhere does not exist")
    assert_user_error(nmt("plot", base, "--out", tmp_path / "a.pdf", check=False), "a.pdf", ".png or .svg")

    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "train.jsonl").write_text(good + lines[-1][: len(lines[-1]) // 2], encoding="utf-8")  # no newline
    proc = nmt("plot", torn, "--out", tmp_path / "torn.png")
    assert f"line {len(lines) + 1}: skipped a last line cut short" in proc.stderr
    assert _png_size(tmp_path / "torn.png")[0] > 0


def test_read_log_rules(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    warnings: list[str] = []
    train = {"kind": "train", "update": 1, "loss": 9.0, "ppl": 500.0, "lr": 1e-4}
    valid = {"kind": "valid", "update": 1, "loss": 8.0, "bleu": None}
    records = [train, {"kind": "note", "text": "x"}, valid]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert [r["kind"] for r in read_log(path, warnings.append)] == ["train", "valid"]  # other kinds ignored
    assert warnings == []
    for bad, message in [("[1, 2]", "line 1: expected a JSON object"),
                         ('{"kind": "train", "loss": 1.0}', "line 1: a train record without its 'update'"),
                         ('{"kind": "train", "update": 1, "loss": "high"}',
                          "line 1: field 'loss' must be a number"),
                         ("\n", "line 1: not a JSON record")]:
        path.write_text(bad + "\n", encoding="utf-8")
        with pytest.raises(NmtError, match=message):
            read_log(path, warnings.append)
    path.write_text(json.dumps(train) + "\n" + '{"kind": "tra', encoding="utf-8")
    assert len(read_log(path, warnings.append)) == 1
    assert "line 2: skipped a last line cut short" in warnings[0]


def test_run_labels_are_folder_names_made_distinct() -> None:
    assert run_labels((Path("/x/a/run"), Path("/x/b/run2"))) == ["run", "run2"]
    assert run_labels((Path("/x/a/run"), Path("/x/b/run"))) == ["a/run", "b/run"]
    assert run_labels((Path("/x/a/run/train.jsonl"),)) == ["run"]


def test_missing_matplotlib_is_named(tmp_path: Path) -> None:
    """Where matplotlib cannot be imported, the message names the extra to install."""
    blocker = tmp_path / "blocked" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.jsonl").write_text('{"kind": "train", "update": 1, "loss": 2.0}\n')
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "blocked"), os.environ.get("PYTHONPATH", "")])}
    proc = nmt("plot", tmp_path / "run", "--out", tmp_path / "a.png", check=False, env=env)
    assert_user_error(proc, "needs matplotlib", "pip install 'nmt-cli[plot]'")


def test_help_of_the_picture_commands_imports_neither_matplotlib_nor_torch(tmp_path: Path) -> None:
    for name in ("matplotlib", "torch"):
        blocker = tmp_path / "blocked" / name
        blocker.mkdir(parents=True)
        (blocker / "__init__.py").write_text(f"raise ImportError('{name} imported on the --help path')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "blocked"), os.environ.get("PYTHONPATH", "")])}
    assert "--x" in nmt("plot", "--help", env=env).stdout
    assert "--kind" in nmt("attention", "--help", env=env).stdout
