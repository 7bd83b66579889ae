"""The generated toy corpus: deterministic, disjoint splits, and the translation phenomena it promises."""

from nmt_cli.data import toy


def test_same_seed_same_corpus_other_seed_other_corpus() -> None:
    first = list(toy.pairs("train", 200, seed=7))
    assert first == list(toy.pairs("train", 200, seed=7))
    assert first != list(toy.pairs("train", 200, seed=8))


def test_splits_are_disjoint() -> None:
    train = {s for s, _ in toy.pairs("train", 5000, seed=1)}
    valid = {s for s, _ in toy.pairs("valid", 300, seed=1)}
    test = {s for s, _ in toy.pairs("test", 300, seed=1)}
    assert not train & valid and not train & test and not valid & test


def test_translation_is_a_function_of_the_source() -> None:
    seen: dict[str, str] = {}
    for source, target in toy.pairs("train", 5000, seed=3):
        assert seen.setdefault(source, target) == target


def test_reordering_and_length_change_are_present() -> None:
    verbs = {toy.LEXICON[stem] for _, stem, _ in toy.VERBS}
    adjective_after_noun = verb_last = single_clauses = length_changed = 0
    for source, target in toy.pairs("train", 2000, seed=1):
        words = target.removesuffix(".").split()
        clause = words
        if toy.CONJUNCTIONS.keys().isdisjoint(source.split()):
            last = clause[-2] if clause[-1] == toy.PAST else clause[-1]
            single_clauses += 1
            verb_last += last in verbs  # SOV: the verb ends the clause
        adjective_after_noun += any(f"{toy.LEXICON[n]} {toy.LEXICON[a]}" in target
                                    for n, _ in toy.NOUNS for a in toy.ADJECTIVES)
        length_changed += len(words) != len(source.split())
    assert single_clauses > 1000 and verb_last == single_clauses
    assert adjective_after_noun > 300 and length_changed > 1500
