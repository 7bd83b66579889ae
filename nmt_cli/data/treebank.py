"""Penn Treebank trees: reading `.mrg` files, the normal form parsers are scored on, and the tree as
a token sequence (arXiv 1706.03762, section 6.3, after Vinyals, Kaiser et al. 2015, "Grammar as a
Foreign Language").

A `.mrg` file holds trees in brackets over several lines, each with an unlabelled outer bracket:
``( (S (NP-SBJ-1 (NNP Vinken)) (VP (VBZ is) (NP-PRD (-NONE- *T*-1))) (. .)) )``. Labels carry
function tags and co-indexes (``NP-SBJ-1``, ``PP-LOC=2``); empty elements are ``-NONE-``
preterminals. `normalise` gives the tree as a parser is scored on it: function tags and indexes cut
(at the first ``-`` or ``=``, as EVALB does), ``-NONE-`` removed and the constituents it leaves
empty with it, the root labelled ``TOP``.

The linearised tree (`linearise`) is the target side of the parsing corpus: an opening token
``(LABEL`` per constituent, a closing token ``)LABEL``, and one token per word in its place: the
part-of-speech tag (``pos_tags="keep"``) or ``XX`` (``"normalise"``). Normalised, the tags of the
punctuation EVALB deletes (``, : `` '' .``) stay, so that the scorer deletes the same words from a
parser's tree as from the reference. The root ``TOP`` is left out. ``inference/trees.py`` turns such
a sequence back into a tree over the input words.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nmt_cli.errors import NmtError

PosTags = Literal["normalise", "keep"]
EMPTY = "-NONE-"
ROOT = "TOP"
NORMALISED_TAG = "XX"
# The preterminals EVALB's COLLINS.prm deletes with their words; a normalised sequence keeps them.
PUNCTUATION_TAGS = frozenset({",", ":", "``", "''", "."})
_TOKEN = re.compile(r"\(|\)|[^\s()]+")


@dataclass
class Tree:
    """A constituent (`children`, no `word`) or a preterminal (`label` its tag, `word` its word)."""

    label: str
    children: list[Tree] = field(default_factory=list)
    word: str | None = None

    @property
    def is_preterminal(self) -> bool:
        return self.word is not None

    def preterminals(self) -> Iterator[Tree]:
        if self.is_preterminal:
            yield self
        for child in self.children:
            yield from child.preterminals()

    def words(self) -> list[str]:
        return [leaf.word for leaf in self.preterminals() if leaf.word is not None]


def to_string(tree: Tree) -> str:
    """The tree on one line, as EVALB reads it: ``(TOP (S (NP (DT the) (NN cat)) ...))``."""
    if tree.is_preterminal:
        return f"({tree.label} {tree.word})"
    return f"({tree.label} {' '.join(to_string(child) for child in tree.children)})"


# ---------------------------------------------------------------------------------------------
# Reading


def read_trees(text: str, where: str) -> Iterator[Tree]:
    """The trees of a treebank file's text (several trees, each over one or more lines). `where`
    names the file in errors, which give the line of the problem."""
    tokens = [(m.group(), m.start()) for m in _TOKEN.finditer(text)]
    position = 0
    while position < len(tokens):
        token, start = tokens[position]
        if token != "(":
            raise _bad(text, where, start, f"{token!r} outside any tree (a tree starts with '(')")
        tree, position = _read_node(tokens, position, text, where)
        yield tree


def _read_node(tokens: list[tuple[str, int]], position: int, text: str, where: str) -> tuple[Tree, int]:
    """The tree whose '(' is tokens[position], and the position after its ')'. Iterative, so that no
    depth of nesting can exhaust Python's stack."""
    stack: list[Tree] = []
    while position < len(tokens):
        token, start = tokens[position]
        if token == "(":
            if stack and stack[-1].word is not None:
                raise _bad(text, where, start, f"({stack[-1].label} {stack[-1].word} ...) holds a word and "
                           "a bracket: a word must be alone, as (TAG word)")
            following = tokens[position + 1][0] if position + 1 < len(tokens) else ")"
            label = "" if following in ("(", ")") else following
            position += 1 if label else 0
            node = Tree(label)
            if stack:
                stack[-1].children.append(node)
            stack.append(node)
        elif token == ")":
            node = stack.pop()
            if not node.children and node.word is None:
                raise _bad(text, where, start, f"the bracket ({node.label} ...) holds nothing")
            if not stack:
                return node, position + 1
        else:
            if stack[-1].children or stack[-1].word is not None:
                raise _bad(text, where, start, f"the word {token!r} is not alone in its bracket "
                           f"({stack[-1].label} ...): a word must be alone, as (TAG word)")
            stack[-1].word = token
        position += 1
    raise _bad(text, where, len(text), "the file ends inside a tree: a ')' is missing")


