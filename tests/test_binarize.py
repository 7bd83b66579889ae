"""`nmt binarize`: joint dictionary, memory-mapped ids that decode back to the text, unknown rates."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from conftest import MULTI30K_SPLITS, assert_user_error, bpe_input_lines, make_prepare_folder, nmt
from nmt_cli.artifacts import read_lines
from nmt_cli.config.data import BinarizeConfig
from nmt_cli.data import binarize, streaming
from nmt_cli.data.dataset import SPECIALS, UNK, Dictionary, IndexedDataset


def test_every_line_reads_back_as_its_text(multi30k_raw: Path, multi30k_bin: Path) -> None:
    """Raw line -> bpe -> binarize -> ids -> dictionary -> sentencepiece decode gives the line back.

    Up to sentencepiece's own normalisation (nmt_nfkc, whitespace runs collapsed, ends stripped):
    the expected text is ``sp.decode(sp.encode(line))``, not the raw line. A piece that never occurs
    in the training text is not in the dictionary and reads back as <unk>; for those few lines the
    ids must still be exactly the dictionary's ids of sentencepiece's pieces.
    """
    sp = spm.SentencePieceProcessor(model_file=str(multi30k_bin / "spm.model"))
    dictionary = Dictionary.load(multi30k_bin / "dict.txt")
    with_unknown = 0
    for split in MULTI30K_SPLITS:
        for lang in ("en", "de"):
            raw = bpe_input_lines(multi30k_raw, split, lang)
            data = IndexedDataset(multi30k_bin / f"{split}.{lang}")
            assert len(data) == len(raw)
            for line, pieces, ids in zip(raw, sp.encode(raw, out_type=str), data, strict=True):
                assert ids.tolist() == dictionary.encode(pieces)
                if UNK in ids:
                    with_unknown += 1
                    assert split != "train"  # the dictionary holds every training piece
                else:
                    assert sp.decode_pieces(dictionary.decode(ids)) == sp.decode(sp.encode(line)), line
    assert with_unknown < 20  # a handful of valid/test lines, out of 62028


def test_manifest_and_dictionary_layout(multi30k_bpe: Path, multi30k_bin: Path) -> None:
    manifest = json.loads((multi30k_bin / "manifest.json").read_text())
    dictionary = Dictionary.load(multi30k_bin / "dict.txt")
    assert manifest["stage"] == "binarize" and (manifest["src_lang"], manifest["tgt_lang"]) == ("en", "de")
    assert manifest["dict_size"] == len(dictionary) and len(dictionary) % 8 == 0
    assert tuple(dictionary.symbols[:4]) == SPECIALS
    real = [c for s, c in zip(dictionary.symbols, dictionary.counts, strict=True)
            if s not in SPECIALS and not s.startswith("<madeupword")]
    assert real == sorted(real, reverse=True) and min(real) >= 1
    assert _counted(dictionary) == _train_pieces(multi30k_bpe)
    bpe_manifest = json.loads((multi30k_bpe / "manifest.json").read_text())
    for split, info in manifest["splits"].items():
        assert info["sentences"] == bpe_manifest["splits"][split]["lines"]
        for lang in ("en", "de"):
            data = IndexedDataset(multi30k_bin / f"{split}.{lang}")
            pieces = bpe_manifest["splits"][split]["pieces"][lang]
            assert info["tokens"][lang] == int(data.sizes.sum()) == pieces
            assert data.dtype == np.uint16  # 16-bit ids: the vocabulary fits
            unknown = sum(int(np.count_nonzero(ids == UNK)) for ids in data)
            assert info["unk_rate"][lang] == pytest.approx(unknown / info["tokens"][lang])
    assert manifest["splits"]["train"]["unk_rate"] == {"en": 0.0, "de": 0.0}
    assert (multi30k_bin / "spm.model").read_bytes() == (multi30k_bpe / "spm.model").read_bytes()


def _counted(dictionary: Dictionary) -> Counter[str]:
    return Counter({s: c for s, c in zip(dictionary.symbols, dictionary.counts, strict=True) if c})


def _train_pieces(bpe: Path) -> Counter[str]:
    """What dict.txt must count: every piece of both training files (the definition, computed plainly)."""
    return Counter(piece for lang in ("en", "de") for line in read_lines(bpe / f"train.{lang}")
                   if line for piece in line.split(" "))


def test_pieces_outside_the_sentencepiece_model_get_their_own_symbols(multi30k_bpe: Path,
                                                                      tmp_path: Path) -> None:
    # A model reused on text with characters it never saw writes those characters as pieces of their
    # own (sentencepiece's unknown pieces); they are training pieces like any other.
    text = "Ein Hund läuft ☃ im Schnee.\nZwei ✓ Katzen ☃\n"
    raw = make_prepare_folder(tmp_path / "raw", {"train": (text, text), "valid": ("☃\n", "✓ ✗\n")})
    nmt("bpe", raw, "--out", tmp_path / "bpe", "--model", multi30k_bpe / "spm.model")
    assert "☃" in (tmp_path / "bpe" / "train.en").read_text(encoding="utf-8").split()
    nmt("binarize", tmp_path / "bpe", "--out", tmp_path / "bin")
    dictionary = Dictionary.load(tmp_path / "bin" / "dict.txt")
    assert _counted(dictionary) == _train_pieces(tmp_path / "bpe")
    assert dictionary.counts[dictionary.index["☃"]] == 4
    valid = IndexedDataset(tmp_path / "bin" / "valid.de")[0].tolist()
    # ✗ is not in the training text
    assert valid == dictionary.encode(["▁", "✓", "▁", "✗"]) and valid[-1] == UNK


def test_two_workers_write_the_same_bytes_as_one(multi30k_bpe: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "BLOCK_BYTES", 1 << 16)  # ~45 blocks per training file: order matters
    for name, workers in (("one", 1), ("two", 2)):
        binarize.run(BinarizeConfig(bpe=multi30k_bpe, out=tmp_path / name, workers=workers))
    names = sorted(p.name for p in (tmp_path / "one").iterdir() if p.suffix in (".bin", ".idx", ".txt"))
    assert len(names) == 13
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_reused_dictionary_is_used_and_unknowns_are_counted(multi30k_bpe: Path, multi30k_bin: Path,
                                                            tmp_path: Path) -> None:
    same = tmp_path / "same"
    nmt("binarize", multi30k_bpe, "--out", same, "--dictionary", multi30k_bin / "dict.txt")
    assert (same / "train.de.bin").read_bytes() == (multi30k_bin / "train.de.bin").read_bytes()
    small = tmp_path / "small.txt"  # the specials and the 100 most frequent pieces only
    small.write_text("".join(f"{line}\n" for line in list(read_lines(multi30k_bin / "dict.txt"))[:104]))
    out = tmp_path / "small"
    proc = nmt("binarize", multi30k_bpe, "--out", out, "--dictionary", small)
    unk_rate = json.loads((out / "manifest.json").read_text())["splits"]["train"]["unk_rate"]["en"]
    first = IndexedDataset(out / "train.en")[0]
    expected = Dictionary.load(small).encode(next(read_lines(multi30k_bpe / "train.en")).split(" "))
    assert first.tolist() == expected and UNK in expected
    assert 0.2 < unk_rate < 1.0
    assert "train" in proc.stdout and "%" in proc.stdout  # the table of unknown rates


def test_min_count_leaves_rare_pieces_out_of_the_dictionary(multi30k_bpe: Path, tmp_path: Path) -> None:
    nmt("binarize", multi30k_bpe, "--out", tmp_path / "bin", "--set", "min_count=50")
    dictionary = Dictionary.load(tmp_path / "bin" / "dict.txt")
    counts = _train_pieces(multi30k_bpe)
    assert _counted(dictionary) == Counter({p: c for p, c in counts.items() if c >= 50})
    rare = sum(c for c in counts.values() if c < 50)
    manifest = json.loads((tmp_path / "bin" / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    assert sum(r * train["tokens"][lang] for lang, r in train["unk_rate"].items()) == pytest.approx(rare)


# ---------------------------------------------------------------------------------------------
# Mistakes a user can make: one clear message, no traceback, no manifest


def _assert_refused(proc: object, out: Path, *needles: str) -> None:
    assert_user_error(proc, *needles)
    assert not (out / "manifest.json").exists()


def test_folder_without_manifest_is_refused(multi30k_bpe: Path, tmp_path: Path) -> None:
    unfinished = tmp_path / "bpe"
    unfinished.mkdir()
    (unfinished / "train.en").write_bytes((multi30k_bpe / "train.en").read_bytes())
    out = tmp_path / "bin"
    _assert_refused(nmt("binarize", unfinished, "--out", out, check=False), out,
                    f"{unfinished} has no manifest.json")


def test_folder_from_another_stage_is_refused(multi30k_raw: Path, tmp_path: Path) -> None:
    out = tmp_path / "bin"
    _assert_refused(nmt("binarize", multi30k_raw, "--out", out, check=False), out,
                    "written by `nmt prepare`, not `nmt bpe`")


def test_changed_pieces_file_is_refused(multi30k_bpe: Path, tmp_path: Path) -> None:
    copy = tmp_path / "bpe"
    copy.mkdir()
    for path in multi30k_bpe.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    with open(copy / "valid.de", "ab") as f:
        f.write(b"\xe2\x96\x81extra\n")
    out = tmp_path / "bin"
    _assert_refused(nmt("binarize", copy, "--out", out, check=False), out, f"{copy / 'valid.de'} has",
                    "run `nmt bpe")


def test_dictionary_with_duplicate_symbols_is_refused(multi30k_bpe: Path, tmp_path: Path) -> None:
    bad = tmp_path / "dict.txt"
    bad.write_text("<pad> 0\n<s> 0\n</s> 0\n<unk> 0\n▁a 5\n▁b 4\n▁a 3\n")
    out = tmp_path / "bin"
    _assert_refused(nmt("binarize", multi30k_bpe, "--out", out, "--dictionary", bad, check=False), out,
                    f"{bad}, line 7", "already appears on line 5")


def test_small_corpus_with_empty_lines(tmp_path: Path) -> None:
    # U+0085 survives sentencepiece's normalisation as a piece; str.split() would take it for a space
    text = "a b c\n\nb\u0085c\n\n"
    raw = make_prepare_folder(tmp_path / "raw", {"train": (text, text), "valid": ("\nc\n", "a\n\n")})
    nmt("bpe", raw, "--out", tmp_path / "bpe", "--vocab-size", 7)
    assert "\u0085" in (tmp_path / "bpe" / "train.en").read_text(encoding="utf-8")
    nmt("binarize", tmp_path / "bpe", "--out", tmp_path / "bin")
    for name, empty in (("train.en", [False, True, False, True]), ("valid.de", [False, True])):
        pieces = list(read_lines(tmp_path / "bpe" / name))
        sizes = IndexedDataset(tmp_path / "bin" / name).sizes.tolist()
        assert [size == 0 for size in sizes] == empty
        assert sizes == [len(line.split(" ")) if line else 0 for line in pieces]
