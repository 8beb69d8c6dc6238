"""Fine-tuning metrics against cases worked by hand from the official definitions."""

import json

import pytest

from megaeval.finetune.metrics import (
    accuracy,
    binary_f1,
    compute_exact,
    compute_f1,
    exact_match_score,
    f1_score,
    find_best_thresh,
    mnli_accuracy,
    normalize_answer,
    qqp_metrics,
    race_accuracy,
    squad_gold_answers,
    squad_v1_evaluate,
    squad_v2_evaluate,
)
from megaeval.finetune.readers import read_squad

# ----------------------------------------------------------------------------- classification


def test_accuracy_and_its_errors():
    assert accuracy([0, 1, 2, 2], [0, 1, 1, 2]) == 0.75
    with pytest.raises(ValueError, match="3 predictions but 2 labels"):
        accuracy([0, 1, 2], [0, 1])
    with pytest.raises(ValueError, match="no examples"):
        accuracy([], [])
    with pytest.raises(ValueError, match="test split has no labels"):
        accuracy([0], [None])


def test_qqp_f1_by_hand():
    # tp = 2 (items 0, 4), fp = 1 (item 1), fn = 1 (item 2), tn = 2:
    # precision = recall = 2/3, so F1 = 2/3; accuracy = 4/6.
    predictions = [1, 1, 0, 0, 1, 0]
    labels = [1, 0, 1, 0, 1, 0]
    assert binary_f1(predictions, labels) == pytest.approx(2 / 3)
    result = qqp_metrics(predictions, labels)
    assert result == pytest.approx({"accuracy": 4 / 6, "f1": 2 / 3, "acc_and_f1": 2 / 3})
    # P = 1/1, R = 1/3: F1 = 2 * 1 * (1/3) / (4/3) = 1/2; not the mean of P and R.
    assert binary_f1([1, 0, 0, 0], [1, 1, 1, 0]) == pytest.approx(0.5)
    # No positive predicted nor gold: sklearn's zero_division gives 0.0.
    assert binary_f1([0, 0], [0, 0]) == 0.0
    # The positive class is 1, not whichever is the majority.
    assert binary_f1([0, 0, 0, 1], [0, 0, 0, 0]) == 0.0


def test_mnli_matched_and_mismatched_apart():
    result = mnli_accuracy(matched=([0, 1, 2, 2], [0, 1, 2, 0]), mismatched=([1, 1], [1, 0]))
    assert result == {"matched": 0.75, "mismatched": 0.5}
    assert mnli_accuracy(mismatched=([2], [2])) == {"mismatched": 1.0}
    with pytest.raises(ValueError, match="give matched"):
        mnli_accuracy()


def test_race_all_pools_the_questions():
    # middle: 1 of 1 right; high: 1 of 3 right; all: 2 of 4 (not the mean 2/3 of the levels).
    result = race_accuracy([0, 1, 2, 3], [0, 1, 0, 0], ["middle", "high", "high", "high"])
    assert result == pytest.approx(
        {"middle": 1.0, "middle_total": 1, "high": 1 / 3, "high_total": 3, "all": 0.5, "total": 4}
    )
    assert race_accuracy([1], [1], ["high"]) == {
        "high": 1.0,
        "high_total": 1,
        "all": 1.0,
        "total": 1,
    }
    with pytest.raises(ValueError, match="unknown levels"):
        race_accuracy([1], [1], ["college"])


