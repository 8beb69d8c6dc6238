"""Fine-tuning metrics of the Megatron-LM paper's Table 5, computed as the official scripts do.

* `accuracy`: the fraction of predictions equal to the labels (GLUE's simple_accuracy).
* `binary_f1`: F1 of the positive class 1, as sklearn.metrics.f1_score(average="binary"),
  which GLUE uses for QQP: 2*tp / (2*tp + fp + fn), and 0.0 when there is no positive in
  either the labels or the predictions (sklearn's zero_division default). `qqp_metrics`
  gives accuracy, F1 and their mean "acc_and_f1" (GLUE's acc_and_f1).
* `mnli_accuracy`: accuracy on dev_matched and dev_mismatched, each reported on its own.
* `race_accuracy`: accuracy on the middle and the high questions, and on all questions
  pooled ("all"), which is the RACE score (not the mean of the two levels).
* SQuAD v1.1: `normalize_answer`, `exact_match_score`, `f1_score`,
  `metric_max_over_ground_truths` and `squad_v1_evaluate` are the official evaluate-v1.1.py
  (its `evaluate`): the max over the gold answers of each question, averaged and x100;
  a question without a prediction scores 0 and still counts in the total (with a warning, as
  the script prints one). Result: {"exact_match", "f1"}.
* SQuAD v2.0: `get_tokens`, `compute_exact`, `compute_f1`, `get_raw_scores`,
  `apply_no_ans_threshold`, `make_eval_dict` and `find_best_thresh` are the official
  evaluate-v2.0.py; `squad_v2_evaluate` is its `main` (without the precision-recall plots).
  A question without a prediction raises ValueError: the official script cannot score it
  either (it fails with a KeyError in the HasAns/NoAns breakdown).

Classification metrics are fractions in [0, 1], as GLUE reports them; the SQuAD results are
percentages, as the official scripts print them.

SQuAD gold answers are given as a mapping question id -> the texts of its gold answers (an
empty list for a v2 unanswerable question) or as the `SquadExample`s of
`megaeval.finetune.readers.read_squad` (`squad_gold_answers` converts them).
"""

from __future__ import annotations

import collections
import re
import string
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from megaeval.finetune.readers import SquadExample

# ----------------------------------------------------------------------------- classification


def _check_pairs(predictions: Sequence[int], labels: Sequence[int | None], what: str) -> None:
    if len(predictions) != len(labels):
        raise ValueError(
            f"{what}: {len(predictions)} predictions but {len(labels)} labels; they must pair up"
        )
    if not labels:
        raise ValueError(f"{what}: no examples to score")
    if any(label is None for label in labels):
        raise ValueError(f"{what}: a label is None (a test split has no labels to score against)")


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """The fraction of predictions equal to their labels (GLUE's simple_accuracy)."""
    _check_pairs(predictions, labels, "accuracy")
    return sum(int(p == y) for p, y in zip(predictions, labels, strict=True)) / len(labels)


def binary_f1(predictions: Sequence[int], labels: Sequence[int], positive: int = 1) -> float:
    """F1 of the `positive` class, as sklearn.metrics.f1_score(average="binary") (GLUE QQP).

    2*tp / (2*tp + fp + fn), which is 2PR/(P+R); 0.0 when the labels and the predictions
    hold no positive at all (sklearn's zero_division default, with its warning left out).
    """
    _check_pairs(predictions, labels, "binary_f1")
    pairs = list(zip(predictions, labels, strict=True))
    tp = sum(1 for p, y in pairs if p == positive and y == positive)
    fp = sum(1 for p, y in pairs if p == positive and y != positive)
    fn = sum(1 for p, y in pairs if p != positive and y == positive)
    denominator = 2 * tp + fp + fn
    return 2 * tp / denominator if denominator else 0.0


def qqp_metrics(predictions: Sequence[int], labels: Sequence[int]) -> dict[str, float]:
    """QQP as GLUE scores it: {"accuracy", "f1" (class 1), "acc_and_f1" (their mean)}."""
    acc = accuracy(predictions, labels)
    f1 = binary_f1(predictions, labels, positive=1)
    return {"accuracy": acc, "f1": f1, "acc_and_f1": (acc + f1) / 2}


