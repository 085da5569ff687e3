"""QA metrics (ldqa.eval.metrics), worked by hand.

Part 1: on ordinary English answers the numbers are the reference scripts' (SQuAD v1.1 evaluate-v1.1.py
`exact_match_score`/`f1_score`, LongBench `qa_f1_score`, Lost in the Middle `best_subspan_em`).
Part 2: the documented deviations (docs/documents-and-limits.md, "Metrics"): answers that SQuAD's normalization empties, empty
predictions, and CJK scored per character.
"""

import re
import string
from collections import Counter

import pytest

from ldqa.eval.metrics import best_subspan_em, exact_match, normalize_answer, token_f1

# ------------------------------------------------------------------ part 1: the references' behaviour


def test_normalize_answer_squad_rules():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("Theory") == "theory"  # 'the' only as a whole word
    assert normalize_answer("The") == normalize_answer("*") == ""  # unchanged: the metrics handle ""


def test_exact_match_reference_cases():
    assert exact_match("The Eiffel Tower!", ["eiffel tower"]) == 1.0  # case, article, punctuation
    assert exact_match("The Beatles", ["beatles"]) == 1.0
    assert exact_match("Beatles band", ["beatles"]) == 0.0
    assert exact_match("Paris", ["London", "paris."]) == 1.0  # max over the gold answers
    assert exact_match("a cat's toy", ["cats toy"]) == 1.0  # apostrophe dropped, not a separator


def test_token_f1_reference_cases_by_hand():
    # pred [beatles, band], gold [beatles]: p = 1/2, r = 1 -> F1 = 2/3
    assert token_f1("Beatles band", ["the Beatles"]) == pytest.approx(2 / 3, rel=1e-12)
    # pred [eiffel, tower, in, paris] (4), gold [eiffel, tower] (2): common 2, p = 1/2, r = 1 -> 2/3
    assert token_f1("The Eiffel Tower, in Paris", ["Eiffel Tower"]) == pytest.approx(2 / 3, rel=1e-12)
    # pred [gustave, eiffels, tower], gold [eiffel, tower]: common {tower}, p = 1/3, r = 1/2
    # -> 2 (1/6) / (5/6) = 2/5 ('eiffels' is not 'eiffel': no stemming)
    assert token_f1("Gustave Eiffel's tower", ["The Eiffel Tower"]) == pytest.approx(0.4, rel=1e-12)
    # counts are clipped: pred [tower, tower], gold [tower]: common 1, p = 1/2, r = 1 -> 2/3
    assert token_f1("tower tower", ["tower"]) == pytest.approx(2 / 3, rel=1e-12)
    assert token_f1("red car", ["blue", "red car"]) == 1.0  # max over the gold answers
    assert token_f1("London", ["Paris"]) == 0.0
    assert token_f1("", ["x"]) == 0.0


def test_best_subspan_em_reference_cases():
    assert best_subspan_em("It was built by Gustave Eiffel in 1889.", ["Gustave Eiffel"]) == 1.0
    assert best_subspan_em("Eiffel", ["Gustave Eiffel"]) == 0.0
    assert best_subspan_em("the answer is 1889", ["1890", "1889"]) == 1.0
    # the reference tests a plain substring of the normalized strings, not whole words: kept as is
    assert best_subspan_em("in 18890", ["1889"]) == 1.0
    assert best_subspan_em("The Beatles' song", ["the beatles"]) == 1.0
    assert best_subspan_em("Café Müller", ["cafe\u0301 müller"]) == 1.0  # NFC folds the combining accent
    for fn in (best_subspan_em, exact_match, token_f1):
        with pytest.raises(ValueError):
            fn("x", [])


def _ref_norm(s):  # SQuAD v1.1 normalize_answer, re-stated for the comparison below
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _ref_f1(pred, gold):  # SQuAD v1.1 f1_score = LongBench qa_f1_score
    p, g = _ref_norm(pred).split(), _ref_norm(gold).split()
    same = sum((Counter(p) & Counter(g)).values())
    return 0.0 if same == 0 else 2 * (same / len(p)) * (same / len(g)) / (same / len(p) + same / len(g))


