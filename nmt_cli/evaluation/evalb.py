"""Labelled bracketing scores of parse trees, computed as EVALB (Sekine and Collins 1997) computes
them with its standard parameter file `COLLINS.prm`, the numbers constituency parsers report
(arXiv 1706.03762, section 6.3, table 4: 91.3 F1 on WSJ section 23).

One tree per line in each file, the reference first. For each line, as `evalb.c` reads it:

- A bracket holding a single word, ``(TAG word)``, is a preterminal: a word with its tag, not a
  bracket. A preterminal whose tag is a deleted label (``-NONE- , : `` '' .``) is removed with its
  word; the other words are numbered 0, 1, ... in order.
- Every other bracket spans the words that remain under it, as (label, start, end). Its label is
  cut at the first ``-`` or ``=`` (``NP-SBJ-1`` is ``NP``); brackets labelled ``TOP`` (or a label
  that becomes TOP when cut) and brackets spanning no word are not counted. An unlabelled bracket
  (``( (S ...) )``) keeps its empty label and counts, as in EVALB.
- ``ADVP`` and ``PRT`` are one label (``EQ_LABEL ADVP PRT``).
- The test tree's brackets match the reference's as multisets: a (label, start, end) present twice
  in both matches twice.
- A test line with no word is skipped (EVALB's status 2); one whose remaining words differ in
  number or spelling from the reference's, or that is not a tree, is an error (status 1). Neither
  enters the totals; both are listed. (EVALB stops after 10 errors; this scorer counts them all.)
- A sentence's length, for the ``len<=40`` subset (``CUTOFF_LEN 40``), is the number of the
  reference's words that are not ``-NONE-`` (punctuation counts; ``DELETE_LABEL_FOR_LENGTH -NONE-``).

Recall = matched / reference brackets, precision = matched / test brackets, F1 their harmonic mean;
complete match = sentences with every bracket matched and none extra; tagging accuracy = words
whose tags are equal. The crossing count is EVALB's: test brackets that cross a reference bracket.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

DELETE_LABELS = frozenset({"TOP", "-NONE-", ",", ":", "``", "''", "."})
DELETE_FOR_LENGTH = frozenset({"-NONE-"})
EQUAL_LABELS = {"PRT": "ADVP"}
CUTOFF_LENGTH = 40
SIGNATURE = ("EVALB COLLINS.prm: labelled brackets; TOP -NONE- , : `` '' . deleted; ADVP=PRT; "
             "functional tags cut at - and =")

Bracket = tuple[str, int, int]


class BadTree(ValueError):
    """A line EVALB cannot read as a tree (the reason is the message)."""


@dataclass
class Sentence:
    """A tree as EVALB sees it."""

    words: list[str]
    tags: list[str]
    brackets: list[Bracket]  # counted brackets: label cut and made canonical, deleted ones left out
    length: int  # words that are not -NONE- (punctuation included): decides the len<=40 subset


def read_sentence(line: str) -> Sentence:
    """`line` as `evalb.c`'s read_line and massage_data see it (see the module docstring)."""
    words: list[str] = []
    tags: list[str] = []
    opened: list[tuple[str, int]] = []
    spans: list[Bracket] = []
    length, i, n = 0, 0, len(line)
    while i < n:
        if line[i].isspace():
            i += 1
        elif line[i] == "(":
            end = _token_end(line, i + 1)
            label, word_end, word = line[i + 1:end], end, None
            if end < n and line[end].isspace():  # evalb.c: after the label's space, a word or a '('
                start = len(line) - len(line[end:].lstrip())
                word_end = _token_end(line, start)
                if word_end < n and line[word_end] == ")":
                    word = line[start:word_end]
                elif start != word_end:
                    raise BadTree(f"({label} {line[start:word_end]} ...) holds more than a word")
            if word is None:
                opened.append((label, len(words)))
                i = end
                continue
            length += label not in DELETE_FOR_LENGTH
            if label not in DELETE_LABELS:
                words.append(word)
                tags.append(label)
            i = word_end + 1
        elif line[i] == ")":
            if not opened:
                raise BadTree("unbalanced brackets (a ')' closes nothing)")
            label, start = opened.pop()
            spans.append((label, start, len(words)))
            i += 1
        else:
            raise BadTree(f"{line[i:_token_end(line, i)]!r} is outside any bracket")
    if opened:
        raise BadTree("unbalanced brackets (a '(' is never closed)")
    return Sentence(words, tags, _counted(spans), length)


def _token_end(line: str, i: int) -> int:
    while i < len(line) and not line[i].isspace() and line[i] not in "()":
        i += 1
    return i


