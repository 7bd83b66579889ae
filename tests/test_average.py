"""`nmt average`: the element-wise mean of the last N checkpoints, as a model file that translates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import assert_user_error, nmt, save_model_file
from nmt_cli.config.model import ModelConfig
from nmt_cli.config.train import AverageConfig
from nmt_cli.data.dataset import Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer
from nmt_cli.training.average import average_states, run

CFG = ModelConfig(encoder_layers=1, decoder_layers=1, d_model=32, d_ff=64, heads=4, dropout=0.0,
                  max_positions=64)


def test_average_states_is_the_elementwise_mean_in_the_original_dtype() -> None:
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "n": torch.tensor(3),
         "x": torch.tensor([0.1, 0.2])}
    b = {"w": torch.tensor([3.0, 5.0], dtype=torch.bfloat16), "n": torch.tensor(4),
         "x": torch.tensor([0.3, 0.6])}
    mean = average_states(iter([a, b]))
    assert mean["w"].dtype == torch.bfloat16 and mean["w"].tolist() == [2.0, 3.5]
    torch.testing.assert_close(mean["x"], torch.tensor([0.2, 0.4]))
    assert mean["n"].item() == 4  # integer buffers are counters: taken from the last, not averaged
    assert a["w"].tolist() == [1.0, 2.0]  # inputs are not modified


def test_average_accumulates_in_fp32() -> None:
    """Many fp16 states whose sum overflows fp16 still average correctly."""
    states = [{"w": torch.full((3,), 60000.0, dtype=torch.float16)} for _ in range(20)]
    assert average_states(iter(states))["w"].tolist() == [60000.0] * 3


def checkpoints(folder: Path, toy_spm, updates: list[int], cfg: ModelConfig = CFG) -> list[Path]:
    spm_bytes, dictionary = toy_spm
    paths = []
    for update in updates:
        torch.manual_seed(update)
        model = Transformer(cfg, len(dictionary))
        paths.append(save_model_file(folder / f"checkpoint_{update}.pt", model, dictionary, spm_bytes, update,
                                     kind="checkpoint"))
    return paths


def test_last_n_checkpoints_are_averaged_and_translate(tmp_path: Path, toy_spm) -> None:
    checkpoints(tmp_path, toy_spm, [9, 10, 100])  # by update number: 100 is the newest, not 9
    save_model_file(tmp_path / "checkpoint_last.pt", Transformer(CFG, len(toy_spm[1])), toy_spm[1],
                    toy_spm[0])
    out = tmp_path / "averaged.pt"
    nmt("average", tmp_path, "--last", 2, "--out", out)
    averaged = model_file.load(out)
    assert averaged["kind"] == "model" and "train" not in averaged
    assert averaged["meta"]["updates"] == [10, 100]
    ten, hundred = (model_file.load(tmp_path / f"checkpoint_{u}.pt")["model"] for u in (10, 100))
    assert averaged["model"].keys() == ten.keys()
    for key, value in averaged["model"].items():
        torch.testing.assert_close(value, (ten[key] + hundred[key]) / 2)
    # One shared embedding: the input embeddings and the output projection are one averaged tensor.
    assert [k for k in averaged["model"] if "embed" in k] == ["embed.weight"]
    model, _, _ = model_file.load_model(out)
    assert model.logits(torch.eye(CFG.d_model)).T.equal(model.embed.weight)
    translated = nmt("translate", out, "--beam", 2, input="red cat\n\n").stdout
    assert translated.count("\n") == 2


def test_explicit_files_are_averaged(tmp_path: Path, toy_spm) -> None:
    paths = checkpoints(tmp_path, toy_spm, [1, 2, 3])
    out = tmp_path / "avg.pt"
    nmt("average", *paths, "--out", out)
    states = [model_file.load(p)["model"] for p in paths]
    averaged = model_file.load(out)
    assert averaged["meta"]["updates"] == [1, 2, 3]
    for key, value in averaged["model"].items():
        torch.testing.assert_close(value, sum(s[key] for s in states) / 3)


def average(*paths: Path, out: Path, last: int = 5) -> None:
    run(AverageConfig(checkpoints=tuple(paths), out=out, last=last))


def test_different_models_are_refused(tmp_path: Path, toy_spm) -> None:
    a = checkpoints(tmp_path / "a", toy_spm, [1])[0]
    b = checkpoints(tmp_path / "b", toy_spm, [2], dataclasses.replace(CFG, d_ff=128))[0]
    with pytest.raises(NmtError, match="d_ff: 64 vs 128") as error:
        average(a, b, out=tmp_path / "x.pt")
    assert str(a) in str(error.value) and str(b) in str(error.value)
    spm_bytes, dictionary = toy_spm
    other = Dictionary([*dictionary.symbols[:-1], "<other>"], dictionary.counts)
    c = save_model_file(tmp_path / "c.pt", Transformer(CFG, len(other)), other, spm_bytes, 3)
    with pytest.raises(NmtError, match="different dictionaries"):
        average(a, c, out=tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def test_too_few_checkpoints_and_bad_files(tmp_path: Path, toy_spm) -> None:
    checkpoints(tmp_path, toy_spm, [5, 6])
    with pytest.raises(NmtError, match="holds 2 numbered checkpoints .* pass --last 2"):
        average(tmp_path, out=tmp_path / "x.pt", last=5)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NmtError, match="no checkpoint_<update>.pt"):
        average(empty, out=tmp_path / "x.pt")
    (tmp_path / "checkpoint_7.pt").write_bytes(b"\x00" * 100)
    assert_user_error(nmt("average", tmp_path, "--last", 3, "--out", tmp_path / "x.pt", check=False),
                      "checkpoint_7.pt", "corrupt")
