"""A generated English -> "Toylang" corpus: offline, deterministic, and a real translation task.

Toylang is a fixed invented language (the same for every seed; the seed only picks sentences) built so
that a model must learn what translation needs, on a CPU in minutes:

- vocabulary mapping: every English word stem has one Toylang word, spelled from shared syllables so
  that BPE finds sub-words;
- local reordering: adjectives follow their noun, postpositions follow their noun phrase;
- long-distance reordering: the verb moves to the end of its clause (subject-object-verb);
- length change: English "a" has no translation, plural nouns and past tense add a separate particle,
  while English verb agreement ("sees"/"see") and irregular forms ("mice", "saw") carry no extra word.

    my lazy cats brought three lazy strange tables in this song.
    mi nura fuka ka san lenazi fuka ruvivo ka sei lademu fezoda vale ta.
    (my cat lazy PLURAL three table lazy strange PLURAL this song in bring PAST.)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

SRC_LANG, TGT_LANG = "en", "ty"

# (singular, plural) English nouns; the Toylang word is generated below.
NOUNS = [("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("house", "houses"), ("tree", "trees"),
         ("river", "rivers"), ("city", "cities"), ("child", "children"), ("man", "men"), ("woman", "women"),
         ("mouse", "mice"), ("teacher", "teachers"), ("doctor", "doctors"), ("farmer", "farmers"),
         ("book", "books"), ("letter", "letters"), ("car", "cars"), ("boat", "boats"), ("garden", "gardens"),
         ("window", "windows"), ("apple", "apples"), ("song", "songs"), ("friend", "friends"),
         ("horse", "horses"), ("king", "kings"), ("queen", "queens"), ("bridge", "bridges"),
         ("mountain", "mountains"), ("student", "students"), ("table", "tables"), ("lamp", "lamps"),
         ("road", "roads"), ("story", "stories"), ("box", "boxes")]
ADJECTIVES = ["big", "small", "red", "old", "young", "happy", "quiet", "green", "tall", "dark", "bright",
              "cold", "warm", "strange", "new", "heavy", "clever", "lazy", "blue", "brave"]
# (present singular, present plural, past) English verbs.
VERBS = [("sees", "see", "saw"), ("finds", "find", "found"), ("likes", "like", "liked"),
         ("takes", "take", "took"), ("brings", "bring", "brought"), ("paints", "paint", "painted"),
         ("follows", "follow", "followed"), ("helps", "help", "helped"), ("builds", "build", "built"),
         ("writes", "write", "wrote"), ("sells", "sell", "sold"), ("watches", "watch", "watched"),
         ("carries", "carry", "carried"), ("visits", "visit", "visited"), ("loves", "love", "loved"),
         ("hides", "hide", "hid"), ("opens", "open", "opened"), ("chooses", "choose", "chose")]
ADVERBS = ["quickly", "slowly", "often", "never", "again", "quietly", "happily", "today"]
PREPOSITIONS = ["in", "near", "behind", "under", "with"]
# English determiners with their Toylang word; "a" has none (a length change).
DETERMINERS = {"the": "lo", "this": "sei", "my": "mi", "every": "oka", "a": None}
NUMBERS = {"two": "tu", "three": "san", "many": "mani", "the": "lo", "these": "seira", "my": "mi"}
CONJUNCTIONS = {"and": "e", "but": "pero", "because": "kausa"}
PLURAL, PAST = "ka", "ta"

_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def _lexicon() -> dict[str, str]:
    """English stem -> Toylang word. Fixed (a constant seed), so every corpus speaks the same language."""
    rng = random.Random("toylang-lexicon-v1")
    stems = [s for s, _ in NOUNS] + ADJECTIVES + [p for _, p, _ in VERBS] + ADVERBS + PREPOSITIONS
    taken = {PLURAL, PAST, *NUMBERS.values(), *CONJUNCTIONS.values(), *(w for w in DETERMINERS.values() if w)}
    lexicon = {}
    for stem in stems:
        while True:
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 2, 3))))
            if word not in taken:
                break
        taken.add(word)
        lexicon[stem] = word
    return lexicon


LEXICON = _lexicon()


def _noun_phrase(rng: random.Random) -> tuple[list[str], list[str], bool]:
    """(English words, Toylang words, is plural). Toylang: DET NOUN ADJ* [PLURAL]."""
    singular, plural = rng.choice(NOUNS)
    adjectives = rng.sample(ADJECTIVES, rng.choice((0, 0, 1, 1, 2)))
    is_plural = rng.random() < 0.4
    if is_plural:
        det = rng.choice(list(NUMBERS))
        en = [det, *adjectives, plural]
        ty = [NUMBERS[det], LEXICON[singular], *(LEXICON[a] for a in adjectives), PLURAL]
    else:
        det = rng.choice(list(DETERMINERS))
        en = [det, *adjectives, singular]
        ty = [w for w in (DETERMINERS[det],) if w] + [LEXICON[singular], *(LEXICON[a] for a in adjectives)]
    if rng.random() < 0.25:  # a prepositional phrase; Toylang puts the postposition after it
        prep = rng.choice(PREPOSITIONS)
        inner_en, inner_ty, _ = _noun_phrase_simple(rng)
        en += [prep, *inner_en]
        ty += [*inner_ty, LEXICON[prep]]
    return en, ty, is_plural


def _noun_phrase_simple(rng: random.Random) -> tuple[list[str], list[str], bool]:
    singular, _ = rng.choice(NOUNS)
    det = rng.choice(["the", "a", "my", "this"])
    return [det, singular], [w for w in (DETERMINERS[det],) if w] + [LEXICON[singular]], False


def _clause(rng: random.Random) -> tuple[list[str], list[str]]:
    """English SUBJECT VERB OBJECT [ADVERB] -> Toylang SUBJECT OBJECT [ADVERB] VERB [PAST]."""
    subj_en, subj_ty, plural = _noun_phrase(rng)
    obj_en, obj_ty, _ = _noun_phrase(rng)
    present_sg, stem, past = rng.choice(VERBS)
    is_past = rng.random() < 0.5
    verb_en = past if is_past else (stem if plural else present_sg)
    adverb = rng.choice(ADVERBS) if rng.random() < 0.3 else None
    en = [*subj_en, verb_en, *obj_en, *([adverb] if adverb else [])]
    ty = [*subj_ty, *obj_ty, *([LEXICON[adverb]] if adverb else []), LEXICON[stem],
          *([PAST] if is_past else [])]
    return en, ty


def sentence_pair(rng: random.Random) -> tuple[str, str]:
    en, ty = _clause(rng)
    if rng.random() < 0.3:
        conj = rng.choice(list(CONJUNCTIONS))
        en2, ty2 = _clause(rng)
        en, ty = [*en, conj, *en2], [*ty, CONJUNCTIONS[conj], *ty2]
    return " ".join(en) + ".", " ".join(ty) + "."


def _bucket(source: str) -> int:
    return hashlib.blake2b(source.encode(), digest_size=2).digest()[0] % 20


_BUCKETS = {"train": range(2, 20), "valid": range(0, 1), "test": range(1, 2)}


def pairs(split: str, size: int, seed: int) -> Iterator[tuple[str, str]]:
    """`size` (English, Toylang) pairs of `split`; the splits never share a source sentence.

    A sentence belongs to a split by a hash of its text (train 90%, valid 5%, test 5%), so the
    splits are disjoint without holding any of them in memory.
    """
    rng = random.Random(f"toy-{seed}-{split}")
    wanted = _BUCKETS[split]
    made = 0
    while made < size:
        source, target = sentence_pair(rng)
        if _bucket(source) in wanted:
            made += 1
            yield source, target
