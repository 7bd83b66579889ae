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

from collections.abc import Sequence

import torch
from torch import Tensor

from nmt_cli.data.dataset import EOS
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


# -- searching only well-formed trees -------------------------------------------------------------

_OTHER, _OPEN, _CLOSE, _WORD = 0, 1, 2, 3


class TreeSymbols:
    """The output symbols of a parsing model's dictionary by kind: opening (``▁(NP``), closing
    (``▁)NP``) and word tokens (any other whole symbol, ``▁XX`` or a tag), each opening token's
    closing token (-1: the dictionary has none), and the word token of each punctuation tag. Pieces
    that do not start a word (continuations of a longer symbol) and the specials are none of these."""

    def __init__(self, symbols: list[str]) -> None:
        kinds, labels = [], []
        for symbol in symbols:
            text = symbol[1:] if symbol.startswith("\N{LOWER ONE EIGHTH BLOCK}") else ""
            bracket, label = text[:1], text[1:]
            if bracket in "()" and label and "(" not in label and ")" not in label:
                kinds.append(_OPEN if bracket == "(" else _CLOSE)
            else:
                kinds.append(_WORD if text and "(" not in text and ")" not in text else _OTHER)
            labels.append(label if kinds[-1] != _WORD else text)
        pairs = list(zip(kinds, labels, strict=True))
        closing = {label: i for i, (kind, label) in enumerate(pairs) if kind == _CLOSE}
        self.kind = torch.tensor(kinds, dtype=torch.int8)
        self.close_of = torch.tensor([closing.get(label, -1) if kind == _OPEN else -1
                                      for kind, label in pairs])
        self.tag = {label: i for i, (kind, label) in enumerate(pairs)
                    if kind == _WORD and label in PUNCTUATION_TAGS}
        self.punctuation = torch.zeros(len(symbols), dtype=torch.bool)
        self.punctuation[list(self.tag.values())] = True

    @property
    def usable(self) -> bool:
        """Whether the dictionary is a parsing model's: it has opening, closing and word tokens."""
        return all(bool((self.kind == kind).any()) for kind in (_OPEN, _CLOSE, _WORD))

    def word_tokens(self, words: list[str]) -> list[int]:
        """The word token each of `words` must have (as `_tag_of` reads them): its punctuation tag's for
        a mark the treebank always tags one way; for ``'`` (a quote or a possessive) ``''`` or a token
        that is no punctuation tag (`_QUOTE`); for any other word a token that is no punctuation tag
        (`_NOT_PUNCTUATION`: EVALB would delete the word); `_ANY_WORD` where the dictionary lacks the tag."""
        tokens = []
        for word in words:
            tag = _PUNCTUATION.get(word)
            if word == "'":
                tokens.append(_QUOTE if "''" in self.tag else _NOT_PUNCTUATION)
            elif tag is None:
                tokens.append(_NOT_PUNCTUATION)
            else:
                tokens.append(self.tag.get(tag, _ANY_WORD))
        return tokens


_ANY_WORD, _NOT_PUNCTUATION, _QUOTE = -1, -2, -3
MAX_OPENING_RUN = 8  # opening tokens in a row (the treebank's longest unary chains are shorter)


class TreeConstraint:
    """The next tokens that keep each hypothesis a well-formed linearised tree over its sentence's
    words (`search.beam_search`'s `constraint`): one root constituent, opened first; a word token
    inside it for each input word, no more, and for a punctuation mark its tag's token (for any other
    word a token that is not a punctuation tag; `TreeSymbols.word_tokens`); a constituent opened only
    while words are left to fill it and closed by its own label's token, only once it holds a word
    (the root only once every word is in), and only so long as the words left and the closing tokens
    still fit in the output's maximum length (and at most `MAX_OPENING_RUN` in a row); EOS only after
    the root is closed. The search renormalises the model's probabilities over these tokens."""

    def __init__(self, symbols: TreeSymbols, lengths: Tensor, expected: Tensor) -> None:
        self.symbols = symbols
        self.lengths = lengths  # (B,): each sentence's words
        self.expected = expected  # (B, longest + 1): the word token of each position (`word_tokens`)

    @classmethod
    def of(cls, symbols: TreeSymbols, sentences: Sequence[Sequence[str]]) -> TreeConstraint:
        """The constraint of sentences given as their words."""
        lengths = torch.tensor([len(words) for words in sentences])
        expected = torch.full((len(sentences), max(lengths.tolist(), default=0) + 1), _ANY_WORD)
        for row, words in enumerate(sentences):
            expected[row, : len(words)] = torch.tensor(symbols.word_tokens(list(words)))
        return cls(symbols, lengths, expected)

    def select(self, sentences: Sequence[int]) -> TreeConstraint:
        rows = torch.as_tensor(sentences, dtype=torch.long)
        return TreeConstraint(self.symbols, self.lengths[rows], self.expected[rows])

    def allowed(self, history: Tensor, sentence: Tensor, room: Tensor) -> Tensor:
        """history (N, t): each row's tokens so far; sentence (N,): each row's sentence; room (N,): the
        tokens each row may still produce after this one before EOS is forced -> (N, V) bool."""
        N, t = history.shape
        device = history.device
        kind_table, close_of = self.symbols.kind.to(device), self.symbols.close_of.to(device)
        if t == 0:  # the root first
            ok = (kind_table == _OPEN)[None, :].repeat(N, 1)
            ok[:, EOS] = ~ok.any(1)
            return ok
        kind = kind_table[history]
        opens, closes = kind == _OPEN, kind == _CLOSE
        depth_after = (opens.int() - closes.int()).cumsum(1)  # (N, t)
        depth = depth_after[:, -1]
        placed = (kind == _WORD).sum(1)
        left = self.lengths.to(device)[sentence] - placed  # words still to place
        more = left > 0
        # The innermost open constituent: the last opening token at the depth the row is at.
        innermost = opens & (depth_after == depth[:, None])
        position = (innermost * torch.arange(1, t + 1, device=device)).argmax(1, keepdim=True)
        closing = close_of[history.gather(1, position)[:, 0]]
        can_close = (depth > 0) & ~opens[:, -1] & ((depth > 1) | ~more)
        inside = more & (depth > 0)
        last_other = (~opens * torch.arange(t, device=device)).amax(1)
        run = torch.where((~opens).any(1), t - 1 - last_other, t)  # opening tokens in a row at the end
        may_open = inside & (left + depth + 1 <= room) & (run < MAX_OPENING_RUN)
        ok = (kind_table == _OPEN)[None, :] & may_open[:, None]
        expected = self.expected.to(device)[sentence, placed.clamp(max=self.expected.shape[1] - 1)]
        words = (kind_table == _WORD)[None, :] & (inside & (expected < 0))[:, None]
        words &= ~(self.symbols.punctuation.to(device)[None, :] & (expected <= _NOT_PUNCTUATION)[:, None])
        ok |= words
        exact = inside & (expected >= 0)
        ok[exact.nonzero()[:, 0], expected[exact]] = True
        if "''" in self.symbols.tag:  # else no word expects _QUOTE
            ok[inside & (expected == _QUOTE), self.symbols.tag["''"]] = True
        matched = can_close & (closing >= 0)
        ok[matched.nonzero()[:, 0], closing[matched]] = True
        # a label without its own closing token in the dictionary: any closing token
        ok |= (kind_table == _CLOSE)[None, :] & (can_close & (closing < 0))[:, None]
        ok[:, EOS] = depth == 0
        ok[:, EOS] |= ~ok.any(1)  # never a row with nothing to choose
        return ok
