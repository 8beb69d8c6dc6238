"""Dedup steps 1-3 (megadata.stages.dedup): MinHash signatures of word shingles, their bands,
and the buckets of documents that share a band's values, as links to each bucket's hub."""

import itertools
import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from megadata.documents import read_docs, read_table, write_table
from megadata.minhash import scheme, signatures_of_hashes
from megadata.ngrams import NGRAM_HASH, ngram_hashes
from megadata.shuffle import read_shuffled as _read_shuffled
from megadata.shuffle import write_shuffled as _write_shuffled

_WORD = re.compile(r"\w+")
# How a signature's shingles were hashed (written beside `scheme`): signatures of
# different hashes are not comparable, so a mix is refused.
SHINGLE_HASH = NGRAM_HASH


def shingles(text: str, n: int = 2) -> set[str]:
    """Word n-grams of the lower-cased text (the whole text if it has fewer than n words)."""
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {" ".join(words)} if words else set()
    if n == 2:  # the usual case, a third faster this way
        return {f"{a} {b}" for a, b in itertools.pairwise(words)}
    return set(map(" ".join, zip(*(words[i:] for i in range(n)), strict=False)))


def choose_bands(threshold: float, num_perm: int, recall: float = 0.995) -> tuple[int, int]:
    """(bands, rows): the most rows per band whose chance of pairing two documents of
    Jaccard = threshold is at least `recall` (more rows, fewer false candidates)."""
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if 1 - (1 - threshold**rows) ** bands >= recall:
            best = (bands, rows)
    return best


def signature_partition(in_path: str, out_path: str, num_perm: int, n: int, seed: int) -> dict:
    ids, lengths, hashes = [], [], []
    for doc in read_docs(Path(in_path)):
        ids.append(doc["doc_id"])
        lengths.append(len(doc["text"]))
        # The shingles as the 64-bit hashes that verification compares (megadata.ngrams):
        # each word is hashed once, not each shingle's bytes.
        hashes.append(ngram_hashes(doc["text"], n, underscore=True, short=True))
    flat = signatures_of_hashes(hashes, num_perm, seed).astype(np.uint64).ravel()
    table = pa.table(
        {
            "doc_id": pa.array(ids, pa.string()),
            "length": pa.array(lengths, pa.int64()),
            "signature": pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.uint64()), num_perm),
        }
    )
    meta = {"scheme": scheme(num_perm, seed), "shingle_hash": SHINGLE_HASH}
    write_table(Path(out_path), table, meta)
    return {"docs_in": len(ids), "docs_out": len(ids)}


def band_partition(
    sig_path: str, doc_path: str, part: int, out_path: str, bands: int, rows: int, shards: int
) -> dict:
    """Step 2: one row per (document, band), routed to its bucket."""
    table = read_table(Path(sig_path))
    docs = read_table(Path(doc_path)).num_rows
    if table.num_rows != docs:
        raise ValueError(
            f"{sig_path}: {table.num_rows} signatures for the {docs} documents of {doc_path}; "
            "delete the signatures directory to have them recomputed"
        )
    width = table.schema.field("signature").type.list_size
    if width < bands * rows:
        raise ValueError(f"{sig_path}: signatures of {width} hashes, {bands} x {rows} needed")
    flat = table.column("signature").combine_chunks().flatten().to_numpy()
    values = flat.reshape(docs, width)[:, : bands * rows].reshape(docs * bands, rows)
    values = np.ascontiguousarray(values, dtype=np.uint64)
    band = np.tile(np.arange(bands, dtype=np.int32), docs)
    node = np.repeat((np.int64(part) << 32) | np.arange(docs, dtype=np.int64), bands)
    key = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(8 * rows), docs * bands, [None, pa.py_buffer(values.tobytes())]
    )
    _write_shuffled(
        out_path,
        {"band": pa.array(band), "key": key, "node": pa.array(node)},
        _mix(band, *values.T) % np.uint64(shards),
        shards,
    )
    return {"docs_in": docs, "docs_out": docs}


def bucket_links(
    band_paths: list[str], bucket: int, links_path: str, hubs_path: str, shards: int
) -> dict:
    """Step 3: each bucket of this shard (documents with equal values in a band) as links
    from its smallest node, its hub, to the others, and each member's (node, band, hub)."""
    table = _read_shuffled(band_paths, bucket, shards)
    band = table.column("band").to_numpy().astype(np.int64)
    node = table.column("node").to_numpy().astype(np.int64)
    width = table.schema.field("key").type.byte_width // 8
    keys = _u64_matrix(table.column("key"), width)
    order = np.lexsort((node, *keys.T[::-1], band))
    band, node, keys = band[order], node[order], keys[order]
    start = np.ones(len(node), dtype=bool)
    start[1:] = (band[1:] != band[:-1]) | (keys[1:] != keys[:-1]).any(axis=1)
    group = np.cumsum(start) - 1
    size = np.bincount(group)
    hub = node[start][group]
    shared = size[group] >= 2
    linked = shared & (node != hub)
    edges = _unique_pairs(hub[linked], node[linked])
    a, b = edges[:, 0], edges[:, 1]
    ends = np.concatenate([a, b])
    _write_shuffled(
        links_path,
        {"node": pa.array(ends), "neighbor": pa.array(np.concatenate([b, a]))},
        ends % shards,
        shards,
    )
    _write_shuffled(
        hubs_path,
        {
            "node": pa.array(node[shared]),
            "band": pa.array(band[shared]),
            "hub": pa.array(hub[shared]),
        },
        node[shared] % shards,
        shards,
    )
    sizes = size[size >= 2].astype(np.int64)
    # What enumerating every pair of every bucket would have cost (a pair once per band).
    return {"extra": {"bucket_pairs": int((sizes * (sizes - 1) // 2).sum())}}


def _mix(*columns: np.ndarray) -> np.ndarray:
    """A fixed 64-bit hash of equal-length integer columns, row by row (splitmix64-style
    steps).  It only routes rows to shards: equal inputs always go to the same one."""
    h = np.full(len(columns[0]), 0x9E3779B97F4A7C15, dtype=np.uint64)
    for column in columns:
        h = (h ^ column.astype(np.uint64)) * np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
    return h


def _unique_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distinct (a, b) rows, sorted: an (m, 2) int64 array."""
    return np.unique(np.stack([a, b], axis=1).astype(np.int64).reshape(-1, 2), axis=0)


def _u64_matrix(column, width: int) -> np.ndarray:
    """A fixed-size binary column of 8 * width bytes as an (n, width) uint64 array."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(array) == 0:
        return np.zeros((0, width), dtype=np.uint64)
    data = np.frombuffer(array.buffers()[1], dtype=np.uint64)
    return data[array.offset * width : (array.offset + len(array)) * width].reshape(-1, width)
