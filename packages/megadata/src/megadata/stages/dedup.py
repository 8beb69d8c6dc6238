"""Near-duplicate removal: MinHash LSH (datasketch) over word shingles, verified by exact Jaccard.

1. `signature_partition` (per partition, in workers): a MinHash of each document's
   set of word n-grams, by datasketch's `MinHash.update_batch`.
2. `find_duplicates` (one process): LSH with b bands of r rows chosen for high
   recall at the threshold, so nearly every pair above it becomes a candidate;
   each candidate pair is then verified on the exact shingle sets and only pairs
   with Jaccard > threshold count.  Pairs join clusters by union-find; each
   cluster keeps one survivor (the member with the most verified pairs, then the
   longest text, then the smallest doc_id) and the rest are removed.  A report
   lists every cluster with its members' Jaccard to the survivor.
3. `remove_partition` (per partition): drops the removed ids.
"""

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
from datasketch import LeanMinHash, MinHash, MinHashLSH

from megadata.documents import (
    atomic_write_bytes,
    atomic_write_json,
    read_docs,
    read_meta,
    read_table,
    text_bytes,
    write_docs,
    write_table,
)

_WORD = re.compile(r"\w+")


def shingles(text: str, n: int = 2) -> set[str]:
    """Word n-grams of the lower-cased text (the whole text if it has fewer than n words)."""
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def choose_bands(threshold: float, num_perm: int, recall: float = 0.995) -> tuple[int, int]:
    """(bands, rows): the most rows per band whose chance of pairing two documents of
    Jaccard = threshold is at least `recall` (more rows, fewer false candidates)."""
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if 1 - (1 - threshold**rows) ** bands >= recall:
            best = (bands, rows)
    return best


def minhash(text: str, num_perm: int, n: int, seed: int) -> MinHash:
    m = MinHash(num_perm=num_perm, seed=seed)
    m.update_batch([s.encode("utf-8") for s in shingles(text, n)])
    return m


def signature_partition(in_path: str, out_path: str, num_perm: int, n: int, seed: int) -> dict:
    ids, lengths, sigs = [], [], []
    scheme = MinHash(num_perm=num_perm, seed=seed).scheme
    for doc in read_docs(Path(in_path)):
        ids.append(doc["doc_id"])
        lengths.append(len(doc["text"]))
        sigs.append(minhash(doc["text"], num_perm, n, seed).hashvalues.astype(np.uint64))
    flat = np.concatenate(sigs) if sigs else np.zeros(0, dtype=np.uint64)
    table = pa.table(
        {
            "doc_id": pa.array(ids, pa.string()),
            "length": pa.array(lengths, pa.int64()),
            "signature": pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.uint64()), num_perm),
        }
    )
    write_table(Path(out_path), table, {"scheme": scheme})
    return {"docs_in": len(ids), "docs_out": len(ids)}


class _UnionFind:
    def __init__(self):
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def find_duplicates(
    signature_paths: list[str],
    doc_paths: list[str],
    out_dir: str,
    threshold: float,
    num_perm: int,
    n: int,
    seed: int,
) -> dict:
    """Write `<out_dir>/removed.json` (sorted ids) and `clusters.jsonl`; return the counts."""
    ids, lengths, sigs, schemes = [], [], [], set()
    for path in signature_paths:
        scheme = read_meta(Path(path)).get("scheme")
        if scheme is None:
            raise ValueError(
                f"{path}: MinHash signatures without their hashing scheme (written by an older "
                "megadata); delete the directory to have them recomputed"
            )
        schemes.add(scheme)
        t = read_table(Path(path))
        ids += t.column("doc_id").to_pylist()
        lengths += t.column("length").to_pylist()
        flat = t.column("signature").combine_chunks().flatten().to_numpy()
        sigs += list(flat.reshape(-1, num_perm)) if len(flat) else []
    if len(schemes) > 1:
        raise ValueError(f"dedup: signatures made with different hashing schemes {sorted(schemes)}")
    scheme = schemes.pop() if schemes else None
    bands, rows = choose_bands(threshold, num_perm)
    lsh = MinHashLSH(num_perm=num_perm, params=(bands, rows))
    for i, sig in enumerate(sigs):
        lsh.insert(
            i, LeanMinHash(seed=seed, hashvalues=sig, scheme=scheme), check_duplication=False
        )
    candidates = set()
    for i, sig in enumerate(sigs):
        for j in lsh.query(LeanMinHash(seed=seed, hashvalues=sig, scheme=scheme)):
            if j != i:
                candidates.add((min(i, j), max(i, j)))
    needed = {i for pair in candidates for i in pair}
    shingle_sets = {}
    index = {doc_id: i for i, doc_id in enumerate(ids)}
    for path in doc_paths:
        for doc in read_docs(Path(path)):
            i = index[doc["doc_id"]]
            if i in needed:
                shingle_sets[i] = shingles(doc["text"], n)
    uf, verified, degree = _UnionFind(), 0, defaultdict(int)
    for i, j in sorted(candidates):
        if jaccard(shingle_sets[i], shingle_sets[j]) > threshold:
            uf.union(i, j)
            verified += 1
            degree[i] += 1
            degree[j] += 1
    clusters = defaultdict(list)
    for i in uf.parent:
        clusters[uf.find(i)].append(i)
    removed, report = [], []
    for members in clusters.values():
        # The document most others duplicate (the original, for copies of one text), then
        # the longest, then the smallest id: deterministic, and close to every member.
        survivor = min(members, key=lambda i: (-degree[i], -lengths[i], ids[i]))
        others = sorted((i for i in members if i != survivor), key=lambda i: ids[i])
        removed += [ids[i] for i in others]
        report.append(
            {
                "survivor": ids[survivor],
                "removed": [
                    {
                        "doc_id": ids[i],
                        "jaccard": round(jaccard(shingle_sets[i], shingle_sets[survivor]), 4),
                    }
                    for i in others
                ],
            }
        )
    report.sort(key=lambda c: c["survivor"])
    out = Path(out_dir)
    lines = "".join(json.dumps(c, sort_keys=True) + "\n" for c in report)
    atomic_write_bytes(out / "clusters.jsonl", lines.encode())
    atomic_write_json(out / "removed.json", sorted(removed))
    return {
        "docs_in": len(ids),
        "docs_out": len(ids) - len(removed),
        "extra": {
            "bands": bands,
            "rows": rows,
            "candidate_pairs": len(candidates),
            "verified_pairs": verified,
            "clusters": len(report),
            "removed": len(removed),
        },
    }


def remove_partition(in_path: str, out_path: str, removed_path: str) -> dict:
    removed = set(json.loads(Path(removed_path).read_text()))
    docs = list(read_docs(Path(in_path)))
    kept = [d for d in docs if d["doc_id"] not in removed]
    write_docs(Path(out_path), kept)
    return {
        "docs_in": len(docs),
        "docs_out": len(kept),
        "bytes_in": text_bytes(docs),
        "bytes_out": text_bytes(kept),
    }
