"""megatrain.data: corpus checks, the paper's loading order, data-parallel slicing, resumption."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from megacommon.files import sha256_file as sha256
from megatrain.data.corpus import open_corpus
from megatrain.data.samples import GPTBatches, epoch_order
from megatrain.testing import EOD, TOKENIZER_SHA, VOCAB, write_corpus

SEQ = 8


def random_docs(rng: np.random.Generator, n_docs: int) -> list[list[int]]:
    return [
        [*rng.integers(1, VOCAB, int(rng.integers(0, 40))).tolist(), EOD] for _ in range(n_docs)
    ]


@pytest.fixture(scope="module")
def docs():
    rng = np.random.default_rng(7)
    return {
        "train": [random_docs(rng, n) for n in (7, 5, 9)],
        "valid": [random_docs(rng, n) for n in (3, 2)],
    }


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, docs):
    return write_corpus(tmp_path_factory.mktemp("corpus"), docs)


def brute_force_epoch(shards: list[list[list[int]]], seed: int, epoch: int) -> list[list[int]]:
    """The documented order, built with Python lists from the documents as written."""
    rng = np.random.default_rng([seed, epoch])
    stream: list[int] = []
    for s in rng.permutation(len(shards)):
        for r in rng.permutation(len(shards[s])):
            stream += shards[s][r]
    n = (len(stream) - 1) // SEQ
    chunks = [stream[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)]
    return [chunks[i] for i in rng.permutation(n)]


def draw(batches: GPTBatches, n: int) -> list[dict]:
    return [next(batches) for _ in range(n)]


def samples_of(microbatches: list[dict]) -> np.ndarray:
    """Samples of seq_len + 1 tokens back from tokens/labels."""
    tokens = np.concatenate([m["tokens"] for m in microbatches])
    labels = np.concatenate([m["labels"] for m in microbatches])
    assert (tokens[:, 1:] == labels[:, :-1]).all()
    return np.concatenate([tokens, labels[:, -1:]], axis=1)


def iteration_union(corpus, dp: int, micro: int, iters: int, gbs: int = 8, seed: int = 3):
    """Per iteration, every rank's microbatches in rank order, as samples."""
    ranks = [GPTBatches(corpus, SEQ, seed, gbs, micro, r, dp) for r in range(dp)]
    per_rank = gbs // (micro * dp)
    return [samples_of([m for b in ranks for m in draw(b, per_rank)]) for _ in range(iters)]


# --- opening a corpus -------------------------------------------------------------------------


def test_open_exposes_documents_and_tokenizer(corpus_dir, docs):
    corpus = open_corpus(corpus_dir, vocab_size=VOCAB, tokenizer_sha256=TOKENIZER_SHA)
    assert (corpus.eod_id, corpus.vocab_size, corpus.tokenizer_sha256) == (
        EOD,
        VOCAB,
        TOKENIZER_SHA,
    )
    assert corpus.manifest["splits"]["train"]["docs"] == 21 and corpus.path == corpus_dir
    assert corpus.num_shards == 3 and corpus.num_docs == 21
    assert corpus.num_tokens == sum(len(d) for s in docs["train"] for d in s)
    for s, shard in enumerate(docs["train"]):
        assert corpus.shard_doc_lengths(s).tolist() == [len(d) for d in shard]
        for r, doc in enumerate(shard):
            assert corpus.doc_tokens(s, r).tolist() == doc
    valid = open_corpus(corpus_dir, "valid", verify_sha256=True)
    assert valid.num_shards == 2 and valid.doc_tokens(1, 1).tolist() == docs["valid"][1][1]


def test_uint32_tokens(tmp_path):
    big = [[70000, 5, EOD], [EOD], [65536, EOD]] * 4
    path = write_corpus(tmp_path, {"train": [big]}, dtype="uint32")
    corpus = open_corpus(path)
    assert corpus.doc_tokens(0, 0).dtype == np.uint32 and corpus.doc_tokens(0, 0)[0] == 70000
    # Such ids are outside the tokenizer's vocabulary: refused when drawn, not fed to the model.
    with pytest.raises(ValueError, match=r"token \d+, outside tokenizer.vocab_size 1000"):
        draw(GPTBatches(corpus, 4, 0, 3, 3), 1)


