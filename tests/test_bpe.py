"""`nmt bpe`: a joint sentencepiece BPE model and every line split into pieces, line for line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece as spm

from conftest import MULTI30K_SPLITS, assert_user_error, bpe_input_lines, make_prepare_folder, nmt
from nmt_cli.artifacts import read_lines, sha256_file
from nmt_cli.config.data import BpeConfig
from nmt_cli.data import bpe, streaming


def test_every_line_becomes_its_sentencepiece_pieces(multi30k_raw: Path, multi30k_bpe: Path) -> None:
    """The source of valid and test normalised first, as prepare normalised train's (and translate
    normalises its input)."""
    sp = spm.SentencePieceProcessor(model_file=str(multi30k_bpe / "spm.model"))
    record = json.loads((multi30k_raw / "manifest.json").read_text())["source_normalization"]
    assert record == {"normalize_punctuation": True, "lang": "en", "remove_non_printing": True}
    assert sp.get_piece_size() == 8000
    # the specials are the Dictionary's
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, -1, -1, -1)
    for split in MULTI30K_SPLITS:
        for lang in ("en", "de"):
            raw = bpe_input_lines(multi30k_raw, split, lang)
            pieces = list(read_lines(multi30k_bpe / f"{split}.{lang}"))
            assert pieces == [" ".join(p) for p in sp.encode(raw, out_type=str)], (split, lang)


def test_manifest_records_counts_vocabulary_and_input_identity(multi30k_raw: Path,
                                                               multi30k_bpe: Path) -> None:
    manifest = json.loads((multi30k_bpe / "manifest.json").read_text())
    raw = json.loads((multi30k_raw / "manifest.json").read_text())
    assert manifest["stage"] == "bpe"
    assert (manifest["src_lang"], manifest["tgt_lang"], manifest["vocab_size"]) == ("en", "de", 8000)
    lines = {s: v["lines"] for s, v in raw["splits"].items()}
    assert {s: v["lines"] for s, v in manifest["splits"].items()} == lines
    pieces_in_file = sum(len(line.split(" ")) for line in read_lines(multi30k_bpe / "valid.de") if line)
    assert manifest["splits"]["valid"]["pieces"]["de"] == pieces_in_file
    assert manifest["inputs"]["raw"]["manifest_sha256"] == sha256_file(multi30k_raw / "manifest.json")
    assert manifest["outputs"]["spm.model"]["sha256"] == sha256_file(multi30k_bpe / "spm.model")
    vocab = (multi30k_bpe / "spm.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == 8000 and vocab[0] == "<unk>\t0"


def test_empty_and_odd_lines_keep_the_line_count(tmp_path: Path) -> None:
    # Empty and whitespace-only lines, a CRLF ending, and U+0085/U+2028, which Python's
    # str.splitlines() would take for line breaks: every input line must stay exactly one line.
    train = "a cat sat\n\n   \nthe dog ran\r\nx\u0085y z\u2028w\nend"
    raw = make_prepare_folder(tmp_path / "raw", {"train": (train, train), "valid": ("\n\nhi\n", "\n\nho\n")})
    nmt("bpe", raw, "--out", tmp_path / "bpe", "--vocab-size", 30)
    for split, expected in (("train", 6), ("valid", 3)):
        lines = (tmp_path / "bpe" / f"{split}.en").read_bytes().split(b"\n")
        assert lines[-1] == b"" and len(lines) - 1 == expected
    pieces = list(read_lines(tmp_path / "bpe" / "train.en"))
    assert pieces[1] == pieces[2] == "" and pieces[3].endswith("n")  # the CR is gone, not a piece
    assert list(read_lines(tmp_path / "bpe" / "valid.de"))[:2] == ["", ""]


def test_partial_character_coverage_turns_rare_characters_into_bytes(tmp_path: Path) -> None:
    text = "the cat sat on the mat\n" * 60 + "a rare ☃ snowman\n"
    raw = make_prepare_folder(tmp_path / "raw", {"train": (text, text), "valid": ("☃ and ✓\n", "x\n")})
    nmt("bpe", raw, "--out", tmp_path / "bpe", "--vocab-size", 280, "--set", "character_coverage=0.98")
    manifest = json.loads((tmp_path / "bpe" / "manifest.json").read_text())
    assert manifest["sentencepiece"]["byte_fallback"] is True
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "bpe" / "spm.model"))
    valid = next(read_lines(tmp_path / "bpe" / "valid.en")).split(" ")
    assert "<0xE2>" in valid and "☃" not in valid  # UTF-8 bytes, not <unk>
    assert sp.decode(sp.piece_to_id(valid)) == "☃ and ✓"


def test_reusing_a_model_gives_the_same_pieces(multi30k_raw: Path, multi30k_bpe: Path,
                                               tmp_path: Path) -> None:
    out = tmp_path / "bpe"
    nmt("bpe", multi30k_raw, "--out", out, "--model", multi30k_bpe / "spm.model", "--workers", 1)
    for name in ("spm.model", "spm.vocab", "train.en", "test.de"):
        assert (out / name).read_bytes() == (multi30k_bpe / name).read_bytes(), name
    assert json.loads((out / "manifest.json").read_text())["sentencepiece"]["trained"] is False


def _run_bpe(raw: Path, out: Path, **fields: object) -> dict:
    bpe.run(BpeConfig(raw=raw, out=out, **fields))
    return json.loads((out / "manifest.json").read_text())


def test_two_workers_write_the_same_bytes_as_one(multi30k_raw: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "BLOCK_BYTES", 1 << 16)  # ~45 blocks per training file: order matters
    _run_bpe(multi30k_raw, tmp_path / "one", vocab_size=2000, workers=1)
    _run_bpe(multi30k_raw, tmp_path / "two", vocab_size=2000, workers=2)
    for split in MULTI30K_SPLITS:
        for lang in ("en", "de"):
            name = f"{split}.{lang}"
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert (tmp_path / "one" / "spm.model").read_bytes() == (tmp_path / "two" / "spm.model").read_bytes()


def test_training_sample_is_seeded(multi30k_raw: Path, tmp_path: Path) -> None:
    fields = dict(vocab_size=500, sample_sentences=3000, workers=1)
    first = _run_bpe(multi30k_raw, tmp_path / "a", seed=1, **fields)
    _run_bpe(multi30k_raw, tmp_path / "b", seed=1, **fields)
    _run_bpe(multi30k_raw, tmp_path / "c", seed=2, **fields)
    assert first["sentencepiece"]["sampled_sentences"] == 3000
    raw = json.loads((multi30k_raw / "manifest.json").read_text())
    assert first["sentencepiece"]["training_sentences"] == 2 * raw["splits"]["train"]["lines"]
    model = {name: (tmp_path / name / "spm.model").read_bytes() for name in "abc"}
    assert model["a"] == model["b"] and model["a"] != model["c"]


# ---------------------------------------------------------------------------------------------
# Mistakes a user can make: one clear message, no traceback, no manifest


def _assert_refused(proc: object, out: Path, *needles: str) -> None:
    assert_user_error(proc, *needles)
    assert not (out / "manifest.json").exists()


def test_folder_without_manifest_is_refused(tmp_path: Path) -> None:
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "train.en").write_text("hello\n")
    out = tmp_path / "bpe"
    _assert_refused(nmt("bpe", tmp_path / "raw", "--out", out, check=False), out, "has no manifest.json")


def test_folder_from_another_stage_is_refused(multi30k_bpe: Path, tmp_path: Path) -> None:
    out = tmp_path / "bpe"
    _assert_refused(nmt("bpe", multi30k_bpe, "--out", out, check=False), out,
                    "written by `nmt bpe`, not `nmt prepare`")


def test_model_that_is_not_sentencepiece_is_refused(multi30k_raw: Path, tmp_path: Path) -> None:
    fake = tmp_path / "fake.model"
    fake.write_text("<pad> 0\n<s> 0\n")
    out = tmp_path / "bpe"
    _assert_refused(nmt("bpe", multi30k_raw, "--out", out, "--model", fake, check=False), out,
                    f"--model {fake} is not a sentencepiece model")


def test_vocabulary_larger_than_the_text_allows_is_refused_with_the_fix(tmp_path: Path) -> None:
    text = "the cat sat on the mat\nthe dog sat on the log\n" * 5
    raw = make_prepare_folder(tmp_path / "raw", {"train": (text, text), "valid": ("cat\n", "dog\n")})
    out = tmp_path / "bpe"
    proc = nmt("bpe", raw, "--out", out, "--vocab-size", 8000, check=False)
    _assert_refused(proc, out, "--vocab-size 8000 is larger than the training text allows",
                    "pass --vocab-size")
    allowed = int(proc.stderr.split("pass --vocab-size ")[1].split()[0])
    nmt("bpe", raw, "--out", out, "--vocab-size", allowed)  # the suggested fix works
    assert (out / "manifest.json").exists()


@pytest.mark.parametrize("damaged", ["train.de", "valid.en"])  # read while training / while encoding
def test_invalid_utf8_is_refused_naming_file_and_line(tmp_path: Path, damaged: str) -> None:
    text = "the cat sat\nthe dog ran\na bird flew\n"
    raw = make_prepare_folder(tmp_path / "raw", {"train": (text, text), "valid": (text, text)})
    (raw / damaged).write_bytes(text.encode().replace(b"dog", b"d\xffg"))  # same size: the manifest agrees
    out = tmp_path / "bpe"
    _assert_refused(nmt("bpe", raw, "--out", out, "--vocab-size", 20, "--workers", 2, check=False), out,
                    f"{raw / damaged}, line 2: invalid UTF-8")


def test_output_folder_equal_to_input_is_refused(multi30k_raw: Path) -> None:
    proc = nmt("bpe", multi30k_raw, "--out", multi30k_raw, check=False)
    assert_user_error(proc, "is the input folder")
    assert (multi30k_raw / "manifest.json").exists()  # the input is left alone