_ENGLISH = [
    ("The Eiffel Tower!", ["eiffel tower"]),
    ("Wilhelm Conrad Röntgen received the first prize", ["Wilhelm Conrad Röntgen"]),
    ("Marie Curie and Pierre Curie", ["Marie Curie", "Pierre and Marie Curie"]),
    ("in 1956—1972, twice", ["1956—1972"]),
    ("the United States of America", ["United States", "USA"]),
    ("It's a dog, a dog", ["the dog"]),
    ("no idea", ["Paris, France"]),
    ("Theater of the Absurd", ["theatre of the absurd"]),
]


@pytest.mark.parametrize("pred,golds", _ENGLISH)
def test_same_numbers_as_the_references_on_english(pred, golds):
    assert exact_match(pred, golds) == float(any(_ref_norm(pred) == _ref_norm(g) for g in golds))
    assert token_f1(pred, golds) == pytest.approx(max(_ref_f1(pred, g) for g in golds), rel=1e-12)
    assert best_subspan_em(pred, golds) == float(any(_ref_norm(g) in _ref_norm(pred) for g in golds))


# ------------------------------------------------------------------ part 2: documented deviations


def test_answers_that_normalize_to_empty_never_match_automatically():
    # SQuAD empties both "the" and "an"; the references give EM 1 (and LitM's '"" in pred' is always true).
    # Here the gold "an" is compared with articles kept (level 1): "the" != "an".
    assert exact_match("the", ["an"]) == token_f1("the", ["an"]) == best_subspan_em("the", ["an"]) == 0.0
    # a correct article-only answer still counts: "A" vs "A" -> 1 under all three
    assert exact_match("A", ["A"]) == token_f1("A", ["A"]) == best_subspan_em("A", ["A"]) == 1.0
    assert exact_match("The.", ["the"]) == 1.0  # level 1 still drops punctuation
    # only-punctuation gold (NQ-open has one: '*' for the computer's multiplication sign): level 2
    assert exact_match("*", ["*"]) == token_f1("*", ["*"]) == best_subspan_em("*", ["*"]) == 1.0
    assert exact_match("x", ["*"]) == token_f1("x", ["*"]) == best_subspan_em("x", ["*"]) == 0.0
    # level 2 tokens [2, *, 3] vs [*]: p = 1/3, r = 1 -> F1 1/2; subspan: '*' is a whole token
    assert token_f1("2 * 3", ["*"]) == pytest.approx(0.5, rel=1e-12)
    assert best_subspan_em("2 * 3", ["*"]) == 1.0
    assert best_subspan_em("**bold**", ["*"]) == 0.0  # whole tokens only at levels 1-2
    assert best_subspan_em("cat", ["a"]) == 0.0  # not a substring match for an article gold
    assert best_subspan_em("anything", ["the"]) == 0.0


def test_article_gold_inside_a_longer_prediction():
    # gold "the" -> level 1, prediction at level 1: [the, answer, is, the]
    assert best_subspan_em("The answer is: the", ["the"]) == 1.0
    assert exact_match("The answer is: the", ["the"]) == 0.0
    # common 1 (clipped), p = 1/4, r = 1 -> 2 (1/4) / (5/4) = 2/5
    assert token_f1("The answer is: the", ["the"]) == pytest.approx(0.4, rel=1e-12)


def test_prediction_that_normalizes_to_empty():
    # The gold keeps a word under SQuAD, so the prediction is normalized with SQuAD too and has no token:
    # 0 everywhere, as SQuAD v1.1 (no credit for sharing an article).
    for pred in ("The", "a) a) a) a", "!!!"):
        for gold in (["The Who"], ["A computer program"], ["x"]):
            assert exact_match(pred, gold) == token_f1(pred, gold) == best_subspan_em(pred, gold) == 0.0