def _bad(text: str, where: str, offset: int, problem: str) -> NmtError:
    line = text.count("\n", 0, offset) + 1
    return NmtError(f"{where}:{line}: {problem}; is this a Penn Treebank .mrg file? "
                    "(fix or leave out the file)")


def read_mrg(path: Path) -> list[Tree]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        text = path.read_text(encoding="latin-1")  # a few releases are not UTF-8; every tag is ASCII
    return list(read_trees(text, str(path)))


# ---------------------------------------------------------------------------------------------
# The normal form parsers are scored on


def strip_function_tags(label: str) -> str:
    """``NP-SBJ-1`` -> ``NP``, ``PP-LOC=2`` -> ``PP``: the label before the first '-' or '=', as EVALB
    cuts it; a label that starts with '-' (``-NONE-``, ``-LRB-``) is a tag and stays whole."""
    if label.startswith("-"):
        return label
    return re.split(r"[-=]", label, maxsplit=1)[0]


def normalise(tree: Tree) -> Tree | None:
    """`tree` as parsers are scored on it (see the module docstring); None when nothing but empty
    elements is left."""
    root = _normalise(tree)
    if root is None:
        return None
    if tree.label in ("", ROOT):
        root.label = ROOT
        return root
    return Tree(ROOT, [root])


def _normalise(tree: Tree) -> Tree | None:
    if tree.is_preterminal:
        return None if tree.label == EMPTY else Tree(tree.label, word=tree.word)
    children = [kept for kept in map(_normalise, tree.children) if kept is not None]
    return Tree(strip_function_tags(tree.label), children) if children else None


def with_root(tree: Tree) -> Tree:
    """The treebank's tree with its unlabelled outer bracket labelled TOP (EVALB deletes TOP; an
    unlabelled bracket it would count)."""
    if tree.label == "":
        return Tree(ROOT, tree.children)
    return tree if tree.label == ROOT else Tree(ROOT, [tree])


# ---------------------------------------------------------------------------------------------
# The tree as a sequence


def leaf_token(tag: str, pos_tags: PosTags) -> str:
    match pos_tags:
        case "keep":
            return tag
        case "normalise":
            return tag if tag in PUNCTUATION_TAGS else NORMALISED_TAG


def linearise(tree: Tree, pos_tags: PosTags) -> str:
    """The target sequence of a normalised tree: ``(S (NP XX XX )NP (VP XX )VP . )S``."""
    tokens: list[str] = []
    for child in tree.children if tree.label == ROOT else [tree]:
        _linearise(child, pos_tags, tokens)
    return " ".join(tokens)


def _linearise(tree: Tree, pos_tags: PosTags, tokens: list[str]) -> None:
    if tree.is_preterminal:
        tokens.append(leaf_token(tree.label, pos_tags))
        return
    tokens.append(f"({tree.label}")
    for child in tree.children:
        _linearise(child, pos_tags, tokens)
    tokens.append(f"){tree.label}")
