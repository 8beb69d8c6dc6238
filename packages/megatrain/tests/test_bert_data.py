"""megatrain.data.bert: BERT samples (SOP pairs of whole sentences, whole-word n-gram masking)
from a corpus of real English (the standard library's docstrings), determinism and resumption."""

import itertools
import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from megacommon.files import sha256_file as sha256
from megatrain.data.bert import BertBatches, bert_tokens, build_runs, truncation
from megatrain.data.corpus import open_corpus
from megatrain.data.samples import GPTBatches
from megatrain.testing import (
    BERT_SPECIALS,
    EOD,
    english_texts,
    random_documents,
    write_bert_text_corpus,
    write_corpus,
)

SEQ = 64
GBS = 8
SEED = 5
N_DRAWN = 320  # samples for the statistics


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(root, tokenizer, sentences of each document as written)."""
    root = tmp_path_factory.mktemp("bert") / "corpus"
    return write_bert_text_corpus(root, english_texts(), vocab_size=1000, batch_rows=7)


@pytest.fixture(scope="module")
def corpus(written):
    return open_corpus(written[0], tokenizer_kind="bert-wordpiece")


@pytest.fixture(scope="module")
def train_sentences(written):
    return [doc for shard in written[2]["train"] for doc in shard]


@pytest.fixture(scope="module")
def drawn(corpus):
    """N_DRAWN samples of one run, as microbatches concatenated, and the samplers' samples."""
    batches = BertBatches(corpus, SEQ, SEED, GBS, 4)
    micro = [next(batches) for _ in range(N_DRAWN // 4)]
    out = {name: np.concatenate([m[name] for m in micro]) for name in micro[0]}
    return batches, out, [batches.sample(k) for k in range(N_DRAWN)]


def draw(batches, n: int) -> list[dict]:
    return [next(batches) for _ in range(n)]


def cat(microbatches: list[dict]) -> dict[str, list]:
    return {
        name: np.concatenate([m[name] for m in microbatches]).tolist() for name in microbatches[0]
    }


# --- the corpus ------------------------------------------------------------------------------


def test_corpus_gives_sentence_ends(corpus, train_sentences):
    assert corpus.tokenizer_kind == "bert-wordpiece" and corpus.has_sentence_ends
    assert corpus.num_docs == len(train_sentences)
    for doc, sentences in enumerate(train_sentences):
        ends = corpus.sentence_ends(doc)
        assert ends.dtype == np.uint32 and not ends.flags.writeable
        assert ends.tolist() == np.cumsum([len(s) for s in sentences]).tolist()
        assert corpus.document(doc).tolist() == [*flat(sentences), corpus.eod_id]


def test_bert_tokens_from_the_tokenizer(corpus, written):
    tok = written[1]
    t = bert_tokens(corpus)
    assert (t.cls, t.sep, t.mask, t.pad) == tuple(
        tok.token_to_id(x) for x in ("[CLS]", "[SEP]", "[MASK]", "[PAD]")
    )
    assert t.sep == corpus.eod_id and len(t.is_continuation) == corpus.vocab_size
    vocab = tok.get_vocab()
    assert sorted(np.flatnonzero(t.is_continuation)) == sorted(
        i for w, i in vocab.items() if w.startswith("##")
    )
    assert sorted(np.flatnonzero(t.is_special)) == sorted(vocab[s] for s in BERT_SPECIALS)


def test_bert_tokens_refuse_a_missing_or_incomplete_tokenizer(written, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(written[0], root)
    (root / "tokenizer.json").unlink()
    corpus = open_corpus(root, tokenizer_kind="bert-wordpiece")
    with pytest.raises(ValueError, match=r"c/tokenizer.json: no tokenizer file"):
        bert_tokens(corpus)
    with pytest.raises(ValueError, match=r"c/tokenizer.json: no tokenizer file"):
        BertBatches(corpus, SEQ, 0, GBS, 1)
    vocab = {w: i for i, w in enumerate([*BERT_SPECIALS[:4], "a", "##b"])}
    Tokenizer(models.WordPiece(vocab, unk_token="[UNK]")).save(str(root / "tokenizer.json"))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = sha256(root / "tokenizer.json")
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"c/tokenizer.json: the vocabulary has no \[MASK\]"):
        bert_tokens(open_corpus(root, tokenizer_kind="bert-wordpiece"))


def test_gpt_corpus_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    gpt = write_corpus(tmp_path / "gpt", {"train": [random_documents(rng, 5, 1000, 10, 50)]})
    with pytest.raises(
        ValueError, match=r"tokenizer.kind is 'gpt2-bpe', expected 'bert-wordpiece'"
    ):
        open_corpus(gpt, tokenizer_kind="bert-wordpiece")
    corpus = open_corpus(gpt)
    assert not corpus.has_sentence_ends
    with pytest.raises(
        ValueError,
        match=r"gpt/manifest.json: sentence ends are read for a corpus of "
        r"tokenizer.kind bert-wordpiece only \(this one is opened as gpt2-bpe\)",
    ):
        corpus.sentence_ends(0)
    with pytest.raises(
        ValueError,
        match=r"gpt/manifest.json: tokenizer.kind is 'gpt2-bpe', expected 'bert-wordpiece': "
        r".*recipe whose \[tokenizer\] kind is bert-wordpiece",
    ):
        BertBatches(corpus, SEQ, 0, GBS, 1)
    # Built as BERT but without sentence boundaries: the shard is named.
    no_ends = write_corpus(
        tmp_path / "bert",
        {"train": [random_documents(rng, 5, 1000, 10, 50)]},
        kind="bert-wordpiece",
    )
    with pytest.raises(
        ValueError,
        match=r"train/shard-00000.arrow: no column 'sentence_ends' \(sentence boundaries\), "
        r"which a bert-wordpiece corpus needs; build it with a recipe whose \[tokenizer\] kind "
        r"is bert-wordpiece",
    ):
        open_corpus(no_ends, tokenizer_kind="bert-wordpiece")


def test_bad_sentence_ends_are_refused(tmp_path):
    docs = [[5, 6, 7, 8, EOD], [5, 6, EOD]]
    past = write_corpus(
        tmp_path / "a",
        {"train": [docs]},
        kind="bert-wordpiece",
        sentence_ends={"train": [[[2, 4], [3]]]},
    )
    with pytest.raises(
        ValueError, match=r"shard-00000.arrow: column 'sentence_ends' of row 1 ends"
    ):
        open_corpus(past, tokenizer_kind="bert-wordpiece")
    unordered = write_corpus(
        tmp_path / "b",
        {"train": [docs]},
        kind="bert-wordpiece",
        sentence_ends={"train": [[[3, 1, 4], [2]]]},
    )
    corpus = open_corpus(unordered, tokenizer_kind="bert-wordpiece")
    with pytest.raises(
        ValueError, match=r"shard-00000.arrow: column 'sentence_ends' of row 0 is not"
    ):
        build_runs(corpus, SEQ, 0, 0.1)


def test_parameters_are_checked(corpus):
    with pytest.raises(ValueError, match=r"seq_len \(4\) must be at least 5 for BERT"):
        BertBatches(corpus, 4, 0, GBS, 1)
    BertBatches(corpus, 5, 0, GBS, 1)
    with pytest.raises(ValueError, match=r"masked_lm_prob \(0.0\)"):
        BertBatches(corpus, SEQ, 0, GBS, 1, masked_lm_prob=0.0)
    with pytest.raises(ValueError, match=r"max_ngram \(0\)"):
        BertBatches(corpus, SEQ, 0, GBS, 1, max_ngram=0)
    with pytest.raises(ValueError, match=r"global_batch_size \(8\) must be a positive multiple"):
        BertBatches(corpus, SEQ, 0, GBS, 3)


def test_documents_of_one_sentence_make_no_sample(tmp_path, written):
    root = tmp_path / "c"
    shutil.copytree(written[0], root)
    manifest = json.loads((root / "manifest.json").read_text())
    sep = manifest["tokenizer"]["eod_id"]
    docs = [[10, 11, 12, sep], [13, sep], [14, 15, 16, 17, sep], [sep]]
    ends = [[3], [1], [1, 1, 1, 4], []]  # the third has 2 sentences of tokens, 2 empty ones
    write_corpus(
        root,
        {"train": [docs]},
        kind="bert-wordpiece",
        sentence_ends={"train": [ends]},
        tokenizer=manifest["tokenizer"],
    )
    corpus = open_corpus(root, tokenizer_kind="bert-wordpiece")
    batches = BertBatches(corpus, SEQ, 0, 1, 1)
    assert batches.samples_per_epoch == 1 and batches.source(0)[:3] == (2, 0, 2)
    t = batches.tokens
    labels = batches.sample(0)["mlm_labels"][:7].tolist()
    assert labels in (
        [t.cls, 14, t.sep, 15, 16, 17, t.sep],  # [14] then [15 16 17], in order or swapped
        [t.cls, 15, 16, 17, t.sep, 14, t.sep],
    )
    write_corpus(
        root,
        {"train": [docs[:2]]},
        kind="bert-wordpiece",
        sentence_ends={"train": [ends[:2]]},
        tokenizer=manifest["tokenizer"],
    )
    with pytest.raises(ValueError, match=r"has no document of at least 2 sentences"):
        BertBatches(open_corpus(root, tokenizer_kind="bert-wordpiece"), SEQ, 0, 1, 1)


# --- the runs of sentences ---------------------------------------------------------------------


def megatron_runs(sizes: list[int], targets: list[int]) -> list[tuple[int, int]]:
    """Megatron's build_mapping loop over one document's sentences, given the targets."""
    runs, start, length, count, remaining, it = [], 0, 0, 0, len(sizes), iter(targets)
    target = next(it)
    for i, size in enumerate(sizes):
        length, count, remaining = length + size, count + 1, remaining - 1
        if (length >= target and remaining > 1 and count >= 2) or remaining == 0:
            runs.append((start, i + 1))
            start, length, count = i + 1, 0, 0
            target = next(it, None)
    return runs


@pytest.mark.parametrize("seq_len", [16, SEQ, 512])
def test_runs_are_megatrons(corpus, train_sentences, seq_len):
    runs = build_runs(corpus, seq_len, SEED, 0.1)
    assert runs.doc.tolist() == sorted(runs.doc.tolist())
    assert set(runs.doc.tolist()) == set(range(corpus.num_docs))  # every document >= 2 sentences
    assert (runs.target >= 2).all() and (runs.target <= seq_len - 3).all()
    if seq_len == SEQ:
        assert 0.05 < (runs.target < seq_len - 3).mean() < 0.16  # short_seq_prob 0.1
    for doc, sentences in enumerate(train_sentences):
        mine = runs.doc == doc
        pairs = list(zip(runs.first[mine].tolist(), runs.stop[mine].tolist(), strict=True))
        assert megatron_runs([len(s) for s in sentences], runs.target[mine].tolist()) == pairs
        assert all(stop - first >= 2 for first, stop in pairs)
    assert (build_runs(corpus, SEQ, SEED, 0.0).target == SEQ - 3).all()
    again = build_runs(corpus, seq_len, SEED, 0.1)
    assert again.target.tolist() == runs.target.tolist()
    assert build_runs(corpus, seq_len, SEED + 1, 0.1).target.tolist() != runs.target.tolist()


def test_epochs_shuffle_every_run_once(corpus):
    batches = BertBatches(corpus, SEQ, SEED, GBS, 1)
    n = batches.samples_per_epoch
    assert n == len(build_runs(corpus, SEQ, SEED, 0.1))
    orders = [batches.epoch_order(e).tolist() for e in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(n)) and orders[0] != orders[1]
    assert BertBatches(corpus, SEQ, SEED + 1, GBS, 1).epoch_order(0).tolist() != orders[0]
    runs = batches.runs
    for k in (0, n - 1, n, 2 * n + 3):
        r = orders[k // n % 2][k % n] if k < 2 * n else batches.epoch_order(2)[k % n]
        assert batches.source(k) == tuple(
            int(x[r]) for x in (runs.doc, runs.first, runs.stop, runs.target)
        )


# --- the samples ---------------------------------------------------------------------------------


def segments(labels: list[int], sep: int) -> tuple[list[int], list[int]]:
    first = labels.index(sep)
    second = labels.index(sep, first + 1)
    return labels[1:first], labels[first + 1 : second]


def test_layout_of_samples(drawn):
    batches, out, _ = drawn
    t = batches.tokens
    assert {n: (a.dtype, a.shape) for n, a in out.items()} == {
        "tokens": (np.int64, (N_DRAWN, SEQ)),
        "token_types": (np.int64, (N_DRAWN, SEQ)),
        "padding_mask": (np.bool_, (N_DRAWN, SEQ)),
        "mlm_labels": (np.int64, (N_DRAWN, SEQ)),
        "loss_mask": (np.float32, (N_DRAWN, SEQ)),
        "sop_labels": (np.int64, (N_DRAWN,)),
    }
    for i in range(N_DRAWN):
        labels, tokens = out["mlm_labels"][i], out["tokens"][i]
        n = int(out["padding_mask"][i].sum())
        assert out["padding_mask"][i, :n].all() and 5 <= n <= SEQ
        assert (labels[n:] == t.pad).all() and (tokens[n:] == t.pad).all()
        assert labels[0] == t.cls and labels[n - 1] == t.sep
        seps = np.flatnonzero(labels[:n] == t.sep)
        assert len(seps) == 2 and (labels[:n] != t.pad).all() and (labels[1:n] != t.cls).all()
        types = np.zeros(SEQ, np.int64)
        types[seps[0] + 1 : n] = 1
        assert out["token_types"][i].tolist() == types.tolist()
        assert seps[0] >= 2 and seps[1] - seps[0] >= 2  # A and B hold a token each
        # What is not predicted is the text as it was; specials and padding never are.
        chosen = out["loss_mask"][i] == 1
        assert (tokens[~chosen] == labels[~chosen]).all()
        assert not chosen[n:].any() and not np.isin(labels[chosen], [t.cls, t.sep, t.pad]).any()
    assert set(out["sop_labels"].tolist()) == {0, 1}


def test_segments_are_whole_sentences_of_one_document(drawn, train_sentences):
    batches, out, _ = drawn
    truncated = 0  # most: a run ends at the first sentence that reaches its target
    for k in range(N_DRAWN):
        doc, first, stop, target = batches.source(k)
        sentences = train_sentences[doc][first:stop]
        a, b = segments(out["mlm_labels"][k].tolist(), batches.tokens.sep)
        if out["sop_labels"][k]:
            a, b = b, a  # back in the document's order
        total = sum(map(len, sentences))
        assert len(a) + len(b) == min(total, target)
        if total <= target:
            splits = [flat(sentences[:s]) for s in range(1, len(sentences))]
            assert a in splits and a + b == flat(sentences)
        else:
            truncated += 1
            # Cut from the ends of A and B only: each is a slice of its sentences.
            assert any(
                contains(flat(sentences[:s]), a) and contains(flat(sentences[s:]), b)
                for s in range(1, len(sentences))
            )
    assert N_DRAWN // 2 < truncated < N_DRAWN


def flat(lists: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def contains(whole: list[int], part: list[int]) -> bool:
    return any(whole[i : i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def test_truncation_is_megatrons():
    """Megatron's truncate_segments, token by token, against the closed form."""
    for len_a, len_b, target in [(10, 3, 8), (3, 10, 8), (7, 7, 5), (20, 1, 2), (6, 5, 11)]:
        for seed in range(5):
            a, b = list(range(len_a)), list(range(100, 100 + len_b))
            rng = np.random.default_rng(seed)
            while len(a) + len(b) > target:
                cut = a if len(a) > len(b) else b
                del cut[0 if rng.random() < 0.5 else -1]
            af, ab, bf, bb = truncation(len_a, len_b, target, np.random.default_rng(seed))
            assert list(range(len_a))[af : len_a - ab] == a
            assert list(range(100, 100 + len_b))[bf : len_b - bb] == b


def test_sop_swaps_half_the_pairs(drawn):
    batches = drawn[0]
    swapped = [batches.sample(k)["sop_labels"] for k in range(1000)]
    assert 0.44 < np.mean(swapped) < 0.56  # 1000 draws: sd 0.016


def test_whole_word_masking_statistics(drawn):
    batches, out, samples = drawn
    t = batches.tokens
    chosen = out["loss_mask"] == 1
    labels, tokens = out["mlm_labels"], out["tokens"]
    text = out["padding_mask"] & ~np.isin(labels, [t.cls, t.sep])
    # 15% of the text tokens, never more than the budget (at least 1).
    budget = np.maximum(1, np.round(0.15 * text.sum(axis=1)))
    assert (chosen.sum(axis=1) <= budget).all()
    assert 0.13 < chosen.sum() / text.sum() < 0.16
    for k in np.flatnonzero(chosen.sum(axis=1) == 0):  # a short sample of long words only
        words = word_lengths(text[k].tolist(), t.is_continuation[labels[k]].tolist())
        assert min(words) > budget[k], (words, budget[k])
    # Whole words: a continuation is chosen with the token before it, in its segment, and so
    # is the continuation after a chosen token.
    cont = t.is_continuation[labels]
    same_word = cont[:, 1:] & text[:, :-1] & text[:, 1:]  # position i + 1 continues i's word
    assert (chosen[:, 1:][same_word] == chosen[:, :-1][same_word]).all()
    assert same_word[chosen[:, 1:]].any()  # words of several pieces are among the chosen
    # 80% [MASK], 10% kept, 10% a random non-special token.
    masked = (tokens[chosen] == t.mask).mean()
    kept = (tokens[chosen] == labels[chosen]).mean()
    other = tokens[chosen & (tokens != t.mask) & (tokens != labels)]
    assert abs(masked - 0.8) < 0.04 and abs(kept - 0.1) < 0.03
    assert abs(len(other) / chosen.sum() - 0.1) < 0.03 and not t.is_special[other].any()
    # n-grams of n whole words, P(n) ~ 1/n (6:3:2) before the budget (9 tokens or so at
    # this seq_len) shortens some: about 67:23:10 here.
    share = ngram_shares(samples)
    assert 0.55 < share[0] < 0.78 and 0.15 < share[1] < 0.32 and 0.05 < share[2] < 0.16, share
    for k, s in enumerate(samples):
        first_sep = s["mlm_labels"].tolist().index(t.sep)
        spans = s["ngrams"]
        assert sum(stop - start for start, stop, _ in spans) == int(out["loss_mask"][k].sum())
        for start, stop, n in spans:
            assert (chosen[k, start:stop]).all() and (stop <= first_sep or start > first_sep)
            words = 1 + int((~t.is_continuation[labels[k, start + 1 : stop]]).sum())
            assert words == n  # an n-gram is n words, each a start and its continuations


def word_lengths(in_text: list[bool], continuation: list[bool]) -> list[int]:
    """Tokens per word: a token of the text and the continuations after it in the text."""
    lengths: list[int] = []
    for i, (here, cont) in enumerate(zip(in_text, continuation, strict=True)):
        if here and cont and i and in_text[i - 1]:
            lengths[-1] += 1
        elif here:
            lengths.append(1)
    return lengths


def ngram_shares(samples: list[dict]) -> np.ndarray:
    sizes = np.bincount([n for s in samples for (_, _, n) in s["ngrams"]], minlength=4)[1:]
    assert sizes[0] > sizes[1] > sizes[2] > 0, sizes
    return sizes / sizes.sum()


def test_ngrams_closer_to_one_over_n_with_a_larger_budget(corpus):
    batches = BertBatches(corpus, 256, SEED, GBS, 1)  # a budget of 35 tokens or so
    share = ngram_shares([batches.sample(k) for k in range(300)])
    assert 0.5 < share[0] < 0.66 and 0.2 < share[1] < 0.32 and 0.1 < share[2] < 0.2, share


def test_masking_follows_the_probabilities(corpus):
    batches = BertBatches(corpus, SEQ, SEED, GBS, 1, masked_lm_prob=0.3, max_ngram=1)
    samples = [batches.sample(k) for k in range(100)]
    assert all(n == 1 for s in samples for (_, _, n) in s["ngrams"])
    chosen = sum(int(s["loss_mask"].sum()) for s in samples)
    text = sum(int(s["padding_mask"].sum()) - 3 for s in samples)
    assert 0.27 < chosen / text < 0.31


# --- determinism ---------------------------------------------------------------------------------


def iteration_union(corpus, dp: int, micro: int, iters: int, seed: int = SEED) -> list[dict]:
    ranks = [BertBatches(corpus, SEQ, seed, GBS, micro, r, dp) for r in range(dp)]
    per_rank = GBS // (micro * dp)
    return [cat([m for b in ranks for m in draw(b, per_rank)]) for _ in range(iters)]


def test_same_samples_for_any_dp_and_micro(corpus):
    n = BertBatches(corpus, SEQ, SEED, GBS, 1).samples_per_epoch
    # Iterations around the first epoch boundary.
    reference = iteration_union(corpus, dp=1, micro=8, iters=n // GBS + 2)
    for dp, micro in ((1, 2), (2, 4), (4, 1), (8, 1)):
        assert iteration_union(corpus, dp, micro, n // GBS + 2) == reference, (dp, micro)


def test_a_sample_depends_on_its_index_only(corpus, drawn):
    _, _, samples = drawn
    fresh = BertBatches(corpus, SEQ, SEED, 16, 2, 1, 2)
    for k in (N_DRAWN - 1, 7, 0, 123):
        got, want = fresh.sample(k), samples[k]
        assert all(np.array_equal(got[name], want[name]) for name in want)
    other = BertBatches(corpus, SEQ, SEED + 1, GBS, 1).sample(0)
    assert not np.array_equal(other["mlm_labels"], samples[0]["mlm_labels"])


@pytest.mark.parametrize("stop", [0, 1, 3, 4])
def test_resume_gives_the_exact_continuation(corpus, stop):
    def make():
        return BertBatches(corpus, SEQ, 9, GBS, 2, 1, 2)  # 2 microbatches per iteration

    uninterrupted = draw(make(), stop + 4)
    first = make()
    draw(first, stop)
    state = json.loads(json.dumps(first.state_dict()))
    assert (state["consumed_samples"], state["microbatches_drawn"]) == (8 * (stop // 2), stop % 2)
    resumed = make()
    resumed.load_state_dict(state)
    assert cat(draw(resumed, 4)) == cat(uninterrupted[stop:])


def test_state_from_another_run_is_refused(corpus, written, tmp_path):
    state = BertBatches(corpus, SEQ, 3, GBS, 2).state_dict()
    assert state["sampler"] == "bert" and state["masked_lm_prob"] == 0.15
    for name, other in [
        ("seed", BertBatches(corpus, SEQ, 4, GBS, 2)),
        ("seq_len", BertBatches(corpus, SEQ + 1, 3, GBS, 2)),
        ("max_ngram", BertBatches(corpus, SEQ, 3, GBS, 2, max_ngram=2)),
        ("short_seq_prob", BertBatches(corpus, SEQ, 3, GBS, 2, short_seq_prob=0.2)),
        (
            "split",
            BertBatches(
                open_corpus(written[0], "valid", tokenizer_kind="bert-wordpiece"), SEQ, 3, GBS, 2
            ),
        ),
    ]:
        with pytest.raises(ValueError, match=rf"{name} was {state[name]!r} when saved, is "):
            other.load_state_dict(state)
    # Same counts, other content: the shards' sha256 tell them apart.
    root = tmp_path / "c"
    shutil.copytree(written[0], root)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["sha256"] = "0" * 64
    (root / "manifest.json").write_text(json.dumps(manifest))
    edited = BertBatches(open_corpus(root, tokenizer_kind="bert-wordpiece"), SEQ, 3, GBS, 2)
    with pytest.raises(ValueError, match=r"corpus_fingerprint was '"):
        edited.load_state_dict(state)
    # A GPT position is not a BERT one.
    gpt = GPTBatches(corpus, SEQ, 3, GBS, 2).state_dict()
    with pytest.raises(ValueError, match=r"sampler was None when saved, is 'bert' now"):
        BertBatches(corpus, SEQ, 3, GBS, 2).load_state_dict(gpt)
