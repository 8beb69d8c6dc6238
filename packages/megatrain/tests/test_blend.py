"""megatrain.data.blend: weighted blends of corpora (Megatron-LM's blending rule), the same
samples at every data-parallel layout, exact resumption, and the refusals before any worker.

The training loop with a blend, at tp 2 x pp 2 x dp 2 against one process and resumed
bitwise, is in test_training.py (its spawns)."""

import json

import numpy as np
import pytest

from megatrain.config import ConfigError, load_config, validate
from megatrain.data.blend import BlendedBatches, blend_block, open_run_blend, run_blend
from megatrain.data.corpus import open_corpus
from megatrain.data.samples import GPTBatches
from megatrain.run.preflight import check_inputs
from megatrain.testing import EOD, write_corpus

SEQ = 8
GBS = 8


def megatron_blending_indices(weights: list[float], size: int) -> tuple[list[int], list[int]]:
    """Megatron-LM's build_blending_indices (its C++ helper), transcribed loop for loop."""
    current = [0] * len(weights)
    dataset_index, dataset_sample_index = [], []
    for sample_idx in range(size):
        sample_idx_double = max(float(sample_idx), 1.0)
        max_error_index = 0
        max_error = weights[0] * sample_idx_double - current[0]
        for d in range(1, len(weights)):
            error = weights[d] * sample_idx_double - current[d]
            if error > max_error:
                max_error, max_error_index = error, d
        dataset_index.append(max_error_index)
        dataset_sample_index.append(current[max_error_index])
        current[max_error_index] += 1
    return dataset_index, dataset_sample_index


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [1, 2, 3, 4], [0.01, 0.98, 0.01]])
def test_blending_rule_is_megatrons_in_any_blocks(weights):
    w = np.asarray(weights, np.float64) / sum(weights)
    size = 3000
    want_d, want_j = megatron_blending_indices(w.tolist(), size)
    counts = np.zeros(len(w), np.int64)
    got_d, got_j, start = [], [], 0
    for block in (1, 7, 64, 500, size):  # the rule carried across blocks by the counts
        block = min(block, size - start)
        d, j = blend_block(w, counts, start, block)
        got_d += d.tolist()
        got_j += j.tolist()
        start += block
        # The realised shares within one sample of the weights after every block.
        assert np.abs(counts - w * start).max() < 1
    assert start == size and got_d == want_d and got_j == want_j


@pytest.mark.parametrize(("corpora", "bound"), [(2, 1.0), (3, 1.5), (5, 1.5)])
def test_shares_stay_within_a_sample_of_the_weights(corpora, bound):
    """Two corpora: within one sample after every sample. Megatron-LM's rule compares the
    counts with w * n before drawing sample n, so with three or more the realised share can
    run up to ~1.4 samples off (measured over random weights), never further."""
    rng = np.random.default_rng(corpora)
    worst = 0.0
    for _ in range(30):
        w = rng.random(corpora)
        w /= w.sum()
        d, _ = blend_block(w, np.zeros(corpora, np.int64), 0, 1500)
        drawn = np.zeros((len(d), corpora))
        drawn[np.arange(len(d)), d] = 1
        realised = np.cumsum(drawn, axis=0)
        n = np.arange(1, len(d) + 1)[:, None]
        worst = max(worst, np.abs(realised - w * n).max())
    assert 0.5 < worst < bound


