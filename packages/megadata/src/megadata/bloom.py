"""A Bloom filter of byte strings: numpy bits, keyed blake2b positions, one file on disk.

Sized for `capacity` items at false-positive rate p: m = -n ln p / (ln 2)^2 bits and
k = round(m/n ln 2) hash functions (the optimum; p = 1e-3 gives 14.4 bits and 10 hashes per
item).  An item's k bit positions come from one keyed blake2b digest of 16 bytes read as two
little-endian uint64, h1 and h2, by double hashing (Kirsch and Mitzenmacher 2006):
position_i = (h1 + i * (h2 | 1)) mod 2^64 mod m, bit b stored in byte b // 8 at bit b % 8.
The key is the seed, so the positions are the same in every process and on every machine
(Python's hash() is salted per process and is never used); items are hashed in Python one by
one but the bits are set and tested with numpy over whole batches.

Why not a library from PyPI: rbloom (well kept, fast) hashes with Python's salted hash()
unless given a hash function, and then saves only its own headerless bytes; pybloom-live and
bloom-filter2 are unmaintained since 2021-2022; pyprobables hashes and tests items one by one
in pure Python and has no versioned header.  We need a file that records how it was hashed
(a corpus's filter is reused by later runs and by `megadata overlap`) and a format we can
refuse when it is not ours, which is a page of code over numpy and hashlib.

File format: the line `megadata-bloom\\n`, one line of JSON (format version, m, k, capacity,
fpr, seed, hash scheme, items added, free metadata), then the ceil(m/8) bytes of the bit array.
"""

import hashlib
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from megacommon.files import atomic_write_bytes

MAGIC = b"megadata-bloom\n"
FORMAT_VERSION = 1
HASH_SCHEME = "blake2b-128(key=seed as 8 bytes LE); h1,h2 = LE uint64; pos_i = (h1 + i*(h2|1)) % m"
_BATCH = 1 << 16  # items hashed and set per numpy step


class BloomFileError(ValueError):
    pass


def bloom_size(capacity: int, fpr: float) -> tuple[int, int]:
    """(m bits, k hashes) for `capacity` items at false-positive rate `fpr`."""
    if capacity < 1:
        raise ValueError(f"Bloom filter capacity must be >= 1, got {capacity}")
    if not 0 < fpr < 1:
        raise ValueError(f"Bloom filter false-positive rate must be in (0, 1), got {fpr}")
    m = max(8, math.ceil(-capacity * math.log(fpr) / math.log(2) ** 2))
    k = max(1, round(m / capacity * math.log(2)))
    return m, k


def _as_bytes(item: str | bytes) -> bytes:
    return item.encode("utf-8") if isinstance(item, str) else item