# ----------------------------------------------------------------------------- SQuAD normalization


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("the Cat sat", "cat sat"),
        ("a cat  sat.", "cat sat"),
        ("An apple, the pear & A plum!", "apple pear plum"),
        ("Theatre another anthem", "theatre another anthem"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("rock'n'roll", "rocknroll"),
        ("the", ""),
        ("  \t ", ""),
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


def test_v11_exact_match_and_f1_by_hand():
    assert exact_match_score("the Cat sat", "a cat  sat.") is True
    assert f1_score("the Cat sat", "a cat  sat.") == 1.0
    # pred [cat, sat, on, mat] (4), gold [cat, on, hat] (3), common {cat, on} = 2:
    # P = 2/4, R = 2/3, F1 = 2 * (1/2) * (2/3) / (1/2 + 2/3) = 4/7.
    assert f1_score("The cat sat on the mat", "cat on a hat") == pytest.approx(4 / 7)
    # Counter overlap: "cat" three times against once counts once. P = 1/3, R = 1/2, F1 = 2/5.
    assert f1_score("cat cat cat", "cat dog") == pytest.approx(0.4)
    assert f1_score("dog", "cat") == 0
    # v1.1 has no empty-answer rule: two empty answers match exactly but share no token.
    assert exact_match_score("", "the") is True and f1_score("", "the") == 0


def test_squad_v11_evaluate_by_hand():
    gold = {
        "q1": ["Cat sat", "the cat"],  # "a cat" matches the second exactly
        "q2": ["blue whale"],  # "whale": P = 1, R = 1/2, F1 = 2/3
        "q3": ["nothing"],  # unanswered: scores 0, counts in the total
    }
    predictions = {"q1": "a cat", "q2": "whale", "extra": "ignored"}
    with pytest.warns(UserWarning, match="1 unanswered question.*q3"):
        result = squad_v1_evaluate(gold, predictions)
    assert result == pytest.approx({"exact_match": 100 / 3, "f1": 100 * (1 + 2 / 3) / 3})


# ----------------------------------------------------------------------------- SQuAD v2.0


def test_v20_empty_answer_rule():
    assert compute_f1("", "") == 1 and compute_exact("", "") == 1
    assert compute_f1("", "London") == 0 and compute_f1("London", "") == 0
    assert compute_f1("", "the") == 1  # "the" normalizes to no token at all
    assert compute_f1("the Eiffel Tower", "Eiffel") == pytest.approx(2 / 3)


GOLD_V2 = {
    "h1": ["Paris"],
    "h2": ["the Eiffel Tower"],
    "n1": [],
    "n2": [],
}
PREDS_V2 = {"h1": "paris", "h2": "Eiffel", "n1": "", "n2": "London"}
# raw EM: h1 1, h2 0, n1 1, n2 0; raw F1: h1 1, h2 2/3, n1 1, n2 0.


def test_squad_v20_without_na_probs():
    result = squad_v2_evaluate(GOLD_V2, PREDS_V2)
    assert list(result) == [
        "exact",
        "f1",
        "total",
        "HasAns_exact",
        "HasAns_f1",
        "HasAns_total",
        "NoAns_exact",
        "NoAns_f1",
        "NoAns_total",
    ]
    assert result == pytest.approx(
        {
            "exact": 50.0,
            "f1": 100 * (1 + 2 / 3 + 1) / 4,
            "total": 4,
            "HasAns_exact": 50.0,
            "HasAns_f1": 100 * (1 + 2 / 3) / 2,
            "HasAns_total": 2,
            "NoAns_exact": 50.0,
            "NoAns_f1": 50.0,
            "NoAns_total": 2,
        }
    )


def test_squad_v20_threshold_and_best_threshold_by_hand():
    na_probs = {"h1": 0.1, "h2": 0.6, "n1": 0.4, "n2": 0.9}
    result = squad_v2_evaluate(GOLD_V2, PREDS_V2, na_probs=na_probs, na_prob_thresh=0.5)
    # Above 0.5 (h2, n2) the answer becomes "": h2 scores 0, n2 scores 1.
    # EM and F1 per question: h1 1, h2 0, n1 1, n2 1.
    # find_best_thresh, EM: start 2 (two no-answer questions), best 2 at 0.0;
    #   h1 (0.1) +1 -> 3, best 3 at 0.1; n1 (0.4) pred "" +0 -> 3; h2 (0.6) +0 -> 3;
    #   n2 (0.9) pred "London" -1 -> 2. best_exact = 3/4, threshold 0.1.
    # F1: h1 +1 -> 3 (at 0.1); n1 +0; h2 +2/3 -> 11/3, best at 0.6; n2 -1 -> 8/3.
    #   best_f1 = (11/3)/4, threshold 0.6.
    assert result == pytest.approx(
        {
            "exact": 75.0,
            "f1": 75.0,
            "total": 4,
            "HasAns_exact": 50.0,
            "HasAns_f1": 50.0,
            "HasAns_total": 2,
            "NoAns_exact": 100.0,
            "NoAns_f1": 100.0,
            "NoAns_total": 2,
            "best_exact": 75.0,
            "best_exact_thresh": 0.1,
            "best_f1": 100 * (11 / 3) / 4,
            "best_f1_thresh": 0.6,
        }
    )


def test_threshold_is_strictly_greater():
    # na_prob 1.0 with the default threshold 1.0 is not "above": n2 keeps its answer.
    na_probs = {"h1": 0.0, "h2": 0.0, "n1": 0.0, "n2": 1.0}
    result = squad_v2_evaluate(GOLD_V2, PREDS_V2, na_probs=na_probs)
    assert result["exact"] == 50.0 and result["NoAns_exact"] == 50.0


def test_best_thresh_uses_the_raw_prediction_text():
    # "the" normalizes to "", so the raw score of n is 1, yet find_best_thresh, as the
    # official script, sees a non-empty prediction for a no-answer question and counts -1:
    # start 1 (one no-answer question); n (0.2) -1 -> 0; h (0.3) +1 -> 1, not above 1.
    gold = {"n": [], "h": ["x"]}
    preds = {"n": "the", "h": "x"}
    na_probs = {"n": 0.2, "h": 0.3}
    result = squad_v2_evaluate(gold, preds, na_probs=na_probs)
    assert result["exact"] == 100.0
    assert (result["best_exact"], result["best_exact_thresh"]) == (50.0, 0.0)
    assert find_best_thresh(preds, {"n": 1, "h": 1}, na_probs, {"n": False, "h": True}) == (
        50.0,
        0.0,
    )


def test_best_thresh_ties_keep_na_probs_order_and_skip_unscored():
    # Equal na_probs: the stable sort keeps the mapping's order, so a has-answer question
    # first raises the score and sets the threshold. "other" is not scored: skipped.
    qid_to_has_ans = {"a": True, "b": False}
    scores = {"a": 1, "b": 0}
    preds = {"a": "yes", "b": "no"}
    na_probs = {"other": 0.0, "a": 0.5, "b": 0.5}
    # start 1; a +1 -> 2 (best, thresh 0.5); b -1 -> 1. 100 * 2 / 2 = 100.
    assert find_best_thresh(preds, scores, na_probs, qid_to_has_ans) == (100.0, 0.5)
    # b first: 1 - 1 = 0, then a: 0 + 1 = 1, never above the start: threshold stays 0.0.
    assert find_best_thresh(preds, scores, {"b": 0.5, "a": 0.5}, qid_to_has_ans) == (50.0, 0.0)


def test_v20_gold_answers_that_normalize_to_nothing():
    # has-answer (the list is not empty), but the only gold answer normalizes to "":
    # the gold becomes [""], so an empty prediction is exactly right.
    result = squad_v2_evaluate({"q": ["The"]}, {"q": ""})
    assert result["exact"] == 100.0 and result["HasAns_total"] == 1 and "NoAns_total" not in result


def test_v20_missing_prediction_or_na_prob():
    with pytest.raises(ValueError, match=r"1 question.*without a prediction.*n2"):
        squad_v2_evaluate(GOLD_V2, {k: v for k, v in PREDS_V2.items() if k != "n2"})
    with pytest.raises(ValueError, match="without an na_prob: h1"):
        squad_v2_evaluate(GOLD_V2, PREDS_V2, na_probs={"h2": 0.1, "n1": 0.1, "n2": 0.1})


def test_squad_examples_from_the_reader_are_gold(tmp_path):
    context = "Paris is the capital of France."
    data = {
        "version": "v2.0",
        "data": [
            {
                "title": "France",
                "paragraphs": [
                    {
                        "context": context,
                        "qas": [
                            {
                                "id": "a",
                                "question": "Capital?",
                                "is_impossible": False,
                                "answers": [
                                    {"text": "Paris", "answer_start": 0},
                                    {"text": "Paris is", "answer_start": 0},
                                ],
                            },
                            {"id": "b", "question": "Moon?", "is_impossible": True, "answers": []},
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "dev-v2.0.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    examples, problems = read_squad(path, version="2.0", strict=True)
    assert problems == []
    assert squad_gold_answers(examples) == {"a": ["Paris", "Paris is"], "b": []}
    result = squad_v2_evaluate(examples, {"a": "paris is", "b": ""})
    assert result["exact"] == 100.0 and result["NoAns_total"] == 1