def test_shards_are_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)
    marker = [60001, 60002, 60003, 60004]
    shard = [*random_docs(rng, 3000), [*marker, EOD]]
    path = write_corpus(tmp_path, {"train": [shard]}, batch_rows=1000)
    token_bytes = 2 * sum(map(len, shard))
    before = pa.total_allocated_bytes()
    corpus = open_corpus(path)
    assert pa.total_allocated_bytes() - before < token_bytes // 10
    view = corpus.doc_tokens(0, 3000)
    assert view.tolist() == [*marker, EOD]
    assert not view.flags.owndata and not view.flags.writeable
    # Proof of a live mapping: bytes changed in the file show through the view opened before.
    file = path / "train" / "shard-00000.arrow"
    data = file.read_bytes()
    at = data.find(np.array(marker, "<u2").tobytes())
    assert at > 0
    with open(file, "r+b") as f:
        f.seek(at)
        f.write(np.array([9], "<u2").tobytes())
    assert view[0] == 9


def _replace_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_missing_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"manifest\.json.*megadata run.*make data"):
        open_corpus(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("edit", "kwargs", "pattern"),
    [
        (lambda m: m.update(format_version=2), {}, r"format_version is 2, expected 1"),
        (None, {"vocab_size": 1024}, r"tokenizer.vocab_size is 1000, expected 1024"),
        (
            lambda m: m["tokenizer"].update(kind="bert-wordpiece"),
            {},
            r"tokenizer.kind is 'bert-wordpiece', expected 'gpt2-bpe'",
        ),
        (None, {"tokenizer_sha256": "cd" * 32}, rf"tokenizer.sha256 is '{TOKENIZER_SHA}', "),
        (lambda m: m.update(token_dtype="int8"), {}, r"token_dtype is 'int8'"),
        (lambda m: m["splits"].pop("valid"), {"split": "valid"}, r"no split 'valid'"),
        (lambda m: m["splits"]["train"].update(shards=[]), {}, r"splits.train.shards' is empty"),
        (
            lambda m: m["splits"]["train"]["shards"][1].update(tokens=3),
            {},
            r"shard-00001.arrow: holds \d+ tokens, expected 3 \(its 'tokens' in .*manifest.json",
        ),
    ],
    ids=["version", "vocab", "kind", "sha", "dtype", "split", "empty", "count"],
)
def test_manifest_refusals(tmp_path, docs, edit, kwargs, pattern):
    path = write_corpus(tmp_path, docs)
    if edit:
        _replace_manifest(path, edit)
    with pytest.raises(ValueError, match=pattern) as info:
        open_corpus(path, **kwargs)
    assert str(path) in str(info.value)
    if "expected" in pattern and "shard" not in pattern:
        assert "manifest.json" in str(info.value)


def test_token_type_must_match_the_manifest(tmp_path, docs):
    path = write_corpus(tmp_path, {"train": docs["train"]}, dtype="uint32")
    _replace_manifest(path, lambda m: m.update(token_dtype="uint16"))
    with pytest.raises(ValueError, match=r"shard-00000.arrow: column 'tokens' is list<.*uint32>, "):
        open_corpus(path)


def test_missing_shard(tmp_path, docs):
    path = write_corpus(tmp_path, docs)
    (path / "train" / "shard-00002.arrow").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard-00002.arrow: shard missing .*shards\[2\]"):
        open_corpus(path)


def test_sha256_verified_on_request(tmp_path, docs):
    path = write_corpus(tmp_path, docs)
    file = path / "train" / "shard-00001.arrow"
    expected = sha256(file)
    _replace_manifest(path, lambda m: m["splits"]["train"]["shards"][1].update(sha256="0" * 64))
    open_corpus(path)  # not checked unless asked: it reads every byte
    with pytest.raises(ValueError, match=r"shard-00001.arrow: sha256") as info:
        open_corpus(path, verify_sha256=True)
    assert "0" * 64 in str(info.value) and expected in str(info.value)


def test_document_without_eod(tmp_path, docs):
    shards = [list(s) for s in docs["train"]]
    shards[1][4] = [5, 6, 7]
    path = write_corpus(tmp_path, {"train": shards})
    with pytest.raises(
        ValueError,
        match=r"shard-00001.arrow: document 'train-1-4' \(row 4\) "
        r"ends with token 7, expected eod_id 0",
    ):
        open_corpus(path)


