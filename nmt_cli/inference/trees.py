"""A parser's output sequence back into a tree over the input words (`nmt translate --output-format
tree`), repaired when it is not a well-formed linearised tree (`data/treebank.py`).

The model writes ``(S (NP XX XX )NP (VP XX )VP . )S``: opening tokens, closing tokens and one token
per word (its tag, or ``XX``). Reading it left to right with a stack, each word token takes the next
input word. What a model can get wrong is repaired the same way every time, and each repair is
named, so that `translate` counts them and no sentence is dropped:

- a token with a bracket inside it (``NP)``), or ``(`` with no label: dropped (``junk token``);
- a closing token with nothing open: dropped (``extra closing bracket``); a closing token whose
  label differs from the open constituent's closes it all the same (``closing label differs``);
- constituents still open at the end (the length limit hit, or a bracket forgotten): closed
  (``unclosed brackets``);
- more word tokens than input words: the extra ones dropped (``too many words``); fewer: the
  missing words added at the end of the first top-level constituent, or of the root when
  there is none (``too few words``);
- constituents left without a word: removed (``empty constituent``);
- a mark of punctuation the treebank always tags one way (``.``, ``,``, ``;``, ``--``, ...) given
  another tag (``XX`` for ``.``), or a word given a punctuation tag (``:`` for ``G.``): the tag of
  the word's form (``punctuation tag``; see `_tag_of`), since EVALB deletes words by their tag and
  a disagreement with the reference would make the whole sentence an error. (The treebank itself
  tags a word or two so, such as ``(, Wa)`` in wsj_0037: such a sentence is an error for EVALB.)

The result is always a tree EVALB reads, rooted at ``TOP``, whose words are the input's.
"""

from __future__ import annotations

from nmt_cli.data.treebank import NORMALISED_TAG, PUNCTUATION_TAGS, ROOT, Tree, to_string

# Words the treebank tags with one of the punctuation tags EVALB deletes, always the same one.
_PUNCTUATION = {",": ",", ".": ".", "?": ".", "!": ".", ":": ":", ";": ":", "--": ":", "-": ":", "...": ":",
                "``": "``", "`": "``", "''": "''"}
_ESCAPES = str.maketrans({"(": "-LRB-", ")": "-RRB-"})  # as the treebank writes brackets in words


def rebuild(output: str, words: list[str]) -> tuple[Tree, list[str]]:
    """The tree of `output` over `words` (at least one), and the repairs it needed (empty: none)."""
    assert words, "a tree needs a word"
    repairs: list[str] = []
    root = _read(output.split(), repairs)
    leaves = list(root.preterminals())
    added: set[int] = set()
    if len(leaves) > len(words):
        repairs.append("too many words")
        _drop_leaves(root, set(map(id, leaves[len(words):])))
    elif len(leaves) < len(words):
        repairs.append("too few words")
        host = next((child for child in root.children if not child.is_preterminal), root)
        host.children += [Tree(NORMALISED_TAG, word="") for _ in words[len(leaves):]]
        added = set(map(id, host.children[len(host.children) - (len(words) - len(leaves)):]))
    for leaf, word in zip(root.preterminals(), words, strict=True):
        leaf.word = word.translate(_ESCAPES)  # a bracket in a word would end its leaf
        tag = _tag_of(word, leaf.label)
        if tag != leaf.label and id(leaf) not in added:
            _note(repairs, "punctuation tag")
        leaf.label = tag
    if _prune(root):
        repairs.append("empty constituent")
    return root, repairs


def _tag_of(word: str, token: str) -> str:
    """The tag of `word` whose output token was `token`. EVALB deletes a word by its tag, so that a
    parse tagging punctuation otherwise than the reference (``XX`` for ``.``, ``:`` for ``G.``) would
    make the whole sentence an error. The marks the treebank always tags one way get that tag; a
    deleted punctuation tag on any other word becomes XX, except on ``'``, which the treebank tags
    as a closing quote or a possessive, as the model says."""
    if word in _PUNCTUATION:
        return _PUNCTUATION[word]
    if token in PUNCTUATION_TAGS and not (word == "'" and token == "''"):
        return NORMALISED_TAG
    return token


def as_tree_line(output: str, words: list[str]) -> tuple[str, list[str]]:
    """`rebuild` as the one-line bracketed tree `translate` writes; no words, an empty line."""
    if not words:
        return "", []
    tree, repairs = rebuild(output, words)
    return to_string(tree), repairs


def _read(tokens: list[str], repairs: list[str]) -> Tree:
    """The tokens as a tree under ROOT, with leaves whose words are still to be filled in."""
    root = Tree(ROOT)
    stack = [root]
    for token in tokens:
        opening, closing = token.startswith("("), token.startswith(")")
        label = token[1:] if opening or closing else token
        if not label and opening or "(" in label or ")" in label:
            _note(repairs, "junk token")
        elif opening:
            node = Tree(label)
            stack[-1].children.append(node)
            stack.append(node)
        elif closing and len(stack) == 1:
            _note(repairs, "extra closing bracket")
        elif closing:
            if label and label != stack[-1].label:
                _note(repairs, "closing label differs")
            stack.pop()
        else:
            stack[-1].children.append(Tree(label, word=""))
    if len(stack) > 1:
        _note(repairs, "unclosed brackets")
    return root


def _note(repairs: list[str], kind: str) -> None:
    if kind not in repairs:
        repairs.append(kind)


def _drop_leaves(tree: Tree, dropped: set[int]) -> None:
    tree.children = [child for child in tree.children if id(child) not in dropped]
    for child in tree.children:
        _drop_leaves(child, dropped)


def _prune(tree: Tree) -> bool:
    """Remove the constituents under `tree` that hold no word; whether there were any."""
    pruned = False
    for child in tree.children:
        pruned |= _prune(child)
    kept = [child for child in tree.children if child.is_preterminal or child.children]
    pruned |= len(kept) != len(tree.children)
    tree.children = kept
    return pruned
