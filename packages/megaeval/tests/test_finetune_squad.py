"""SQuAD features (windows, max context, answer positions) and answer extraction, on tiny
WordPiece tokenizers, against run_squad.py's rules."""

import math

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from megaeval.finetune.metrics import squad_v1_evaluate, squad_v2_evaluate
from megaeval.finetune.readers import SquadAnswer, SquadExample
from megaeval.finetune.squad import (
    apply_null_threshold,
    check_is_max_context,
    doc_spans,
    squad_feature_arrays,
    squad_features,
    squad_predictions,
)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_tokenizer(model):
    tok = Tokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tok


@pytest.fixture(scope="module")
def word_tok():
    """Whole-word vocab: "w0".."w199" and "q0".."q19" are one token each."""
    words = [f"w{i}" for i in range(200)] + [f"q{i}" for i in range(20)] + ["."]
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    return bert_tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))


TEXTS = [
    "The Café in Zürich opened in 1850 under Émile Durand.",
    "Naïve travellers visit Montréal and São Paulo every summer.",
    "Where did the café open? Who ran it? When did it open?",
]


@pytest.fixture(scope="module")
def text_tok():
    tok = bert_tokenizer(models.WordPiece(unk_token="[UNK]"))
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=SPECIALS, show_progress=False
    )
    tok.train_from_iterator(TEXTS * 3, trainer=trainer)
    return tok


def words(n, prefix="w", first=0):
    return " ".join(f"{prefix}{i}" for i in range(first, first + n))


def example(qid, context, question="q1 q2", answer=None, impossible=False):
    answers = ()
    if answer is not None:
        answers = (SquadAnswer(answer, context.index(answer)),)
    return SquadExample(qid, question, context, answers, is_impossible=impossible)


def reference_max_context(spans, span_index, position):
    """run_squad.py's _check_is_max_context, verbatim but for names."""
    best_score = None
    best_span_index = None
    for index, (start, length) in enumerate(spans):
        end = start + length - 1
        if position < start:
            continue
        if position > end:
            continue
        num_left_context = position - start
        num_right_context = end - position
        score = min(num_left_context, num_right_context) + 0.01 * length
        if best_score is None or score > best_score:
            best_score = score
            best_span_index = index
    return span_index == best_span_index


def answer_text(ex, feature):
    s, e = feature.start_position, feature.end_position
    return ex.context[feature.token_to_char[s][0] : feature.token_to_char[e][1]]


def logits_at(feature, starts=(), ends=(), base=0.0):
    """Logit rows with `base` everywhere and the given {position: value} overrides."""
    start = np.full(len(feature.input_ids), base)
    end = np.full(len(feature.input_ids), base)
    for p, v in dict(starts).items():
        start[p] = v
    for p, v in dict(ends).items():
        end[p] = v
    return start, end


# ----------------------------------------------------------------------------- windows


def test_windows_stride_and_max_context(word_tok):
    ex = example("a", words(60))
    feats = squad_features([ex], word_tok, max_seq_length=20, doc_stride=6, is_training=False)
    # 20 - 2 query tokens - 3 = 15 tokens a window, a new one every 6 until one ends at 59.
    assert [(f.window_start, f.window_length) for f in feats] == [
        (0, 15),
        (6, 15),
        (12, 15),
        (18, 15),
        (24, 15),
        (30, 15),
        (36, 15),
        (42, 15),
        (48, 12),
    ]
    assert [f.window_index for f in feats] == list(range(9))
    assert feats[-1].window_start + feats[-1].window_length == 60
    spans = [(f.window_start, f.window_length) for f in feats]
    covered = {}
    for k, f in enumerate(feats):
        assert f.context_offset == 4
        assert sorted(f.token_to_char) == list(range(4, 4 + f.window_length))
        assert sorted(f.token_is_max_context) == sorted(f.token_to_char)
        for pos, (s, e) in f.token_to_char.items():
            t = f.window_start + pos - 4
            assert ex.context[s:e] == f"w{t}"
            assert f.token_is_max_context[pos] == reference_max_context(spans, k, t)
            if f.token_is_max_context[pos]:
                covered.setdefault(t, []).append(k)
    # Every context token has its max context in exactly one window.
    assert covered == {t: covered[t] for t in range(60)}
    assert all(len(ks) == 1 for ks in covered.values())
    # Token 10: min(10, 4) in window 0 ties min(4, 10) in window 1: the first wins.
    assert covered[10] == [0] and covered[13] == [1] and covered[59] == [8]


