"""GPT training samples from a megadata corpus directory, in the paper's loading order.

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
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from megacommon.corpus_format import (
    TOKEN_DTYPES,
    check_shard_schema,
    manifest_field,
    read_manifest,
    refuse,
)
from megacommon.files import sha256_file
from megatrain.config import DEFAULT_CORPUS, Config

SENTENCE_KINDS = ("bert-wordpiece",)  # tokenizer kinds whose corpora must hold sentence_ends


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
        shards = manifest_field(self.manifest, self.path, "splits", self.split, "shards")
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
    manifest, manifest_path = read_manifest(path)

    def get(*keys: str) -> Any:
        return manifest_field(manifest, manifest_path, *keys)

    kind = get("tokenizer", "kind")
    if kind != tokenizer_kind:
        refuse(
            manifest_path,
            "tokenizer.kind",
            tokenizer_kind,
            kind,
            " (corpus built for another model)",
        )
    corpus_vocab = get("tokenizer", "vocab_size")
    if vocab_size is not None and corpus_vocab != vocab_size:
        refuse(
            manifest_path, "tokenizer.vocab_size", vocab_size, corpus_vocab, " (model's vocab_size)"
        )
    corpus_sha = get("tokenizer", "sha256")
    if tokenizer_sha256 is not None and corpus_sha != tokenizer_sha256:
        refuse(manifest_path, "tokenizer.sha256", tokenizer_sha256, corpus_sha)
    eod_id = get("tokenizer", "eod_id")
    dtype_name = get("token_dtype")
    if dtype_name not in TOKEN_DTYPES:
        refuse(manifest_path, "token_dtype", " or ".join(TOKEN_DTYPES), dtype_name)
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
        file = path / manifest_field(shard, manifest_path, "file")
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
            expected = manifest_field(shard, manifest_path, "sha256")
            if found != expected:
                refuse(
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
        check_shard_schema(schema, file, dtype_name, manifest_path)
        if sent_buffers is not None and "sentence_ends" not in schema.names:
            raise ValueError(
                f"{file}: no column 'sentence_ends' (sentence boundaries), which a {kind} "
                "corpus needs; build it with a recipe whose [tokenizer] kind is "
                f"bert-wordpiece ({manifest_path} says sentence_boundaries = "
                f"{manifest.get('sentence_boundaries')!r})"
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


# A Llama reads a byte-level BPE corpus (its tokenizer.json, or one trained as GPT-2's).
TOKENIZER_KINDS = {"gpt": "gpt2-bpe", "bert": "bert-wordpiece", "llama": "gpt2-bpe"}


def open_run_corpus(
    config: Config, split: str, verify: bool | None = None, path: str | None = None
) -> Corpus:
    """The corpus split of a run (or of `path`, one corpus of its blend), refused when its
    tokenizer or vocabulary is not the model's (and, when `verify` (default:
    data.verify_sha256), a shard whose sha256 differs)."""
    return open_corpus(
        path or config.data.corpus or DEFAULT_CORPUS,
        split,
        vocab_size=config.model.vocab_size or None,
        tokenizer_kind=TOKENIZER_KINDS[config.model.kind],
        tokenizer_sha256=config.data.tokenizer_sha256,
        verify_sha256=config.data.verify_sha256 if verify is None else verify,
    )
