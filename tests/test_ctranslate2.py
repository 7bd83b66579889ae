"""`nmt export ctranslate2` and `nmt translate DIR`: the exported imported fairseq model translates
Multi30k's test set as `nmt translate` does (greedy, float32, on 2 threads: the same text on >= 99% of
the lines; int8 beam 4: within 1 BLEU); a clear message without the package; settings CTranslate2 cannot
represent refused. (`nmt translate DIR` against hostile input: tests/test_hostile.py.)"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import sacrebleu

from conftest import assert_user_error, nmt, save_model_file
from nmt_cli.config.convert import Ctranslate2ExportConfig
from nmt_cli.errors import NmtError
from nmt_cli.inference import ct2
from nmt_cli.model import file as model_file
from nmt_cli.model.transformer import Transformer

pytest.importorskip("ctranslate2", reason="the optional ctranslate2 package is not installed")


@pytest.fixture(scope="module")
def multi30k_test(shared_data: Path) -> tuple[Path, list[str]]:
    folder = shared_data / "multi30k" / "en-de"
    return folder / "test_2016_flickr.en", (folder / "test_2016_flickr.de").read_text().splitlines()


def _translate(model: Path, source: Path, out: Path, *options: object, threads: int = 1) -> list[str]:
    nmt("translate", model, "-i", source, "-o", out, "--device", "cpu", "--set", f"threads={threads}",
        *options)
    return out.read_text(encoding="utf-8").splitlines()


@pytest.mark.slow
def test_exported_model_translates_as_nmt(imported: dict[str, Path], multi30k_test, tmp_path: Path) -> None:
    source, refs = multi30k_test
    model = imported["transformer"]
    nmt("export", "ctranslate2", model, "--out", tmp_path / "f32")
    nmt("export", "ctranslate2", model, "--out", tmp_path / "int8", "--quantization", "int8")
    ours = _translate(model, source, tmp_path / "nmt.txt", "--beam", 1, "--dtype", "fp32")  # as exported
    # on 2 threads CTranslate2 searches several batches at once: the lines must still come back in order
    exported = _translate(tmp_path / "f32", source, tmp_path / "f32.txt", "--beam", 1, threads=2)
    same = sum(a == b for a, b in zip(ours, exported, strict=True)) / len(ours)
    assert len(ours) == 1000 and same >= 0.99, f"greedy: the same on {same:.1%} of the lines"
    # CTranslate2's beam search is fairseq's, which these two options select (99.9% identical when
    # written; 98.9% with nmt's default stopping rule)
    beam = ("--beam", 4, "--length-penalty", "fairseq", "--stop", "beam")
    runs = (("nmt", model, ("--dtype", "fp32")), ("f32", tmp_path / "f32", ()),
            ("int8", tmp_path / "int8", ()))
    found = {name: _translate(m, source, tmp_path / f"{name}.beam", *beam, *dtype) for name, m, dtype in runs}
    same = sum(a == b for a, b in zip(found["nmt"], found["f32"], strict=True)) / len(ours)
    assert same >= 0.995, f"beam 4: the same on {same:.1%} of the lines"
    bleu = [sacrebleu.corpus_bleu(found[name], [refs]).score for name in ("nmt", "int8")]
    assert abs(bleu[0] - bleu[1]) <= 1.0, bleu


def test_the_folder_is_self_contained(imported: dict[str, Path], tmp_path: Path) -> None:
    """Everything `nmt translate DIR` reads is inside DIR: moved elsewhere, it translates the same.
    (Written under a folder that does not exist yet, which the export makes.)"""
    model = imported["prenorm"]  # separate source and target vocabularies
    ct2.run(Ctranslate2ExportConfig(model=model, out=tmp_path / "a" / "exported"))
    (tmp_path / "a" / "exported").rename(tmp_path / "moved")
    assert [p.name for p in (tmp_path / "a").iterdir()] == []  # no temporary folder left
    (tmp_path / "in.txt").write_text("A dog runs.\n\nTwo men are talking.\n", encoding="utf-8")
    assert (_translate(tmp_path / "moved", tmp_path / "in.txt", tmp_path / "out.txt", "--beam", 1)
            == _translate(model, tmp_path / "in.txt", tmp_path / "ref.txt", "--beam", 1, "--dtype", "fp32"))


def test_a_missing_package_is_named(imported: dict[str, Path], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` fails as if absent
    with pytest.raises(NmtError, match=r"pip install 'nmt-cli\[ctranslate2\]'"):
        ct2.run(Ctranslate2ExportConfig(model=imported["transformer"], out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_what_ctranslate2_cannot_represent_is_refused(imported: dict[str, Path], tmp_path: Path) -> None:
    model, dictionary, spm_bytes = model_file.load_model(imported["transformer"])
    cfg = dataclasses.replace(model.cfg, d_k=8, d_v=24)
    path = save_model_file(tmp_path / "dk.pt", Transformer(cfg, len(dictionary)), dictionary, spm_bytes)
    proc = nmt("export", "ctranslate2", path, "--out", tmp_path / "out", check=False)
    assert_user_error(proc, str(path), "d_k")