def test_empty_prediction_or_gold_never_scores():
    for pred in ("", "   ", "\n"):
        for golds in (["x"], ["the"], ["*"], [""], ["北京"]):
            assert exact_match(pred, golds) == token_f1(pred, golds) == best_subspan_em(pred, golds) == 0.0
    for golds in ([""], [" "], ["", "  "]):
        for pred in ("", "anything", "the"):
            assert exact_match(pred, golds) == token_f1(pred, golds) == best_subspan_em(pred, golds) == 0.0
    # an empty gold next to a real one: the real one decides
    assert exact_match("Paris", ["", "paris"]) == best_subspan_em("Paris", ["", "paris"]) == 1.0


def test_cjk_scored_per_character():
    # pred [北, 京, 市] (3), gold [北, 京] (2): common 2, p = 2/3, r = 1 -> 2 (2/3) / (5/3) = 0.8
    # (the references: one token each, no overlap -> 0)
    assert token_f1("北京市", ["北京"]) == pytest.approx(0.8, rel=1e-12)
    assert exact_match("北京市", ["北京"]) == 0.0
    assert best_subspan_em("北京市", ["北京"]) == 1.0
    assert exact_match("北京 市", ["北京市"]) == 1.0  # white space between CJK characters does not matter
    # Hangul too: [서, 울, 에] vs [서, 울] -> 0.8
    assert token_f1("서울에", ["서울"]) == pytest.approx(0.8, rel=1e-12)
    # mixed text: [tokyo, 東, 京, 都] (4) vs [東, 京]: p = 1/2, r = 1 -> 2/3
    assert token_f1("Tokyo 東京都", ["東京"]) == pytest.approx(2 / 3, rel=1e-12)
    assert token_f1("abc北京", ["ABC"]) == pytest.approx(0.5, rel=1e-12)  # [abc, 北, 京] vs [abc]: 2/4


def test_cjk_punctuation():
    # CJK punctuation (ideographic full stop, fullwidth !, kana middle dot) is dropped, as LongBench does
    assert exact_match("北京。", ["北京"]) == exact_match("北京！", ["北京"]) == 1.0
    assert exact_match("スマート・フォン", ["スマートフォン"]) == 1.0
    # ... and separates tokens: [paris, france] vs [paris]: p = 1/2, r = 1 -> 2/3
    assert token_f1("paris。france", ["paris"]) == pytest.approx(2 / 3, rel=1e-12)
    # general punctuation is kept as SQuAD keeps it (LongBench's Chinese rule would drop the curly
    # quotes): [“, 北, 京, ”] vs [北, 京]: p = 2/4, r = 1 -> 2/3
    assert token_f1("“北京”", ["北京"]) == pytest.approx(2 / 3, rel=1e-12)
    # a gold that is only CJK punctuation falls back to level 2
    assert exact_match("。", ["。"]) == 1.0 and exact_match("北京", ["。"]) == 0.0
    # NQ-open question 312's gold, a Japanese title inside an English answer
    gold = ["異世界はスマートフォンとともに"]
    assert best_subspan_em("It is 異世界はスマートフォンとともに (Isekai wa Sumātofon to Tomo ni).", gold) == 1.0
    assert exact_match("異世界はスマートフォンとともに。", gold) == 1.0


@pytest.mark.parametrize("pred,golds", _ENGLISH + [
    ("A", ["A"]), ("the", ["an"]), ("*", ["*"]), ("北京 市", ["北京市"]), ("北京市", ["北京"]), ("", ["x"]),
    ("The answer is: the", ["the"]), ("スマート・フォン", ["スマートフォン"]),
])
def test_metrics_agree(pred, golds):
    em, f1, sub = exact_match(pred, golds), token_f1(pred, golds), best_subspan_em(pred, golds)
    assert 0.0 <= f1 <= 1.0 and em in (0.0, 1.0) and sub in (0.0, 1.0)
    if em == 1.0:  # the same level and tokens for all three: EM 1 implies F1 1 and subspan 1
        assert f1 == 1.0 and sub == 1.0
