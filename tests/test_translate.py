"""`nmt translate`: one output line per input line whatever the bytes, input order kept, n-best layout,
interactive use from a terminal, and clear refusals of bad model files."""

from __future__ import annotations

import os
import pty
import random
import select
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from conftest import REPO, assert_user_error, nmt, toy_sentences, why_torch_compile_cannot_run
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.errors import NmtError
from nmt_cli.inference.replicas import Replicas
from nmt_cli.inference.translate import Translator, clean_line, run
from nmt_cli.model import file as model_file


def load(path: Path, **settings: object) -> Translator:
    model, dictionary, spm_bytes = model_file.load_model(path)
    sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
    return Translator(model, dictionary, sp, TranslateConfig(model=path, **settings), lambda _: None)


def test_clean_line_keeps_each_line_one_line() -> None:
    warnings: list[str] = []
    for raw in [b"a\rb", b"a\x00b", b"a\x0cb", "a\u2028b".encode(), "a\u2029b".encode(), b"a\x1bb", b"a\x85b",
                "a\u0085b".encode(), b"a\x0bb"]:
        text = clean_line(raw, 7, warnings.append)
        assert len(text.splitlines()) == 1 and text.isprintable(), (raw, text)
    assert clean_line(b"hello\r", 1, warnings.append) == "hello"  # a CRLF ending
    assert clean_line(b"caf\xe9", 42, warnings.append) == "caf\ufffd"
    assert any("line 42" in w and "UTF-8" in w for w in warnings)


def test_translate_lines_gives_one_translation_per_line(tiny_trained_model: Path) -> None:
    model, dictionary, spm_bytes = model_file.load_model(tiny_trained_model)
    sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
    lines = ["red cat sees the dog", "", "   ", "large house"]
    found = Translator(model, dictionary, sp, TranslateConfig(model=None), print).translate(lines)
    out = [best[0][1] if best else "" for best in found]
    assert len(out) == 4 and out[1] == "" and out[2] == ""
    assert out[0] and "\n" not in out[0]


def test_file_output_is_in_input_order(tiny_trained_model: Path, tmp_path: Path) -> None:
    """Lines of shuffled lengths, several chunks and batches: each output is the line's own translation."""
    lines = toy_sentences(40, seed=7, max_words=15)
    random.Random(0).shuffle(lines)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    nmt("translate", tiny_trained_model, "-i", src, "-o", out, "--max-tokens", 40, "--set", "chunk_lines=16",
        "--threads", 2, "--dtype", "fp32")  # two batches searched at once, in the precision of `load`
    got = out.read_text(encoding="utf-8").split("\n")
    assert got[-1] == "" and len(got) - 1 == len(lines)
    translator = load(tiny_trained_model)
    alone = [translator.translate([line])[0][0][1] for line in lines]
    assert got[:-1] == alone
    assert len(set(alone)) > len(lines) * 3 // 4  # translations differ, so a mix-up would show


def test_adversarial_input_gives_one_line_per_line(tiny_trained_model: Path, tmp_path: Path) -> None:
    lines = [
        b"red cat", b"", b"   ", b"\t", "\u200b\ufeff".encode(), b"dog\r", b"cat\rdog", b"fish\x00bird",
        b"tree\x0cstone", "river\u2028cloud".encode(), b"bad \xff\xfe utf8", b"\x1b[31mred\x1b[0m",
        "old\u0085new".encode(),
        " ".join(["house"] * 200).encode(),  # longer than max_positions (64)
        b"last line without newline",
    ]
    src = tmp_path / "in.txt"
    src.write_bytes(b"\n".join(lines))
    proc = nmt("translate", tiny_trained_model, "-i", src, "--beam", 2)
    out = proc.stdout.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines), proc.stdout
    assert out[1] == out[2] == out[3] == out[4] == ""  # blank, or nothing sentencepiece keeps
    assert out[0] != ""
    assert "line 11" in proc.stderr and "UTF-8" in proc.stderr  # the invalid bytes, by line number
    assert "line 14" in proc.stderr and "max_positions" in proc.stderr  # the truncated line


def test_stdin_pipe_and_pieces_formats(tiny_trained_model: Path) -> None:
    translator = load(tiny_trained_model)
    pieces = " ".join(translator.sp.encode("red cat sees the dog", out_type=str))
    raw = nmt("translate", tiny_trained_model, input="red cat sees the dog\n\n").stdout
    as_pieces = nmt("translate", tiny_trained_model, "--input-format", "pieces", "--output-format", "pieces",
                    input=pieces + "\n").stdout
    assert raw.count("\n") == 2 and raw.endswith("\n\n")
    assert translator.sp.decode(as_pieces.split()) == raw.split("\n")[0]