def _counted(spans: Iterable[Bracket]) -> list[Bracket]:
    """The brackets EVALB counts: not empty, label cut at '-' or '=', not deleted, ADVP = PRT."""
    counted = []
    for label, start, end in spans:
        label = label.replace("=", "-").split("-", 1)[0]
        if start != end and label not in DELETE_LABELS:
            counted.append((EQUAL_LABELS.get(label, label), start, end))
    return counted


# ---------------------------------------------------------------------------------------------
# Comparing and totalling


@dataclass
class Outcome:
    """One sentence: status 0 (scored), 1 (error) or 2 (skipped), with its counts when scored."""

    status: int
    length: int
    reason: str = ""
    gold: int = 0
    test: int = 0
    matched: int = 0
    crossing: int = 0
    words: int = 0
    correct_tags: int = 0


def compare(gold: Sentence, test_line: str) -> Outcome:
    """The reference `gold` against the test tree `test_line`, as `evalb.c`'s calc_result."""
    try:
        test = read_sentence(test_line)
    except BadTree as e:
        return Outcome(1, gold.length, f"the test tree is not a tree: {e}")
    if not test.words:
        return Outcome(2, gold.length, "the test tree has no word")
    if len(test.words) != len(gold.words):
        return Outcome(1, gold.length, f"length mismatch: the reference has {len(gold.words)} scored words, "
                       f"the test tree {len(test.words)}")
    for position, (a, b) in enumerate(zip(gold.words, test.words, strict=True)):
        if a != b:
            return Outcome(1, gold.length, f"words differ at word {position + 1}: {a!r} | {b!r}")
    matched = sum((Counter(gold.brackets) & Counter(test.brackets)).values())
    crossing = sum(1 for t in test.brackets if any(_cross(g, t) for g in gold.brackets))
    tags = sum(1 for a, b in zip(gold.tags, test.tags, strict=True)
               if EQUAL_LABELS.get(a, a) == EQUAL_LABELS.get(b, b))
    return Outcome(0, gold.length, gold=len(gold.brackets), test=len(test.brackets), matched=matched,
                   crossing=crossing, words=len(gold.words), correct_tags=tags)


def _cross(gold: Bracket, test: Bracket) -> bool:
    _, gs, ge = gold
    _, ts, te = test
    return (gs < ts < ge < te) or (ts < gs < te < ge)


@dataclass
class Totals:
    """EVALB's summary over a set of sentences."""

    sentences: int = 0
    errors: int = 0
    skipped: int = 0
    gold: int = 0
    test: int = 0
    matched: int = 0
    complete: int = 0
    crossing: int = 0
    words: int = 0
    correct_tags: int = 0

    def add(self, outcome: Outcome) -> None:
        self.sentences += 1
        self.errors += outcome.status == 1
        self.skipped += outcome.status == 2
        if outcome.status == 0:
            self.gold += outcome.gold
            self.test += outcome.test
            self.matched += outcome.matched
            self.complete += outcome.gold == outcome.test == outcome.matched
            self.crossing += outcome.crossing
            self.words += outcome.words
            self.correct_tags += outcome.correct_tags

    def report(self) -> dict[str, float | int]:
        recall = 100.0 * self.matched / self.gold if self.gold else 0.0
        precision = 100.0 * self.matched / self.test if self.test else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        valid = self.sentences - self.errors - self.skipped
        return {"sentences": self.sentences, "error_sentences": self.errors,
                "skipped_sentences": self.skipped, "valid_sentences": valid,
                "recall": recall, "precision": precision, "f1": f1,
                "complete_match": 100.0 * self.complete / valid if valid else 0.0,
                "average_crossing": self.crossing / valid if valid else 0.0,
                "tagging_accuracy": 100.0 * self.correct_tags / self.words if self.words else 0.0,
                "matched_brackets": self.matched, "gold_brackets": self.gold, "test_brackets": self.test}


def evaluate(gold_lines: list[str], test_lines: list[str],
             cutoff: int = CUTOFF_LENGTH) -> tuple[Totals, Totals, list[tuple[int, str]]]:
    """(all sentences, those of at most `cutoff` words, [(line number, reason)] of each error or
    skipped sentence). A reference line that is not a tree raises `BadTree` with its line number."""
    every, short, problems = Totals(), Totals(), []
    for number, (gold_line, test_line) in enumerate(zip(gold_lines, test_lines, strict=True), 1):
        try:
            gold = read_sentence(gold_line)
        except BadTree as e:
            raise BadTree(f"line {number}: {e}") from None
        outcome = compare(gold, test_line)
        every.add(outcome)
        if outcome.length <= cutoff:
            short.add(outcome)
        if outcome.status:
            problems.append((number, outcome.reason))
    return every, short, problems
