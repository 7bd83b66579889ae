"""`nmt translate --dtype int8` (model/int8.py): each linear layer equals a reference int8 computation
(the dequantised weights times the quantized inputs), a sentence's translation does not depend on
what it is batched with, the line guarantees of `nmt translate` hold, and a CPU or torch without the
kernel is a clear error."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from conftest import assert_user_error, nmt, toy_sentences
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.inference.translate import Translator, load_translator, run
from nmt_cli.model import file as model_file
from nmt_cli.model import int8
from nmt_cli.model.int8 import Int8Linear, quantize_rows

pytestmark = pytest.mark.skipif(int8.missing() is not None, reason=f"no int8 kernel: {int8.missing()}")


def test_an_int8_layer_equals_the_reference_int8_computation() -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(2, 5, 32) * 3
    layer = Int8Linear(weight, bias)
    qx, x_scale = quantize_rows(x.reshape(-1, 32))
    reference = (qx.float() * x_scale) @ layer.dequantized().T + bias
    assert torch.allclose(layer(x).reshape(-1, 48), reference, rtol=1e-5, atol=1e-4)
    # rows of the stacked weight, as the attention's W^Q and W^K, W^V take them
    assert torch.allclose(layer(x, slice(16, None)).reshape(-1, 32), reference[:, 16:], rtol=1e-5, atol=1e-4)
    # the quantization itself is close to float (each weight within half a step of its row's scale)
    assert (layer.dequantized() - weight).abs().max() <= layer.scale.max() / 2 + 1e-6
    exact = torch.nn.functional.linear(x, weight, bias)
    assert (layer(x) - exact).norm() / exact.norm() < 0.02
    assert layer(x[:, :0]).shape == (2, 0, 48)


def test_a_row_comes_out_the_same_whatever_it_is_batched_with() -> None:
    torch.manual_seed(1)
    layer = Int8Linear(torch.randn(64, 32), torch.randn(64))
    rows = torch.randn(9, 32)
    rows[4] *= 100  # an outlier row: with one scale for the batch it would flatten the others
    together = layer(rows)
    assert all(torch.equal(together[i], layer(rows[i : i + 1])[0]) for i in range(9))
    assert torch.equal(layer(rows), together)  # deterministic


def test_int8_translations_are_deterministic_and_independent_of_the_batch(tiny_trained_model: Path,
                                                                           tmp_path: Path) -> None:
    lines = toy_sentences(24, seed=11, max_words=12)
    random.Random(0).shuffle(lines)
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    nmt("translate", tiny_trained_model, "-i", src, "-o", out, "--dtype", "int8", "--max-tokens", 40,
        "--threads", 2)
    got = out.read_text(encoding="utf-8").split("\n")[:-1]
    translator = load_translator(TranslateConfig(model=[tiny_trained_model], dtype="int8", threads=1),
                                 lambda _: None)
    alone = [translator.translate([line])[0][0][1] for line in lines]
    assert got == alone
    model, dictionary, spm_bytes = model_file.load_model(tiny_trained_model)
    fp32 = Translator(model, dictionary, spm.SentencePieceProcessor(model_proto=spm_bytes),
                      TranslateConfig(model=None), lambda _: None)
    same = sum(a == fp32.translate([line])[0][0][1] for a, line in zip(alone, lines, strict=True))
    assert same >= len(lines) // 2, (same, len(lines))  # int8 is close to fp32, not equal to it


def test_int8_keeps_every_line_guarantee(tiny_trained_model: Path, tmp_path: Path) -> None:
    lines = [b"red cat", b"", b"   ", "\u200b\ufeff".encode(), b"cat\rdog", b"fish\x00bird",
             b"bad \xff\xfe utf8", " ".join(["house"] * 200).encode(), b"last line without newline"]
    src = tmp_path / "in.txt"
    src.write_bytes(b"\n".join(lines))
    proc = nmt("translate", tiny_trained_model, "-i", src, "--beam", 2, "--dtype", "int8")
    out = proc.stdout.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines), proc.stdout
    assert out[0] != "" and out[1] == out[2] == out[3] == ""
    assert "line 7" in proc.stderr and "UTF-8" in proc.stderr
    assert "line 8" in proc.stderr and "max_positions" in proc.stderr


def test_an_ensemble_translates_in_int8(tiny_trained_model: Path) -> None:
    text = "red cat sees the dog\nlarge house\n"
    out = nmt("translate", tiny_trained_model, tiny_trained_model, "--dtype", "int8", input=text).stdout
    alone = nmt("translate", tiny_trained_model, "--dtype", "int8", input=text).stdout
    assert out.count("\n") == 2 and out.split("\n")[0]
    assert out == alone  # two equal members score as one


def test_int8_without_the_kernel_or_off_a_cpu_is_a_clear_error(tiny_trained_model: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    proc = nmt("translate", tiny_trained_model, "--dtype", "int8", "--compile", input="x\n", check=False)
    assert_user_error(proc, "--dtype int8", "--compile")
    if torch.cuda.is_available():
        with pytest.raises(NmtError, match="--dtype int8 runs on a CPU"):
            run(TranslateConfig(model=[tiny_trained_model], dtype="int8", device="cuda"))
    monkeypatch.delattr(torch, "_int_mm")  # a torch without the kernel
    assert "torch._int_mm" in int8.missing()
    with pytest.raises(NmtError, match=r"--dtype int8: torch .* has no int8 matrix product .*--dtype fp32"):
        load_translator(TranslateConfig(model=[tiny_trained_model], dtype="int8"), lambda _: None)