def mnli_accuracy(
    *,
    matched: tuple[Sequence[int], Sequence[int]] | None = None,
    mismatched: tuple[Sequence[int], Sequence[int]] | None = None,
) -> dict[str, float]:
    """MNLI accuracy per dev split: {"matched": ..., "mismatched": ...} from (predictions, labels).

    The two are reported separately (MNLI m/mm), never pooled; a split not given is left out.
    """
    if matched is None and mismatched is None:
        raise ValueError(
            "mnli_accuracy: give matched=(predictions, labels), mismatched=..., or both"
        )
    result = {}
    for name, pair in (("matched", matched), ("mismatched", mismatched)):
        if pair is not None:
            predictions, labels = pair
            result[name] = accuracy(predictions, labels)
    return result


def race_accuracy(
    predictions: Sequence[int], labels: Sequence[int], levels: Sequence[str]
) -> dict[str, float | int]:
    """RACE accuracy: "middle", "high" and "all" (every question pooled), with their counts.

    `levels[i]` is the level ("middle" or "high") of question i, e.g. `RaceExample.level`.
    Keys: "middle", "high", "all" (fractions) and "middle_total", "high_total", "total"; a
    level without questions is left out.
    """
    _check_pairs(predictions, labels, "race_accuracy")
    if len(levels) != len(labels):
        raise ValueError(f"race_accuracy: {len(levels)} levels but {len(labels)} labels")
    unknown = sorted({lv for lv in levels if lv not in ("middle", "high")})
    if unknown:
        raise ValueError(f"race_accuracy: unknown levels {unknown} (expected middle or high)")
    result: dict[str, float | int] = {}
    for level in ("middle", "high"):
        picked = [i for i, lv in enumerate(levels) if lv == level]
        if picked:
            result[level] = accuracy([predictions[i] for i in picked], [labels[i] for i in picked])
            result[f"{level}_total"] = len(picked)
    result["all"] = accuracy(predictions, labels)
    result["total"] = len(labels)
    return result


# ----------------------------------------------------------------------------- SQuAD, shared

Gold = Mapping[str, Sequence[str]] | Iterable[SquadExample]


def squad_gold_answers(examples: Iterable[SquadExample]) -> dict[str, list[str]]:
    """question id -> gold answer texts ([] for a v2 unanswerable question), in file order."""
    return {e.id: [a.text for a in e.answers] for e in examples}


def _gold(gold: Gold) -> dict[str, list[str]]:
    if isinstance(gold, Mapping):
        result = {qid: list(answers) for qid, answers in gold.items()}
    else:
        result = squad_gold_answers(gold)
    if not result:
        raise ValueError("SQuAD evaluation: no gold questions")
    return result


