"""`nmt prepare`: WMT14 from a fake statmt.org on 127.0.0.1, local files, cleaning counts, bad input."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import unicodedata
from pathlib import Path

import pytest
from sacremoses import MosesPunctNormalizer

from conftest import assert_user_error, nmt
from fake_statmt import FakeStatmt, checksums_file, read_lines, wmt14_archives
from nmt_cli.artifacts import read_manifest
from nmt_cli.config.data import PrepareConfig
from nmt_cli.data import prepare
from nmt_cli.data.clean import Cleaner, Options, normalize_punctuation, read_chunks
from nmt_cli.data.wmt import clean_segment, sgml_segments
from nmt_cli.errors import NmtError

EUROPARL, COMMONCRAWL = "/wmt13/training-parallel-europarl-v7.tgz", "/wmt13/training-parallel-commoncrawl.tgz"
NEWS_COMMENTARY, TEST_FULL = "/wmt14/training-parallel-nc-v9.tgz", "/wmt14/test-full.tgz"


@pytest.fixture(scope="module")
def archives(shared_data: Path) -> dict[str, dict]:
    return wmt14_archives(shared_data)


@pytest.fixture
def site(archives: dict[str, dict]) -> FakeStatmt:
    with FakeStatmt({path: a["bytes"] for path, a in archives.items()}) as server:
        yield server


def cli_args(dataset: str, out: Path, site: FakeStatmt, sums: Path, *extra: object) -> list[object]:
    return ["prepare", dataset, "--out", out, "--mirror", site.url, "--checksums", sums, "--workers", 1,
            "--set", "retry_wait_seconds=0.01", *extra]


def config(dataset: str, out: Path, **fields: object) -> PrepareConfig:
    return dataclasses.replace(PrepareConfig(dataset=dataset, out=out), workers=1, retry_wait_seconds=0.01,
                               **fields)


def check_contract(out: Path, src: str, tgt: str, splits: tuple[str, ...]) -> dict:
    """What `nmt bpe` relies on: languages, per-split line counts equal to the files, every file listed."""
    manifest = read_manifest(out, "prepare", "nmt prepare")
    assert (manifest["src_lang"], manifest["tgt_lang"]) == (src, tgt)
    assert tuple(manifest["splits"]) == splits
    for split in splits:
        for lang in (src, tgt):
            text = (out / f"{split}.{lang}").read_bytes()
            assert text.count(b"\n") == manifest["splits"][split]["lines"] and text.endswith(b"\n")
            assert b"\r" not in text
            assert manifest["outputs"][f"{split}.{lang}"]["lines"] == manifest["splits"][split]["lines"]
    assert set(manifest["outputs"]) == {f"{s}.{lang}" for s in splits for lang in (src, tgt)}
    return manifest


# ---------------------------------------------------------------------------------------------
# WMT14 through HTTP


@pytest.mark.slow
def test_wmt14_en_de_end_to_end_with_interrupted_and_failing_downloads(
        site: FakeStatmt, archives: dict, shared_data: Path, tmp_path: Path) -> None:
    site.fail(EUROPARL, "cut")
    site.fail(COMMONCRAWL, "500", "500")
    site.fail(NEWS_COMMENTARY, "drop")
    sums = checksums_file(archives, tmp_path / "SHA256SUMS")
    proc = nmt(*cli_args("wmt14-en-de", tmp_path / "raw", site, sums))
    assert site.requests_for(EUROPARL) == [None, f"bytes={len(archives[EUROPARL]['bytes']) // 2}-"]
    assert len(site.requests_for(COMMONCRAWL)) == 3 and len(site.requests_for(NEWS_COMMENTARY)) == 2
    assert "attempt 2" in proc.stderr

    out = tmp_path / "raw"
    manifest = check_contract(out, "en", "de", ("train", "valid", "test"))
    test_dir = shared_data / "wmt14-newstest2014/en-de"
    for lang in ("en", "de"):  # the full newstest2014 from SGML equals sacreBLEU's text
        assert (out / f"test.{lang}").read_bytes() == (test_dir / f"newstest2014.{lang}").read_bytes()
        published = shared_data / f"wmt13-newstest2013/en-de/newstest2013.{lang}"
        assert (out / f"valid.{lang}").read_bytes() == published.read_bytes()
    for path, archive in archives.items():
        name = Path(path).name
        if name in manifest["inputs"]:
            assert manifest["inputs"][name]["sha256"] == hashlib.sha256(archive["bytes"]).hexdigest()
    assert len(manifest["inputs"]) == 5  # no UN or Giga-fren archive for German
    corpora = manifest["cleaning"]["corpora"]
    assert list(corpora) == ["europarl-v7", "commoncrawl", "news-commentary-v9"]
    assert corpora["commoncrawl"]["invalid_utf8_pairs"] == 1  # the Latin-1 line, replaced and counted
    assert corpora["europarl-v7"]["pairs_in"] == len(archives[EUROPARL]["train"]["de"]["de"])
    assert sum(c["pairs_out"] for c in corpora.values()) == manifest["splits"]["train"]["lines"]
    for record in corpora.values():
        steps = record["steps"]
        assert [s["step"] for s in steps] == ["drop_empty", "max_words", "max_ratio"]
        assert steps[0]["before"] == record["pairs_in"] and steps[-1]["after"] == record["pairs_out"]
        assert all(a["after"] == b["before"] for a, b in zip(steps, steps[1:], strict=False))
        assert [s["before"] - s["after"] for s in steps][:2] == [2, 1]  # the planted empty and long pairs
    assert "valid and test are not normalised" in manifest["cleaning"]["valid_and_test"]
    assert "train" in proc.stdout and f"{manifest['splits']['train']['lines']:,}" in proc.stdout


def test_a_corrupted_archive_is_refused_and_kept_out_of_the_corpus(
        site: FakeStatmt, archives: dict, tmp_path: Path) -> None:
    sums = checksums_file(archives, tmp_path / "SHA256SUMS")
    out = tmp_path / "raw"
    site.fail(NEWS_COMMENTARY, "wrong")
    proc = nmt(*cli_args("wmt14-en-de", out, site, sums), check=False)
    expected = hashlib.sha256(archives[NEWS_COMMENTARY]["bytes"]).hexdigest()
    assert_user_error(proc, "training-parallel-nc-v9.tgz", f"expected {expected}", "got ", "run again")
    assert not (out / "manifest.json").exists() and not (out / "train.en").exists()
    assert not any("nc-v9" in p.name for p in (out / "downloads").iterdir())  # neither the file nor a .part
    nmt(*cli_args("wmt14-en-de", out, site, sums))  # the next run downloads only what is missing
    assert len(site.requests_for(EUROPARL)) == 1 and len(site.requests_for(NEWS_COMMENTARY)) == 2
    check_contract(out, "en", "de", ("train", "valid", "test"))


def test_built_in_sizes_refuse_a_mirror_with_other_files(site: FakeStatmt, tmp_path: Path) -> None:
    proc = nmt("prepare", "wmt14-en-de", "--out", tmp_path / "raw", "--mirror", site.url, check=False)
    assert_user_error(proc, "training-parallel-europarl-v7.tgz", "657632379", "--mirror")
    assert not (tmp_path / "raw/manifest.json").exists()


def test_from_folder_works_without_a_network_in_both_directions(
        archives: dict, shared_data: Path, tmp_path: Path) -> None:
    folder = tmp_path / "archives"  # what a user downloaded by hand; no server runs in this test
    folder.mkdir()
    for path, archive in archives.items():
        (folder / Path(path).name).write_bytes(archive["bytes"])
    sums = checksums_file(archives, tmp_path / "SHA256SUMS")
    forward, backward = tmp_path / "en-de", tmp_path / "de-en"
    prepare.run(config("wmt14-en-de", forward, from_dir=folder, checksums=sums))
    prepare.run(config("wmt14-en-de", backward, from_dir=folder, checksums=sums,
                       src_lang="de", tgt_lang="en"))
    check_contract(backward, "de", "en", ("train", "valid", "test"))
    for split in ("train", "valid", "test"):  # the same pairs, each side under its own language
        for lang in ("en", "de"):
            assert (forward / f"{split}.{lang}").read_bytes() == (backward / f"{split}.{lang}").read_bytes()
    published = shared_data / "wmt14-newstest2014/en-de/newstest2014.de"
    assert (backward / "test.de").read_bytes() == published.read_bytes()
    assert not list((backward / "downloads").glob("*.tgz"))  # taken from --from, not copied

    (folder / "training-parallel-nc-v9.tgz").unlink()
    (folder / "dev.tgz").unlink()
    with pytest.raises(NmtError, match=r"lacks 2 file\(s\): training-parallel-nc-v9.tgz "
                                       r"\(http://statmt.org/wmt14/training-parallel-nc-v9.tgz\); dev.tgz"):
        prepare.run(config("wmt14-en-de", tmp_path / "again", from_dir=folder, checksums=sums))


@pytest.mark.slow
def test_wmt14_en_fr_reads_the_un_and_giga_fren_archives(
        site: FakeStatmt, archives: dict, shared_data: Path, tmp_path: Path) -> None:
    sums = checksums_file(archives, tmp_path / "SHA256SUMS")
    out = tmp_path / "raw"
    prepare.run(config("wmt14-en-fr", out, mirror=site.url, checksums=sums, dedup=True))
    manifest = check_contract(out, "en", "fr", ("train", "valid", "test"))
    corpora = manifest["cleaning"]["corpora"]
    assert list(corpora) == ["europarl-v7", "commoncrawl", "un-undoc2000", "news-commentary-v9", "giga-fren"]
    giga = archives["/wmt10/training-giga-fren.tar"]["train"]["fr"]
    assert corpora["giga-fren"]["pairs_in"] == len(giga["fr"])  # read from the .gz inside the tar
    # Every corpus carries the same planted pair twice: only its first occurrence overall survives.
    dedup = [c["steps"][-1]["before"] - c["steps"][-1]["after"] for c in corpora.values()]
    assert dedup[0] >= 1 and all(d >= 2 for d in dedup[1:])
    assert read_lines(out / "train.en").count("Same pair .") == 1
    assert len(manifest["inputs"]) == 7
    for lang in ("en", "fr"):
        published = shared_data / f"wmt14-newstest2014/en-fr/newstest2014.{lang}"
        assert (out / f"test.{lang}").read_bytes() == published.read_bytes()


def test_wmt_language_pairs_are_checked(tmp_path: Path) -> None:
    with pytest.raises(NmtError, match="between en and de"):
        prepare.run(config("wmt14-en-de", tmp_path, src_lang="fr"))
    assert prepare.languages(config("wmt14-en-fr", tmp_path, tgt_lang="en")) == ("fr", "en")
    with pytest.raises(NmtError, match="--train, --valid and --test are for"):
        prepare.run(config("wmt14-en-de", tmp_path, train="x"))
    with pytest.raises(NmtError, match="not both"):
        prepare.run(config("wmt14-en-de", tmp_path, from_dir=tmp_path, mirror="http://127.0.0.1:1"))


# ---------------------------------------------------------------------------------------------
# SGML and normalisation against their references


def test_sgml_reading_equals_sacrebleus_plain_text(shared_data: Path) -> None:
    sgm = shared_data / "wmt14-newstest2014/sgm"
    for path in sorted(sgm.glob("*.sgm")):  # e.g. newstest2014-fren-ref.fr.sgm -> en-fr/newstest2014.fr
        lang = path.suffixes[-2].lstrip(".")
        pair = "en-de" if "-deen-" in path.name else "en-fr"
        segments = [text for text, _ in sgml_segments(path, "strict")]
        published = shared_data / f"wmt14-newstest2014/{pair}/newstest2014.{lang}"
        assert segments == read_lines(published), path.name


def test_segment_cleaning_decodes_entities_and_collapses_whitespace() -> None:
    assert clean_segment("  AT&amp;T&#160; and\u00a0 R&D &copy &#x41;  ") == "AT&T and R&D &copy A"


def test_fast_normalisation_equals_sacremoses(shared_data: Path) -> None:
    for path, lang in [(shared_data / "wmt-train-sample-10k/train.de", "de"),
                       (shared_data / "wmt14-newstest2014/en-fr/newstest2014.fr", "fr"),
                       (shared_data / "multi30k/en-de/train.en", "en")]:
        moses = MosesPunctNormalizer(lang=lang)
        lines = read_lines(path)[:3000] + ["„Zitat“ – (test) ,\"x\" 1\u00a0000 «\u00a0oui\u00a0» ``a''"]
        ours = [normalize_punctuation(line, lang) for line in lines]
        assert ours == [moses.normalize(line) for line in lines]


# ---------------------------------------------------------------------------------------------
# Cleaning counts on real text, computed independently


def reference_cleaning(en: list[str], de: list[str], max_words: int, max_ratio: float) -> tuple[dict, list]:
    """The cleaning rules written out plainly (sacremoses' own normalize, unicodedata categories)."""
    moses = {"en": MosesPunctNormalizer(lang="en"), "de": MosesPunctNormalizer(lang="de")}

    def printable(text: str) -> str:
        kept = "".join("" if unicodedata.category(c) == "Cf" else " " if unicodedata.category(c)[0] == "C"
                       else c for c in text)
        return " ".join(part for part in kept.split(" ") if part) if kept != text else text

    removed = {"drop_empty": 0, "max_words": 0, "max_ratio": 0, "dedup": 0}
    kept, seen = [], set()
    for a, b in zip(en, de, strict=True):
        a, b = printable(moses["en"].normalize(a)), printable(moses["de"].normalize(b))
        words = len(a.split()), len(b.split())
        if not a.strip() or not b.strip():
            removed["drop_empty"] += 1
        elif max(words) > max_words:
            removed["max_words"] += 1
        elif max(words) / min(words) > max_ratio:
            removed["max_ratio"] += 1
        elif (a, b) in seen:
            removed["dedup"] += 1
        else:
            seen.add((a, b))
            kept.append((a, b))
    return removed, kept


def test_cleaning_counts_match_an_independent_count(shared_data: Path, tmp_path: Path) -> None:
    sample = shared_data / "wmt-train-sample-10k/train"
    en, de = read_lines(Path(f"{sample}.en")), read_lines(Path(f"{sample}.de"))
    en[10:10], de[10:10] = ["", "Tab\tand\u00adsoft hyphen", " "], ["Leer .", "Tab\tund\u200bZero", "Hallo"]
    prefix = write_pair(tmp_path / "data/train", "".join(f"{x}\n" for x in en).encode(),
                        "".join(f"{x}\n" for x in de).encode())
    out = tmp_path / "raw"
    prepare.run(config("local", out, src_lang="en", tgt_lang="de", train=prefix, valid=str(sample),
                       dedup=True, max_words=40, max_ratio=1.5))
    manifest = check_contract(out, "en", "de", ("train", "valid"))
    [record] = manifest["cleaning"]["corpora"].values()
    removed, kept = reference_cleaning(en, de, 40, 1.5)
    assert {s["step"]: s["before"] - s["after"] for s in record["steps"]} == removed
    assert all(removed.values())  # every step removed something, so every count was tested
    assert list(zip(read_lines(out / "train.en"), read_lines(out / "train.de"), strict=True)) == kept
    assert (out / "valid.de").read_bytes() == Path(f"{sample}.de").read_bytes()  # valid is never cleaned
    assert ("Tab andsoft hyphen", "Tab undZero") in kept  # tab -> space, Cf deleted


def test_worker_processes_keep_the_order_and_the_counts(shared_data: Path, tmp_path: Path) -> None:
    sample = shared_data / "wmt-train-sample-10k/train"
    for lang in ("en", "de"):
        lines = read_lines(Path(f"{sample}.{lang}"))[:2500]
        (tmp_path / f"part.{lang}").write_text("".join(f"{x}\n" for x in lines))
    results = []
    for workers in (1, 2):  # 50 chunks of 50 pairs, several in flight at once
        written: list[tuple[str, str]] = []
        options = Options.of(PrepareConfig(dataset="local", out=tmp_path, dedup=True), "en", "de")
        with Cleaner(options, workers, chunk_pairs=50) as cleaner:
            record = cleaner.clean("part", tmp_path / "part.en", tmp_path / "part.de",
                                   lambda a, b, out=written: out.append((a, b)))
        results.append((written, record))
    assert results[0] == results[1]
    assert results[0][1]["pairs_in"] == 2500 and len(results[0][0]) == results[0][1]["pairs_out"]


@pytest.mark.slow
def test_local_multi30k_keeps_every_line(shared_data: Path, tmp_path: Path) -> None:
    d = shared_data / "multi30k/en-de"
    out = tmp_path / "raw"
    nmt("prepare", "local", "--out", out, "--src-lang", "en", "--tgt-lang", "de", "--train", d / "train",
        "--valid", d / "valid", "--test", d / "test_2016_flickr", "--workers", 1, "--set", "max_ratio=0")
    manifest = check_contract(out, "en", "de", ("train", "valid", "test"))
    assert [manifest["splits"][s]["lines"] for s in ("train", "valid", "test")] == [29000, 1014, 1000]
    for lang in ("en", "de"):  # valid and test stay byte for byte as given
        assert (out / f"test.{lang}").read_bytes() == (d / f"test_2016_flickr.{lang}").read_bytes()
    digest = hashlib.sha256((d / "train.de").read_bytes()).hexdigest()
    assert manifest["inputs"][str(d / "train.de")]["sha256"] == digest


# ---------------------------------------------------------------------------------------------
# A user's own files, good and bad


def write_pair(prefix: Path, en: bytes, de: bytes) -> str:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.en").write_bytes(en)
    Path(f"{prefix}.de").write_bytes(de)
    return str(prefix)


GOOD_EN = b"a house .\nthe cat sleeps .\none more line\n"
GOOD_DE = b"ein Haus .\ndie Katze schl\xc3\xa4ft .\nnoch eine Zeile\n"


@pytest.mark.parametrize("split, en, de, needles", [
    ("train", GOOD_EN, GOOD_DE + b"extra\n", ["train.en has 3 lines", "train.de has 4"]),
    ("train", GOOD_EN, None, ["train.de", "not found"]),
    ("train", b"", b"", ["train.en", "empty"]),
    ("train", GOOD_EN, b"ein Haus .\nKatze sch\xe4ft .\nnoch\n",
     ["train.de, line 2: invalid UTF-8", "iconv"]),
    ("valid", b"a\x00b\nc\n", b"x\ny\n", ["valid.en, line 1", "NUL byte"]),
])
def test_bad_local_input_is_a_clear_error_and_leaves_no_manifest(
        tmp_path: Path, split: str, en: bytes, de: bytes | None, needles: list[str]) -> None:
    data, out = tmp_path / "data", tmp_path / "raw"
    prefixes = {s: write_pair(data / s, GOOD_EN, GOOD_DE) for s in ("train", "valid")}
    prepare.run(config("local", out, src_lang="en", tgt_lang="de", **prefixes))  # a good earlier run
    assert (out / "manifest.json").exists()
    write_pair(data / split, en, de or b"")
    if de is None:
        Path(f"{data / split}.de").unlink()
    proc = nmt("prepare", "local", "--out", out, "--src-lang", "en", "--tgt-lang", "de",
               "--train", prefixes["train"], "--valid", prefixes["valid"], "--workers", 1, check=False)
    assert_user_error(proc, *needles)
    assert not (out / "manifest.json").exists()
    assert not list(out.glob(".*.tmp"))


def test_crlf_endings_and_stray_characters_keep_the_line_count(tmp_path: Path) -> None:
    data, out = tmp_path / "data", tmp_path / "raw"
    train = write_pair(data / "train", GOOD_EN.replace(b"\n", b"\r\n"), GOOD_DE.replace(b"\n", b"\r\n"))
    # a lone CR, a U+2028 and no final LF
    valid = write_pair(data / "valid", b"left\rright\nnext\xe2\x80\xa8line\n", b"eins\nzwei")
    proc = nmt("prepare", "local", "--out", out, "--src-lang", "en", "--tgt-lang", "de", "--train", train,
               "--valid", valid, "--workers", 1)
    assert proc.returncode == 0
    check_contract(out, "en", "de", ("train", "valid"))
    assert read_lines(out / "train.en") == ["a house .", "the cat sleeps .", "one more line"]
    assert read_lines(out / "valid.en") == ["left right", "next line"]
    assert read_lines(out / "valid.de") == ["eins", "zwei"]


def test_unequal_or_damaged_inputs_are_named_with_their_line_counts(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x\n" * 5)
    (tmp_path / "b").write_bytes(b"y\n" * 7)
    for chunk_pairs in (2, 5, 100):  # the shorter file ends inside, at the end of, or before a chunk
        with pytest.raises(NmtError, match=r"a has 5 lines but .*b has 7"):
            list(read_chunks(tmp_path / "a", tmp_path / "b", chunk_pairs))
    whole = gzip.compress(os.urandom(50_000).hex().encode().replace(b"a", b"\n"))
    (tmp_path / "c.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "d.gz").write_bytes(whole)
    with pytest.raises(NmtError, match="cannot read .*c.gz"):
        list(read_chunks(tmp_path / "c.gz", tmp_path / "d.gz"))


def test_local_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(NmtError, match="needs --src-lang and --tgt-lang"):
        prepare.run(config("local", tmp_path, train="x", valid="y"))
    with pytest.raises(NmtError, match="needs --train PREFIX and --valid PREFIX"):
        prepare.run(config("local", tmp_path, src_lang="en", tgt_lang="de", valid="y"))
    with pytest.raises(NmtError, match="must differ"):
        prepare.run(config("local", tmp_path, src_lang="en", tgt_lang="en", train="x", valid="y"))
    with pytest.raises(NmtError, match="only the wmt14 datasets download"):
        prepare.run(config("local", tmp_path, src_lang="en", tgt_lang="de", train="x", valid="y", mirror="http://m"))


def test_a_finished_preparation_is_not_redone_until_its_input_changes(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, out = tmp_path / "data", tmp_path / "raw"
    prefixes = {s: write_pair(data / s, GOOD_EN, GOOD_DE) for s in ("train", "valid")}
    cfg = config("local", out, src_lang="en", tgt_lang="de", **prefixes)
    prepare.run(cfg)
    created = json.loads((out / "manifest.json").read_text())["created"]
    (out / "manifest.json").touch()
    prepare.run(cfg)
    assert "nothing to do" in capsys.readouterr().err
    assert json.loads((out / "manifest.json").read_text())["created"] == created
    write_pair(data / "train", GOOD_EN + b"new\n", GOOD_DE + b"neu\n")
    prepare.run(cfg)
    assert read_manifest(out, "prepare", "nmt prepare")["splits"]["train"]["lines"] == 4


def test_toy_dataset_in_both_directions(tmp_path: Path) -> None:
    toy = pytest.importorskip("nmt_cli.data.toy")
    prepare.run(config("toy", tmp_path / "a", toy_train=50, toy_valid=5, toy_test=0))
    manifest = check_contract(tmp_path / "a", toy.SRC_LANG, toy.TGT_LANG, ("train", "valid"))
    assert manifest["splits"]["train"]["lines"] == 50
    expected = list(toy.pairs("train", 50, 1))
    written = zip(read_lines(tmp_path / f"a/train.{toy.SRC_LANG}"),
                  read_lines(tmp_path / f"a/train.{toy.TGT_LANG}"), strict=True)
    assert list(written) == expected
    prepare.run(config("toy", tmp_path / "b", toy_train=50, toy_valid=5, toy_test=5,
                       src_lang=toy.TGT_LANG, tgt_lang=toy.SRC_LANG))
    check_contract(tmp_path / "b", toy.TGT_LANG, toy.SRC_LANG, ("train", "valid", "test"))
    toylang = f"train.{toy.TGT_LANG}"
    assert (tmp_path / "b" / toylang).read_bytes() == (tmp_path / "a" / toylang).read_bytes()
