"""SQuAD 1.1/2.0 features and answer extraction for BERT fine-tuning (no model code).

What it matches: BERT's reference implementation, Google's `run_squad.py`
(`convert_examples_to_features`, `_check_is_max_context`, `write_predictions`), which
Hugging Face's legacy `run_squad.py` / `squad_metrics.compute_predictions_logits` copy.

* `squad_features`: one `SquadFeature` per window ("doc span") of a question's context.
  The question's WordPiece tokens are cut to `max_query_length`; the context's tokens are
  covered by windows of at most `max_seq_length - len(query) - 3` tokens, a new one starting
  every `doc_stride` tokens until one reaches the context's end (run_squad.py's loop, so the
  last window ends at the last context token). A feature is
  `[CLS] query [SEP] window [SEP]` padded with [PAD] to `max_seq_length`, token types 0 for
  `[CLS] query [SEP]` and 1 for `window [SEP]` (0 on padding), `padding_mask` True on real
  tokens, the map from a window position to its character span in the context, and
  `token_is_max_context` (the window in which a token has the most context,
  min(left, right) + 0.01 * window length, the first window winning ties). For training, the
  FIRST gold answer's token span within the feature, or (0, 0) ([CLS]) when the answer is not
  fully inside the window or the question is a v2 impossible one.
* `squad_predictions`: run_squad.py's `write_predictions`: over every feature of an example,
  the pairs of its `n_best_size` best start and end logits, both inside the window, end >=
  start, at most `max_answer_length` tokens, the start having its max context in that
  feature; the best start_logit + end_logit wins. The answer is the ORIGINAL context from the
  start token's first character to the end token's last, so casing, accents and spacing
  are the context's own, as the official evaluation scripts expect.
  For v2, `na_probs` holds HF's `null_score_diff`: the null score (the least
  start_logits[0] + end_logits[0], at [CLS], over the example's features) minus the best
  non-null score, and the prediction is "" where it exceeds `null_score_diff_threshold`
  (0.0 by default, as in run_squad.py).

Where this differs from run_squad.py, on purpose:
* Tokens come from `tokenizers` with character offsets into the original context instead of
  whitespace words + `_improve_answer_span` + `get_final_text`: the answer's characters
  [answer_start, answer_start + len(text)) map to the context tokens overlapping them, and a
  predicted span maps back to context[first char : last char] directly. (BertNormalizer
  lowercases and strips accents but keeps the offsets on the original string.)
* A context without any token still gets one feature (an empty window), so every example has
  a prediction ("" with na_prob +inf); run_squad.py would make no feature and drop it.
* An example with no valid non-null candidate is predicted "" (run_squad.py writes "empty"),
  with na_prob +inf (there is no non-null score to subtract).
* A gold answer that no token overlaps (only whitespace or characters the normalizer drops)
  gets (0, 0) in every window; run_squad.py skips such a training example.

The v2 threshold, the official way: `squad_predictions(..., version_2=True,
null_score_diff_threshold=math.inf)` gives the best non-null answer of every question;
`squad_v2_evaluate(gold, predictions, na_probs, na_prob_thresh=0.0)` then scores them at
threshold 0 and finds best_exact_thresh / best_f1_thresh, and
`apply_null_threshold(predictions, na_probs, threshold)` gives the answers at that threshold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megaeval.finetune.readers import SquadExample

CLS_TOKEN = "[CLS]"
SEP_TOKEN = "[SEP]"
PAD_TOKEN = "[PAD]"


@dataclass(frozen=True)
class SquadFeature:
    """One window of an example's context, as the model sees it.

    Positions are indices into `input_ids` (0 is [CLS]). `token_to_char` and
    `token_is_max_context` have a key for each window position and no other.
    """

    example_index: int  # index of the example in the list given to squad_features
    example_id: str  # SquadExample.id
    window_index: int  # which window of the example (run_squad.py's doc_span_index)
    window_start: int  # index of the window's first token among the context's tokens
    window_length: int  # number of context tokens in the window
    context_offset: int  # position of the window's first token: 2 + the query's length
    input_ids: list[int]  # [CLS] query [SEP] window [SEP] [PAD]...
    token_type_ids: list[int]  # 0 for [CLS] query [SEP] (and padding), 1 for window [SEP]
    padding_mask: list[bool]  # True on real tokens, False on [PAD]
    token_to_char: dict[int, tuple[int, int]]  # window position -> (start, end) chars
    token_is_max_context: dict[int, bool]  # window position -> this window is its best
    start_position: int | None = None  # training target; 0 ([CLS]) when not in the window
    end_position: int | None = None  # None when features were made with is_training=False


def _special_id(tokenizer: Any, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token} token (a BERT WordPiece vocab needs it)")
    return token_id


def _plain_tokenizer(tokenizer: Any) -> Any:
    """A `tokenizers.Tokenizer` that neither truncates nor pads (a copy if the given one does)."""
    tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a transformers fast one
    if tokenizer.truncation is None and tokenizer.padding is None:
        return tokenizer
    copy = type(tokenizer).from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


MAX_QUERY_LENGTH = 64  # run_squad.py's: a longer question is cut to its first 64 tokens


def doc_spans(num_tokens: int, max_tokens_for_doc: int, doc_stride: int) -> list[tuple[int, int]]:
    """run_squad.py's windows over `num_tokens` context tokens: (start, length) pairs.

    A window of at most `max_tokens_for_doc` tokens starts every `doc_stride` tokens (or every
    window length, if that is shorter) until one reaches the end. No token gives [(0, 0)].
    """
    if max_tokens_for_doc < 1:
        raise ValueError(f"max_tokens_for_doc must be >= 1, got {max_tokens_for_doc}")
    if doc_stride < 1:
        raise ValueError(f"doc_stride must be >= 1, got {doc_stride}")
    if num_tokens == 0:
        return [(0, 0)]
    spans = []
    start = 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens_for_doc)
        spans.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, doc_stride)
    return spans


def check_is_max_context(spans: Sequence[tuple[int, int]], span_index: int, position: int) -> bool:
    """run_squad.py's `_check_is_max_context`: is `spans[span_index]` the best for `position`?

    A token's score in a window is min(tokens left of it, tokens right of it) + 0.01 * the
    window's length; the best score wins, the first window on ties.
    """
    best_score = None
    best_span_index = None
    for index, (start, length) in enumerate(spans):
        end = start + length - 1
        if position < start or position > end:
            continue
        num_left_context = position - start
        num_right_context = end - position
        score = min(num_left_context, num_right_context) + 0.01 * length
        if best_score is None or score > best_score:
            best_score = score
            best_span_index = index
    return span_index == best_span_index


def _max_context_windows(spans: Sequence[tuple[int, int]], num_tokens: int) -> list[int]:
    """For every token, the index of its max-context window (check_is_max_context, batched)."""
    best_score = np.full(num_tokens, -np.inf)
    best_span = np.full(num_tokens, -1, dtype=np.int64)
    for index, (start, length) in enumerate(spans):
        if length == 0:
            continue
        offsets = np.arange(length)
        score = np.minimum(offsets, length - 1 - offsets) + 0.01 * length
        window = slice(start, start + length)
        better = score > best_score[window]
        best_score[window] = np.where(better, score, best_score[window])
        best_span[window] = np.where(better, index, best_span[window])
    return best_span.tolist()


def _answer_token_span(
    offsets: Sequence[tuple[int, int]], char_start: int, char_end: int
) -> tuple[int, int] | None:
    """The first and last context tokens overlapping characters [char_start, char_end)."""
    covering = [i for i, (s, e) in enumerate(offsets) if s < char_end and e > char_start]
    if not covering:
        return None
    return covering[0], covering[-1]


def squad_features(
    examples: Sequence[SquadExample],
    tokenizer: Any,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = MAX_QUERY_LENGTH,
    is_training: bool = True,
) -> list[SquadFeature]:
    """run_squad.py's `convert_examples_to_features`: the windows of every example, in order.

    `tokenizer` is a BERT WordPiece `tokenizers.Tokenizer` (or a transformers fast tokenizer,
    whose backend is used) with [CLS], [SEP] and [PAD]; special tokens are added here, not by
    its post-processor, and its truncation/padding settings (if any) are ignored.
    With `is_training`, each feature carries start/end positions (see the module docstring).
    """
    if max_query_length < 0:
        raise ValueError(f"max_query_length must be >= 0, got {max_query_length}")
    tokenizer = _plain_tokenizer(tokenizer)
    cls_id = _special_id(tokenizer, CLS_TOKEN)
    sep_id = _special_id(tokenizer, SEP_TOKEN)
    pad_id = _special_id(tokenizer, PAD_TOKEN)

    # Many questions share a context: tokenize each distinct text once.
    contexts = list(dict.fromkeys(e.context for e in examples))
    questions = list(dict.fromkeys(e.question for e in examples))
    context_enc = dict(
        zip(contexts, tokenizer.encode_batch(contexts, add_special_tokens=False), strict=True)
    )
    question_ids = {
        q: enc.ids[:max_query_length]
        for q, enc in zip(
            questions, tokenizer.encode_batch(questions, add_special_tokens=False), strict=True
        )
    }

    features: list[SquadFeature] = []
    for example_index, example in enumerate(examples):
        query = question_ids[example.question]
        encoding = context_enc[example.context]
        doc_ids = encoding.ids
        offsets = encoding.offsets
        max_tokens_for_doc = max_seq_length - len(query) - 3
        if max_tokens_for_doc < 1:
            raise ValueError(
                f"max_seq_length {max_seq_length} leaves no room for the context after a "
                f"{len(query)}-token question (question {example.id}; lower max_query_length)"
            )

        answer_span = None
        if is_training and not example.is_impossible and example.answers:
            answer = example.answers[0]
            answer_span = _answer_token_span(
                offsets, answer.answer_start, answer.answer_start + len(answer.text)
            )

        spans = doc_spans(len(doc_ids), max_tokens_for_doc, doc_stride)
        context_offset = len(query) + 2
        max_context_window = _max_context_windows(spans, len(doc_ids))
        for window_index, (start, length) in enumerate(spans):
            input_ids = [cls_id, *query, sep_id, *doc_ids[start : start + length], sep_id]
            token_type_ids = [0] * (len(query) + 2) + [1] * (length + 1)
            n_real = len(input_ids)
            n_pad = max_seq_length - n_real
            input_ids += [pad_id] * n_pad
            token_type_ids += [0] * n_pad
            padding_mask = [True] * n_real + [False] * n_pad

            token_to_char = {context_offset + i: tuple(offsets[start + i]) for i in range(length)}
            token_is_max_context = {
                context_offset + i: max_context_window[start + i] == window_index
                for i in range(length)
            }

            start_position = end_position = None
            if is_training:
                start_position = end_position = 0
                if answer_span is not None:
                    first, last = answer_span
                    if first >= start and last <= start + length - 1:
                        start_position = first - start + context_offset
                        end_position = last - start + context_offset

            features.append(
                SquadFeature(
                    example_index=example_index,
                    example_id=example.id,
                    window_index=window_index,
                    window_start=start,
                    window_length=length,
                    context_offset=context_offset,
                    input_ids=input_ids,
                    token_type_ids=token_type_ids,
                    padding_mask=padding_mask,
                    token_to_char=token_to_char,
                    token_is_max_context=token_is_max_context,
                    start_position=start_position,
                    end_position=end_position,
                )
            )
    return features


def squad_feature_arrays(features: Sequence[SquadFeature]) -> dict[str, np.ndarray]:
    """The features as batched arrays: input_ids, token_type_ids (int64), padding_mask (bool),
    and, if the features carry them, start_positions and end_positions (int64)."""
    if not features:
        raise ValueError("squad_feature_arrays: no features")
    arrays = {
        "input_ids": np.array([f.input_ids for f in features], dtype=np.int64),
        "token_type_ids": np.array([f.token_type_ids for f in features], dtype=np.int64),
        "padding_mask": np.array([f.padding_mask for f in features], dtype=bool),
    }
    if all(f.start_position is not None for f in features):
        arrays["start_positions"] = np.array([f.start_position for f in features], np.int64)
        arrays["end_positions"] = np.array([f.end_position for f in features], np.int64)
    return arrays


def _best_indexes(logits: np.ndarray, n_best_size: int) -> list[int]:
    """run_squad.py's `_get_best_indexes`: the n best positions, the earlier one on ties."""
    order = np.argsort(-logits, kind="stable")
    return [int(i) for i in order[:n_best_size]]


