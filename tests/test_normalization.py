"""One normalisation of the source text from training to translation: what `nmt prepare` did to the
training source is recorded in its manifest, carried by bpe and binarize into the model file, and
applied by `nmt translate` (`--normalize model`, the default) and by bpe to the valid/test source
that validation BLEU translates; references are never normalised; a model file from before the
record keeps translating raw text."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from conftest import nmt
from nmt_cli.config.data import PrepareConfig
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.config.model import ModelConfig
from nmt_cli.data.clean import Chunk, Normalization, Options, clean_chunk
from nmt_cli.data.dataset import Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.inference.translate import load_translator
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer

CURLY, STRAIGHT = "“quoted” — text, ‘said’ she…", "\"quoted\" - text, 'said' she..."
# Lines with what Moses normalisation and non-printing removal change (quotes, dashes, spaces before
# punctuation, a zero-width space, a soft hyphen, a no-break space) and what they keep.
SAMPLES = [CURLY, STRAIGHT, "a  b ,c ( d ) « e » 1 000,5 %",
           "zero\u200bwidth soft\u00adhyphen no\u00a0break", "plain text", "„Anführung“ – Strich"]
RECORD = {"normalize_punctuation": True, "lang": "en", "remove_non_printing": True}


def test_translation_normalises_exactly_as_prepare_cleaned_the_training_text() -> None:
    opts = Options.of(PrepareConfig(dataset="local", out=Path("x")), "en", "de")
    kept = clean_chunk(Chunk("s", "t", 1, [(s.encode(), s.encode()) for s in SAMPLES]), opts).kept
    normalization = Normalization.from_record(RECORD, "test", "")
    assert [src for src, _ in kept] == [normalization.apply(s) for s in SAMPLES]
    assert normalization.apply(CURLY) == normalization.apply(STRAIGHT) != CURLY
    assert Normalization.from_record(normalization.record(), "test", "") == normalization


def test_a_missing_record_is_none_and_a_damaged_one_a_clear_error() -> None:
    assert Normalization.from_record(None, "old.pt", "") is None
    nothing = {"normalize_punctuation": False, "lang": None, "remove_non_printing": False}
    off = Normalization.from_record(nothing, "f", "")
    assert off is not None and off.apply(CURLY) == CURLY
    with pytest.raises(NmtError, match=r"model.pt: the source normalisation record is damaged .*; fix it"):
        Normalization.from_record({"normalize_punctuation": "yes"}, "model.pt", "fix it")


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same untrained model as a file with the record of normalised data, and as a file written
    before nmt recorded it (no such key at all). Its sentencepiece model knows both quote styles."""
    folder = tmp_path_factory.mktemp("normalization")
    text = folder / "text.txt"
    lines = [*SAMPLES, "the cat sees the dog", "she said yes"] * 20
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "spm"), vocab_size=60,
                                   model_type="bpe", character_coverage=1.0, pad_id=-1, bos_id=-1, eos_id=-1,
                                   unk_id=0, hard_vocab_limit=False, num_threads=1, minloglevel=2)
    spm_bytes = (folder / "spm.model").read_bytes()
    sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
    dictionary = Dictionary.from_counts(Counter(
        p for line in SAMPLES for p in sp.encode(line, out_type=str)))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, d_ff=32, heads=2),
                        len(dictionary)).eval()
    state = model_file.model_state(model, model.cfg, dictionary, spm_bytes, RECORD)
    model_file.save(folder / "normalised.pt", {"kind": "model", "meta": {}, **state})
    del state["source_normalization"]
    model_file.save(folder / "old.pt", {"kind": "model", "meta": {}, **state})
    return {"normalised": folder / "normalised.pt", "old": folder / "old.pt", "folder": folder}


def _source_ids(path: Path, line: str, normalize: str = "model") -> list[int]:
    translator = load_translator(TranslateConfig(model=path, normalize=normalize, threads=1), print)
    return translator.encode(line, 1)


