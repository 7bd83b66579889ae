"""Constituency parsing end to end (arXiv 1706.03762, section 6.3): `nmt prepare ptb` on the real
sample and on bad input, the recipe's smoke run, and a small CPU model trained on the sample that
parses better than a right-branching baseline scored by the same scorer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_user_error, nmt
from nmt_cli.data import treebank
from nmt_cli.evaluation import evalb

SPLIT = "train=1-79,valid=80-84,test=85-99"


def test_prepare_ptb_writes_words_linearised_trees_and_references(ptb_sample: Path, tmp_path: Path) -> None:
    out = tmp_path / "raw"
    nmt("prepare", "ptb", "--treebank", ptb_sample, "--out", out, "--split-files", SPLIT)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["src_lang"], manifest["tgt_lang"]) == ("en", "parse")
    assert sum(manifest["splits"][s]["trees"] for s in ("train", "valid", "test")) == 1921
    for split in ("train", "valid", "test"):
        words = (out / f"{split}.en").read_text().splitlines()
        linear = (out / f"{split}.parse").read_text().splitlines()
        references = (out / f"{split}.trees").read_text().splitlines()
        assert len(words) == len(linear) == len(references) == manifest["splits"][split]["lines"]
        for sentence, reference in zip(words, references, strict=True):
            seen = evalb.read_sentence(reference)  # a tree EVALB reads, over the same words
            kept = [w for w in sentence.split() if w not in seen.words]
            assert set(kept) <= {",", ".", ":", "``", "''", "--", ";", "?", "!", "...", "'", "`", "-", "Wa"}
    first = (out / "train.parse").read_text().splitlines()[0]
    assert first.startswith("(S (NP (NP XX XX )NP , (ADJP (NP XX XX )NP XX )ADJP , )NP (VP XX")


@pytest.mark.parametrize("args, needles", [
    ([], ["no file of the train split (0200-2199) (the standard split by section", "numbered 0001-0099"]),
    (["--split-files", "train=1-50,valid=40-60"], ["file 40 is both in train (1-50) and in valid"]),
    (["--split-files", "train=1-50"], ["names no valid files"]),
    (["--split-files", "train=1-50,dev=51-60"], ["'dev=51-60' is not SPLIT=FIRST-LAST"]),
])
def test_prepare_ptb_explains_a_split_it_cannot_make(ptb_sample: Path, tmp_path: Path, args: list[str],
                                                      needles: list[str]) -> None:
    proc = nmt("prepare", "ptb", "--treebank", ptb_sample, "--out", tmp_path / "raw", *args, check=False)
    assert_user_error(proc, *needles)


def test_prepare_ptb_names_the_file_and_line_of_a_damaged_tree(tmp_path: Path) -> None:
    folder = tmp_path / "treebank" / "00"
    folder.mkdir(parents=True)
    (folder / "wsj_0001.mrg").write_text("( (S (NP (DT The) (NN cat)) (VP (VBD sat))) )\n")
    (folder / "wsj_0002.mrg").write_text("( (S (NP (DT The) (NN cat))\n   (VP (VBD sat) dog)) )\n")
    proc = nmt("prepare", "ptb", "--treebank", tmp_path / "treebank", "--out", tmp_path / "raw",
               "--split-files", "train=1,valid=2", check=False)
    assert_user_error(proc, f"{folder / 'wsj_0002.mrg'}:2: the word 'dog' is not alone")
    assert_user_error(nmt("prepare", "ptb", "--out", tmp_path / "raw", check=False), "needs --treebank DIR")
    assert_user_error(nmt("prepare", "ptb", "--treebank", tmp_path / "none", "--out", tmp_path / "raw",
                          check=False), "is not a folder")


ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
       "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_recipe_smoke_runs_every_stage_on_a_tiny_treebank(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "recipes/wsj_parsing/run.sh", "--smoke", "--work", str(tmp_path / "w")],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"run.sh --smoke failed:\n{proc.stdout}\n{proc.stderr}"
    for number in range(1, 8):
        assert f"== stage {number}: " in proc.stdout
    assert re.search(r"translate: 4 trees, \d+ repaired", proc.stderr)
    trees = (tmp_path / "w" / "parse" / "test.trees").read_text().splitlines()
    assert len(trees) == 4 and all(evalb.read_sentence(t).words for t in trees)
    assert json.loads((tmp_path / "w" / "parse" / "test.scores.json").read_text())["task"] == "parse"


# The end-to-end run on the sample: training keeps sentences of at most 40 words (1,285 trees of files
# 1-79) and the model is scored on the test sentences of at most 15 words (a CPU-minutes model learns
# short trees best); pre-norm blocks, dropout 0.2 and a peak learning rate of 3e-3, 600 updates. The
# search is held to well-formed trees (`nmt translate --constrain`, the default), so no output needs
# repair. It beats right-branching trees of every labelling tried (see the parsing issue's note).
E2E_TRAIN_WORDS, E2E_TEST_WORDS, E2E_UPDATES = 40, 15, 600
E2E_TRAIN = ["--arch", "transformer_tiny", "--precision", "fp32", "--device", "cpu", "--set", "threads=2",
             "--set", "model.norm=pre", "--set", "model.dropout=0.2",
             "--set", "optim.label_smoothing=0", "--set", "optim.warmup_updates=200",
             "--set", "optim.lr_scale=0.5", "--tokens-per-update", 2000, "--max-tokens", 2000,
             "--max-update", E2E_UPDATES, "--save-interval-minutes", 0,
             "--save-interval-updates", E2E_UPDATES, "--set", "valid.interval_updates=0",
             "--set", "log.interval=100"]
PARSING = ["--output-format", "tree", "--beam", 21, "--lenpen", 0.3, "--set", "max_len_a=1",
           "--set", "max_len_b=300"]


def right_branching(reference: str, label: str) -> str:
    """The reference's words and tags as a right-branching binary tree: every constituent `label`,
    the root S (the tags only decide which punctuation EVALB deletes, as in the reference)."""
    leaves = list(treebank.normalise(next(treebank.read_trees(reference, "reference"))).preterminals())
    tree = leaves[-1]
    for leaf in reversed(leaves[:-1]):
        tree = treebank.Tree(label, [leaf, tree])
    if not tree.is_preterminal:
        tree.label = "S"
    return treebank.to_string(treebank.Tree(treebank.ROOT, [tree]))


def f1_of(hyp: Path, ref: Path) -> dict:
    nmt("score", "--task", "parse", "--hyp", hyp, "--ref", ref)
    return json.loads(hyp.with_name(hyp.name + ".scores.json").read_text())["all"]


@pytest.mark.slow
def test_a_small_cpu_model_parses_better_than_right_branching(ptb_sample: Path, tmp_path: Path) -> None:
    raw, bpe, data, save = (tmp_path / name for name in ("raw", "bpe", "bin", "save"))
    nmt("prepare", "ptb", "--treebank", ptb_sample, "--out", raw, "--split-files", SPLIT,
        "--set", f"max_words={E2E_TRAIN_WORDS}")
    nmt("bpe", raw, "--out", bpe, "--vocab-size", 2000, "--workers", 1)
    symbols = json.loads((raw / "manifest.json").read_text())["parsing"]["target_symbols"]
    assert {"(NP", ")NP", "XX", ","} <= set(symbols)
    assert [len(line.split()) for line in (bpe / "train.parse").read_text().splitlines()] == [
        len(line.split()) for line in (raw / "train.parse").read_text().splitlines()]  # a piece per symbol
    nmt("binarize", bpe, "--out", data, "--workers", 1)
    nmt("train", data, "--save-dir", save, *E2E_TRAIN)
    pairs = [(words, tree) for words, tree in zip((raw / "test.en").read_text().splitlines(),
                                                   (raw / "test.trees").read_text().splitlines(), strict=True)
             if len(words.split()) <= E2E_TEST_WORDS]
    source, reference, hyp = tmp_path / "short.en", tmp_path / "short.trees", tmp_path / "short.hyp"
    source.write_text("".join(f"{words}\n" for words, _ in pairs))
    reference.write_text("".join(f"{tree}\n" for _, tree in pairs))
    proc = nmt("translate", save / "checkpoint_last.pt", "--input", source, "--output", hyp, *PARSING)
    repaired = re.search(r"translate: (\d+) trees, (\d+) repaired", proc.stderr)
    assert repaired is not None and int(repaired[1]) == len(pairs)
    trees = hyp.read_text().splitlines()
    assert len(trees) == len(pairs)  # one tree per sentence, in order, over the sentence's words
    assert [evalb.read_sentence(tree).words for tree in trees] == [
        evalb.read_sentence(gold).words for _, gold in pairs]
    model = f1_of(hyp, reference)
    baselines = {}
    for label in ("S", "NP", "VP", "PP"):
        path = tmp_path / f"right-branching-{label}.trees"
        path.write_text("".join(f"{right_branching(gold, label)}\n" for _, gold in pairs))
        baselines[label] = f1_of(path, reference)["f1"]
    print(f"\nparsing end to end: {len(pairs)} test sentences, model F1 {model['f1']:.2f} "
          f"({model['error_sentences']} errors), right-branching F1 {baselines}, "
          f"{repaired[2]} of {repaired[1]} outputs repaired")
    assert model["error_sentences"] == 0 and model["valid_sentences"] == len(pairs)
    assert int(repaired[2]) == 0  # the search wrote well-formed trees only
    assert model["f1"] > max(baselines.values())
