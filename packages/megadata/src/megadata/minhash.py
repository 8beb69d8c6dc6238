"""MinHash signatures of many documents at once, equal to datasketch's `MinHash` bit for bit.

datasketch hashes each shingle with SHA-1 (its first 4 bytes, little-endian), mixes the
32-bit value with the MurmurHash3 finalizer and applies `num_perm` affine permutations
h -> a*h + b mod 2^32 drawn from `seed`; a signature holds the minimum of each
permutation over the document's shingles.  `MinHash.bulk` does that document by
document.  Here the permutations are drawn once (by datasketch itself, from one
`MinHash(num_perm, seed)`), a shingle that several documents of the batch share is hashed
and permuted once, and the permutation runs as one numpy product over the batch's
distinct shingles; each document then takes the minimum over its rows.  The batch is cut
at `BATCH_SHINGLES` shingles so the permuted matrix stays near 100 MB whatever the
partition size.  A test checks the signatures against datasketch's.
"""

import hashlib
from collections.abc import Iterable

import numpy as np
from datasketch import MinHash
from datasketch.minhash import _fmix  # the finalizer datasketch applies before permuting

BATCH_SHINGLES = 1 << 18  # x num_perm x 4 bytes: 128 MiB at 128 permutations
SCHEME = "affine32"  # datasketch's default since 2.0; what `scheme` below must give


def scheme(num_perm: int, seed: int) -> str:
    return MinHash(num_perm=num_perm, seed=seed).scheme


def signatures(shingle_sets: Iterable, num_perm: int, seed: int) -> np.ndarray:
    """(documents, num_perm) uint32: the MinHash values datasketch computes for each
    collection of shingles (bytes; a set, or a list whose repeats change nothing)."""
    m = MinHash(num_perm=num_perm, seed=seed)
    if m.scheme != SCHEME:
        raise ValueError(f"datasketch's default MinHash scheme is {m.scheme!r}, not {SCHEME!r}")
    a, b = (np.asarray(x, dtype=np.uint32) for x in m.permutations)
    empty = np.asarray(m.hashvalues, dtype=np.uint32)  # all 2^32 - 1: a set with no shingle
    out, batch, size = [], [], 0
    for s in shingle_sets:
        batch.append(s)
        size += len(s)
        if size >= BATCH_SHINGLES:
            out.append(_batch(batch, a, b, empty))
            batch, size = [], 0
    if batch:
        out.append(_batch(batch, a, b, empty))
    return np.concatenate(out) if out else np.zeros((0, num_perm), dtype=np.uint32)


def _batch(sets: list, a: np.ndarray, b: np.ndarray, empty: np.ndarray) -> np.ndarray:
    index: dict[bytes, int] = {}
    add = index.setdefault
    rows = [add(x, len(index)) for s in sets for x in s]
    sha1 = hashlib.sha1
    digests = b"".join([sha1(x).digest() for x in index])
    # datasketch's sha1_hash32: the digest's first 4 bytes as a little-endian uint32
    first = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 20)[:, :4].copy()
    hv = _fmix(first.view("<u4").ravel().astype(np.uint32), 32)[rows]
    out = np.tile(empty, (len(sets), 1))
    start = 0
    with np.errstate(over="ignore"):  # mod 2^32, as datasketch computes it
        for i, s in enumerate(sets):
            # One document at a time: its (shingles x num_perm) block stays in the cache.
            if len(s):
                out[i] = (hv[start : start + len(s), None] * a + b).min(axis=0)
            start += len(s)
    return out
