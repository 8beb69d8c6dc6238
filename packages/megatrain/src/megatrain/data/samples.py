"""The corpus is read through the file contract of DESIGN.md ("Corpus directory"):
`manifest.json` plus Arrow IPC shards whose `tokens` column holds one document
per row, each already ending with the end-of-document token. Shards are memory
mapped and documents are numpy views of the mapped buffers, so opening a corpus
of any size costs O(docs) memory and reads no token it does not use.

Order of one epoch (the paper's loading row: shards in random order, documents
shuffled within a shard, EOT appended, flattened, chunked to the sequence
length, chunks shuffled, redone every epoch):

1. the split's shards are put in a random order;
2. the documents of each shard are shuffled among themselves (a document never
   leaves its shard, so a shard is read as one region of the disk);
3. the documents, each ending with EOD, are flattened into one token stream;
4. the stream is cut into samples of seq_len + 1 tokens with stride seq_len, as
   Megatron's GPT dataset does: consecutive samples share one token, so every
   token but the first is a target exactly once; the tail shorter than
   seq_len + 1 is dropped;
5. the samples are shuffled.

Every epoch draws its permutations from `numpy.random.default_rng([seed, epoch])`,
in the order listed (shards, then each shard's documents in the new shard order,
then samples). The order of epoch e is thus a pure function of (corpus, seq_len,
seed, e): every process computes the same one without communicating, and a
resumed run recomputes it instead of saving it. Only index arrays are built per
epoch; a sample's tokens are sliced out of the documents it spans when drawn.

Epochs follow each other without a gap: global sample k is sample k % n of epoch
k // n, n being the (order independent) number of samples per epoch. Iteration t
of training uses global samples [t*G, (t+1)*G) for global batch G; data-parallel
rank r takes the contiguous slice [r*G/dp, (r+1)*G/dp) of them and hands it out
as microbatches in order, so the samples of an iteration and their order do not
depend on the data-parallel size or the microbatch size. `SampleBatches` holds
this slicing and the position state; `GPTBatches` adds the GPT samples, and
`megatrain.data.bert.BertBatches` the BERT ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrain.data.corpus import Corpus


@dataclass(frozen=True)
class EpochOrder:
    """The index arrays of one epoch; O(docs + samples) int64."""

    shard_order: np.ndarray  # shard numbers, in reading order
    doc_order: np.ndarray  # document numbers (see Corpus), in reading order
    doc_offsets: np.ndarray  # [docs + 1]: where each document of doc_order starts in the stream
    sample_order: np.ndarray  # sample j of the epoch is the stream's chunk sample_order[j]


def samples_per_epoch(corpus: Corpus, seq_len: int) -> int:
    # Chunk i spans stream tokens [i*seq_len, i*seq_len + seq_len + 1).
    return max(corpus.num_tokens - 1, 0) // seq_len


def epoch_order(corpus: Corpus, seq_len: int, seed: int, epoch: int) -> EpochOrder:
    # The sequence of draws is part of the format of a run: changing it would make a
    # resumed run read other samples than the ones its checkpoint counted.
    rng = np.random.default_rng([seed, epoch])
    shard_order = rng.permutation(corpus.num_shards)
    doc_order = np.concatenate(
        [corpus.shard_first_doc[s] + rng.permutation(corpus.shard_num_docs(s)) for s in shard_order]
    ).astype(np.int64, copy=False)
    doc_offsets = np.zeros(len(doc_order) + 1, np.int64)
    np.cumsum(corpus.doc_lengths[doc_order], out=doc_offsets[1:])
    sample_order = rng.permutation(samples_per_epoch(corpus, seq_len))
    return EpochOrder(shard_order, doc_order, doc_offsets, sample_order)


class SampleBatches:
    """Microbatches of one data-parallel rank, endless (epochs follow each other): the
    slicing of global samples among ranks and microbatches, and the position state.

    A subclass sets `samples_per_epoch` (the same for every epoch), and defines
    `epoch_order(epoch)` (the index of an epoch, cached here), `sample(k)` (global
    sample k, a pure function of k) and `collate(samples)` (one microbatch). Extra
    entries of `identity()` go into the state and must match when it is loaded.
    Each training iteration draws `num_microbatches` microbatches on every rank.
    For validation, build one over the valid split with a fixed seed and call
    `reset()` before each evaluation, so every evaluation scores the same samples.
    """

    samples_per_epoch: int

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        seed: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if seq_len < 1 or micro_batch_size < 1 or dp_size < 1:
            raise ValueError(
                f"seq_len ({seq_len}), micro_batch_size ({micro_batch_size}) and "
                f"data-parallel size ({dp_size}) must be positive"
            )
        if global_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a positive multiple of "
                f"micro_batch_size x data-parallel size ({micro_batch_size} x {dp_size} = "
                f"{micro_batch_size * dp_size})"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside data-parallel size {dp_size}")
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)
        self._fingerprint = corpus.fingerprint()
        self._epochs: dict[int, Any] = {}
        self.reset()

    def reset(self) -> None:
        """Back to the first sample (validation restarts here at every evaluation)."""
        self.consumed_samples = 0  # whole global batches, all ranks together
        self.microbatches_drawn = 0  # of the current iteration, by this rank

    def epoch_order(self, epoch: int) -> Any:
        raise NotImplementedError

    def sample(self, k: int) -> Any:
        raise NotImplementedError

    def collate(self, samples: list[Any]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        return {}

    def data_identity(self) -> dict[str, Any]:
        """What the position state says of the data it counts (checked when loaded)."""
        return {
            "split": self.corpus.split,
            "corpus_docs": self.corpus.num_docs,
            "corpus_tokens": self.corpus.num_tokens,
            "corpus_fingerprint": self._fingerprint,
        }

    def log_fields(self) -> dict[str, Any]:
        """Entries for the run's log records (a blend's samples per corpus)."""
        return {}

    def _order(self, epoch: int) -> Any:
        if epoch not in self._epochs:
            # An iteration spans at most two epochs; older ones are never needed again.
            for old in [e for e in self._epochs if e < epoch - 1]:
                del self._epochs[old]
            self._epochs[epoch] = self.epoch_order(epoch)
        return self._epochs[epoch]

    def __iter__(self) -> SampleBatches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        per_rank = self.global_batch_size // self.dp_size
        first = (
            self.consumed_samples
            + self.dp_rank * per_rank
            + self.microbatches_drawn * self.micro_batch_size
        )
        batch = self.collate([self.sample(k) for k in range(first, first + self.micro_batch_size)])
        self.microbatches_drawn += 1
        if self.microbatches_drawn == self.num_microbatches:
            self.consumed_samples += self.global_batch_size
            self.microbatches_drawn = 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "microbatches_drawn": self.microbatches_drawn,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
            "seed": self.seed,
            "seq_len": self.seq_len,
            **self.data_identity(),
            **self.identity(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        now = self.state_dict()
        identity = ("seed", "seq_len", "split", "corpus_tokens", "corpus_docs")
        for name in (*identity, *self.identity(), "corpus_fingerprint"):
            if state.get(name) != now[name]:
                raise ValueError(
                    f"data position state: {name} was {state.get(name)!r} when saved, "
                    f"is {now[name]!r} now; it belongs to another run or corpus"
                )
        drawn = int(state["microbatches_drawn"])
        if drawn:
            # Mid-iteration the position is counted in this layout's microbatches.
            for name in ("global_batch_size", "micro_batch_size", "dp_size"):
                if state.get(name) != now[name]:
                    raise ValueError(
                        f"data position state saved in the middle of an iteration "
                        f"({drawn} microbatches drawn): {name} was {state.get(name)!r}, "
                        f"is {now[name]!r} now; only a state at an iteration boundary "
                        f"can change it"
                    )
        self.consumed_samples = int(state["consumed_samples"])
        self.microbatches_drawn = drawn


@dataclass(frozen=True)
class PackedDocuments:
    """Megatron-LM's switches for the documents packed into one sample (`data.*`): positions
    that restart after each end-of-document token, attention that never crosses one, and no
    loss where the input token is one (the prediction of the next document's first token)."""

    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def __bool__(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss


def document_arrays(tokens: np.ndarray, eod_id: int, packing: PackedDocuments) -> dict:
    """The arrays `packing` asks for, from a microbatch's input tokens [b, s]: "position_ids"
    (int64: 0 at a document's first token; the EOD is its document's last), "segments"
    (int64: the EODs before each token, so tokens attend within their document) and
    "loss_mask" (float32: 0 where the input token is the EOD). Megatron-LM's
    get_ltor_masks_and_position_ids, as arrays per token instead of an s x s mask."""
    is_eod = tokens == eod_id
    index = np.arange(tokens.shape[1])
    out = {}
    if packing.reset_position_ids:
        # The last EOD strictly before each token; its document starts one after it.
        last = np.maximum.accumulate(np.where(is_eod, index, -1), axis=1)
        before = np.concatenate([np.full((len(tokens), 1), -1), last[:, :-1]], axis=1)
        out["position_ids"] = index - (before + 1)
    if packing.reset_attention_mask:
        segments = np.zeros(tokens.shape, np.int64)
        np.cumsum(is_eod[:, :-1], axis=1, out=segments[:, 1:])
        out["segments"] = segments
    if packing.eod_mask_loss:
        out["loss_mask"] = (~is_eod).astype(np.float32)
    return out


class GPTBatches(SampleBatches):
    """GPT microbatches (see `SampleBatches`): `next()` gives
    {"tokens": int64 [micro, seq_len], "labels": int64 [micro, seq_len]},
    labels being the tokens shifted by one, and the arrays of `packing` (`document_arrays`).
    """

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        seed: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        packing: PackedDocuments = PackedDocuments(),
    ):
        super().__init__(
            corpus, seq_len, seed, global_batch_size, micro_batch_size, dp_rank, dp_size
        )
        self.packing = packing
        self.samples_per_epoch = samples_per_epoch(corpus, seq_len)
        if self.samples_per_epoch < 1:
            raise ValueError(
                f"split {corpus.split!r} of {corpus.path} holds {corpus.num_tokens} tokens, "
                f"fewer than one sample of seq_len + 1 = {seq_len + 1} tokens"
            )

    def epoch_order(self, epoch: int) -> EpochOrder:
        return epoch_order(self.corpus, self.seq_len, self.seed, epoch)

    def sample(self, k: int) -> np.ndarray:
        """Global sample k: seq_len + 1 tokens, int64."""
        epoch, j = divmod(k, self.samples_per_epoch)
        order = self._order(epoch)
        start = int(order.sample_order[j]) * self.seq_len
        out = np.empty(self.seq_len + 1, np.int64)
        i = int(np.searchsorted(order.doc_offsets, start, side="right")) - 1
        filled = 0
        while filled < len(out):
            doc = self.corpus.document(int(order.doc_order[i]))
            begin = start + filled - int(order.doc_offsets[i])
            piece = doc[begin : begin + len(out) - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            i += 1
        if out.max() >= self.corpus.vocab_size:
            raise ValueError(
                f"split {self.corpus.split!r} of {self.corpus.path}: sample {k} holds token "
                f"{int(out.max())}, outside tokenizer.vocab_size {self.corpus.vocab_size}"
            )
        return out

    def collate(self, samples: list[np.ndarray]) -> dict[str, np.ndarray]:
        stacked = np.stack(samples)
        tokens = np.ascontiguousarray(stacked[:, :-1])
        batch = {"tokens": tokens, "labels": np.ascontiguousarray(stacked[:, 1:])}
        if self.packing:
            batch.update(document_arrays(tokens, self.corpus.eod_id, self.packing))
        return batch
