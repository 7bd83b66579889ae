"""Reading the Penn Treebank, its normal form and the linearised tree (`data/treebank.py`), checked on
hand-built trees and on every tree of the real sample."""

from __future__ import annotations

from pathlib import Path

import pytest

from nmt_cli.data import treebank
from nmt_cli.errors import NmtError
from nmt_cli.evaluation import evalb
from nmt_cli.inference.trees import rebuild

# The real format: several lines per tree, an unlabelled outer bracket, function tags, co-indexes,
# empty elements (one leaving its NP empty), -LRB-/-RRB-, PRP$.
MRG = """
( (S
    (NP-SBJ-1 (PRP$ Its) (NN chief) )
    (VP (VBD said)
      (SBAR (-NONE- 0)
        (S
          (NP-SBJ (-NONE- *-1) )
          (VP (TO to)
            (VP (VB go)
              (PP-LOC=2 (IN in) (NP (NNP May) ))
              (PRN (-LRB- -LRB-) (NP (CD 1990) ) (-RRB- -RRB-) ))))))
    (. .) ))
( (NP (NN Second) ))
"""


def trees() -> list[treebank.Tree]:
    return list(treebank.read_trees(MRG, "x.mrg"))


def test_reads_multi_line_trees_with_the_unlabelled_root() -> None:
    first, second = trees()
    assert first.label == "" and [c.label for c in first.children] == ["S"]
    assert first.words() == ["Its", "chief", "said", "0", "*-1", "to", "go", "in", "May", "-LRB-", "1990",
                             "-RRB-", "."]
    assert second.words() == ["Second"]


def test_normal_form_cuts_tags_and_indexes_and_removes_empty_elements() -> None:
    normal = treebank.normalise(trees()[0])
    assert treebank.to_string(normal) == (
        "(TOP (S (NP (PRP$ Its) (NN chief)) (VP (VBD said) (SBAR (S (VP (TO to) (VP (VB go) (PP (IN in) "
        "(NP (NNP May))) (PRN (-LRB- -LRB-) (NP (CD 1990)) (-RRB- -RRB-))))))) (. .)))")


def test_linearised_tree_normalised_or_with_tags() -> None:
    normal = treebank.normalise(trees()[1])
    assert treebank.linearise(normal, "normalise") == "(NP XX )NP"
    first = treebank.normalise(trees()[0])
    assert treebank.linearise(first, "keep").startswith("(S (NP PRP$ NN )NP (VP VBD (SBAR (S (VP TO")
    assert treebank.linearise(first, "normalise").endswith("-RRB- )PRN )VP )VP )S )SBAR )VP . )S".replace(
        "-RRB-", "XX"))


def test_a_tree_of_empty_elements_only_has_no_normal_form() -> None:
    (tree,) = treebank.read_trees("( (S (NP-SBJ (-NONE- *)) (VP (-NONE- *?*))) )", "x")
    assert treebank.normalise(tree) is None


@pytest.mark.parametrize("text, problem", [
    ("( (S (NP (DT the) (NN cat))", "x.mrg:1: the file ends inside a tree"),
    ("( (S (NP the cat)) )", "x.mrg:1: the word 'cat' is not alone"),
    ("\n\n( (S (NP (DT the) dog)) )", "x.mrg:3: the word 'dog' is not alone"),
    ("( (S (DT the (NN cat))) )", "x.mrg:1: (DT the ...) holds a word and a bracket"),
    ("word ( (S (NN x)) )", "x.mrg:1: 'word' outside any tree"),
    ("( (S (NP ) (NN x)) )", "x.mrg:1: the bracket (NP ...) holds nothing"),
])
def test_a_damaged_file_is_an_error_naming_file_and_line(text: str, problem: str) -> None:
    with pytest.raises(NmtError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        list(treebank.read_trees(text, "x.mrg"))


def test_every_tree_of_the_sample_survives_linearising_and_rebuilding(ptb_sample: Path) -> None:
    """Linearise, rebuild over the words: the tree the scorer sees is the treebank's (function tags,
    indexes and empty elements removed), with no repair; the words are the treebank's. The one
    exception is a tree where the treebank tags a word as punctuation EVALB deletes ((, Wa)): the
    rebuilt tree tags it XX (a repair), as it would any parser's (`trees._tag_of`)."""
    count, mistagged = 0, []
    for path in sorted(ptb_sample.glob("wsj_*.mrg")):
        for tree in treebank.read_mrg(path):
            normal = treebank.normalise(tree)
            assert normal is not None
            words = [leaf.word for leaf in tree.preterminals() if leaf.label != "-NONE-"]
            assert normal.words() == words
            reference = evalb.read_sentence(treebank.to_string(treebank.with_root(tree)))
            odd = [leaf.word for leaf in normal.preterminals()
                   if leaf.label in treebank.PUNCTUATION_TAGS and leaf.word.isalnum()]
            mistagged += odd
            for pos_tags in ("normalise", "keep"):
                rebuilt, repairs = rebuild(treebank.linearise(normal, pos_tags), words)
                seen = evalb.read_sentence(treebank.to_string(rebuilt))
                if odd:
                    assert repairs == ["punctuation tag"] and len(seen.words) == len(reference.words) + 1
                    continue
                assert repairs == []
                assert (seen.words, sorted(seen.brackets)) == (reference.words, sorted(reference.brackets))
                if pos_tags == "keep":
                    assert seen.tags == reference.tags
            count += 1
    assert count == 1921 and mistagged == ["Wa"]  # the sample's README; wsj_0037
