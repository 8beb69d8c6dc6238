"""BERT pretraining samples from a megadata bert-wordpiece corpus, as Megatron's BERT dataset.

A sample is two segments of whole sentences of one document, for sentence-order
prediction (SOP) and masked language modelling with whole-word n-gram masking:

    [CLS] A [SEP] B [SEP] [PAD] ...        token_types 0 on [CLS] A [SEP], 1 on B [SEP]

The corpus gives each document's sentence ends (`Corpus.sentence_ends`, written
by megadata's tokenize stage with pysbd). Sentences of no token are ignored.

Runs (which sentences make a sample), as Megatron's `build_mapping`: a document
with fewer than 2 sentences cannot make an SOP pair and is skipped (not merged
with another: A and B must come from one document), and so is a document with a
sentence longer than 512 tokens (Megatron's LONG_SENTENCE_LEN). The sentences
of every other document are cut, in order, into runs: a run takes sentences
until it holds at least its target length of tokens and at least 2 sentences,
unless fewer than 2 sentences would be left for the next run, in which case it
takes the rest of the document. The target is seq_len - 3 (room for [CLS] and
two [SEP]), or, with probability short_seq_prob, uniform in [2, seq_len - 3].
Megatron draws new runs every epoch, so its epochs differ in size; here the runs
are drawn once, from `default_rng([seed, 3])`, so that every epoch has the same
number of samples n and global sample k is sample k % n of epoch k // n, as in
`GPTBatches`. Epoch e shuffles the runs with `default_rng([seed, 2, e])`; the
index is 4 numbers per run, built with numpy (all documents advance in step, a
run each, one record batch of the corpus at a time).

Sample k draws everything else from `default_rng([seed, 1, k])`, so a sample
depends on (corpus, seq_len, seed, the three probabilities, k) only, not on the
data-parallel size, the microbatch size, or what was drawn before; a run resumed
from `state_dict` reads exactly the samples it would have read. In this order:

1. the split: A takes the run's first a sentences, B the rest, a uniform in
   [1, sentences - 1] (a = 1 without a draw for 2 sentences);
2. the order: with probability 0.5, A and B are swapped: `sop_labels` is 1 when
   swapped ("B came first in the document", Megatron's is_random), 0 in order;
3. the truncation (Megatron's `truncate_segments`): while A + B exceed the target,
   the longer segment (B on a tie) loses one token, from its front or its back
   with probability 0.5 each;
4. the masking (Megatron's `create_masked_lm_predictions`, masking_style "bert",
   not geometric): a word is a token and the "##" continuations that follow it in
   its segment ([CLS], [SEP], [PAD] and [MASK] are never candidates; a segment
   that starts inside a word, after truncation, starts with a word of its own).
   The budget is max(1, round(masked_lm_prob * candidate tokens)) (Megatron also
   counts [CLS] and the two [SEP], which are never predicted). The words are
   visited in a random order; from each an n-gram of n whole words, 1 <= n <=
   max_ngram, P(n) proportional to 1/n, is drawn (n stays within the segment, so an
   n-gram never spans the middle [SEP]); n is lowered while it would exceed the
   budget, and the n-gram is skipped if even one word would, or if it overlaps one
   already chosen; this stops once the budget is met (a short sample whose words
   are all longer than its budget gets no prediction, as in Megatron). Each chosen
   token becomes [MASK] with probability 0.8, stays itself with 0.1, and becomes a
   random token with 0.1, drawn uniformly from the vocabulary's non-special tokens
   (Megatron draws from all of it).

A microbatch is a dict of numpy arrays, [micro, seq_len] unless said:
`tokens` int64 (masked), `token_types` int64, `padding_mask` bool (True on real
tokens), `mlm_labels` int64 (the tokens before masking, everywhere; [PAD] on
padding), `loss_mask` float32 (1.0 exactly on the tokens chosen for prediction)
and `sop_labels` int64 [micro]. `BertBatches.sample(k)` gives one row of these,
with the chosen n-grams too, and `BertBatches.source(k)` the run it was cut from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megacommon.files import sha256_file
from megatrain.data.corpus import Corpus
from megatrain.data.samples import SampleBatches

LONG_SENTENCE_LEN = 512  # Megatron skips documents with a longer sentence
SPECIAL_TOKENS = {"cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]", "pad": "[PAD]"}
# default_rng([seed, KEY, ...]): the streams of the runs, of the epochs and of the samples.
_SAMPLE_KEY, _EPOCH_KEY, _RUNS_KEY = 1, 2, 3


@dataclass(frozen=True)
class BertTokens:
    """The ids the sampler needs from the corpus's WordPiece tokenizer."""

    cls: int
    sep: int
    mask: int
    pad: int
    is_continuation: np.ndarray  # bool [vocab]: the token starts with "##"
    is_special: np.ndarray  # bool [vocab]: special tokens, never a random replacement

    @property
    def random_ids(self) -> np.ndarray:
        return np.flatnonzero(~self.is_special)


