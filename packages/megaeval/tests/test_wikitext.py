import math

import numpy as np
import pytest
from eval_inputs import FakeScorer, fake_nll

from megaeval.errors import EvalDataError, EvalSettingsError
from megaeval.wikitext import (
    count_raw_tokens,
    detokenize,
    evaluate_wikitext,
    read_wikitext,
    windows,
)


@pytest.mark.parametrize(
    ("tokenized", "expected"),
    [
        ("the club 's players", "the club's players"),
        ("the players ' union", "the players' union"),
        ("a well @-@ known actor", "a well-known actor"),
        ("in 1950 @-@ 51 the", "in 1950-51 the"),
        ("some 1 @,@ 200 people", "some 1,200 people"),
        ("about 3 @.@ 5 metres", "about 3.5 metres"),
        ("he said : yes", "he said: yes"),
        ("one ; two", "one; two"),
        ("it ended . Then", "it ended. Then"),
        ("stop ! Now", "stop! Now"),
        ("why ? Because", "why? Because"),
        ("red , green", "red, green"),
        ("the tower ( built 1872 ) stands", "the tower (built 1872) stands"),
        ("a tower ( red , white ) here", "a tower (red, white) here"),
        ("see [ 3 ] here", "see [3] here"),
        ("a { b } c", "a {b} c"),
        ('called " the Old Light " by', 'called "the Old Light" by'),
        ('" Hello , world . "', '"Hello, world."'),
        ("the ' Lantern ' ship", "the 'Lantern' ship"),
        ("it 's the keepers ' house", "it's the keepers' house"),
        (" = Harbour Lighthouse = \n", " = Harbour Lighthouse =\n"),
        (" = = History = = \n", " == History ==\n"),
        (" = = = Decline = = = \n", " === Decline ===\n"),
        ("= = = = Deep = = = =", "==== Deep ===="),
        ("at 2 ° C", "at 2°C"),
        ("the end \n next line", "the end\nnext line"),
        ("built N towers", "built 1 towers"),
        ("plain words stay", "plain words stay"),
    ],
)
def test_detokenize(tokenized, expected):
    assert detokenize(tokenized) == expected


def test_count_raw_tokens_splits_on_single_spaces():
    # strip, then split on " ": the two line breaks count as words, a double space as an
    # empty word.
    text = " = Title = \n \n One two , three . \n"
    assert count_raw_tokens(text) == 10
    assert count_raw_tokens("a  b") == 3
    assert count_raw_tokens("word") == 1


def brute_force_context_start(target: int, seq_len: int, stride: int) -> int:
    """Where the context of token position `target` begins, in closed form."""
    if target <= seq_len:
        return 0
    return math.ceil((target - seq_len) / stride) * stride


@pytest.mark.parametrize(
    ("num_tokens", "seq_len", "stride", "num_windows"),
    [
        (10, 16, 4, 1),  # shorter than one window
        (17, 16, 4, 1),  # exactly one window of targets
        (29, 16, 4, 4),  # 28 targets: 16 + 3 x 4, an exact multiple
        (31, 16, 4, 5),  # 30 targets: 16 + 3 x 4 + 2, a remainder
        (40, 8, 8, 5),  # stride == seq_len: disjoint windows
        (20, 8, 1, 12),  # stride 1
        (2, 8, 4, 1),  # one target
    ],
)
def test_windows_score_every_target_once_with_enough_context(
    num_tokens, seq_len, stride, num_windows
):
    plan = windows(num_tokens, seq_len, stride)
    assert len(plan) == num_windows
    scored = []
    for k, w in enumerate(plan):
        assert w.begin == k * stride
        assert 1 <= w.end - w.begin <= seq_len  # the model input tokens[begin:end]
        assert w.end <= num_tokens - 1
        assert w.begin + 1 <= w.score_from <= w.end
        if k > 0:
            # Its first scored target sees tokens[begin:score_from]: seq_len - stride + 1 of them
            # (the paper's "at least 992" for 1024/32); later targets see more.
            assert w.score_from - w.begin == seq_len - stride + 1
        scored += range(w.score_from, w.end + 1)
        for target in range(w.score_from, w.end + 1):
            assert w.begin == brute_force_context_start(target, seq_len, stride)
    assert scored == list(range(1, num_tokens))  # each of the T - 1 targets exactly once