def _docs(rng, n_docs, low, high):
    """Documents of ids in [low, high): the corpus a sample came from shows in its ids."""
    return [
        [*rng.integers(low, high, int(rng.integers(1, 30))).tolist(), EOD] for _ in range(n_docs)
    ]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two corpora of one tokenizer: `wiki` (ids < 500, bigger) and `news` (ids >= 500,
    a few samples an epoch, so a 70% weight cycles it many times)."""
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("blend")
    wiki = write_corpus(
        root / "wiki",
        {"train": [_docs(rng, 12, 1, 500) for _ in range(3)], "valid": [_docs(rng, 6, 1, 500)]},
    )
    news = write_corpus(
        root / "news",
        {
            "train": [_docs(rng, 3, 500, 1000) for _ in range(2)],
            "valid": [_docs(rng, 3, 500, 1000)],
        },
    )
    return str(wiki), str(news)


def _config(corpora, *extra, weights=(0.3, 0.7)):
    blend = json.dumps([[w, c] for w, c in zip(weights, corpora, strict=True)])
    return load_config(None, [f"data.blend={blend}", *extra])


def _blend(config, split="train", micro=GBS, dp_rank=0, dp_size=1, seed=5):
    data = open_run_blend(config, split)
    sources = [GPTBatches(c, SEQ, seed, GBS, micro) for c in data.corpora]
    return BlendedBatches(data.entries, sources, GBS, micro, dp_rank, dp_size)


def _samples(microbatches):
    tokens = np.concatenate([m["tokens"] for m in microbatches])
    labels = np.concatenate([m["labels"] for m in microbatches])
    return np.concatenate([tokens, labels[:, -1:]], axis=1)


def _iterations(config, dp, micro, iters, split="train"):
    ranks = [_blend(config, split, micro, r, dp) for r in range(dp)]
    per_rank = GBS // (micro * dp)
    return [
        _samples([next(b) for b in ranks for _ in range(per_rank)]).tolist() for _ in range(iters)
    ], ranks[0]


def test_samples_are_each_corpus_own_in_order_at_the_weights(corpora):
    config = _config(corpora)
    entries = run_blend(config, "train")
    assert [(e.name, e.weight) for e in entries] == [("wiki", 0.3), ("news", 0.7)]
    iters = 40
    got, blend = _iterations(config, 1, GBS, iters)
    flat = [s for it in got for s in it]
    # Each sample is the next one of its corpus, in that corpus's own (paper) order.
    seqs = [GPTBatches(open_corpus(c), SEQ, 5, GBS, GBS) for c in corpora]
    d, j = blend_block(np.array([0.3, 0.7]), np.zeros(2, np.int64), 0, iters * GBS)
    assert flat == [seqs[int(a)].sample(int(b)).tolist() for a, b in zip(d, j, strict=True)]
    # Told apart by their ids, the corpora gave their shares; news went round many epochs.
    from_news = sum(max(s[:-1]) >= 500 for s in flat if max(s) != EOD)
    drawn = blend.log_fields()["blend_samples"]
    assert drawn == {"wiki": int((d == 0).sum()), "news": int((d == 1).sum())}
    assert abs(drawn["news"] - 0.7 * iters * GBS) < 1 and from_news > 0
    assert drawn["news"] > 4 * seqs[1].samples_per_epoch
    assert "news 70.0%" in blend.describe(iters * GBS) and "epochs of its" in blend.describe(8)


def test_same_samples_for_any_dp_and_micro(corpora):
    config = _config(corpora, weights=(2, 1))
    reference, _ = _iterations(config, 1, GBS, 12)
    for dp, micro in ((1, 2), (2, 1), (2, 4), (4, 2), (8, 1)):
        assert _iterations(config, dp, micro, 12)[0] == reference, (dp, micro)


@pytest.mark.parametrize("stop", [0, 1, 5, 8, 13])
def test_resume_continues_the_blend_exactly(corpora, stop):
    config = _config(corpora)

    def make():
        return _blend(config, micro=2, dp_rank=1, dp_size=2)  # 2 microbatches an iteration

    uninterrupted = _samples(_draw(make(), stop + 6))
    first = make()
    _draw(first, stop)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed_samples"] == GBS * (stop // 2)
    assert sum(state["blend_counts"]) == state["consumed_samples"]
    resumed = make()
    resumed.load_state_dict(state)
    assert _samples(_draw(resumed, 6)).tolist() == uninterrupted[2 * stop :].tolist()


def _draw(batches, n):
    return [next(batches) for _ in range(n)]


def test_valid_blend_restarts_and_can_be_set_apart(corpora):
    config = _config(corpora, weights=(1, 1))
    valid = _blend(config, "valid")
    first = _samples(_draw(valid, 3)).tolist()
    valid.reset()
    assert _samples(_draw(valid, 3)).tolist() == first
    assert valid.log_fields()["blend_samples"] == {"wiki": 12, "news": 12}
    only_news = _config(corpora, f"data.valid_blend=[[1, {corpora[1]!r}]]")
    assert [e.name for e in run_blend(only_news, "valid")] == ["news"]
    assert [e.name for e in run_blend(only_news, "train")] == ["wiki", "news"]


def test_state_of_another_blend_is_refused(corpora):
    state = _blend(_config(corpora)).state_dict()
    with pytest.raises(ValueError, match=r"blend was \[\['wiki', 0.3\], \['news', 0.7\]\]"):
        _blend(_config(corpora, weights=(0.5, 0.5))).load_state_dict(state)
    single = GPTBatches(open_corpus(corpora[0]), SEQ, 5, GBS, GBS)
    with pytest.raises(ValueError, match="corpus_tokens was"):
        single.load_state_dict(state)
    damaged = {**state, "consumed_samples": 16, "blend_counts": [3, 4]}
    with pytest.raises(ValueError, match=r"blend_counts .* do not add up to consumed_samples 16"):
        _blend(_config(corpora)).load_state_dict(damaged)


@pytest.mark.parametrize(
    ("blend", "extra", "pattern"),
    [
        ("[[-0.3, 'a'], [1.3, 'b']]", [], r"data.blend\[0\]: the weight of 'a' is -0.3"),
        ("[[0, 'a'], [0, 'b']]", [], r"data.blend\[0\]: the weight of 'a' is 0; weights must"),
        ("[[0.5, 'a'], [0.5, './a']]", [], r"data.blend\[1\]: corpus './a' is listed twice"),
        ("[[0.5, 'a', 'b']]", [], r"data.blend\[0\]: expected a \[weight, corpus\] pair"),
        ("[['a', 0.5]]", [], r"data.blend\[0\]: expected a \[weight, corpus\] pair"),
        ("[]", [], "data.blend: expected a non-empty list"),
        ("[[1, 'a']]", ["data.corpus='c'"], "data.blend and data.corpus are both set"),
        ("[[1, 'a']]", ["data.valid_blend=[[1, 'a'], [-1, 'b']]"], r"data.valid_blend\[1\]"),
    ],
)
def test_bad_blends_are_refused_by_validate(blend, extra, pattern):
    config = load_config(None, [f"data.blend={blend}", *extra])
    with pytest.raises(ConfigError, match=pattern):
        validate(config, 1)


def test_missing_corpus_and_other_tokenizer_refused_before_workers(corpora, tmp_path):
    out = [f"training.output_dir={str(tmp_path / 'out')!r}"]
    missing = str(tmp_path / "nowhere")
    with pytest.raises(
        FileNotFoundError, match=rf"data.blend\[1\]: {missing}/manifest.json: no corpus manifest"
    ):
        check_inputs(_config((corpora[0], missing), *out))
    other = write_corpus(
        tmp_path / "other",
        {"train": [[[1, 2, 3, EOD]] * 40], "valid": [[[1, 2, EOD]] * 9]},
        tokenizer={
            "eod_id": EOD,
            "file": "tokenizer.json",
            "kind": "gpt2-bpe",
            "sha256": "cd" * 32,
            "vocab_size": 1000,
        },
    )
    with pytest.raises(ValueError, match="do not share one tokenizer") as e:
        check_inputs(_config((corpora[0], str(other)), *out))
    message = str(e.value)
    assert f"{other}/tokenizer.json (sha256 {'cd' * 32})" in message
    assert f"{corpora[0]}/tokenizer.json (sha256 {'ab' * 32})" in message


def test_bert_corpora_blend_as_gpt_ones(tmp_path):
    """A blend of two BERT corpora (one WordPiece tokenizer): each sample is the next one of
    its corpus's own sentence-pair sampler, and resumption carries the counts."""
    from megatrain.data.bert import BertBatches
    from megatrain.testing import english_texts, write_bert_text_corpus

    texts = english_texts()[:60]
    roots = [write_bert_text_corpus(tmp_path / n, texts, 400, every)[0]
             for n, every in (("a", 5), ("b", 3))]  # fmt: skip
    blend = json.dumps([[1, str(roots[0])], [3, str(roots[1])]])
    config = load_config(None, ["model.kind='bert'", f"data.blend={blend}"])
    data = open_run_blend(config, "train")

    def make():
        sources = [BertBatches(c, 32, 1, GBS, 4) for c in data.corpora]
        return BlendedBatches(data.entries, sources, GBS, 4), sources

    blend, sources = make()
    got = _draw(blend, 6)
    d, j = blend_block(np.array([0.25, 0.75]), np.zeros(2, np.int64), 0, 3 * GBS)
    want = [sources[int(a)].sample(int(b)) for a, b in zip(d, j, strict=True)]
    for m, batch in enumerate(got):
        expected = sources[0].collate(want[4 * m : 4 * m + 4])
        assert batch.keys() == expected.keys()
        for key in batch:
            assert np.array_equal(batch[key], expected[key]), key
    resumed, _ = make()
    resumed.load_state_dict(json.loads(json.dumps(blend.state_dict())))
    again, _ = make()
    _draw(again, 6)
    for a, b in zip(_draw(resumed, 2), _draw(again, 2), strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