def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation, drop the articles a/an/the, collapse whitespace.

    The same function in evaluate-v1.1.py and evaluate-v2.0.py (the v2.0 regex adds
    re.UNICODE, which is Python 3's default for str patterns).
    """

    def remove_articles(text: str) -> str:
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text: str) -> str:
        return " ".join(text.split())

    def remove_punc(text: str) -> str:
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


# ----------------------------------------------------------------------------- SQuAD v1.1


def f1_score(prediction: str, ground_truth: str) -> float:
    """evaluate-v1.1.py f1_score: token F1 of the normalized answers (Counter overlap).

    No special case for empty answers: no common token gives 0 (even both empty).
    """
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    """evaluate-v1.1.py exact_match_score: the normalized answers are equal."""
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def metric_max_over_ground_truths(
    metric_fn: Callable[[str, str], float], prediction: str, ground_truths: Sequence[str]
) -> float:
    """evaluate-v1.1.py: the best score of the prediction against any gold answer."""
    return max(metric_fn(prediction, ground_truth) for ground_truth in ground_truths)


def squad_v1_evaluate(gold: Gold, predictions: Mapping[str, str]) -> dict[str, float]:
    """evaluate-v1.1.py `evaluate`: {"exact_match", "f1"}, both x100, over every gold question.

    A question without a prediction scores 0 and counts in the total (a warning names it, as
    the script prints "Unanswered question ... will receive score 0."); predictions for
    questions not in `gold` are ignored.
    """
    gold = _gold(gold)
    f1 = exact_match = 0.0
    total = 0
    unanswered = []
    for qid, ground_truths in gold.items():
        total += 1
        if qid not in predictions:
            unanswered.append(qid)
            continue
        if not ground_truths:
            raise ValueError(f"SQuAD v1.1 question {qid} has no gold answer (v1.1 needs one)")
        prediction = predictions[qid]
        exact_match += metric_max_over_ground_truths(exact_match_score, prediction, ground_truths)
        f1 += metric_max_over_ground_truths(f1_score, prediction, ground_truths)
    if unanswered:
        warnings.warn(
            f"{len(unanswered)} unanswered question(s) receive score 0 "
            f"(as in evaluate-v1.1.py): {', '.join(unanswered[:5])}",
            stacklevel=2,
        )
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


# ----------------------------------------------------------------------------- SQuAD v2.0


def get_tokens(s: str) -> list[str]:
    """evaluate-v2.0.py get_tokens: the normalized answer's tokens ([] for "")."""
    if not s:
        return []
    return normalize_answer(s).split()


def compute_exact(a_gold: str, a_pred: str) -> int:
    """evaluate-v2.0.py compute_exact: 1 if the normalized answers are equal, else 0."""
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    """evaluate-v2.0.py compute_f1: token F1; if either side has no token, 1 iff both have none."""
    gold_toks = get_tokens(a_gold)
    pred_toks = get_tokens(a_pred)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        # If either is no-answer, then F1 is 1 if they agree, 0 otherwise.
        return int(gold_toks == pred_toks)
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(pred_toks)
    recall = 1.0 * num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def get_raw_scores(
    gold: Mapping[str, Sequence[str]], preds: Mapping[str, str]
) -> tuple[dict[str, int], dict[str, float]]:
    """evaluate-v2.0.py get_raw_scores: per-question EM and F1, max over the gold answers.

    Gold answers that normalize to "" are dropped; a question left with none has [""] as its
    only gold answer. Questions without a prediction are left out (the script prints them).
    """
    exact_scores: dict[str, int] = {}
    f1_scores: dict[str, float] = {}
    for qid, answers in gold.items():
        gold_answers = [a for a in answers if normalize_answer(a)]
        if not gold_answers:
            # For unanswerable questions, only correct answer is empty string.
            gold_answers = [""]
        if qid not in preds:
            continue
        a_pred = preds[qid]
        exact_scores[qid] = max(compute_exact(a, a_pred) for a in gold_answers)
        f1_scores[qid] = max(compute_f1(a, a_pred) for a in gold_answers)
    return exact_scores, f1_scores


def apply_no_ans_threshold(
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    qid_to_has_ans: Mapping[str, bool],
    na_prob_thresh: float,
) -> dict[str, float]:
    """evaluate-v2.0.py: where na_prob > thresh, the answer is "" (scores 1 iff no gold answer)."""
    new_scores = {}
    for qid, s in scores.items():
        pred_na = na_probs[qid] > na_prob_thresh
        if pred_na:
            new_scores[qid] = float(not qid_to_has_ans[qid])
        else:
            new_scores[qid] = s
    return new_scores


def make_eval_dict(
    exact_scores: Mapping[str, float],
    f1_scores: Mapping[str, float],
    qid_list: Sequence[str] | None = None,
) -> dict[str, Any]:
    """evaluate-v2.0.py make_eval_dict: {"exact", "f1" (x100), "total"} over `qid_list` or all."""
    if not qid_list:
        total = len(exact_scores)
        return {
            "exact": 100.0 * sum(exact_scores.values()) / total,
            "f1": 100.0 * sum(f1_scores.values()) / total,
            "total": total,
        }
    total = len(qid_list)
    return {
        "exact": 100.0 * sum(exact_scores[k] for k in qid_list) / total,
        "f1": 100.0 * sum(f1_scores[k] for k in qid_list) / total,
        "total": total,
    }


def find_best_thresh(
    preds: Mapping[str, str],
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    qid_to_has_ans: Mapping[str, bool],
) -> tuple[float, float]:
    """evaluate-v2.0.py find_best_thresh: (best score x100, the na_prob threshold giving it).

    Starts from "every question answered no-answer" (score = the number of unanswerable
    questions, threshold 0.0) and walks the questions in increasing na_prob (a stable sort, so
    ties keep `na_probs`' order), answering one more each step: an answerable question adds
    its score, an unanswerable one loses 1 if its raw prediction is non-empty (0 if empty).
    The threshold moves to a question's na_prob only when the running score beats the best.
    """
    num_no_ans = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    cur_score = num_no_ans
    best_score = cur_score
    best_thresh = 0.0
    qid_list = sorted(na_probs, key=lambda k: na_probs[k])
    for qid in qid_list:
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        elif preds[qid]:
            diff = -1
        else:
            diff = 0
        cur_score += diff
        if cur_score > best_score:
            best_score = cur_score
            best_thresh = na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def squad_v2_evaluate(
    gold: Gold,
    predictions: Mapping[str, str],
    na_probs: Mapping[str, float] | None = None,
    na_prob_thresh: float = 1.0,
) -> dict[str, Any]:
    """evaluate-v2.0.py `main`: exact, f1, total, HasAns_*/NoAns_* and, given na_probs, best_*.

    `predictions`: question id -> answer text ("" for no answer). `na_probs`: question id ->
    the model's no-answer probability (the script's --na-prob-file); a question whose na_prob
    exceeds `na_prob_thresh` (default 1.0) is scored as answered "". Without na_probs every
    na_prob is 0.0 and there are no best_* keys, as in the script. HasAns_* (NoAns_*) keys are
    present only if some question has (has no) gold answer. Every gold question needs a
    prediction and, if na_probs is given, an na_prob.
    """
    gold = _gold(gold)
    missing = [qid for qid in gold if qid not in predictions]
    if missing:
        raise ValueError(
            f"SQuAD v2.0: {len(missing)} question(s) without a prediction "
            f"(evaluate-v2.0.py cannot score them either): {', '.join(missing[:5])}"
        )
    qid_to_has_ans = {qid: bool(answers) for qid, answers in gold.items()}
    has_ans_qids = [k for k, v in qid_to_has_ans.items() if v]
    no_ans_qids = [k for k, v in qid_to_has_ans.items() if not v]
    exact_raw, f1_raw = get_raw_scores(gold, predictions)
    probs = na_probs if na_probs is not None else {k: 0.0 for k in predictions}
    absent = [qid for qid in exact_raw if qid not in probs]
    if absent:
        raise ValueError(
            f"SQuAD v2.0: {len(absent)} question(s) without an na_prob: {', '.join(absent[:5])}"
        )
    exact_thresh = apply_no_ans_threshold(exact_raw, probs, qid_to_has_ans, na_prob_thresh)
    f1_thresh = apply_no_ans_threshold(f1_raw, probs, qid_to_has_ans, na_prob_thresh)
    out_eval = make_eval_dict(exact_thresh, f1_thresh)
    if has_ans_qids:
        has_ans_eval = make_eval_dict(exact_thresh, f1_thresh, qid_list=has_ans_qids)
        out_eval.update({f"HasAns_{k}": v for k, v in has_ans_eval.items()})
    if no_ans_qids:
        no_ans_eval = make_eval_dict(exact_thresh, f1_thresh, qid_list=no_ans_qids)
        out_eval.update({f"NoAns_{k}": v for k, v in no_ans_eval.items()})
    if na_probs is not None:
        best_exact, exact_best_thresh = find_best_thresh(
            predictions, exact_raw, na_probs, qid_to_has_ans
        )
        best_f1, f1_best_thresh = find_best_thresh(predictions, f1_raw, na_probs, qid_to_has_ans)
        out_eval["best_exact"] = best_exact
        out_eval["best_exact_thresh"] = exact_best_thresh
        out_eval["best_f1"] = best_f1
        out_eval["best_f1_thresh"] = f1_best_thresh
    return out_eval
