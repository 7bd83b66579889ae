"""`nmt score`: sacreBLEU and chrF as sacreBLEU's own command computes them, and the paper's
tokenized, compound-split BLEU checked by hand."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_user_error, nmt
from nmt_cli.config.evaluation import ScoreConfig
from nmt_cli.errors import NmtError
from nmt_cli.evaluation.score import compute_scores, paper_tokenize, run, split_compounds, tokenized_bleu


def perturb(lines: list[str], seed: int) -> list[str]:
    """Drop, swap and misspell words in some lines, as a system's mistakes would."""
    rng = random.Random(seed)
    out = []
    for line in lines:
        words = line.split()
        if words and rng.random() < 0.5:
            words.pop(rng.randrange(len(words)))
        if len(words) > 2 and rng.random() < 0.3:
            i = rng.randrange(len(words) - 1)
            words[i], words[i + 1] = words[i + 1], words[i]
        if words and rng.random() < 0.3:
            i = rng.randrange(len(words))
            words[i] = words[i][::-1]
        out.append(" ".join(words))
    return out


def test_scores_equal_sacrebleu_command_line(shared_data: Path, tmp_path: Path) -> None:
    ref = shared_data / "wmt14-newstest2014" / "en-de" / "newstest2014.de"
    refs = ref.read_text(encoding="utf-8").splitlines()[:500]
    ref_file, hyp_file = tmp_path / "ref.de", tmp_path / "hyp.de"
    ref_file.write_text("\n".join(refs) + "\n", encoding="utf-8")
    hyp_file.write_text("\n".join(perturb(refs, seed=1)) + "\n", encoding="utf-8")
    official = subprocess.run([sys.executable, "-m", "sacrebleu", str(ref_file), "-i", str(hyp_file),
                               "-m", "bleu", "chrf", "-w", "4"], capture_output=True, text=True, check=True)
    bleu, chrf = json.loads(official.stdout)
    out_json = tmp_path / "scores.json"
    printed = nmt("score", "--hyp", hyp_file, "--ref", ref_file, "--langpair", "en-de",
                  "--json", out_json).stdout
    ours = json.loads(out_json.read_text(encoding="utf-8"))
    assert ours["sacrebleu"]["score"] == pytest.approx(bleu["score"], abs=1e-4)
    assert ours["sacrebleu"]["signature"] == bleu["signature"]
    assert ours["chrf"]["score"] == pytest.approx(chrf["score"], abs=1e-4)
    assert ours["chrf"]["signature"] == chrf["signature"]
    assert 20 < ours["sacrebleu"]["score"] < 90 and ours["segments"] == 500
    assert "28.4" in printed and bleu["signature"] in printed and chrf["signature"] in printed
    assert f"{ours['tokenized_bleu']['score']:6.2f}" in printed


def test_reference_against_itself_scores_100(shared_data: Path) -> None:
    newstest = shared_data / "wmt14-newstest2014" / "en-de" / "newstest2014.de"
    refs = newstest.read_text(encoding="utf-8").splitlines()[:300]
    scores = compute_scores(refs, refs, "de", "13a")
    for name in ("sacrebleu", "chrf", "tokenized_bleu"):
        assert scores[name]["score"] == pytest.approx(100.0), name


def test_compound_splitting_is_the_perl_substitution() -> None:
    assert split_compounds("rich-text format") == "rich ##AT##-##AT## text format"
    assert split_compounds("E-Mail-Verkehr") == "E ##AT##-##AT## Mail ##AT##-##AT## Verkehr"
    # Perl's s{(\S)-(\S)}{...}g does not overlap its matches: a one-letter part keeps its second hyphen.
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"
    assert split_compounds("Mitte - Ende -5") == "Mitte - Ende -5"


def test_tokenized_bleu_on_a_hand_example() -> None:
    """Ref "Das E-Mail-Konto ist neu ." and hyp "Das E-Mail-Passwort ist neu .": compounds split, 9 tokens
    each; matching 1- to 4-grams 8/9, 6/8, 4/7, 2/6; same length, so no brevity penalty. Unsplit,
    no 4-gram would match and BLEU would be 0."""
    hyp, ref = ["Das E-Mail-Passwort ist neu."], ["Das E-Mail-Konto ist neu."]
    assert paper_tokenize(ref, "de") == ["Das E ##AT##-##AT## Mail ##AT##-##AT## Konto ist neu ."]
    expected = 100 * math.exp((math.log(8 / 9) + math.log(6 / 8) + math.log(4 / 7) + math.log(2 / 6)) / 4)
    assert tokenized_bleu(hyp, ref, "de").score == pytest.approx(expected, abs=1e-6)


def test_line_count_mismatch_and_missing_reference(tmp_path: Path) -> None:
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("a\nb\nc\n", encoding="utf-8")
    ref.write_text("a\nb\n", encoding="utf-8")
    assert_user_error(nmt("score", "--hyp", hyp, "--ref", ref, check=False), str(hyp), str(ref), "3", "2")
    with pytest.raises(NmtError, match="--ref"):
        run(ScoreConfig(hyp=hyp))


def test_offline_test_set_download_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no sacreBLEU cache and no network, --test-set names the fix (--ref) instead of hanging
    or crashing."""
    import sacrebleu.dataset.base
    import sacrebleu.utils

    for module in (sacrebleu.utils, sacrebleu.dataset.base):  # an empty cache (read at import time)
        monkeypatch.setattr(module, "SACREBLEU_DIR", str(tmp_path / "sacrebleu-cache"))
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")  # a closed port: every download fails at once
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    hyp = tmp_path / "hyp.txt"
    hyp.write_text("a\n", encoding="utf-8")
    with pytest.raises(NmtError, match="--ref"):
        run(ScoreConfig(hyp=hyp, test_set="wmt14/full", langpair="en-de"))