def test_corpus_too_small(tmp_path):
    path = write_corpus(tmp_path, {"train": [[[1, 2, EOD], [EOD]]]})
    corpus = open_corpus(path)
    GPTBatches(corpus, 3, 0, 1, 1)  # 4 tokens: one sample of 3 + 1
    with pytest.raises(ValueError, match=r"split 'train' .* holds 4 tokens, .*seq_len \+ 1 = 5"):
        GPTBatches(corpus, 4, 0, 1, 1)


def test_batch_sizes_must_divide(corpus_dir):
    corpus = open_corpus(corpus_dir)
    with pytest.raises(
        ValueError,
        match=r"global_batch_size \(12\).*micro_batch_size x "
        r"data-parallel size \(2 x 4 = 8\)",
    ):
        GPTBatches(corpus, SEQ, 0, 12, 2, 0, 4)


# --- the loading order ------------------------------------------------------------------------


def test_epoch_order_is_shards_then_docs_then_samples(corpus_dir):
    corpus = open_corpus(corpus_dir)
    orders = {(s, e): epoch_order(corpus, SEQ, s, e) for s in (1, 2) for e in (0, 1)}
    for order in orders.values():
        assert sorted(order.shard_order.tolist()) == [0, 1, 2]
        # Documents stay in their shard: the reading order is shard blocks in shard_order.
        pos = 0
        for s in order.shard_order:
            first, n = int(corpus.shard_first_doc[s]), corpus.shard_num_docs(int(s))
            block = order.doc_order[pos : pos + n].tolist()
            assert sorted(block) == list(range(first, first + n))
            pos += n
        assert pos == corpus.num_docs
        assert order.doc_offsets[-1] == corpus.num_tokens
        n_samples = (corpus.num_tokens - 1) // SEQ
        assert sorted(order.sample_order.tolist()) == list(range(n_samples))
    # Every (seed, epoch) gives a new order of documents and of samples.
    docs = {k: tuple(o.doc_order.tolist()) for k, o in orders.items()}
    samples = {k: tuple(o.sample_order.tolist()) for k, o in orders.items()}
    assert len(set(docs.values())) == 4 and len(set(samples.values())) == 4


def test_samples_match_brute_force_over_two_epochs(corpus_dir, docs):
    corpus = open_corpus(corpus_dir)
    seed = 11
    expected = brute_force_epoch(docs["train"], seed, 0) + brute_force_epoch(docs["train"], seed, 1)
    n = len(expected) // 2
    batches = GPTBatches(corpus, SEQ, seed, 4, 2)
    assert batches.samples_per_epoch == n
    microbatches = draw(batches, n)  # 2 samples per microbatch: two epochs
    for m in microbatches:
        assert m["tokens"].dtype == m["labels"].dtype == np.int64
        assert m["tokens"].shape == m["labels"].shape == (2, SEQ)
    got = samples_of(microbatches)
    assert got.tolist() == expected
    # Unshuffled, the chunks overlap by one token and rebuild the stream up to the dropped tail.
    order = epoch_order(corpus, SEQ, seed, 1)
    chunks = np.empty_like(got[n:])
    chunks[order.sample_order] = got[n:]
    stream = np.concatenate([corpus.document(d) for d in order.doc_order]).tolist()
    assert (chunks[1:, 0] == chunks[:-1, -1]).all()
    rebuilt = [*chunks[0].tolist(), *chunks[1:, 1:].ravel().tolist()]
    assert rebuilt == stream[: n * SEQ + 1] and len(stream) - len(rebuilt) < SEQ


def test_valid_split_restarts_identically(corpus_dir, docs):
    valid = GPTBatches(open_corpus(corpus_dir, "valid"), SEQ, 1234, 2, 1)
    first = samples_of(draw(valid, 6))
    valid.reset()
    assert samples_of(draw(valid, 6)).tolist() == first.tolist()
    expected = brute_force_epoch(docs["valid"], 1234, 0)
    assert first.tolist()[: len(expected)] == expected[:6]


# --- data parallelism and resumption ----------------------------------------------------------


def test_same_samples_for_any_dp_and_micro(corpus_dir):
    corpus = open_corpus(corpus_dir)
    n = GPTBatches(corpus, SEQ, 3, 8, 1).samples_per_epoch
    iters = n // 8 + 3  # past the first epoch boundary
    reference = iteration_union(corpus, dp=1, micro=8, iters=iters)
    flat = np.concatenate(reference)
    assert len(flat) > n and flat[n:].tolist() != flat[: len(flat) - n].tolist()
    for dp, micro in ((1, 2), (2, 1), (2, 4), (4, 1), (4, 2), (8, 1)):
        got = iteration_union(corpus, dp=dp, micro=micro, iters=iters)
        assert [g.tolist() for g in got] == [r.tolist() for r in reference], (dp, micro)


