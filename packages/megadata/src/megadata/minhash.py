"""MinHash signatures of many documents at once, equal to datasketch's `MinHash` bit for bit.

datasketch hashes each shingle to 32 bits (by default SHA-1's first 4 bytes,
little-endian), mixes the value with the MurmurHash3 finalizer and applies `num_perm`
affine permutations h -> a*h + b mod 2^32 drawn from `seed`; a signature holds the minimum
of each permutation over the document's shingles.  `MinHash.bulk` does that document by
document, building a `MinHash` (and its permutations) for each.  Here the permutations are
drawn once (by datasketch itself, from one `MinHash(num_perm, seed)`) and each document's
(shingles x num_perm) product runs as one numpy expression.  Two ways in:
- `signatures`: shingles as bytes, hashed with SHA-1 as datasketch's default; a shingle
  that several documents of a batch share is hashed once.  The batch is cut at
  `BATCH_SHINGLES` shingles so memory stays bounded whatever the partition size.
- `signatures_of_hashes`: shingles already hashed to integers (dedup passes the 64-bit
  n-gram hashes of megadata.ngrams, which it also verifies Jaccard with), taken mod 2^32:
  datasketch's values for a `hashfunc` that returns them.  Hashing words once and
  combining them with numpy costs a fraction of hashing every shingle's bytes.
Tests check both against datasketch.
"""

import hashlib
from collections.abc import Iterable

import numpy as np
from datasketch import MinHash

BATCH_SHINGLES = 1 << 18  # x num_perm x 4 bytes: 128 MiB at 128 permutations
SCHEME = "affine32"  # datasketch's default since 2.0; what `scheme` below must give
# MurmurHash3's 32-bit finalizer, which datasketch applies to each hash before permuting it
# (kept here rather than imported: datasketch's own is private).
_FMIX32 = tuple(np.uint32(c) for c in (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16))


def scheme(num_perm: int, seed: int) -> str:
    return MinHash(num_perm=num_perm, seed=seed).scheme


def signatures(shingle_sets: Iterable, num_perm: int, seed: int) -> np.ndarray:
    """(documents, num_perm) uint32: the MinHash values datasketch computes for each
    collection of shingles (bytes; a set, or a list whose repeats change nothing) with its
    default hash, SHA-1."""
    a, b, empty = _permutations(num_perm, seed)
    out, batch, size = [], [], 0
    for s in shingle_sets:
        batch.append(s)
        size += len(s)
        if size >= BATCH_SHINGLES:
            out.append(_sha1_batch(batch, a, b, empty))
            batch, size = [], 0
    if batch:
        out.append(_sha1_batch(batch, a, b, empty))
    return np.concatenate(out) if out else np.zeros((0, num_perm), dtype=np.uint32)


def signatures_of_hashes(hash_arrays: Iterable, num_perm: int, seed: int) -> np.ndarray:
    """(documents, num_perm) uint32: each document's shingles given as integer hashes (one
    array per document, e.g. megadata.ngrams' 64-bit n-gram hashes); the values datasketch
    computes with `hashfunc` returning each shingle's hash mod 2^32.  No shingle is hashed
    from its bytes here, which is most of the cost of the SHA-1 way."""
    a, b, empty = _permutations(num_perm, seed)
    out = []
    with np.errstate(over="ignore"):  # mod 2^32, as datasketch computes it
        for h in hash_arrays:
            hv = _fmix32(np.asarray(h).astype(np.uint32))  # astype: mod 2^32
            out.append(_permute_min(hv, a, b) if len(hv) else empty)
    return np.stack(out) if out else np.zeros((0, num_perm), dtype=np.uint32)


def _fmix32(hv: np.ndarray) -> np.ndarray:
    """MurmurHash3's finalizer on uint32 values (a bijection that avalanches the bits), as
    datasketch mixes a shingle's hash; the products wrap mod 2^32 on purpose."""
    s1, m1, s2, m2, s3 = _FMIX32
    with np.errstate(over="ignore"):
        hv = hv ^ (hv >> s1)
        hv = hv * m1
        hv = hv ^ (hv >> s2)
        hv = hv * m2
        return hv ^ (hv >> s3)


def _permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m = MinHash(num_perm=num_perm, seed=seed)
    if m.scheme != SCHEME:
        raise ValueError(f"datasketch's default MinHash scheme is {m.scheme!r}, not {SCHEME!r}")
    a, b = (np.asarray(x, dtype=np.uint32) for x in m.permutations)
    empty = np.asarray(m.hashvalues, dtype=np.uint32)  # all 2^32 - 1: a set with no shingle
    return a, b, empty


def _permute_min(hv: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # One document at a time: its (shingles x num_perm) block stays in the cache.  (Callers
    # silence numpy's overflow warning: the products are mod 2^32 on purpose.)
    return (hv[:, None] * a + b).min(axis=0)


def _sha1_batch(sets: list, a: np.ndarray, b: np.ndarray, empty: np.ndarray) -> np.ndarray:
    index: dict[bytes, int] = {}
    add = index.setdefault
    rows = [add(x, len(index)) for s in sets for x in s]
    sha1 = hashlib.sha1
    digests = b"".join([sha1(x).digest() for x in index])
    # datasketch's sha1_hash32: the digest's first 4 bytes as a little-endian uint32
    first = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 20)[:, :4].copy()
    hv = _fmix32(first.view("<u4").ravel().astype(np.uint32))[rows]
    out = np.tile(empty, (len(sets), 1))
    start = 0
    with np.errstate(over="ignore"):
        for i, s in enumerate(sets):
            if len(s):
                out[i] = _permute_min(hv[start : start + len(s)], a, b)
            start += len(s)
    return out
