"""Ensembles (`nmt translate A.pt B.pt`): the members' log-probabilities averaged at every step. A
model with itself translates as the model; two different models give hypotheses whose log-probability
is the mean of the members' log-probabilities of them; members of different dictionaries are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from conftest import nmt, save_model_file, toy_sentences
from nmt_cli.config.inference import TranslateConfig
from nmt_cli.data.dataset import BOS, EOS, Dictionary
from nmt_cli.errors import NmtError
from nmt_cli.inference.ensemble import Ensemble
from nmt_cli.inference.search import translate_ids
from nmt_cli.inference.translate import run
from nmt_cli.model import file as model_file


@pytest.fixture(scope="module")
def second_model(tiny_trained_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model of the same dictionary: the trained one with every weight moved a little."""
    model, dictionary, spm_bytes = model_file.load_model(tiny_trained_model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return save_model_file(tmp_path_factory.mktemp("second") / "b.pt", model, dictionary, spm_bytes, 301)


def _sources(path: Path) -> list[list[int]]:
    _, dictionary, spm_bytes = model_file.load_model(path)
    sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
    return [dictionary.encode(sp.encode(s, out_type=str)) + [EOS] for s in toy_sentences(12, seed=9)]


def test_an_ensemble_of_a_model_with_itself_is_the_model(tiny_trained_model: Path) -> None:
    model, _, _ = model_file.load_model(tiny_trained_model)
    cfg = TranslateConfig(model=None, beam=4, nbest=3)
    sources = _sources(tiny_trained_model)
    alone = translate_ids(model, sources, cfg)
    both = translate_ids(Ensemble([model, model]), sources, cfg)
    for a, b in zip(alone, both, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def _log_prob(model, source: list[int], tokens: list[int]) -> float:
    """log P(tokens + EOS | source) under `model`, teacher-forced (PAD and BOS not renormalised away,
    as the search does)."""
    with torch.no_grad():
        logits = model(torch.tensor([source]), torch.tensor([[BOS, *tokens]]))[0]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
    return float(log_probs.gather(1, torch.tensor([*tokens, EOS])[:, None]).sum())


def test_ensemble_scores_are_the_mean_of_the_members(tiny_trained_model: Path, second_model: Path) -> None:
    a, _, _ = model_file.load_model(tiny_trained_model)
    b, _, _ = model_file.load_model(second_model)
    sources = _sources(tiny_trained_model)
    found = translate_ids(Ensemble([a, b]), sources, TranslateConfig(model=None, beam=4, nbest=4))
    alone_a = translate_ids(a, sources, TranslateConfig(model=None, beam=4, nbest=1))
    assert any(f[0].tokens != x[0].tokens for f, x in zip(found, alone_a, strict=True)), \
        "the second member changes nothing: the test would not see it"
    for source, hypotheses in zip(sources, found, strict=True):
        assert len(hypotheses) == 4
        for h in hypotheses:
            mean = (_log_prob(a, source, h.tokens) + _log_prob(b, source, h.tokens)) / 2
            assert h.log_prob == pytest.approx(mean, abs=1e-4)


def test_the_command_line_translates_with_an_ensemble(tiny_trained_model: Path, second_model: Path,
                                                     tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("red cat sees the dog\n\nlarge house\n", encoding="utf-8")
    out = nmt("translate", tiny_trained_model, second_model, "-i", tmp_path / "in.txt", "--nbest", 2,
              "--device", "cpu").stdout.splitlines()
    assert [line.split("\t")[0] for line in out] == ["1", "1", "2", "2", "3", "3"]  # K lines each


def test_members_of_different_dictionaries_are_refused(tiny_trained_model: Path, tmp_path: Path) -> None:
    model, dictionary, spm_bytes = model_file.load_model(tiny_trained_model)
    other = Dictionary([*dictionary.symbols[:-1], "<another>"], dictionary.counts)
    path = save_model_file(tmp_path / "other.pt", model, other, spm_bytes)
    (tmp_path / "in.txt").write_text("red cat\n", encoding="utf-8")
    with pytest.raises(NmtError, match="must share a dictionary") as error:
        run(TranslateConfig(model=(tiny_trained_model, path), input=tmp_path / "in.txt"))
    assert str(path) in str(error.value) and str(tiny_trained_model) in str(error.value)
