r"""Word n-grams as 64-bit hashes, and the evaluation sets' n-grams as one exact index.

Decontamination compares the n-grams of every training document with those of the
evaluation sets, and dedup hashes every document's word bigrams for MinHash and for the
exact Jaccard that verifies a pair.  Building each n-gram as a string (and hashing it)
costs more than the rest of those stages; here a document's n-grams are hashed with numpy
instead, without a Python call per word:
- words are the maximal runs of word characters of the lower-cased text, as
  `re.findall(r"\w+")` finds them (or `[^\W_]+`, underscore excluded): the text's code
  points are classified by one lookup table (`str.isalnum` of every code point, built
  once per process, as Python's regex engine decides \w);
- a word's hash is the polynomial sum_k c_k * P^k mod 2^64 of its code points, finished
  with the splitmix64 mixer (its length folded in): prefix sums over the whole text give
  every word's sum at once (`word_hash` is the same function, one word at a time);
- the n-gram starting at word i is sum_j word[i + j] * C_j mod 2^64 with fixed odd
  constants C_j.
Two different n-grams share a hash with probability about 2^-63, so a set of hashes
stands for the set of n-grams: at the paper's scale (3 * 10^10 training n-grams against
10^6 evaluation n-grams) about 10^-3 false matches are expected in all, against the Bloom
filter's 1e-3 of every evaluation n-gram.  `NGRAM_HASH` names the function; files that
hold its values record it, so values of another version are never compared.

The words of decontamination are those of `word_ngrams` (lower-cased runs of letters and
digits), so the hashes and the strings describe the same n-grams (a test checks the
counts agree); dedup's are its shingles' (`\w+`).

`EvalIndex` (built once from the evaluation sets, loaded by every worker) holds the sorted
distinct hashes of all sets, each set's positions among them, and the (hash, article)
pairs of the WikiText articles for the removal rules.  Its size is that of the evaluation
sets, whatever the size of the training corpus.
"""

import functools
import hashlib
import io
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megacommon.files import atomic_write_bytes

NGRAM_HASH = "megadata-ngram-v2"  # the function below: change it with the function
_P = 0x100000001B3  # odd: invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
CHUNK_POINTS = 1 << 20  # a longer text is hashed in pieces of about this many characters
_powers = [(np.ones(1, np.uint64), np.ones(1, np.uint64))]  # P^k, P^-k mod 2^64 (grown)


@functools.cache
def _word_chars(underscore: bool) -> np.ndarray:
    r"""A bool per code point: is it a word character, as Python's regex \w decides (and
    "_" only with `underscore`).  Every code point in one string, each run of non-word ones
    (lone surrogates included) overwritten with NULs by the regex itself: about 0.1 s."""
    every = np.arange(0x110000, dtype="<u4").tobytes().decode("utf-32-le", "surrogatepass")
    non_word = re.compile(r"\W+" if underscore else r"[\W_]+")
    words_only = non_word.sub(lambda m: "\0" * len(m[0]), every)
    points = np.frombuffer(words_only.encode("utf-32-le"), dtype=np.uint32)
    return points != 0


def _splitmix(x):
    """splitmix64's finalizer, on a Python int or a uint64 array (mod 2^64)."""
    if isinstance(x, int):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        return x ^ (x >> 31)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def word_hash(word: str) -> int:
    """One word's 64-bit hash, as `ngram_hashes` computes it for all words at once."""
    h, p = 0, 1
    for ch in word:
        h, p = (h + ord(ch) * p) & _M64, (p * _P) & _M64
    return _splitmix((h + len(word) * _GOLDEN) & _M64)


def _power_tables(n: int) -> tuple[np.ndarray, np.ndarray]:
    up, down = _powers[0]  # one pair, replaced whole: a worker's threads share it
    if len(up) < n:
        size = max(n, 2 * len(up), 1 << 16)
        tables = []
        for base in (_P, _P_INV):
            steps = np.full(size, base, dtype=np.uint64)
            steps[0] = 1
            tables.append(np.cumprod(steps, dtype=np.uint64))  # wraps: mod 2^64
        up, down = _powers[0] = tuple(tables)
    return up[:n], down[:n]