def test_ranks_take_contiguous_slices(corpus_dir):
    corpus = open_corpus(corpus_dir)
    reference = GPTBatches(corpus, SEQ, 5, 8, 1)
    rank1 = GPTBatches(corpus, SEQ, 5, 8, 2, 1, 2)
    assert samples_of(draw(rank1, 1)).tolist() == [reference.sample(k).tolist() for k in (4, 5)]
    assert samples_of(draw(rank1, 2)).tolist() == [
        reference.sample(k).tolist() for k in (6, 7, 12, 13)
    ]


@pytest.mark.parametrize("stop", [0, 1, 3, 4, 5, 9, 18])
def test_resume_gives_the_exact_continuation(corpus_dir, stop):
    corpus = open_corpus(corpus_dir)

    def make():
        return GPTBatches(corpus, SEQ, 9, 8, 2, 1, 2)  # 2 microbatches per iteration

    uninterrupted = samples_of(draw(make(), stop + 6))
    first = make()
    draw(first, stop)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed_samples"] == 8 * (stop // 2)
    assert state["microbatches_drawn"] == stop % 2
    resumed = make()
    resumed.load_state_dict(state)
    assert samples_of(draw(resumed, 6)).tolist() == uninterrupted[2 * stop :].tolist()


@pytest.mark.parametrize(("dp", "micro"), [(1, 8), (4, 1), (8, 1)])
def test_resume_under_another_dp_at_a_boundary(corpus_dir, dp, micro):
    corpus = open_corpus(corpus_dir)
    reference = iteration_union(corpus, dp=1, micro=8, iters=7)
    saved = [GPTBatches(corpus, SEQ, 3, 8, 2, r, 2) for r in range(2)]
    for b in saved:
        draw(b, 2 * 5)  # five iterations of two microbatches
    state = saved[0].state_dict()
    assert state == {**saved[1].state_dict()} and state["consumed_samples"] == 40
    ranks = [GPTBatches(corpus, SEQ, 3, 8, micro, r, dp) for r in range(dp)]
    for b in ranks:
        b.load_state_dict(state)
    per_rank = 8 // (micro * dp)
    for t in (5, 6):
        got = samples_of([m for b in ranks for m in draw(b, per_rank)])
        assert got.tolist() == reference[t].tolist()


def test_mid_iteration_state_needs_the_same_layout(corpus_dir):
    corpus = open_corpus(corpus_dir)
    b = GPTBatches(corpus, SEQ, 3, 8, 2, 0, 2)
    draw(b, 1)
    with pytest.raises(
        ValueError,
        match=r"middle of an iteration \(1 microbatches drawn\): "
        r"dp_size was 2, is 4 now",
    ):
        GPTBatches(corpus, SEQ, 3, 8, 2, 0, 4).load_state_dict(b.state_dict())


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("seed", lambda c, o: GPTBatches(c, SEQ, 4, 8, 2)),
        ("seq_len", lambda c, o: GPTBatches(c, SEQ + 1, 3, 8, 2)),
        ("corpus_tokens", lambda c, o: GPTBatches(o["fewer"], SEQ, 3, 8, 2)),
        ("corpus_fingerprint", lambda c, o: GPTBatches(o["edited"], SEQ, 3, 8, 2)),
    ],
)
def test_state_from_another_run_is_refused(corpus_dir, tmp_path, docs, field, make):
    corpus = open_corpus(corpus_dir)
    edited = [list(s) for s in docs["train"]]
    edited[0][0] = [7 if t == edited[0][0][0] else t for t in edited[0][0]]
    assert edited[0][0] != docs["train"][0][0]
    other = {
        "fewer": open_corpus(write_corpus(tmp_path / "a", {"train": docs["train"][:2]})),
        # Same counts, other content: told apart by the shards' sha256 in the manifest.
        "edited": open_corpus(write_corpus(tmp_path / "b", {"train": edited})),
    }
    state = GPTBatches(corpus, SEQ, 3, 8, 2).state_dict()
    with pytest.raises(ValueError, match=rf"{field} was {state[field]!r} when saved, is "):
        make(corpus, other).load_state_dict(state)