def test_windows_of_nothing_and_bad_settings():
    assert windows(1, 8, 4) == []
    assert windows(0, 8, 4) == []
    with pytest.raises(EvalSettingsError, match="--stride"):
        windows(100, 8, 9)
    with pytest.raises(EvalSettingsError, match="--stride"):
        windows(100, 8, 0)
    with pytest.raises(EvalSettingsError, match="--seq-len"):
        windows(100, 0, 1)


@pytest.mark.parametrize(
    ("seq_len", "stride", "batch_size"), [(64, 8, 3), (40, 40, 8), (16, 1, 64)]
)
def test_evaluate_equals_brute_force_on_a_fake_model(wikitext_file, seq_len, stride, batch_size):
    scorer = FakeScorer(max_seq_len=64)
    result = evaluate_wikitext(
        scorer, wikitext_file, seq_len=seq_len, stride=stride, batch_size=batch_size, progress=False
    )

    raw = wikitext_file.read_text(encoding="utf-8")
    tokens = scorer.encode(detokenize(raw))
    expected = sum(
        fake_nll(p - brute_force_context_start(p, seq_len, stride), tokens[p])
        for p in range(1, len(tokens))
    )
    num_raw = len(raw.strip().split(" "))
    assert result["T"] == len(tokens) and result["targets"] == len(tokens) - 1
    assert result["T_o"] == num_raw
    assert result["mean_loss"] == pytest.approx(expected / (len(tokens) - 1), rel=1e-12)
    assert result["ppl"] == pytest.approx(math.exp(expected / (len(tokens) - 1)), rel=1e-12)
    assert result["adjusted_ppl"] == pytest.approx(math.exp(expected / (num_raw - 1)), rel=1e-12)
    assert result["windows"] == len(windows(len(tokens), seq_len, stride))
    # Batched: every call but the last holds batch_size windows.
    assert all(len(call) == batch_size for call in scorer.calls[:-1])
    assert sum(len(call) for call in scorer.calls) == result["windows"]


def test_evaluate_refuses_settings_the_model_cannot_take(wikitext_file):
    scorer = FakeScorer(max_seq_len=16)
    with pytest.raises(EvalSettingsError, match="--seq-len 32"):
        evaluate_wikitext(scorer, wikitext_file, seq_len=32, stride=8, progress=False)
    with pytest.raises(EvalSettingsError, match="--stride"):
        evaluate_wikitext(scorer, wikitext_file, seq_len=16, stride=17, progress=False)
    assert scorer.calls == []


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such file"), ("", "empty"), (" \n \n\t\n", "empty"), (b"\xff\xfe x", "UTF-8")],
)
def test_read_wikitext_names_the_bad_file(tmp_path, content, message):
    path = tmp_path / "wiki.test.tokens"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(EvalDataError, match=message) as error:
        read_wikitext(path)
    assert str(path) in str(error.value)


def test_read_wikitext_keeps_the_raw_text(wikitext_file):
    assert read_wikitext(wikitext_file) == wikitext_file.read_text(encoding="utf-8")


def test_tiny_gpt2_stride_path_equals_per_token_brute_force(tiny_gpt2, wikitext_file):
    import torch
    import transformers

    from megaeval.scoring import HFScorer

    seq_len, stride = 16, 4
    scorer = HFScorer(tiny_gpt2, dtype="float64")
    assert scorer.max_seq_len == 32
    result = evaluate_wikitext(
        scorer, wikitext_file, seq_len=seq_len, stride=stride, batch_size=8, progress=False
    )
    tokens = scorer.encode(detokenize(read_wikitext(wikitext_file)))
    assert result["T"] == len(tokens) > 3 * seq_len

    model = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2).to(torch.float64).eval()
    total = 0.0
    with torch.no_grad():
        for p in range(1, len(tokens)):
            begin = brute_force_context_start(p, seq_len, stride)
            logits = model(torch.tensor([tokens[begin:p]])).logits[0, -1]
            total += float(-torch.log_softmax(logits, dim=-1)[tokens[p]])
    assert result["mean_loss"] * result["targets"] == pytest.approx(total, rel=1e-9)
    # A random model over a few hundred tokens: near the uniform loss, not a degenerate one.
    assert 0.5 * np.log(400) < result["mean_loss"] < 2 * np.log(400)