def _word_hashes(text: str, underscore: bool) -> np.ndarray:
    """The 64-bit hash of each word of the lower-cased `text`, in order."""
    points = np.frombuffer(text.lower().encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    is_word = _word_chars(underscore)[points]
    if len(points) <= CHUNK_POINTS:
        return _chunk_word_hashes(points, is_word)
    # A long text goes in pieces cut at non-word characters (no word is cut), so the
    # temporaries and the power tables stay near CHUNK_POINTS entries.
    gaps = np.flatnonzero(~is_word)
    cuts = {0, len(points)}
    for target in range(CHUNK_POINTS, len(points), CHUNK_POINTS):
        k = np.searchsorted(gaps, target)
        cuts.add(int(gaps[k]) if k < len(gaps) else len(points))
    pieces = itertools.pairwise(sorted(cuts))
    return np.concatenate([_chunk_word_hashes(points[a:b], is_word[a:b]) for a, b in pieces])


def _chunk_word_hashes(points: np.ndarray, is_word: np.ndarray) -> np.ndarray:
    edges = np.diff(is_word.view(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if not len(starts):
        return np.zeros(0, dtype=np.uint64)
    up, down = _power_tables(len(points))
    with np.errstate(over="ignore"):  # the arithmetic is mod 2^64 on purpose
        prefix = np.zeros(len(points) + 1, dtype=np.uint64)
        np.cumsum(points * up, out=prefix[1:])
        poly = (prefix[ends] - prefix[starts]) * down[starts]  # sum_k c_k P^k of each word
        return _splitmix(poly + (ends - starts).astype(np.uint64) * np.uint64(_GOLDEN))


def _constants(n: int) -> np.ndarray:
    digest = hashlib.blake2b(f"ngram constants {n}".encode(), digest_size=8 * n).digest()
    return np.frombuffer(digest, dtype="<u8").astype(np.uint64) | np.uint64(1)


def ngram_hashes(
    text: str, n: int = 8, underscore: bool = False, short: bool = False
) -> np.ndarray:
    r"""The sorted distinct hashes of the text's word n-grams (none under n words; with
    `short`, a text of 1..n-1 words is one n-gram of all its words, as dedup's shingles).
    Words: runs of letters and digits, with `underscore` of \w (dedup's shingles)."""
    w = _word_hashes(text, underscore)
    if short and 0 < len(w) < n:
        n = len(w)
    if len(w) < n:
        return np.zeros(0, dtype=np.uint64)
    count = len(w) - n + 1
    out = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j, c in enumerate(_constants(n)):
            out += w[j : j + count] * c
    return sorted_distinct(out)


def sorted_distinct(values: np.ndarray) -> np.ndarray:
    """np.unique(values), sorting in place then dropping repeats: twice as fast as
    np.unique's hash table on these arrays."""
    values.sort()
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if len(values) else values


@dataclass
class EvalIndex:
    hashes: np.ndarray  # sorted distinct n-gram hashes of all evaluation sets (uint64)
    set_rows: dict[str, np.ndarray]  # each set's positions in `hashes`
    article_hash: np.ndarray  # (hash, article) pairs of the WikiText articles, by hash
    article_id: np.ndarray
    _article_rows: tuple | None = field(default=None, repr=False, compare=False)
    _present: tuple | None = field(default=None, repr=False, compare=False)

    def save(self, path: Path) -> None:
        arrays = {"hashes": self.hashes, "article_hash": self.article_hash}
        arrays["article_id"] = self.article_id
        arrays.update({f"set:{name}": rows for name, rows in self.set_rows.items()})
        arrays["ngram_hash"] = np.array(NGRAM_HASH)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        atomic_write_bytes(Path(path), buffer.getvalue())

    @classmethod
    def load(cls, path: Path) -> "EvalIndex":
        with np.load(path) as data:
            made_by = str(data["ngram_hash"]) if "ngram_hash" in data.files else "an older one"
            if made_by != NGRAM_HASH:
                raise ValueError(
                    f"{path}: evaluation n-grams hashed by {made_by}, not {NGRAM_HASH}; "
                    f"delete {Path(path).parent} to have it rebuilt"
                )
            sets = {k[4:]: data[k] for k in data.files if k.startswith("set:")}
            return cls(data["hashes"], sets, data["article_hash"], data["article_id"])

    def found(self, hashes: np.ndarray) -> np.ndarray:
        """The positions in the index of those of `hashes` it holds."""
        if self._present is None:
            # A table of the top bits of the index's hashes, at least 8 slots a hash: a
            # training n-gram whose slot is empty (nearly all of them) is not looked up.
            # Exact: the binary search below decides for every hash the table lets by.
            bits = min(max(len(self.hashes).bit_length() + 3, 16), 30)
            shift = np.uint64(64 - bits)
            table = np.zeros(1 << bits, dtype=bool)
            table[self.hashes >> shift] = True
            self._present = (table, shift)
        table, shift = self._present
        hashes = hashes[table[hashes >> shift]]
        at = np.searchsorted(self.hashes, hashes)
        inside = at < len(self.hashes)
        at, hashes = at[inside], hashes[inside]
        return at[self.hashes[at] == hashes]

    def article_hits(self, at: np.ndarray, articles: int) -> np.ndarray:
        """For each article, how many of the index's hashes at positions `at` (distinct, as
        `found` gives them) are among its n-grams."""
        if self._article_rows is None:  # once: where each hash's (hash, article) pairs are
            first = np.searchsorted(self.article_hash, self.hashes, side="left")
            after = np.searchsorted(self.article_hash, self.hashes, side="right")
            self._article_rows = (first, after - first)
        left, width = self._article_rows[0][at], self._article_rows[1][at]
        if not width.any():
            return np.zeros(articles, dtype=np.int64)
        rows = np.repeat(left, width) + _ranks(width)
        return np.bincount(self.article_id[rows], minlength=articles)


def _ranks(width: np.ndarray) -> np.ndarray:
    """0, 1, ..., w - 1 for each w of `width`, one after the other."""
    starts = np.repeat(np.cumsum(width) - width, width)
    return np.arange(int(width.sum())) - starts


def build_index(sets: list[dict], n: int) -> tuple[EvalIndex, list[dict]]:
    """The index of prepared evaluation sets ({name, kind, units: [{title, text}]}) and the
    WikiText articles it numbers ({set, title, grams})."""
    per_set, articles, pairs = {}, [], []
    for s in sets:
        unit_hashes = [ngram_hashes(u["text"], n) for u in s["units"]]
        per_set[s["name"]] = np.unique(np.concatenate([np.zeros(0, np.uint64), *unit_hashes]))
        if s["kind"] != "wikitext":
            continue
        for unit, h in zip(s["units"], unit_hashes, strict=True):
            if len(h):
                pairs.append((h, len(articles)))
                articles.append({"set": s["name"], "title": unit["title"], "grams": len(h)})
    hashes = np.unique(np.concatenate([np.zeros(0, np.uint64), *per_set.values()]))
    rows = {name: np.searchsorted(hashes, h) for name, h in per_set.items()}
    a_hash = np.concatenate([np.zeros(0, np.uint64), *(h for h, _ in pairs)])
    a_id = np.concatenate([np.zeros(0, np.int64), *(np.full(len(h), a) for h, a in pairs)])
    order = np.argsort(a_hash, kind="stable")
    return EvalIndex(hashes, rows, a_hash[order], a_id[order]), articles
