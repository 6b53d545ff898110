"""Episode prompts hold each piece in its section and order; transition statistics by hand."""
import pytest

from dstrain.rl.episode import (Episode, episode_stats, hint_prompt, transition_stats, turn1_prompt,
                                turn2_prompt)

TASK = "What is 17 * 23?"
T1 = "17 * 23 = 381"
HINT_TEXT = "Check the product of 17 and 3."


def _in_order(text: str, pieces: list[str]) -> bool:
    pos = -1
    for piece in pieces:
        nxt = text.find(piece, pos + 1)
        if nxt <= pos:
            return False
        pos = nxt
    return True


def test_turn1_prompt():
    p = turn1_prompt(f"  {TASK}\n\n")
    assert p == f"Problem:\n{TASK}\n\nAnswer:\n"
    assert "Previous attempt:" not in p and "Hint:" not in p


def test_hint_prompt():
    p = hint_prompt(TASK, T1)
    assert _in_order(p, ["Problem:", TASK, "Previous attempt:", T1, "Hint:"])
    assert p.endswith("Hint:\n")  # the guidance model writes the hint next
    assert "Try again:" not in p


def test_turn2_prompt():
    p = turn2_prompt(TASK, T1 + "\n", "\n" + HINT_TEXT)
    assert _in_order(p, ["Problem:", TASK, "Previous attempt:", T1, "Hint:", HINT_TEXT, "Try again:", "Answer:"])
    assert p.endswith("Answer:\n")
    assert f"Previous attempt:\n{T1}\n\nHint:\n{HINT_TEXT}\n\nTry again:" in p
    assert p.count(TASK) == 1 and p.count(T1) == 1 and p.count(HINT_TEXT) == 1


def test_transition_stats_by_hand():
    #        ep:  0  1  2  3  4  5  6  7
    r1 = [1, 1, 0, 0, 0, 1, 0, 0]
    r2 = [1, 0, 1, 1, 0, 1, 0, 1]
    # t1 correct: 0,1,5 -> 3/8; t2 correct: 0,2,3,5,7 -> 5/8
    # incorrect->correct: 2,3,7 -> 3/8; correct->incorrect: 1 -> 1/8; delta = 2/8
    s = transition_stats(r1, r2)
    assert s["accuracy@t1"] == 3 / 8 and s["accuracy@t2"] == 5 / 8
    assert s["delta(t1,t2)"] == pytest.approx(2 / 8)
    assert s["incorrect_to_correct"] == 3 / 8 and s["correct_to_incorrect"] == 1 / 8
    assert s["delta(t1,t2)"] == pytest.approx(s["incorrect_to_correct"] - s["correct_to_incorrect"])
    assert s["episodes"] == 8


def test_episode_helpers():
    eps = [Episode(0, "a", "h", "b", 0.0, 1.0), Episode(1, "a", "h", "b", 1.0, 1.0),
           Episode(2, "a", "h", "b", 1.0, 0.0)]
    assert [e.improvement for e in eps] == [1.0, 0.0, -1.0]
    s = episode_stats(eps)
    assert s["accuracy@t1"] == pytest.approx(2 / 3) and s["accuracy@t2"] == pytest.approx(2 / 3)
    assert s["incorrect_to_correct"] == pytest.approx(1 / 3) and s["correct_to_incorrect"] == pytest.approx(1 / 3)


def test_transition_stats_rejects_bad_input():
    with pytest.raises(ValueError, match="paired"):
        transition_stats([1, 0], [1])
    with pytest.raises(ValueError, match="at least one"):
        transition_stats([], [])
