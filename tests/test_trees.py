"""A parser's output back into a tree (`inference/trees.py`): well-formed outputs need no repair, and
any corruption of a linearised tree comes back as a valid tree over exactly the input words."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from test_search import padded, random_model

from nmt_cli.data import treebank
from nmt_cli.data.dataset import EOS, SPECIALS
from nmt_cli.evaluation import evalb
from nmt_cli.inference.search import beam_search
from nmt_cli.inference.trees import TreeConstraint, TreeSymbols, _tag_of, as_tree_line, rebuild

TREES = [  # normalised trees of several shapes: unary chains, punctuation, several top constituents
    "(TOP (S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .)))",
    "(TOP (NP (NP (NNP Mr.) (NNP Vinken)) (, ,) (NP (NN chairman))))",
    "(TOP (S (S (NP (PRP It)) (VP (VBZ is))) (: ;) (S (NP (PRP we)) (VP (VBP know))) (. .)))",
    "(TOP (FRAG (ADVP (RB Not)) (ADVP (RB yet)) (. ?)))",
    "(TOP (X (X (X (NN a)))))",
]


def parsed(line: str) -> treebank.Tree:
    return next(treebank.read_trees(line, "test"))


def valid(tree: treebank.Tree, words: list[str]) -> bool:
    """A tree EVALB reads without error, rooted at TOP, over exactly `words`, with no empty
    constituent and every word in a preterminal."""
    line = treebank.to_string(tree)
    sentence = evalb.read_sentence(line)  # raises BadTree otherwise
    again = parsed(line)
    return (tree.label == treebank.ROOT and again.words() == words
            and all(node.children or node.is_preterminal for node in _nodes(again))
            and len(sentence.tags) <= len(words))


def _nodes(tree: treebank.Tree) -> list[treebank.Tree]:
    return [tree, *(n for child in tree.children for n in _nodes(child))]


@pytest.mark.parametrize("line", TREES)
@pytest.mark.parametrize("pos_tags", ["normalise", "keep"])
def test_a_well_formed_output_needs_no_repair(line: str, pos_tags: treebank.PosTags) -> None:
    tree = parsed(line)
    rebuilt, repairs = rebuild(treebank.linearise(tree, pos_tags), tree.words())
    assert repairs == [] and evalb.read_sentence(treebank.to_string(rebuilt)).brackets == \
        evalb.read_sentence(line).brackets


def corrupt(tokens: list[str], rng: random.Random) -> list[str]:
    """One to three of: drop a token, duplicate one, insert a bracket or a junk token, truncate."""
    tokens = list(tokens)
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["drop", "extra", "open", "close", "junk", "truncate", "leaf"])
        at = rng.randint(0, len(tokens))
        match kind:
            case "drop" if tokens:
                del tokens[min(at, len(tokens) - 1)]
            case "extra" if tokens:
                tokens.insert(at, rng.choice(tokens))
            case "open":
                tokens.insert(at, rng.choice(["(NP", "(S", "(VP"]))
            case "close":
                tokens.insert(at, rng.choice([")", ")NP", ")S", ")ZZ"]))
            case "junk":
                tokens.insert(at, rng.choice(["(", "NP)", "((", "a(b", "⁇"]))
            case "truncate":
                tokens = tokens[:at]
            case "leaf":
                tokens.insert(at, "XX")
    return tokens


def test_random_corruptions_always_give_a_valid_tree_over_the_words() -> None:
    rng = random.Random(0)
    repaired = 0
    for trial in range(3000):
        tree = parsed(TREES[trial % len(TREES)])
        words = tree.words()
        tokens = corrupt(treebank.linearise(tree, rng.choice(["normalise", "keep"])).split(), rng)
        rebuilt, repairs = rebuild(" ".join(tokens), words)
        assert valid(rebuilt, words), (tokens, treebank.to_string(rebuilt))
        repaired += bool(repairs)
    assert repaired > 2500  # nearly every corruption is noticed (a dropped XX and an added one cancel)


@pytest.mark.parametrize("output, repair", [
    ("(S (NP XX XX )NP (VP XX (PP XX (NP XX XX )NP )PP )VP", "unclosed brackets"),  # the length limit hit
    ("(S (NP XX XX )NP )S )S", "extra closing bracket"),
    ("(S (NP XX XX )VP )S", "closing label differs"),
    ("(S (NP XX XX XX XX XX XX XX XX )NP )S", "too many words"),
    ("(S (NP XX XX )NP )S", "too few words"),
    ("(S (NP )NP XX XX XX XX XX XX XX )S", "empty constituent"),
    ("", "too few words"),
    ("(S (NP XX XX )NP (VP XX (PP XX (NP XX XX )NP )PP )VP XX )S", "punctuation tag"),
    ("(S (NP XX : )NP (VP XX (PP XX (NP XX XX )NP )PP )VP . )S", "punctuation tag"),
])
def test_each_kind_of_repair_is_named(output: str, repair: str) -> None:
    words = ["The", "cat", "sat", "on", "the", "mat", "."]
    tree, repairs = rebuild(output, words)
    assert repair in repairs and valid(tree, words)


def test_added_punctuation_is_tagged_so_that_evalb_deletes_it_and_brackets_in_words_are_escaped() -> None:
    line, repairs = as_tree_line("(S (NP XX )NP", ["(", "Hi", ")", "."])
    assert line == "(TOP (S (NP (XX -LRB-)) (XX Hi) (XX -RRB-) (. .)))" and "too few words" in repairs
    assert as_tree_line("(S XX )S", []) == ("", [])


def test_translate_writes_one_tree_per_line_in_order_and_counts_repairs(tiny_trained_model, tmp_path) -> None:
    """A model that is no parser (it copies toy sentences, whose words then read as leaves under the
    root, or need repair; its dictionary has no tree symbols to hold the search to): every line gets
    its tree over its own words, an empty line stays empty, and the trees and repairs are counted."""
    from conftest import nmt

    lines = ["red cat sings", "", "the old dog runs near the river", "a"]
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{line}\n" for line in lines))
    proc = nmt("translate", tiny_trained_model, "--input", source, "--output", tmp_path / "out.trees",
               "--output-format", "tree", "--beam", 3, "--lenpen", 0.3, "--set", "max_len_b=30")
    written = (tmp_path / "out.trees").read_text().split("\n")[:-1]
    assert len(written) == len(lines) and written[1] == ""
    for line, tree in zip(lines, written, strict=True):
        if line:
            assert evalb.read_sentence(tree).words == line.split() and tree.startswith("(TOP ")
    assert re.search(r"translate: 3 trees, [0-3] repaired", proc.stderr), proc.stderr
    assert "has no tree symbols" in proc.stderr  # so the search was not held to trees


# -- the search held to well-formed trees ----------------------------------------------------------

PIECE = "\N{LOWER ONE EIGHTH BLOCK}"


def tree_symbols(tokens: set[str]) -> list[str]:
    """A parsing model's dictionary: the specials, a piece per tree token, and pieces of source words."""
    return [*SPECIALS, *sorted(PIECE + token for token in tokens), f"{PIECE}the", "ing", f"{PIECE}"]