def bert_tokens(corpus: Corpus) -> BertTokens:
    """The special ids and the "##" pieces of the corpus's `tokenizer.json`, checked
    against its manifest (sha256, vocab_size, eod_id = [SEP])."""
    from tokenizers import Tokenizer

    name = corpus.manifest.get("tokenizer", {}).get("file", "tokenizer.json")
    path = Path(corpus.path) / name
    if not path.is_file():
        raise ValueError(
            f"{path}: no tokenizer file (tokenizer.file of {corpus.path / 'manifest.json'}); "
            "the BERT sampler reads the WordPiece vocabulary from it"
        )
    tok = Tokenizer.from_file(str(path))
    ids = {}
    for field_name, token in SPECIAL_TOKENS.items():
        ids[field_name] = tok.token_to_id(token)
        if ids[field_name] is None:
            raise ValueError(f"{path}: the vocabulary has no {token} token, which BERT needs")
    manifest = corpus.path / "manifest.json"
    found = sha256_file(path)
    if found != corpus.tokenizer_sha256:
        raise ValueError(
            f"{path}: sha256 is {found!r}, expected {corpus.tokenizer_sha256!r} "
            f"(tokenizer.sha256 of {manifest})"
        )
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != corpus.vocab_size:
        raise ValueError(
            f"{path}: holds {size} tokens, expected {corpus.vocab_size} "
            f"(tokenizer.vocab_size of {manifest})"
        )
    if ids["sep"] != corpus.eod_id:
        raise ValueError(
            f"{path}: [SEP] is {ids['sep']}, but tokenizer.eod_id of {manifest} is "
            f"{corpus.eod_id} (a BERT corpus ends documents with [SEP])"
        )
    prefix = getattr(tok.model, "continuing_subword_prefix", "##")
    is_continuation = np.zeros(size, bool)
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        is_continuation[i] = token.startswith(prefix)
    is_special = np.zeros(size, bool)
    is_special[list(ids.values())] = True
    for i, added in tok.get_added_tokens_decoder().items():
        is_special[i] |= added.special
    return BertTokens(**ids, is_continuation=is_continuation, is_special=is_special)


@dataclass(frozen=True)
class Runs:
    """The sentence runs of a corpus, one per sample of an epoch, in document order:
    run i is sentences [first[i], stop[i]) of document doc[i] (its sentences of at
    least one token), to fit in target[i] tokens."""

    doc: np.ndarray  # int64
    first: np.ndarray  # int32
    stop: np.ndarray  # int32
    target: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.doc)


