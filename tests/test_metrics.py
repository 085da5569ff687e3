import pytest

from ldqa.eval.metrics import best_subspan_em, exact_match, normalize_answer, token_f1


def test_normalize_answer_squad_rules():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("Theory") == "theory"  # 'the' only as a whole word


def test_best_subspan_em_hand_worked():
    assert best_subspan_em("It was built by Gustave Eiffel in 1889.", ["Gustave Eiffel"]) == 1.0
    assert best_subspan_em("Eiffel", ["Gustave Eiffel"]) == 0.0
    assert best_subspan_em("the answer is 1889", ["1890", "1889"]) == 1.0
    assert best_subspan_em("", ["x"]) == 0.0
    assert best_subspan_em("anything", ["the"]) == 0.0  # empty after normalization never matches
    assert best_subspan_em("Café Müller", ["cafe\u0301 müller"]) == 1.0  # NFC folds the combining accent
    with pytest.raises(ValueError):
        best_subspan_em("x", [])


def test_exact_match_and_f1():
    assert exact_match("The Beatles", ["beatles"]) == 1.0
    assert exact_match("Beatles band", ["beatles"]) == 0.0
    # pred tokens [beatles, band], gold [beatles]: p=1/2, r=1 -> f1 = 2/3
    assert token_f1("Beatles band", ["the Beatles"]) == pytest.approx(2 / 3)
    assert token_f1("", ["x"]) == 0.0
    assert token_f1("red car", ["blue", "red car"]) == 1.0
