"""Word n-grams as 64-bit hashes, and the evaluation sets' n-grams as one exact index.

Decontamination compares the n-grams of every training document with those of the
evaluation sets.  Building each n-gram as a string (and hashing it for a Bloom filter)
costs more than the rest of the stage; here a document's n-grams are hashed with numpy
instead: each distinct word gets a 64-bit keyed blake2b hash (remembered per process),
and the n-gram starting at word i is sum_j word[i + j] * C_j mod 2^64 with fixed odd
constants C_j.  Two different n-grams share a hash with probability about 2^-63, so a
set of hashes stands for the set of n-grams: at the paper's scale (3 * 10^10 training
n-grams against 10^6 evaluation n-grams) about 10^-3 false matches are expected in all,
against the Bloom filter's 1e-3 of every evaluation n-gram.

The words are those of `word_ngrams` (lower-cased runs of letters and digits), so the
hashes and the strings describe the same n-grams (a test checks the counts agree).

`EvalIndex` (built once from the evaluation sets, loaded by every worker) holds the sorted
distinct hashes of all sets, each set's positions among them, and the (hash, article)
pairs of the WikiText articles for the removal rules.  Its size is that of the evaluation
sets, whatever the size of the training corpus.
"""

import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megadata.documents import atomic_write_bytes

_WORD = re.compile(r"[^\W_]+")  # \w+ less "_": Moses splits add_argument as add _ argument
_WORD_KEY = b"megadata-ngram-v1"
_CACHE_WORDS = 1 << 21
_word_hashes: dict[str, int] = {}


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _constants(n: int) -> np.ndarray:
    digest = hashlib.blake2b(f"ngram constants {n}".encode(), digest_size=8 * n).digest()
    return np.frombuffer(digest, dtype="<u8").astype(np.uint64) | np.uint64(1)


def _hash_words(tokens: list[str]) -> np.ndarray:
    if len(_word_hashes) > _CACHE_WORDS:
        _word_hashes.clear()
    missing = [w for w in set(tokens) if w not in _word_hashes]
    for w in missing:
        digest = hashlib.blake2b(w.encode(), digest_size=8, key=_WORD_KEY).digest()
        _word_hashes[w] = int.from_bytes(digest, "little")
    get = _word_hashes.__getitem__
    return np.fromiter(map(get, tokens), dtype=np.uint64, count=len(tokens))


def ngram_hashes(
    text: str, n: int = 8, word: re.Pattern = _WORD, short: bool = False
) -> np.ndarray:
    """The sorted distinct hashes of the text's word n-grams (none under n words; with
    `short`, a text of 1..n-1 words is one n-gram of all its words, as dedup's shingles)."""
    tokens = word.findall(text.lower())
    if short and 0 < len(tokens) < n:
        n = len(tokens)
    if len(tokens) < n:
        return np.zeros(0, dtype=np.uint64)
    w = _hash_words(tokens)
    count = len(tokens) - n + 1
    out = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):  # the arithmetic is mod 2^64 on purpose
        for j, c in enumerate(_constants(n)):
            out += w[j : j + count] * c
    return np.unique(out)


@dataclass
class EvalIndex:
    hashes: np.ndarray  # sorted distinct n-gram hashes of all evaluation sets (uint64)
    set_rows: dict[str, np.ndarray]  # each set's positions in `hashes`
    article_hash: np.ndarray  # (hash, article) pairs of the WikiText articles, by hash
    article_id: np.ndarray

    def save(self, path: Path) -> None:
        arrays = {"hashes": self.hashes, "article_hash": self.article_hash}
        arrays["article_id"] = self.article_id
        arrays.update({f"set:{name}": rows for name, rows in self.set_rows.items()})
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        atomic_write_bytes(Path(path), buffer.getvalue())

    @classmethod
    def load(cls, path: Path) -> "EvalIndex":
        with np.load(path) as data:
            sets = {k[4:]: data[k] for k in data.files if k.startswith("set:")}
            return cls(data["hashes"], sets, data["article_hash"], data["article_id"])

    def found(self, hashes: np.ndarray) -> np.ndarray:
        """The positions in the index of those of `hashes` it holds."""
        at = np.searchsorted(self.hashes, hashes)
        inside = at < len(self.hashes)
        at, hashes = at[inside], hashes[inside]
        return at[self.hashes[at] == hashes]

    def article_hits(self, hashes: np.ndarray, articles: int) -> np.ndarray:
        """For each article, how many of the given (distinct) hashes are among its n-grams."""
        left = np.searchsorted(self.article_hash, hashes, side="left")
        right = np.searchsorted(self.article_hash, hashes, side="right")
        width = right - left
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