def _nonempty_sentences(ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of a document's sentences of at least one token."""
    ends = ends.astype(np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    keep = ends > starts
    return starts[keep], ends[keep]


def build_runs(corpus: Corpus, seq_len: int, seed: int, short_seq_prob: float) -> Runs:
    """The runs of the module docstring, from `default_rng([seed, 3])`."""
    max_len = seq_len - 3
    rng = np.random.default_rng([seed, _RUNS_KEY])
    parts: list[tuple[np.ndarray, ...]] = []
    for first_doc, counts, ends in corpus.sentence_blocks():
        counts = counts.astype(np.int64)
        ends = ends.astype(np.int64)
        n_docs = len(counts)
        doc_of = np.repeat(np.arange(n_docs), counts)  # block-local document of each sentence
        doc_first = np.cumsum(counts) - counts  # its first sentence
        starts = np.zeros_like(ends)
        starts[1:] = ends[:-1]
        starts[doc_first[counts > 0]] = 0
        lengths = ends - starts
        if (lengths < 0).any():
            bad = int(np.argmax(lengths < 0))
            shard, row = corpus.shard_of(first_doc + int(doc_of[bad]))
            raise ValueError(
                f"{corpus.shard_files[shard]}: column 'sentence_ends' of row {row} is not "
                f"in increasing order (sentence {bad - int(doc_first[doc_of[bad]])})"
            )
        keep = lengths > 0
        sizes = lengths[keep]
        doc_of = doc_of[keep]
        n_sent = np.bincount(doc_of, minlength=n_docs)
        too_long = np.zeros(n_docs, bool)
        too_long[doc_of[sizes > LONG_SENTENCE_LEN]] = True
        cum = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=cum[1:])
        # Every eligible document advances by one run per round.
        active = np.flatnonzero((n_sent >= 2) & ~too_long)
        base = (np.cumsum(n_sent) - n_sent)[active]  # first sentence, in the kept numbering
        end = base + n_sent[active]  # one past the last
        pos = base.copy()
        while len(active):
            target = np.full(len(active), max_len, np.int64)
            if short_seq_prob > 0:
                short = rng.random(len(active)) < short_seq_prob
                target[short] = rng.integers(2, max_len + 1, int(short.sum()))
            # The first sentence at which the run holds >= target tokens and >= 2 sentences...
            last = np.searchsorted(cum, cum[pos] + target, side="left") - 1
            last = np.maximum(last, pos + 1)
            # ...unless fewer than 2 sentences would be left: then the rest of the document.
            last = np.where(last <= end - 3, last, end - 1)
            parts.append((first_doc + active, pos - base, last + 1 - base, target.astype(np.int32)))
            pos = last + 1
            more = pos < end
            active, base, end, pos = active[more], base[more], end[more], pos[more]
    if not parts:
        return Runs(*(np.zeros(0, t) for t in (np.int64, np.int32, np.int32, np.int32)))
    doc, first, stop, target = (np.concatenate(p) for p in zip(*parts, strict=True))
    order = np.lexsort((first, doc))
    return Runs(
        doc[order].astype(np.int64),
        first[order].astype(np.int32),
        stop[order].astype(np.int32),
        target[order],
    )


def truncation(len_a: int, len_b: int, target: int, rng: np.random.Generator) -> tuple[int, ...]:
    """Tokens to cut from (A's front, A's back, B's front, B's back): Megatron's
    `truncate_segments`, one draw per token cut, without its loop."""
    excess = len_a + len_b - target
    if excess <= 0:
        return 0, 0, 0, 0
    # The longer segment loses a token, B on a tie: first the longer down to the shorter,
    # then B, A, B, A...
    head = min(excess, abs(len_a - len_b))
    from_a = np.empty(excess, bool)
    from_a[:head] = len_a > len_b
    from_a[head:] = np.arange(excess - head) % 2 == 1
    front = rng.random(excess) < 0.5
    a_front, b_front = int((from_a & front).sum()), int((~from_a & front).sum())
    n_a = int(from_a.sum())
    return a_front, n_a - a_front, b_front, excess - n_a - b_front


class BertBatches(SampleBatches):
    """BERT microbatches of one data-parallel rank (see the module docstring and
    `SampleBatches`: the same slicing, `reset`, `state_dict` and `load_state_dict`).
    `tokens` defaults to `bert_tokens(corpus)`."""

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        seed: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        masked_lm_prob: float = 0.15,
        max_ngram: int = 3,
        short_seq_prob: float = 0.1,
        tokens: BertTokens | None = None,
    ):
        super().__init__(
            corpus, seq_len, seed, global_batch_size, micro_batch_size, dp_rank, dp_size
        )
        if seq_len < 5:
            raise ValueError(
                f"seq_len ({seq_len}) must be at least 5 for BERT: [CLS], two [SEP] and "
                "at least one token of each segment"
            )
        if not 0 < masked_lm_prob <= 1:
            raise ValueError(f"masked_lm_prob ({masked_lm_prob}) must be in (0, 1]")
        if not 0 <= short_seq_prob <= 1:
            raise ValueError(f"short_seq_prob ({short_seq_prob}) must be in [0, 1]")
        if max_ngram < 1:
            raise ValueError(f"max_ngram ({max_ngram}) must be at least 1")
        if corpus.tokenizer_kind != "bert-wordpiece" or not corpus.has_sentence_ends:
            raise ValueError(
                f"{corpus.path / 'manifest.json'}: tokenizer.kind is {corpus.tokenizer_kind!r}, "
                "expected 'bert-wordpiece': BERT samples need the sentence boundaries of a corpus "
                "built for BERT; build it with a recipe whose [tokenizer] kind is bert-wordpiece "
                "and open it with tokenizer_kind='bert-wordpiece'"
            )
        self.masked_lm_prob = float(masked_lm_prob)
        self.max_ngram = int(max_ngram)
        self.short_seq_prob = float(short_seq_prob)
        self.tokens = bert_tokens(corpus) if tokens is None else tokens
        self._random_ids = self.tokens.random_ids
        t = self.tokens
        self._never_masked = np.zeros(len(t.is_special), bool)
        self._never_masked[[t.cls, t.sep, t.pad, t.mask]] = True
        # P(n) for n-grams of at most a words, as cumulative tables: row a - 1.
        p = 1.0 / np.arange(1, self.max_ngram + 1)
        self._ngram_cdf = np.full((self.max_ngram, self.max_ngram), 2.0)
        for a in range(1, self.max_ngram + 1):
            self._ngram_cdf[a - 1, :a] = np.cumsum(p[:a]) / p[:a].sum()
            self._ngram_cdf[a - 1, a - 1] = 1.0  # u < 1 always stops here
        self.runs = build_runs(corpus, seq_len, seed, self.short_seq_prob)
        self.samples_per_epoch = len(self.runs)
        if self.samples_per_epoch < 1:
            raise ValueError(
                f"split {corpus.split!r} of {corpus.path} has no document of at least 2 "
                f"sentences (and none longer than {LONG_SENTENCE_LEN} tokens): no sample for "
                "sentence-order prediction"
            )

    def identity(self) -> dict[str, Any]:
        return {
            "sampler": "bert",
            "masked_lm_prob": self.masked_lm_prob,
            "max_ngram": self.max_ngram,
            "short_seq_prob": self.short_seq_prob,
        }

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Epoch e's sample j is run epoch_order(e)[j]."""
        return np.random.default_rng([self.seed, _EPOCH_KEY, epoch]).permutation(len(self.runs))

    def source(self, k: int) -> tuple[int, int, int, int]:
        """(document, first sentence, stop sentence, target length) of global sample k."""
        epoch, j = divmod(k, self.samples_per_epoch)
        r = int(self._order(epoch)[j])
        runs = self.runs
        return int(runs.doc[r]), int(runs.first[r]), int(runs.stop[r]), int(runs.target[r])

    def sample(self, k: int) -> dict[str, Any]:
        """Global sample k: the arrays of one row of a microbatch (see the module docstring)."""
        doc, first, stop, target = self.source(k)
        text = self.corpus.document(doc)
        starts, ends = _nonempty_sentences(self.corpus.sentence_ends(doc))
        starts, ends = starts[first:stop], ends[first:stop]
        rng = np.random.default_rng([self.seed, _SAMPLE_KEY, k])
        split = int(rng.integers(1, len(starts))) if len(starts) >= 3 else 1
        a = text[starts[0] : ends[split - 1]]
        b = text[starts[split] : ends[-1]]
        swapped = bool(rng.random() < 0.5)
        if swapped:
            a, b = b, a
        a_front, a_back, b_front, b_back = truncation(len(a), len(b), target, rng)
        a = a[a_front : len(a) - a_back]
        b = b[b_front : len(b) - b_back]
        t = self.tokens
        n = len(a) + len(b) + 3
        original = np.full(self.seq_len, t.pad, np.int64)
        original[0] = t.cls
        original[1 : 1 + len(a)] = a
        original[1 + len(a)] = t.sep
        original[2 + len(a) : n - 1] = b
        original[n - 1] = t.sep
        if original.max() >= self.corpus.vocab_size:
            raise ValueError(
                f"split {self.corpus.split!r} of {self.corpus.path}: sample {k} holds token "
                f"{int(original.max())}, outside tokenizer.vocab_size {self.corpus.vocab_size}"
            )
        token_types = np.zeros(self.seq_len, np.int64)
        token_types[2 + len(a) : n] = 1
        positions, ngrams = self._predicted_positions(original, len(a), n, rng)
        tokens = original.copy()
        keep_or_random = rng.random(len(positions)) >= 0.8
        randomly = keep_or_random & (rng.random(len(positions)) >= 0.5)
        replacement = self._random_ids[rng.integers(len(self._random_ids), size=len(positions))]
        tokens[positions] = np.where(
            keep_or_random, np.where(randomly, replacement, original[positions]), t.mask
        )
        loss_mask = np.zeros(self.seq_len, np.float32)
        loss_mask[positions] = 1.0
        padding_mask = np.zeros(self.seq_len, bool)
        padding_mask[:n] = True
        return {
            "tokens": tokens,
            "token_types": token_types,
            "padding_mask": padding_mask,
            "mlm_labels": original,
            "loss_mask": loss_mask,
            "sop_labels": int(swapped),
            "ngrams": ngrams,  # (first position, stop position, words) of each chosen n-gram
        }

    def _predicted_positions(
        self, original: np.ndarray, len_a: int, n: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """Whole-word n-gram masking: the positions chosen for prediction, sorted, and the
        chosen n-grams as (first position, stop position, words)."""
        pos = np.flatnonzero(~self._never_masked[original[:n]])
        if not len(pos):
            return pos, []
        budget = max(1, round(self.masked_lm_prob * len(pos)))
        # A word starts at a token that is no continuation or follows no candidate.
        word_start = ~self.tokens.is_continuation[original[pos]]
        word_start[1:] |= np.diff(pos) != 1
        word_start[0] = True
        starts = np.flatnonzero(word_start)  # into pos
        bounds = np.append(starts, len(pos))  # word w is pos[bounds[w] : bounds[w + 1]]
        n_words = len(starts)
        in_b = pos[starts] > len_a + 1
        # Words left in the segment from each word on, at most max_ngram.
        first_b = int(np.argmax(in_b)) if in_b.any() else n_words
        seg_end = np.where(in_b, n_words, first_b)
        avail = np.minimum(seg_end - np.arange(n_words), self.max_ngram)
        order = rng.permutation(n_words)
        u = rng.random(n_words)
        ngram = (self._ngram_cdf[avail[order] - 1] < u[:, None]).sum(axis=1) + 1
        bounds_list = bounds.tolist()
        covered = [False] * n_words
        chosen: list[tuple[int, int, int]] = []  # (first token, stop token) into pos, words
        count = 0
        for w, size in zip(order.tolist(), ngram.tolist(), strict=True):
            if count >= budget:
                break
            while size > 1 and count + bounds_list[w + size] - bounds_list[w] > budget:
                size -= 1
            tokens = bounds_list[w + size] - bounds_list[w]
            if count + tokens > budget or any(covered[w : w + size]):
                continue
            covered[w : w + size] = [True] * size
            chosen.append((bounds_list[w], bounds_list[w + size], size))
            count += tokens
        chosen.sort()
        positions = np.concatenate([pos[lo:hi] for lo, hi, _ in chosen] or [pos[:0]])
        return positions, [(int(pos[lo]), int(pos[hi - 1]) + 1, size) for lo, hi, size in chosen]

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        out = {
            name: np.stack([s[name] for s in samples])
            for name in ("tokens", "token_types", "padding_mask", "mlm_labels", "loss_mask")
        }
        out["sop_labels"] = np.array([s["sop_labels"] for s in samples], np.int64)
        return out