def squad_predictions(
    examples: Sequence[SquadExample],
    features: Sequence[SquadFeature],
    start_logits: Sequence[Any],
    end_logits: Sequence[Any],
    n_best_size: int = 20,
    max_answer_length: int = 30,
    version_2: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> tuple[dict[str, str], dict[str, float]]:
    """run_squad.py's `write_predictions`: (question id -> answer text, question id -> na_prob).

    `start_logits[i]` / `end_logits[i]` are feature i's logits over its `max_seq_length`
    positions (anything numpy can read: lists, arrays, rows of a [features, seq] array).
    na_prob is the null score minus the best non-null score (HF's `null_score_diff`; +inf
    when there is no valid non-null candidate), computed for v1.1 too. With `version_2`, the
    prediction is "" where na_prob > `null_score_diff_threshold`; otherwise it is the best
    non-null answer ("" only when there is none).
    """
    if len(start_logits) != len(features) or len(end_logits) != len(features):
        raise ValueError(
            f"squad_predictions: {len(features)} features but {len(start_logits)} start and "
            f"{len(end_logits)} end logit rows"
        )
    if n_best_size < 1 or max_answer_length < 1:
        raise ValueError("squad_predictions: n_best_size and max_answer_length must be >= 1")
    by_example: dict[int, list[int]] = {}
    for i, feature in enumerate(features):
        if not 0 <= feature.example_index < len(examples):
            raise ValueError(
                f"feature {i} names example {feature.example_index}, "
                f"but {len(examples)} examples were given"
            )
        if examples[feature.example_index].id != feature.example_id:
            raise ValueError(
                f"feature {i} is for question {feature.example_id}, but example "
                f"{feature.example_index} is question {examples[feature.example_index].id} "
                "(give the examples the features were made from, in the same order)"
            )
        by_example.setdefault(feature.example_index, []).append(i)
    missing = [e.id for k, e in enumerate(examples) if k not in by_example]
    if missing:
        raise ValueError(
            f"squad_predictions: {len(missing)} example(s) without a feature: "
            f"{', '.join(missing[:5])}"
        )

    predictions: dict[str, str] = {}
    na_probs: dict[str, float] = {}
    for example_index, example in enumerate(examples):
        score_null = math.inf
        best: tuple[float, int, int, int] | None = None  # (score, feature, start, end)
        for i in by_example[example_index]:
            feature = features[i]
            starts = np.asarray(start_logits[i], dtype=np.float64).reshape(-1)
            ends = np.asarray(end_logits[i], dtype=np.float64).reshape(-1)
            if len(starts) != len(feature.input_ids) or len(ends) != len(feature.input_ids):
                raise ValueError(
                    f"feature {i}: {len(starts)} start and {len(ends)} end logits for "
                    f"{len(feature.input_ids)} positions"
                )
            score_null = min(score_null, float(starts[0] + ends[0]))
            end_indexes = _best_indexes(ends, n_best_size)
            for s in _best_indexes(starts, n_best_size):
                if s not in feature.token_to_char or not feature.token_is_max_context[s]:
                    continue
                for e in end_indexes:
                    if e not in feature.token_to_char or e < s:
                        continue
                    if e - s + 1 > max_answer_length:
                        continue
                    score = float(starts[s] + ends[e])
                    if best is None or score > best[0]:  # the first candidate on ties
                        best = (score, i, s, e)
        if best is None:
            predictions[example.id] = ""
            na_probs[example.id] = math.inf
            continue
        score, i, s, e = best
        text = example.context[features[i].token_to_char[s][0] : features[i].token_to_char[e][1]]
        na_prob = score_null - score
        na_probs[example.id] = na_prob
        null = version_2 and na_prob > null_score_diff_threshold
        predictions[example.id] = "" if null else text
    return predictions, na_probs


def apply_null_threshold(
    predictions: Mapping[str, str], na_probs: Mapping[str, float], threshold: float
) -> dict[str, str]:
    """The predictions with "" wherever na_prob > `threshold` (evaluate-v2.0.py's rule).

    Use it with squad_v2_evaluate's best_f1_thresh (or best_exact_thresh) on the best
    non-null predictions (see the module docstring).
    """
    missing = [qid for qid in predictions if qid not in na_probs]
    if missing:
        raise ValueError(
            f"apply_null_threshold: {len(missing)} prediction(s) without an na_prob: "
            f"{', '.join(missing[:5])}"
        )
    return {qid: "" if na_probs[qid] > threshold else text for qid, text in predictions.items()}
