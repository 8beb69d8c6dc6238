"""GPT training samples from a megadata corpus directory, in the paper's loading order.

The corpus is read through the file contract of DESIGN.md ("Corpus directory"):
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
`megatrain.bert_data.BertBatches` the BERT ones.

A BERT corpus (tokenizer kind bert-wordpiece) also has a `sentence_ends` column:
per document, the token offset after each sentence (the EOD excluded). When a
corpus is opened for BERT the column is required, and mapped like the tokens
(`Corpus.sentence_ends`); a corpus opened for GPT does not read it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

FORMAT_VERSION = 1
TOKEN_DTYPES = {"uint16": pa.uint16(), "uint32": pa.uint32()}
SENTENCE_KINDS = ("bert-wordpiece",)  # tokenizer kinds whose corpora must hold sentence_ends
_HASH_CHUNK = 1 << 20


def _manifest_field(manifest: dict, where: Path, *keys: str) -> Any:
    value: Any = manifest
    for i, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            name = ".".join(keys[: i + 1])
            raise ValueError(f"{where}: field {name!r} is missing")
        value = value[key]
    return value


def _refuse(where: Path | str, name: str, expected: Any, found: Any, hint: str = "") -> NoReturn:
    raise ValueError(f"{where}: {name} is {found!r}, expected {expected!r}{hint}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Corpus:
    """One split of a corpus directory, memory mapped; build it with `open_corpus`.

    Documents are numbered across the split in manifest shard order: row r of
    shard i is document `shard_first_doc[i] + r`.
    """

    path: Path
    split: str
    manifest: dict
    eod_id: int
    vocab_size: int
    tokenizer_kind: str
    tokenizer_sha256: str
    shard_files: list[Path]
    shard_first_doc: np.ndarray  # int64 [shards + 1]
    # Per document (O(docs) memory): which mapped values array holds it, where, how long.
    _doc_buffer: np.ndarray = field(repr=False)
    _doc_start: np.ndarray = field(repr=False)
    _doc_length: np.ndarray = field(repr=False)
    # The mapped token arrays (one per record batch) and the maps that keep them alive.
    _buffers: list[np.ndarray] = field(repr=False)
    _maps: list[pa.MemoryMappedFile] = field(repr=False)
    # sentence_ends, where the shards have it: per document where its ends start in the
    # mapped array of its record batch (_doc_buffer) and how many; None without the column.
    _doc_sent_start: np.ndarray | None = field(default=None, repr=False)
    _doc_sent_count: np.ndarray | None = field(default=None, repr=False)
    _sent_buffers: list[np.ndarray] | None = field(default=None, repr=False)

    @property
    def num_shards(self) -> int:
        return len(self.shard_files)

    @property
    def num_docs(self) -> int:
        return len(self._doc_length)

    @cached_property
    def num_tokens(self) -> int:
        return int(self._doc_length.sum())

    @property
    def doc_lengths(self) -> np.ndarray:
        return self._doc_length

    def shard_num_docs(self, shard: int) -> int:
        return int(self.shard_first_doc[shard + 1] - self.shard_first_doc[shard])

    def shard_doc_lengths(self, shard: int) -> np.ndarray:
        return self._doc_length[self.shard_first_doc[shard] : self.shard_first_doc[shard + 1]]

    def doc_tokens(self, shard: int, row: int) -> np.ndarray:
        """Tokens of one document, EOD included: a read-only view of the mapped shard."""
        if not 0 <= row < self.shard_num_docs(shard):
            raise IndexError(f"row {row} of shard {shard} ({self.shard_files[shard]}) is absent")
        return self.document(int(self.shard_first_doc[shard]) + row)

    def document(self, doc: int) -> np.ndarray:
        start = self._doc_start[doc]
        return self._buffers[self._doc_buffer[doc]][start : start + self._doc_length[doc]]

    @property
    def has_sentence_ends(self) -> bool:
        return self._sent_buffers is not None

    def sentence_ends(self, doc: int) -> np.ndarray:
        """The token offset after each sentence of a document (uint32, EOD not counted):
        sentence i is tokens [ends[i-1], ends[i]) with ends[-1] = 0. A read-only view."""
        self._need_sentence_ends()
        start = self._doc_sent_start[doc]
        return self._sent_buffers[self._doc_buffer[doc]][start : start + self._doc_sent_count[doc]]

    def sentence_blocks(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """The sentence ends of all documents in bulk, one mapped record batch at a time:
        (its first document, sentences per document, their ends one after the other)."""
        self._need_sentence_ends()
        bounds = np.searchsorted(self._doc_buffer, np.arange(len(self._sent_buffers) + 1))
        for b, values in enumerate(self._sent_buffers):
            lo, hi = int(bounds[b]), int(bounds[b + 1])
            if lo < hi:
                start = int(self._doc_sent_start[lo])
                stop = int(self._doc_sent_start[hi - 1] + self._doc_sent_count[hi - 1])
                yield lo, self._doc_sent_count[lo:hi], values[start:stop]

    def shard_of(self, doc: int) -> tuple[int, int]:
        """(shard, row) of a document."""
        shard = int(np.searchsorted(self.shard_first_doc, doc, side="right")) - 1
        return shard, doc - int(self.shard_first_doc[shard])

    def _need_sentence_ends(self) -> None:
        if self._sent_buffers is None:
            raise ValueError(
                f"{self.path / 'manifest.json'}: sentence ends are read for a corpus of "
                f"tokenizer.kind {', '.join(SENTENCE_KINDS)} only (this one is opened as "
                f"{self.tokenizer_kind}); build it with a recipe whose [tokenizer] kind is "
                "bert-wordpiece and open it with that tokenizer_kind"
            )

    def fingerprint(self) -> str:
        """Identity of the split's content, from the manifest alone (no file is read)."""
        shards = _manifest_field(self.manifest, self.path, "splits", self.split, "shards")
        text = json.dumps([self.tokenizer_sha256, [s.get("sha256") for s in shards]])
        return hashlib.sha256(text.encode()).hexdigest()