def test_a_model_from_normalised_data_translates_curly_quotes_as_straight_ones(
        model_files: dict[str, Path]) -> None:
    path, folder = model_files["normalised"], model_files["folder"]
    assert _source_ids(path, CURLY) == _source_ids(path, STRAIGHT)
    assert _source_ids(path, CURLY, "none") != _source_ids(path, STRAIGHT, "none")  # the test can fail
    (folder / "in.txt").write_text(f"{CURLY}\n{STRAIGHT}\n", encoding="utf-8")
    nmt("translate", path, "-i", folder / "in.txt", "-o", folder / "out.txt", "--beam", 2, "--threads", 1)
    first, second = (folder / "out.txt").read_text(encoding="utf-8").splitlines()
    assert first == second


def test_an_old_model_file_keeps_translating_the_raw_text(model_files: dict[str, Path]) -> None:
    path = model_files["old"]
    assert model_file.load(path).get("source_normalization", "absent") == "absent"
    assert _source_ids(path, CURLY) == _source_ids(path, CURLY, "none") != _source_ids(path, STRAIGHT)


def test_a_model_exported_for_ctranslate2_normalises_as_its_model_file(model_files: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    """`nmt export ctranslate2` carries the record into the folder's nmt.json; `nmt translate DIR`
    applies it (or not, with --normalize none); a folder exported before it was carried, without the
    key, and the export of an old model file translate the raw text."""
    pytest.importorskip("ctranslate2", reason="the optional ctranslate2 package is not installed")
    from nmt_cli.config.convert import Ctranslate2ExportConfig
    from nmt_cli.inference import ct2

    exported, old = tmp_path / "normalised", tmp_path / "old"
    ct2.run(Ctranslate2ExportConfig(model=model_files["normalised"], out=exported))
    ct2.run(Ctranslate2ExportConfig(model=model_files["old"], out=old))
    assert json.loads((exported / "nmt.json").read_text())["source_normalization"] == RECORD
    assert _source_ids(exported, CURLY) == _source_ids(exported, STRAIGHT) == _source_ids(
        model_files["normalised"], CURLY)
    assert _source_ids(exported, CURLY, "none") != _source_ids(exported, STRAIGHT, "none")
    assert _source_ids(old, CURLY) == _source_ids(old, CURLY, "none") != _source_ids(old, STRAIGHT)
    settings = json.loads((exported / "nmt.json").read_text())
    del settings["source_normalization"]
    (exported / "nmt.json").write_text(json.dumps(settings))
    assert _source_ids(exported, CURLY) == _source_ids(exported, CURLY, "none")


def test_the_record_goes_from_prepare_through_bpe_and_binarize_and_only_sources_are_normalised(
        tmp_path: Path) -> None:
    pairs = [(f"{s} {i}", f"{s} ziel {i}") for i in range(30) for s in SAMPLES]
    for split, chosen in (("train", pairs), ("valid", pairs[:12])):
        for side, lang in ((0, "en"), (1, "de")):
            text = "".join(p[side] + "\n" for p in chosen)
            (tmp_path / f"{split}.{lang}").write_text(text, encoding="utf-8")
    nmt("prepare", "local", "--src-lang", "en", "--tgt-lang", "de", "--train", tmp_path / "train",
        "--valid", tmp_path / "valid", "--out", tmp_path / "raw", "--workers", 1)
    nmt("bpe", tmp_path / "raw", "--out", tmp_path / "bpe", "--vocab-size", 80, "--workers", 1)
    nmt("binarize", tmp_path / "bpe", "--out", tmp_path / "bin", "--workers", 1)
    for stage in ("raw", "bpe", "bin"):
        assert json.loads((tmp_path / stage / "manifest.json").read_text())["source_normalization"] == RECORD
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "bpe" / "spm.model"))
    norm = Normalization.from_record(RECORD, "test", "")
    sources = [sp.decode(line.split()) for line in (tmp_path / "bpe" / "valid.en").read_text().splitlines()]
    targets = [sp.decode(line.split()) for line in (tmp_path / "bpe" / "valid.de").read_text().splitlines()]
    assert sources == [sp.decode(sp.encode(norm.apply(s), out_type=str)) for s, _ in pairs[:12]]
    assert targets == [sp.decode(sp.encode(t, out_type=str)) for _, t in pairs[:12]]  # raw, as prepared
    assert sources[0] != sp.decode(sp.encode(pairs[0][0], out_type=str))