class BloomFilter:
    def __init__(self, capacity: int, fpr: float = 1e-3, seed: int = 0, meta: dict | None = None):
        self.m, self.k = bloom_size(capacity, fpr)
        self.capacity, self.fpr, self.seed = capacity, fpr, seed
        self.meta = dict(meta or {})
        self.added = 0  # add() calls, repeats included
        self.bits = np.zeros((self.m + 7) // 8, dtype=np.uint8)
        self._key = int(seed).to_bytes(8, "little")
        self._steps = np.arange(self.k, dtype=np.uint64)

    def digests(self, items: list[bytes]) -> np.ndarray:
        """(len(items), 2) uint64: h1, h2 of each item's keyed blake2b digest."""
        key = self._key
        data = b"".join(hashlib.blake2b(x, digest_size=16, key=key).digest() for x in items)
        return np.frombuffer(data, dtype="<u8").reshape(-1, 2).astype(np.uint64)

    def _positions(self, h: np.ndarray) -> np.ndarray:
        """(len(h), k) bit positions of items whose digests are `h`."""
        h1, h2 = h[:, :1], h[:, 1:] | np.uint64(1)  # odd h2: the k positions never coincide
        return (h1 + self._steps * h2) % np.uint64(self.m)  # uint64 wraps like the spec says

    def _batches(self, items: Iterable[str | bytes]):
        batch = []
        for item in items:
            batch.append(_as_bytes(item))
            if len(batch) == _BATCH:
                yield self.digests(batch)
                batch = []
        if batch:
            yield self.digests(batch)

    def add_many(self, items: Iterable[str | bytes]) -> None:
        for h in self._batches(items):
            self.add_digests(h)

    def add_digests(self, h: np.ndarray) -> None:
        """Add the items whose `digests` are `h` (computed elsewhere, by the same seed)."""
        for start in range(0, len(h), _BATCH):
            pos = self._positions(h[start : start + _BATCH]).ravel()
            masks = np.left_shift(np.uint8(1), (pos & np.uint64(7)).astype(np.uint8))
            np.bitwise_or.at(self.bits, pos >> np.uint64(3), masks)
        self.added += len(h)

    def add(self, item: str | bytes) -> None:
        self.add_many([item])

    def contains_many(self, items: Iterable[str | bytes]) -> np.ndarray:
        """A bool per item: False means certainly absent, True present or a false positive."""
        found = [np.zeros(0, dtype=bool)] + [self.contains_digests(h) for h in self._batches(items)]
        return np.concatenate(found)

    def contains_digests(self, h: np.ndarray) -> np.ndarray:
        if not len(h):
            return np.zeros(0, dtype=bool)
        pos = self._positions(h)
        bit = (self.bits[pos >> np.uint64(3)] >> (pos & np.uint64(7)).astype(np.uint8)) & 1
        return bit.all(axis=1)

    def __contains__(self, item: str | bytes) -> bool:
        return bool(self.contains_many([item])[0])

    def header(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "m": self.m,
            "k": self.k,
            "capacity": self.capacity,
            "fpr": self.fpr,
            "seed": self.seed,
            "hash": HASH_SCHEME,
            "added": self.added,
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        """Write the filter to `path` atomically (a reader never sees half a file)."""
        head = json.dumps(self.header(), sort_keys=True).encode() + b"\n"
        atomic_write_bytes(Path(path), MAGIC + head + self.bits.tobytes())

    @classmethod
    def load(cls, path: str | Path) -> "BloomFilter":
        path = Path(path)
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise BloomFileError(f"{path}: not a megadata Bloom filter file")
                line = f.readline(1 << 20)
                try:
                    head = json.loads(line)
                except json.JSONDecodeError:
                    raise BloomFileError(f"{path}: Bloom filter header is damaged") from None
                if head.get("format_version") != FORMAT_VERSION:
                    raise BloomFileError(
                        f"{path}: Bloom filter format version {head.get('format_version')!r}; "
                        f"this megadata reads version {FORMAT_VERSION}"
                    )
                if head.get("hash") != HASH_SCHEME:
                    raise BloomFileError(f"{path}: Bloom filter hashed by {head.get('hash')!r}")
                data = bytearray(os.fstat(f.fileno()).st_size - f.tell())
                f.readinto(data)
        except FileNotFoundError:
            raise BloomFileError(f"Bloom filter file {path} does not exist") from None
        bloom = cls(head["capacity"], head["fpr"], head["seed"], head["meta"])
        if (bloom.m, bloom.k) != (head["m"], head["k"]):
            raise BloomFileError(f"{path}: m and k do not follow from capacity and fpr")
        if len(data) != len(bloom.bits):
            raise BloomFileError(
                f"{path}: truncated or damaged Bloom filter: {len(data)} bytes of bits, "
                f"the header says {len(bloom.bits)}"
            )
        bloom.bits = np.frombuffer(data, dtype=np.uint8)  # writable: it is a bytearray
        bloom.added = head["added"]
        return bloom


# ---------------------------------------------------------------- sharded filters
#
# A filter too large for one process is kept as `shards` filters, one file each: an item
# belongs to shard ((h1 >> 32) * shards) >> 32 of its digest, so each shard is built from
# its own items alone (by its own task) and sized for them, and a query loads one shard
# at a time.  The shard is chosen by h1's top 32 bits; the positions inside a shard come
# from h1 and h2 mod m, so items of one shard are still spread over all of its bits.  A
# single filter file is the case shards = 1.

SHARD_FILE = "shard-{shard:05d}-of-{shards:05d}.bloom"


def shard_of(h: np.ndarray, shards: int) -> np.ndarray:
    return ((h[:, 0] >> np.uint64(32)) * np.uint64(shards)) >> np.uint64(32)


def shard_files(path: str | Path) -> list[Path]:
    """The files of a filter: `path` itself, or the shard files of the directory `path`
    (all of them, or an error naming what is missing)."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    files = sorted(path.glob("shard-*-of-*.bloom"))
    if not files:
        raise BloomFileError(f"{path}: no Bloom filter shard files (shard-*-of-*.bloom) in it")
    shards = int(files[0].stem.rsplit("-of-", 1)[1])
    want = [path / SHARD_FILE.format(shard=k, shards=shards) for k in range(shards)]
    missing = [p.name for p in want if not p.exists()]
    if missing or len(files) != shards:
        raise BloomFileError(f"{path}: a sharded Bloom filter of {shards} shards lacks {missing}")
    return want


def contains_sharded(path: str | Path, items: list[str | bytes]) -> tuple[np.ndarray, dict]:
    """(a bool per item, the filter's totals) for a filter file or a directory of shards,
    holding one shard in memory at a time."""
    found = np.zeros(len(items), dtype=bool)
    totals = {"shards": 0, "m": 0, "capacity": 0, "added": 0}
    h, seed, meta = None, None, None
    files = shard_files(path)
    for k, file in enumerate(files):
        bloom = BloomFilter.load(file)
        shards = int(bloom.meta.get("shards", 1))
        if shards != len(files) or int(bloom.meta.get("shard", 0)) != k:
            raise BloomFileError(f"{file}: shard {bloom.meta.get('shard')} of {shards}, not {k}")
        if h is None:
            seed, meta = bloom.seed, {x: v for x, v in bloom.meta.items() if "shard" not in x}
            h = bloom.digests([_as_bytes(x) for x in items])
            route = shard_of(h, shards) if len(h) else np.zeros(0, dtype=np.uint64)
        elif bloom.seed != seed:
            raise BloomFileError(f"{file}: seed {bloom.seed}, the other shards {seed}")
        mine = np.flatnonzero(route == k)
        found[mine] = bloom.contains_digests(h[mine])
        for key in ("m", "capacity", "added"):
            totals[key] += getattr(bloom, key)
        totals["shards"] += 1
        totals.update(fpr=bloom.fpr, seed=bloom.seed, k=bloom.k)
    return found, {**totals, "meta": meta}