def open_corpus(
    path: str | Path,
    split: str = "train",
    *,
    vocab_size: int | None = None,
    tokenizer_kind: str = "gpt2-bpe",
    tokenizer_sha256: str | None = None,
    verify_sha256: bool = False,
) -> Corpus:
    """Open one split of the corpus directory at `path`, checking it against the model.

    `vocab_size` is the tokenizer's size the model was configured for (before
    padding to a multiple of 128 x tp). Refusals are ValueError, or
    FileNotFoundError for a missing file, naming the file, field and values.
    """
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{manifest_path}: no corpus manifest; build the corpus with "
            "`megadata run --recipe ...` (or `make data`)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{manifest_path}: not valid JSON ({e})") from e

    def get(*keys: str) -> Any:
        return _manifest_field(manifest, manifest_path, *keys)

    if get("format_version") != FORMAT_VERSION:
        _refuse(manifest_path, "format_version", FORMAT_VERSION, get("format_version"))
    kind = get("tokenizer", "kind")
    if kind != tokenizer_kind:
        _refuse(
            manifest_path,
            "tokenizer.kind",
            tokenizer_kind,
            kind,
            " (corpus built for another model)",
        )
    corpus_vocab = get("tokenizer", "vocab_size")
    if vocab_size is not None and corpus_vocab != vocab_size:
        _refuse(
            manifest_path, "tokenizer.vocab_size", vocab_size, corpus_vocab, " (model's vocab_size)"
        )
    corpus_sha = get("tokenizer", "sha256")
    if tokenizer_sha256 is not None and corpus_sha != tokenizer_sha256:
        _refuse(manifest_path, "tokenizer.sha256", tokenizer_sha256, corpus_sha)
    eod_id = get("tokenizer", "eod_id")
    dtype_name = get("token_dtype")
    if dtype_name not in TOKEN_DTYPES:
        _refuse(manifest_path, "token_dtype", " or ".join(TOKEN_DTYPES), dtype_name)
    splits = get("splits")
    if split not in splits:
        raise ValueError(
            f"{manifest_path}: field 'splits' has no split {split!r} (found {sorted(splits)})"
        )
    shards = get("splits", split, "shards")
    if not shards:
        raise ValueError(f"{manifest_path}: field 'splits.{split}.shards' is empty")

    files = []
    for i, shard in enumerate(shards):
        file = path / _manifest_field(shard, manifest_path, "file")
        if not file.is_file():
            raise FileNotFoundError(
                f"{file}: shard missing (listed in {manifest_path} as splits.{split}.shards[{i}])"
            )
        files.append(file)
    if verify_sha256:
        # hashlib releases the GIL: the shards are hashed in parallel, at disk speed.
        with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
            digests = list(pool.map(sha256_file, files))
        for i, (shard, file, found) in enumerate(zip(shards, files, digests, strict=True)):
            expected = _manifest_field(shard, manifest_path, "sha256")
            if found != expected:
                _refuse(
                    file,
                    f"sha256 (splits.{split}.shards[{i}].sha256 of {manifest_path})",
                    expected,
                    found,
                )

    maps, buffers, doc_buffer, doc_start, doc_length = [], [], [], [], []
    # Read for the kinds that need them only: a GPT corpus is opened as it always was.
    sent_buffers: list[np.ndarray] | None = [] if kind in SENTENCE_KINDS else None
    sent_start, sent_count = [], []
    first_doc = [0]
    for shard, file in zip(shards, files, strict=True):
        mapped = pa.memory_map(str(file), "r")
        maps.append(mapped)
        reader = ipc.open_file(mapped)
        schema = reader.schema
        tokens_type = schema.field("tokens").type if "tokens" in schema.names else None
        wanted = TOKEN_DTYPES[dtype_name]
        if not (
            tokens_type is not None
            and (pa.types.is_list(tokens_type) or pa.types.is_large_list(tokens_type))
            and tokens_type.value_type == wanted
        ):
            raise ValueError(
                f"{file}: column 'tokens' is {tokens_type}, expected list<{dtype_name}> "
                f"(token_dtype of {manifest_path})"
            )
        if sent_buffers is not None:
            if "sentence_ends" not in schema.names:
                raise ValueError(
                    f"{file}: no column 'sentence_ends' (sentence boundaries), which a {kind} "
                    "corpus needs; build it with a recipe whose [tokenizer] kind is "
                    f"bert-wordpiece ({manifest_path} says sentence_boundaries = "
                    f"{manifest.get('sentence_boundaries')!r})"
                )
            ends_type = schema.field("sentence_ends").type
            if not (pa.types.is_list(ends_type) and ends_type.value_type == pa.uint32()):
                raise ValueError(
                    f"{file}: column 'sentence_ends' is {ends_type}, expected list<uint32>"
                )
        n_docs = n_tokens = 0
        for b in range(reader.num_record_batches):
            batch = reader.get_batch(b)
            column = batch.column("tokens")
            if column.null_count:
                raise ValueError(f"{file}: column 'tokens' has {column.null_count} null rows")
            # offsets honour the batch's slice; values is the whole child array, so they agree.
            offsets = column.offsets.to_numpy().astype(np.int64)
            values = column.values.to_numpy(zero_copy_only=True)
            lengths = np.diff(offsets)
            # The check reads one token per document: cheap even for a corpus of any size.
            last = np.full(len(lengths), -1, np.int64)
            nonempty = lengths > 0
            last[nonempty] = values[offsets[1:][nonempty] - 1]
            if (last != eod_id).any():
                row = int(np.argmax(last != eod_id))
                doc_id = batch.column("doc_id")[row].as_py() if "doc_id" in schema.names else None
                found = "no token" if last[row] < 0 else f"token {last[row]}"
                raise ValueError(
                    f"{file}: document {doc_id!r} (row {n_docs + row}) ends with {found}, "
                    f"expected eod_id {eod_id} (tokenizer.eod_id of {manifest_path})"
                )
            if sent_buffers is not None:
                ends = batch.column("sentence_ends")
                if ends.null_count:
                    raise ValueError(
                        f"{file}: column 'sentence_ends' has {ends.null_count} null rows"
                    )
                ends_offsets = ends.offsets.to_numpy().astype(np.int64)
                ends_values = ends.values.to_numpy(zero_copy_only=True)
                counts = np.diff(ends_offsets)
                # One value per document, like the EOD check: the last sentence ends at
                # most at the EOD. The sampler checks the order of the others as it reads them.
                final = np.zeros(len(counts), np.int64)
                final[counts > 0] = ends_values[ends_offsets[1:][counts > 0] - 1]
                if (final > lengths - 1).any():
                    row = int(np.argmax(final > lengths - 1))
                    raise ValueError(
                        f"{file}: column 'sentence_ends' of row {n_docs + row} ends at token "
                        f"{final[row]}, past its document of {lengths[row] - 1} tokens + EOD"
                    )
                sent_buffers.append(ends_values)
                sent_start.append(ends_offsets[:-1])
                sent_count.append(counts)
            doc_buffer.append(np.full(len(lengths), len(buffers), np.int32))
            doc_start.append(offsets[:-1])
            doc_length.append(lengths)
            buffers.append(values)
            n_docs += len(lengths)
            n_tokens += int(lengths.sum())
        for name, found in (("docs", n_docs), ("tokens", n_tokens)):
            if name in shard and shard[name] != found:
                raise ValueError(
                    f"{file}: holds {found} {name}, expected {shard[name]} "
                    f"(its {name!r} in {manifest_path})"
                )
        first_doc.append(first_doc[-1] + n_docs)

    def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    return Corpus(
        path=path,
        split=split,
        manifest=manifest,
        eod_id=int(eod_id),
        vocab_size=int(corpus_vocab),
        tokenizer_kind=kind,
        tokenizer_sha256=corpus_sha,
        shard_files=files,
        shard_first_doc=np.asarray(first_doc, np.int64),
        _doc_buffer=cat(doc_buffer, np.int32),
        _doc_start=cat(doc_start, np.int64),
        _doc_length=cat(doc_length, np.int64),
        _buffers=buffers,
        _maps=maps,
        _doc_sent_start=None if sent_buffers is None else cat(sent_start, np.int64),
        _doc_sent_count=None if sent_buffers is None else cat(sent_count, np.int64),
        _sent_buffers=sent_buffers,
    )


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
            "split": self.corpus.split,
            "corpus_docs": self.corpus.num_docs,
            "corpus_tokens": self.corpus.num_tokens,
            "corpus_fingerprint": self._fingerprint,
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


class GPTBatches(SampleBatches):
    """GPT microbatches (see `SampleBatches`): `next()` gives
    {"tokens": int64 [micro, seq_len], "labels": int64 [micro, seq_len]},
    labels being the tokens shifted by one.
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
    ):
        super().__init__(
            corpus, seq_len, seed, global_batch_size, micro_batch_size, dp_rank, dp_size
        )
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
        return {
            "tokens": np.ascontiguousarray(stacked[:, :-1]),
            "labels": np.ascontiguousarray(stacked[:, 1:]),
        }