def test_doc_spans_edge_cases():
    assert doc_spans(10, 15, 6) == [(0, 10)]
    assert doc_spans(15, 15, 6) == [(0, 15)]
    assert doc_spans(16, 15, 6) == [(0, 15), (6, 10)]
    # A stride longer than a window: the next window starts right after (no gap).
    assert doc_spans(10, 4, 100) == [(0, 4), (4, 4), (8, 2)]
    assert doc_spans(0, 4, 2) == [(0, 0)]
    with pytest.raises(ValueError, match="max_tokens_for_doc"):
        doc_spans(10, 0, 2)


def test_max_context_length_tiebreak():
    # Equal min(left, right): the longer window wins (0.01 * length), else the first one.
    spans = [(2, 3), (0, 5)]
    assert [check_is_max_context(spans, k, 3) for k in (0, 1)] == [False, True]
    spans = [(0, 5), (2, 5)]
    assert [check_is_max_context(spans, k, 3) for k in (0, 1)] == [True, False]


def test_question_truncation_padding_and_types(word_tok):
    ex = example("a", words(5), question=words(10, prefix="q"))
    (f,) = squad_features([ex], word_tok, max_seq_length=16, max_query_length=4)
    cls, sep, pad = (word_tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    q = [word_tok.token_to_id(f"q{i}") for i in range(4)]
    w = [word_tok.token_to_id(f"w{i}") for i in range(5)]
    assert f.input_ids == [cls, *q, sep, *w, sep, pad, pad, pad, pad]
    assert f.token_type_ids == [0] * 6 + [1] * 6 + [0] * 4
    assert f.padding_mask == [True] * 12 + [False] * 4
    assert f.context_offset == 6
    assert sorted(f.token_to_char) == [6, 7, 8, 9, 10]
    # v1 example, training: the answer-less example here is not a v2 impossible one.
    arrays = squad_feature_arrays([f])
    assert arrays["input_ids"].shape == (1, 16) and arrays["padding_mask"].dtype == bool
    assert arrays["start_positions"].tolist() == [0]


def test_query_too_long_for_seq_length(word_tok):
    ex = example("a", words(5), question=words(10, prefix="q"))
    with pytest.raises(ValueError, match="no room"):
        squad_features([ex], word_tok, max_seq_length=12, max_query_length=64)


def test_the_command_names_the_flag_when_a_question_leaves_no_room(word_tok):
    from megaeval.finetune.tasks import TASKS, features

    ex = example("a", words(5), question=words(10, prefix="q"))
    with pytest.raises(ValueError, match=r"--max-seq-length 12 leaves no room .*\(10 tokens\): "
                       r"pass --max-seq-length 14 or more"):  # fmt: skip
        features(TASKS["squad1"], [ex], word_tok, 12, training=True)
    assert len(features(TASKS["squad1"], [ex], word_tok, 14, training=True)) == 5


def test_empty_context_gets_one_empty_window(word_tok):
    ex = SquadExample("a", "q1", "", (), is_impossible=True)
    (f,) = squad_features([ex], word_tok, max_seq_length=8)
    assert f.window_length == 0 and f.token_to_char == {}
    assert (f.start_position, f.end_position) == (0, 0)
    start, end = logits_at(f)
    preds, na = squad_predictions([ex], [f], [start], [end], version_2=True)
    assert preds == {"a": ""} and na == {"a": math.inf}


def test_truncating_tokenizer_is_not_used_as_is(word_tok):
    tok = Tokenizer.from_str(word_tok.to_str())
    tok.enable_truncation(max_length=3)
    tok.enable_padding(length=50)
    ex = example("a", words(30), answer="w25")
    feats = squad_features([ex], tok, max_seq_length=64)
    assert len(feats) == 1 and feats[0].window_length == 30
    assert answer_text(ex, feats[0]) == "w25"
    assert tok.truncation is not None  # the caller's tokenizer is left as it was


# ----------------------------------------------------------------------------- positions


def test_answer_positions_keep_original_text(text_tok):
    context = TEXTS[0]
    exs = [
        example("z", context, "Where did the café open?", "Zürich"),
        example("c", context, "Where did the café open?", "Café in Zürich"),
        example("e", context, "Who ran it?", "Émile Durand"),
        example("y", context, "When did it open?", "1850"),
    ]
    feats = squad_features(exs, text_tok, max_seq_length=64)
    assert [f.example_id for f in feats] == ["z", "c", "e", "y"]
    for ex, f in zip(exs, feats, strict=True):
        assert f.start_position >= f.context_offset
        assert answer_text(ex, f) == ex.answers[0].text
    # The model sees lowercased, accent-stripped tokens ...
    z = feats[0]
    pieces = [text_tok.id_to_token(i) for i in z.input_ids[z.start_position : z.end_position + 1]]
    assert "".join(p.removeprefix("##") for p in pieces) == "zurich"
    # ... and the offsets still point into the original string.
    assert [context[s:e] for s, e in z.token_to_char.values()][:4] == [
        "The",
        "Café",
        "in",
        "Zürich",
    ]


def test_first_answer_and_spacing(text_tok):
    context = "Naïve travellers visit  Montréal   and São Paulo every summer."
    ex = SquadExample(
        "m",
        "Where do naïve travellers go?",
        context,
        (
            SquadAnswer("Montréal   and São Paulo", context.index("Montréal")),
            SquadAnswer("São Paulo", context.index("São")),
        ),
    )
    (f,) = squad_features([ex], text_tok, max_seq_length=64)
    assert answer_text(ex, f) == "Montréal   and São Paulo"


def test_answer_outside_or_across_window_is_cls(word_tok):
    context = words(40)
    ex = example("a", context, answer="w33 w34")
    feats = squad_features([ex], word_tok, max_seq_length=20, doc_stride=5)
    spans = [(f.window_start, f.window_length) for f in feats]
    assert spans == [(0, 15), (5, 15), (10, 15), (15, 15), (20, 15), (25, 15)]
    for f in feats:
        inside = f.window_start <= 33 and f.window_start + f.window_length > 34
        if inside:
            assert f.start_position == 33 - f.window_start + 4
            assert f.end_position == f.start_position + 1
            assert answer_text(ex, f) == "w33 w34"
        else:
            # Windows 0-3 miss it; window 4 (tokens 20..34) holds it, window 5 too.
            assert (f.start_position, f.end_position) == (0, 0)
    assert [f.start_position != 0 for f in feats] == [False] * 4 + [True] * 2
    # Across a window's edge (w34 in, w35 out): (0, 0) there.
    ex2 = example("b", context, answer="w34 w35")
    f4 = squad_features([ex2], word_tok, max_seq_length=20, doc_stride=5)[4]
    assert (f4.window_start, f4.window_length) == (20, 15)
    assert (f4.start_position, f4.end_position) == (0, 0)


def test_impossible_and_eval_features(word_tok):
    ex = SquadExample("a", "q1", words(40), (), is_impossible=True)
    feats = squad_features([ex], word_tok, max_seq_length=20, doc_stride=5)
    assert all((f.start_position, f.end_position) == (0, 0) for f in feats)
    ex2 = example("b", words(40), answer="w3")
    feats = squad_features([ex2], word_tok, max_seq_length=20, is_training=False)
    assert all(f.start_position is None and f.end_position is None for f in feats)
    assert "start_positions" not in squad_feature_arrays(feats)


def test_answer_within_a_word_maps_to_its_token(text_tok):
    context = "Montréal-based travellers"
    ex = SquadExample("p", "Where?", context, (SquadAnswer("tréal", 3),))
    (f,) = squad_features([ex], text_tok, max_seq_length=64)
    # The covering tokens of "tréal" give back at least the answer, from the original text.
    assert "tréal" in answer_text(ex, f) and answer_text(ex, f) in context


# ----------------------------------------------------------------------------- predictions


def test_predictions_pick_best_span_across_windows(word_tok):
    ex = example("a", words(40), answer="w30")
    feats = squad_features([ex], word_tok, max_seq_length=20, doc_stride=5, is_training=False)
    rows = [logits_at(f) for f in feats]
    # Window 4 (tokens 20..34) gives w30 its max context? Check, then favour w30..w31 there.
    best = next(
        k for k, f in enumerate(feats) if f.token_is_max_context.get(30 - f.window_start + 4)
    )
    f = feats[best]
    rows[best] = logits_at(f, {30 - f.window_start + 4: 5.0}, {31 - f.window_start + 4: 5.0})
    # A higher score in a window where the start token lacks max context is not taken:
    # window 0 holds w0..w14, and w13 (1 token to its right) is better centred in window 1.
    g = feats[0]
    assert (g.window_start, g.window_length) == (0, 15)
    assert g.token_is_max_context[13 + 4] is False and 14 + 4 in g.token_to_char
    rows[0] = logits_at(g, {13 + 4: 9.0}, {14 + 4: 9.0})
    preds, na = squad_predictions([ex], feats, [r[0] for r in rows], [r[1] for r in rows])
    assert preds == {"a": "w30 w31"}
    # Null score: min over windows of start[0] + end[0] = 0; best non-null 10.
    assert na == {"a": -10.0}


def test_predictions_respect_length_order_and_window(word_tok):
    ex = example("a", words(10), question="q1 q2")
    (f,) = squad_features([ex], word_tok, max_seq_length=20, is_training=False)
    off = f.context_offset  # w_i is at off + i
    starts = {
        0: 50.0,  # [CLS]
        1: 40.0,  # query
        off - 1: 40.0,  # [SEP]
        off + 10: 40.0,  # the last [SEP]
        19: 40.0,  # padding
        off + 1: 10.0,
        off + 6: 8.0,
        off + 2: 3.0,
    }
    ends = {0: 50.0, 2: 40.0, off + 10: 40.0, 18: 40.0, off + 5: 9.0, off + 8: 7.0, off + 3: 1.0}
    start, end = logits_at(f, starts, ends)
    # w1..w5 (19) is 5 tokens, w1..w8 (17) 8: with max_answer_length 4 neither; w6..w8 (15).
    preds, na = squad_predictions([ex], [f], [start], [end], max_answer_length=4)
    assert preds == {"a": "w6 w7 w8"} and na == {"a": 100.0 - 15.0}
    preds, _ = squad_predictions([ex], [f], [start], [end], max_answer_length=30)
    assert preds == {"a": "w1 w2 w3 w4 w5"}


def test_end_before_start_is_skipped(word_tok):
    ex = example("a", words(10))
    (f,) = squad_features([ex], word_tok, max_seq_length=20, is_training=False)
    off = f.context_offset
    start, end = logits_at(f, {off + 7: 10.0, off + 2: 1.0}, {off + 3: 10.0, off + 9: 0.5})
    preds, na = squad_predictions([ex], [f], [start], [end])
    # (w7, w3) = 20 is backwards; (w2, w3) = 11 is the best valid pair.
    assert preds == {"a": "w2 w3"} and na == {"a": -11.0}
    # With n_best_size 1 only (w7, w3) is tried: no candidate, "" and na_prob +inf.
    preds, na = squad_predictions([ex], [f], [start], [end], n_best_size=1, version_2=True)
    assert preds == {"a": ""} and na == {"a": math.inf}


def test_v2_null_favoured(word_tok):
    ex = SquadExample("n", "q1", words(40), (), is_impossible=True)
    feats = squad_features([ex], word_tok, max_seq_length=20, doc_stride=10, is_training=False)
    assert len(feats) >= 2
    rows = [logits_at(f, {0: 6.0}, {0: 6.0}) for f in feats]
    f = feats[0]
    rows[0] = logits_at(f, {0: 4.0, f.context_offset: 3.0}, {0: 5.0, f.context_offset + 1: 2.0})
    starts, ends = [r[0] for r in rows], [r[1] for r in rows]
    preds, na = squad_predictions([ex], feats, starts, ends, version_2=True)
    # Null score: min(4 + 5, 12, ...) = 9; best non-null w0 w1 = 5: diff 4 > 0.
    assert preds == {"n": ""} and na == {"n": 4.0}
    raw, na_raw = squad_predictions(
        [ex], feats, starts, ends, version_2=True, null_score_diff_threshold=math.inf
    )
    assert raw == {"n": "w0 w1"} and na_raw == na
    # v1 never predicts null.
    assert squad_predictions([ex], feats, starts, ends)[0] == {"n": "w0 w1"}
    assert apply_null_threshold(raw, na, 3.9) == {"n": ""}
    assert apply_null_threshold(raw, na, 4.0) == {"n": "w0 w1"}


def test_predictions_check_inputs(word_tok):
    exs = [example("a", words(5)), example("b", words(5))]
    feats = squad_features(exs, word_tok, max_seq_length=16, is_training=False)
    rows = [logits_at(f) for f in feats]
    starts, ends = [r[0] for r in rows], [r[1] for r in rows]
    with pytest.raises(ValueError, match="features but"):
        squad_predictions(exs, feats, starts[:1], ends)
    with pytest.raises(ValueError, match="without a feature"):
        squad_predictions(exs, feats[:1], starts[:1], ends[:1])
    with pytest.raises(ValueError, match="is question"):
        squad_predictions(exs[::-1], feats, starts, ends)
    with pytest.raises(ValueError, match="positions"):
        squad_predictions(exs, feats, [s[:-1] for s in starts], ends)
    with pytest.raises(ValueError, match="without an na_prob"):
        apply_null_threshold({"a": "x"}, {}, 0.0)


# ----------------------------------------------------------------------------- end to end


def gold_logits(features):
    starts = np.zeros((len(features), len(features[0].input_ids)))
    ends = np.zeros_like(starts)
    for i, f in enumerate(features):
        starts[i, f.start_position] = 10.0
        ends[i, f.end_position] = 10.0
    return starts, ends


def test_end_to_end_v1_exact_match(text_tok, word_tok):
    exs = [
        example("z", TEXTS[0], "Where did the café open?", "Zürich"),
        example("e", TEXTS[0], "Who ran it?", "Émile Durand"),
        example("s", TEXTS[1], "Which cities?", "Montréal and São Paulo"),
        example("y", TEXTS[0], "When did it open?", "1850"),
    ]
    feats = squad_features(exs, text_tok, max_seq_length=16, doc_stride=3, max_query_length=6)
    assert all(sum(f.example_index == k for f in feats) > 1 for k in range(4))  # several windows
    starts, ends = gold_logits(feats)
    preds, _ = squad_predictions(exs, feats, starts, ends)
    assert preds == {e.id: e.answers[0].text for e in exs}
    assert squad_v1_evaluate(exs, preds) == {"exact_match": 100.0, "f1": 100.0}
    long = [example(f"l{k}", words(120), answer=f"w{k} w{k + 1}") for k in range(0, 118, 9)]
    feats = squad_features(long, word_tok, max_seq_length=32, doc_stride=8)
    starts, ends = gold_logits(feats)
    preds, _ = squad_predictions(long, feats, starts, ends)
    assert squad_v1_evaluate(long, preds)["exact_match"] == 100.0


def test_end_to_end_v2_threshold(word_tok):
    exs = [
        example("h", words(50), answer="w40"),
        SquadExample("n", "q1", words(50), (), is_impossible=True),
    ]
    feats = squad_features(exs, word_tok, max_seq_length=24, doc_stride=6)
    starts, ends = gold_logits(feats)
    preds, na = squad_predictions(exs, feats, starts, ends, version_2=True)
    assert preds == {"h": "w40", "n": ""}
    # "h": null = min over windows = 0 (a window holding w40), best 20; "n": null 20, best 0.
    assert na == {"h": -20.0, "n": 20.0}
    result = squad_v2_evaluate(exs, preds, na, na_prob_thresh=0.0)
    assert result["exact"] == 100.0 and result["f1"] == 100.0
    raw, na = squad_predictions(
        exs, feats, starts, ends, version_2=True, null_score_diff_threshold=math.inf
    )
    assert raw["h"] == "w40" and raw["n"] != ""
    best = squad_v2_evaluate(exs, raw, na, na_prob_thresh=0.0)
    assert best["best_exact"] == 100.0 and best["best_exact_thresh"] == -20.0
    final = apply_null_threshold(raw, na, best["best_exact_thresh"])
    assert final == {"h": "w40", "n": ""}
