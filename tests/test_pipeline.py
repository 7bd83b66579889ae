"""The whole pipeline on real text, as a user runs it: Multi30k en-de through prepare, bpe, binarize,
train (a few minutes on the CPU), average, translate and score on test_2016_flickr.

The model is trained once per test session (`conftest.multi30k_run`, which other tests reuse); the
bounds below were measured on this setup and are set with a wide margin (see each test), so they catch
a pipeline that stopped learning, not noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

def _records(save: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (save / "train.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_validation_perplexity_falls(multi30k_run: dict[str, Path]) -> None:
    """Measured on 2 CPU cores: valid perplexity 161.4 at update 100, 15.8 at update 400 (fp32); valid
    BLEU (first 200 sentences) 3.2 -> 23.7. Bound: below 24, and a third of the first."""
    valid = _records(multi30k_run["save"], "valid")
    assert [r["update"] for r in valid] == list(range(100, 401, 100))
    assert valid[-1]["ppl"] < 24.0 and valid[-1]["ppl"] < valid[0]["ppl"] / 3
    assert valid[-1]["bleu"] > valid[0]["bleu"]


def test_test_set_bleu(multi30k_run: dict[str, Path]) -> None:
    """Measured on 2 CPU cores: sacreBLEU 23.5 on test_2016_flickr after averaging the last 3 checkpoints
    of 400 updates (BP 0.855; 29.8 after 700). Bound: above 15."""
    scores = json.loads(multi30k_run["scores"].read_text())
    assert scores["sacrebleu"]["score"] > 15.0
    assert scores["sacrebleu"]["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    hyp = multi30k_run["hyp"].read_text(encoding="utf-8").split("\n")
    assert len(hyp) - 1 == 1000 and all(hyp[:-1])  # one non-empty line per test sentence


def test_averaged_model_is_the_mean_of_the_last_checkpoints(multi30k_run: dict[str, Path]) -> None:
    import torch

    from nmt_cli.model import file as model_file

    averaged = model_file.load(multi30k_run["model"])
    assert [a["update"] for a in averaged["meta"]["averaged"]] == [200, 300, 400]
    states = [model_file.load(multi30k_run["save"] / f"checkpoint_{u}.pt")["model"] for u in (200, 300, 400)]
    for name, value in averaged["model"].items():
        mean = sum(s[name].double() for s in states) / 3
        torch.testing.assert_close(value.double(), mean.to(value.dtype).double(), rtol=0, atol=1e-6)


def test_the_model_file_carries_the_normalisation_of_prepare(multi30k_run: dict[str, Path]) -> None:
    """prepare's defaults (Moses punctuation normalisation for en, non-printing removal) reach the
    averaged model file through bpe, binarize, train and average, for `nmt translate` to apply."""
    from nmt_cli.model import file as model_file

    assert model_file.load(multi30k_run["model"])["source_normalization"] == {
        "normalize_punctuation": True, "lang": "en", "remove_non_printing": True}