def test_nbest_layout(tiny_trained_model: Path) -> None:
    proc = nmt("translate", tiny_trained_model, "--beam", 4, "--nbest", 3, input="red cat\n\nbig dog house\n")
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    assert len(rows) == 9 and all(len(r) == 3 for r in rows)
    assert [r[0] for r in rows] == ["1"] * 3 + ["2"] * 3 + ["3"] * 3
    assert [r[1] for r in rows[3:6]] == ["-inf"] * 3 and [r[2] for r in rows[3:6]] == [""] * 3
    for first in (0, 6):
        scores = [float(r[1]) for r in rows[first : first + 3]]
        assert scores == sorted(scores, reverse=True)
    best = nmt("translate", tiny_trained_model, "--beam", 4,
               input="red cat\n\nbig dog house\n").stdout.splitlines()
    assert [rows[0][2], rows[6][2]] == [best[0], best[2]]


def test_terminal_input_is_translated_line_by_line(tiny_trained_model: Path) -> None:
    """From a terminal, each line's translation appears before the next line is typed."""
    main, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "nmt_cli", "translate", str(tiny_trained_model)],
                            stdin=secondary, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    os.close(secondary)
    try:
        for line in ["red cat", "", "old tree near the river"]:
            os.write(main, line.encode() + b"\n")
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            assert ready, f"no output for {line!r} while the input is still open"
            assert proc.stdout.readline().endswith(b"\n")
    finally:
        os.close(main)
        proc.wait(timeout=60)


def test_bad_model_files_are_refused(tmp_path: Path, tiny_trained_model: Path) -> None:
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a model at all")
    assert_user_error(nmt("translate", garbage, input="a\n", check=False), "garbage.pt", "corrupt")
    flipped = tmp_path / "flipped.pt"
    data = bytearray(tiny_trained_model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(NmtError, match="flipped.pt"):
        run(TranslateConfig(model=flipped))
    with pytest.raises(NmtError, match="missing.pt"):
        run(TranslateConfig(model=tmp_path / "missing.pt"))
    with pytest.raises(NmtError, match="--nbest"):
        run(TranslateConfig(model=tiny_trained_model, beam=4, nbest=5))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dtypes_translate(tiny_trained_model: Path, dtype: str) -> None:
    out = nmt("translate", tiny_trained_model, "--dtype", dtype, "--device", "cpu",
              input="red cat sees the dog\n").stdout
    assert out.count("\n") == 1 and out.strip()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_and_cpu_fp16_are_refused(tiny_trained_model: Path) -> None:
    with pytest.raises(NmtError, match="--device cpu"):
        run(TranslateConfig(model=tiny_trained_model, device="cuda"))
    with pytest.raises(NmtError, match="bf16"):
        run(TranslateConfig(model=tiny_trained_model, device="cpu", dtype="fp16"))


def test_compiled_decoder_translates_as_the_eager_one_and_a_dead_worker_is_a_clear_error(
        tiny_trained_model: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--compile with two threads (fused kernels, in two worker processes, `Replicas`) gives the eager
    decoder's translations in fp32, batches of several sentences and single ones alike, beam 4 with
    fairseq's length penalty and stopping rule (the workers search with the translator's settings),
    with no graph compiled mid-search; then a worker killed (as the out-of-memory killer would) stops the
    translation with a message that says so, not with a traceback or a hang. One test, because each
    compile costs minutes of a 2-core CI machine (a decoder compiled in this process is test_search's
    `test_compiled_search_equals_reference`; the command line's --compile path up to the compiler,
    `test_compile_without_a_compiler_is_a_clear_error`)."""
    if (reason := why_torch_compile_cannot_run()) is not None:
        pytest.skip(reason)
    lines = toy_sentences(30, seed=11, max_words=12)
    settings = dict(beam=4, max_tokens=60, dtype="fp32", threads=2, length_penalty="fairseq", stop="beam")
    eager = load(tiny_trained_model, **settings).translate(lines)
    assert len({hyps[0][1] for hyps in eager}) > 20  # real, differing translations
    translator = load(tiny_trained_model, compile=True, **settings)
    translator.replicas = Replicas(translator.cfg, torch.float32, 2)
    try:
        compiled = translator.translate(lines)
        assert [[text for _, text in h] for h in compiled] == [[text for _, text in h] for h in eager]
        assert [h[0][0] for h in compiled] == pytest.approx([h[0][0] for h in eager], abs=1e-4)
        assert "recompile_limit" not in capfd.readouterr().err  # the workers' warnings, on stderr
        for process in translator.replicas.processes():
            process.kill()
        with pytest.raises(NmtError, match="worker process stopped while translating.*fewer --threads"):
            translator.translate(["red cat", "a dog"])
    finally:
        translator.close()


@pytest.mark.parametrize("threads", [1, 2])  # compiling here, or in worker processes
def test_compile_without_a_compiler_is_a_clear_error(tiny_trained_model: Path, tmp_path: Path,
                                                     threads: int) -> None:
    proc = nmt("translate", tiny_trained_model, "--compile", "--threads", threads, check=False,
               input="red cat\n", env={"CXX": str(tmp_path / "no-such-g++"),
                                       "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert_user_error(proc, "--compile", "C++ compiler", "no-such-g++", "translate without --compile")
    assert proc.stdout == ""
