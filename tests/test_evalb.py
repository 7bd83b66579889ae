"""The parsing scorer on hand-built cases whose EVALB (COLLINS.prm) results follow from its definition,
and `nmt score --task parse` on files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_user_error, nmt
from nmt_cli.evaluation import evalb

# the cat sat on the mat .  Brackets: S(0,6) NP(0,2) VP(2,6) PP(3,6) NP(4,6); '.' is deleted.
GOLD = ("(TOP (S (NP-SBJ (DT the) (NN cat)) (VP (VBD sat) (PP-LOC (IN on) (NP (DT the) (NN mat)))) "
        "(. .)))")


def scores(gold: list[str], test: list[str], cutoff: int = 40) -> tuple[dict, dict, list]:
    every, short, problems = evalb.evaluate(gold, test, cutoff)
    return every.report(), short.report(), problems


def test_identical_trees_score_100() -> None:
    every, short, problems = scores([GOLD], [GOLD])
    assert (every["f1"], every["recall"], every["precision"], every["complete_match"]) == (100, 100, 100, 100)
    assert every["gold_brackets"] == 5 and short == every and problems == []


def test_a_missing_bracket_costs_recall_only() -> None:
    test = "(TOP (S (NP (DT the) (NN cat)) (VP (VBD sat) (IN on) (NP (DT the) (NN mat))) (. .)))"
    every, _, _ = scores([GOLD], [test])
    assert (every["matched_brackets"], every["gold_brackets"], every["test_brackets"]) == (4, 5, 4)
    assert every["recall"] == 80 and every["precision"] == 100
    assert every["f1"] == pytest.approx(2 * 80 * 100 / 180)
    assert every["complete_match"] == 0


def test_a_wrong_label_is_a_wrong_bracket() -> None:
    test = GOLD.replace("PP-LOC", "SBAR")
    every, _, _ = scores([GOLD], [test])
    assert every["matched_brackets"] == 4 and every["recall"] == every["precision"] == 80


def test_advp_and_prt_are_one_label_and_function_tags_and_indexes_are_cut() -> None:
    gold = "(TOP (S (NP-SBJ-1 (PRP He)) (VP (VBD gave) (PRT (RP up)) (PP-TMP=2 (IN in) (NP (NN May))))))"
    test = "(TOP (S (NP (PRP He)) (VP (VBD gave) (ADVP (RP up)) (PP (IN in) (NP (NN May))))))"
    every, _, _ = scores([gold], [test])
    assert every["f1"] == 100 and every["matched_brackets"] == 6
    wrong = test.replace("(ADVP (RP up))", "(ADJP (RP up))")
    assert scores([gold], [wrong])[0]["matched_brackets"] == 5


def test_punctuation_attached_elsewhere_changes_nothing() -> None:
    moved = ("(TOP (S (NP (DT the) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat) (. .))))))")
    every, _, _ = scores([GOLD], [moved])
    assert every["f1"] == 100 and every["complete_match"] == 100


def test_empty_elements_and_the_constituents_they_empty_are_not_counted() -> None:
    gold = ("(TOP (S (NP-SBJ (-NONE- *-1)) (VP (VBZ is) (ADJP-PRD (JJ true))) (SBAR (-NONE- 0) "
            "(S (-NONE- *T*-2))) (. .)))")
    test = "(TOP (S (VP (VBZ is) (ADJP (JJ true))) (. .)))"
    every, _, _ = scores([gold], [test])
    assert every["f1"] == 100 and every["gold_brackets"] == 3


def test_brackets_are_multisets() -> None:
    gold = "(TOP (S (NP (NP (NN x))) (VP (VBZ is))))"  # NP(0,1) twice: a unary chain
    test = "(TOP (S (NP (NN x)) (VP (VBZ is))))"
    every, _, _ = scores([gold], [test])
    assert (every["matched_brackets"], every["gold_brackets"], every["test_brackets"]) == (3, 4, 3)


def test_top_is_deleted_but_an_unlabelled_root_counts_as_evalb_counts_it() -> None:
    unlabelled = GOLD.replace("(TOP ", "( ", 1)
    every, _, _ = scores([unlabelled], [GOLD])
    assert (every["gold_brackets"], every["test_brackets"], every["matched_brackets"]) == (6, 5, 5)


def test_length_mismatch_and_other_words_are_errors_left_out_of_the_totals() -> None:
    extra = GOLD.replace("(NN mat)", "(NN mat) (NN rug)")
    other = GOLD.replace("(NN cat)", "(NN dog)")
    tagged = GOLD.replace("(. .)", "(XX .)")  # a parser that tags '.' otherwise keeps the word: 6 | 7
    every, short, problems = scores([GOLD] * 4, [extra, other, tagged, GOLD])
    assert (every["sentences"], every["error_sentences"], every["valid_sentences"]) == (4, 3, 1)
    assert every["f1"] == 100 and every["gold_brackets"] == 5  # only the valid sentence counts
    assert [n for n, _ in problems] == [1, 2, 3] and short["error_sentences"] == 3
    assert "length mismatch" in problems[0][1] and "'cat' | 'dog'" in problems[1][1]


def test_a_test_line_that_is_not_a_tree_is_an_error_and_an_empty_one_is_skipped() -> None:
    every, _, problems = scores([GOLD] * 3, ["(TOP (S (NP (DT the)", "", GOLD])
    assert (every["error_sentences"], every["skipped_sentences"], every["valid_sentences"]) == (1, 1, 1)
    assert "unbalanced" in problems[0][1]


def test_totals_are_summed_over_sentences_before_dividing() -> None:
    small = "(TOP (S (NP (PRP It)) (VP (VBZ is))))"
    small_test = "(TOP (FRAG (NP (PRP It)) (VP (VBZ is))))"  # 2 of 3 brackets
    every, _, _ = scores([GOLD, small], [GOLD, small_test])
    assert every["matched_brackets"] == 7 and every["recall"] == pytest.approx(100 * 7 / 8)


def test_the_short_subset_counts_punctuation_but_not_empty_elements() -> None:
    def sentence(words: int, extra: str = "") -> str:
        return "(TOP (S (NP " + " ".join("(NN w)" for _ in range(words)) + ")" + extra + "))"

    forty = sentence(40, " (-NONE- *T*-1)")  # 40 words: in
    forty_one = sentence(39, " (, ,) (. .)")  # 39 words + 2 punctuation = 41: out
    wrong = sentence(40).replace("(NP", "(VP", 1)
    every, short, _ = scores([forty, forty_one], [wrong, forty_one])
    assert every["sentences"] == 2 and short["sentences"] == 1
    assert short["f1"] == 50 and every["f1"] == 75  # S matched, NP missed in the short one


def test_score_task_parse_writes_json_like_score(tmp_path: Path) -> None:
    ref, hyp = tmp_path / "ref.trees", tmp_path / "hyp.trees"
    ref.write_text(f"{GOLD}\n{GOLD}\n")
    hyp.write_text(f"{GOLD}\n{GOLD.replace('PP-LOC', 'NP')}\n")
    out = nmt("score", "--task", "parse", "--hyp", hyp, "--ref", ref).stdout
    report = json.loads((tmp_path / "hyp.trees.scores.json").read_text())
    assert report["task"] == "parse" and report["sentences"] == 2 and "COLLINS.prm" in report["signature"]
    assert report["all"]["f1"] == pytest.approx(90) and report["len<=40"]["f1"] == pytest.approx(90)
    assert "F1  90.00" in out


def test_score_task_parse_refuses_a_reference_that_is_not_trees(tmp_path: Path) -> None:
    ref, hyp = tmp_path / "ref.trees", tmp_path / "hyp.trees"
    ref.write_text(f"{GOLD}\n(TOP (S (NP x y)))\n")
    hyp.write_text(f"{GOLD}\n{GOLD}\n")
    assert_user_error(nmt("score", "--task", "parse", "--hyp", hyp, "--ref", ref, check=False),
                      f"{ref}, line 2", "one tree per line")
    hyp.write_text(f"{GOLD}\n")
    assert_user_error(nmt("score", "--task", "parse", "--hyp", hyp, "--ref", ref, check=False),
                      "has 1 lines but the reference")