def allows(constraint: TreeConstraint, ids: list[int], room: int = 1000) -> list[bool]:
    """Whether each token of `ids` (then EOS) was allowed after the ones before it."""
    one = torch.tensor([0])
    return [bool(constraint.allowed(torch.tensor([ids[:t]]), one, torch.tensor([room - t]))[0, token])
            for t, token in enumerate([*ids, EOS])]


@pytest.mark.parametrize("pos_tags", ["normalise", "keep"])
def test_the_constraint_admits_every_tree_of_the_sample(ptb_sample: Path, pos_tags: treebank.PosTags) -> None:
    """Every linearised tree of the treebank sample (every tenth, for time) is allowed token by token,
    but for the trees the treebank itself tags against its own punctuation (``(, Wa)``): EVALB
    would make those errors anyway."""
    trees = [treebank.normalise(tree) for path in sorted(ptb_sample.glob("wsj_*.mrg"))
             for tree in treebank.read_mrg(path)][::10]
    trees = [tree for tree in trees if tree is not None]
    linear = [treebank.linearise(tree, pos_tags).split() for tree in trees]
    symbols = tree_symbols({token for tokens in linear for token in tokens})
    index = {symbol: i for i, symbol in enumerate(symbols)}
    tree_table = TreeSymbols(symbols)
    refused = 0
    for tree, tokens in zip(trees, linear, strict=True):
        words = tree.words()
        marks = [(_tag_of(word, leaf.label), leaf.label) for word, leaf in zip(words, tree.preterminals(),
                                                                                 strict=True)]
        own_punctuation = all(tag == label for tag, label in marks)
        ok = all(allows(TreeConstraint.of(tree_table, [words]), [index[PIECE + token] for token in tokens]))
        assert ok or not own_punctuation, " ".join(tokens)
        refused += not ok
    assert refused <= len(trees) // 100


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_constrained_search_writes_only_well_formed_trees(seed: int) -> None:
    """A random model held to the constraint: every output is a tree over exactly its sentence's words,
    punctuation tagged as the treebank tags it, with no repair; also when the maximum length leaves
    little room beyond the words (max_len_b 3 over the source's pieces)."""
    tokens = {"(S", ")S", "(NP", ")NP", "(VP", ")VP", "(PP", ")PP", "XX", ",", ".", "``", "''", ":"}
    symbols = tree_symbols(tokens)
    model = random_model(len(symbols), seed)
    g = random.Random(seed)
    marks = ["a", "b", ",", ".", "--", "'"]
    sentences = [[g.choice(marks) for _ in range(g.randint(1, 9))] for _ in range(12)]
    sources = [[4 + g.randrange(len(symbols) - 4) for _ in words] + [EOS] for words in sentences]
    constraint = TreeConstraint.of(TreeSymbols(symbols), sentences)
    for max_len_b in (20, 3):
        found = beam_search(model, padded(sources), beam=3, nbest=1, lenpen=0.6, max_len_a=1.0,
                            max_len_b=max_len_b, constraint=constraint)
        for words, hyps in zip(sentences, found, strict=True):
            output = " ".join(symbols[i][1:] for i in hyps[0].tokens)
            tree, repairs = rebuild(output, words)
            assert repairs == [] and valid(tree, words), output
