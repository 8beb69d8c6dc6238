"""Dedup steps 7-8 (megadata.stages.dedup): exact Jaccard of the candidates, on their shingles
as sorted 64-bit hashes: each member against its component's first document, in parallel,
then the greedy walk of the members the first did not remove."""

from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa

from megacommon.files import atomic_write_bytes
from megadata.documents import read_table, write_table
from megadata.ngrams import ngram_hashes
from megadata.shuffle import read_shuffled as _read_shuffled
from megadata.shuffle import write_shuffled as _write_shuffled
from megadata.stages.dedup.nodes import hub_matrix, take
from megadata.stages.dedup.report import jsonl, removed_nodes_path


def jaccard(a: set, b: set) -> float:
    if not (a or b):
        return 1.0
    common = len(a & b)
    return common / (len(a) + len(b) - common)  # = len(a & b) / len(a | b)


def _sorted_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """`jaccard` of two sets given as sorted arrays of distinct values."""
    if not (len(a) or len(b)):
        return 1.0
    both = np.concatenate([a, b])
    both.sort(kind="stable")  # two sorted runs: merged in one pass, 2x a searchsorted
    common = int(np.count_nonzero(both[1:] == both[:-1]))
    return common / (len(a) + len(b) - common)


def verify_against_first(
    check_paths: list[str],
    shard: int,
    doc_paths: list[str],
    out_path: str,
    threshold: float,
    n: int,
    shards: int,
) -> dict:
    """Step 7: the exact Jaccard of each of the shard's members to its component's first
    document (a candidate of it), routed back by component."""
    table = _read_shuffled(check_paths, shard, shards)
    node, first = table.column("node").to_numpy(), table.column("first").to_numpy()
    sets = _shingle_hashes(doc_paths, np.unique(np.concatenate([node, first])), n)
    pairs = zip(node.tolist(), first.tolist(), strict=True)
    similarity = np.array([_sorted_jaccard(sets[a], sets[b]) for a, b in pairs], dtype=np.float64)
    label = table.column("label").to_numpy()
    _write_shuffled(
        out_path,
        {"node": pa.array(node), "jaccard": pa.array(similarity)},
        label % shards,
        shards,
    )
    removed = int((similarity > threshold).sum())
    return {"extra": {"candidate_pairs": len(node), "verified_pairs": removed}}


CHUNK_DOCS = 1024  # texts read at a time by the greedy walk


def verify_remaining(
    order_path: str,
    checked_paths: list[str],
    shard: int,
    doc_paths: list[str],
    out_path: str,
    threshold: float,
    n: int,
    shards: int,
) -> dict:
    """Step 8: the rule on the members that their component's first document did not
    remove, in the survivor order; the shard's report lines."""
    members = read_table(Path(order_path))
    label, node = members.column("label").to_numpy(), members.column("node").to_numpy()
    doc_id = members.column("doc_id").to_pylist()
    hubs = hub_matrix(members)
    checked = _read_shuffled(checked_paths, shard, shards)
    similarity = dict(
        zip(
            checked.column("node").to_numpy().tolist(),
            checked.column("jaccard").to_numpy().tolist(),
            strict=True,
        )
    )
    start = np.ones(len(label), dtype=bool)
    start[1:] = label[1:] != label[:-1]
    first = np.maximum.accumulate(np.where(start, np.arange(len(label)), 0))
    removed_by = defaultdict(list)  # position of a kept document -> [(doc_id, jaccard)]
    gone = []  # the positions of the removed documents
    walk = []
    for i, (v, f) in enumerate(zip(node.tolist(), first.tolist(), strict=True)):
        if i == f:
            continue
        j = similarity.get(v)
        if j is not None and j > threshold:
            removed_by[f].append((doc_id[i], j))
            gone.append(i)
        else:
            walk.append(i)
    compared = verified = 0
    component, kept, buckets = None, {}, defaultdict(list)
    for c in range(0, len(walk), CHUNK_DOCS):
        chunk = walk[c : c + CHUNK_DOCS]
        texts = take(doc_paths, node[chunk], "text")
        for i, text in zip(chunk, texts, strict=True):
            if first[i] != component:  # a new component: nothing is kept yet but its first
                component, kept, buckets = first[i], {}, defaultdict(list)
            keys = [(b, h) for b, h in enumerate(hubs[i].tolist()) if h >= 0]
            earlier = sorted({k for key in keys for k in buckets.get(key, ())})
            # The kept documents' shingles as sorted 64-bit hashes, not sets of strings: a
            # component of many documents sharing some text holds 10x less memory (the
            # Jaccard is the same but for a hash collision, about 2^-64 a pair).
            own = ngram_hashes(text, n, underscore=True, short=True)
            for k in earlier:
                compared += 1
                # Jaccard <= smaller / larger: a pair of sizes this far apart cannot be
                # above the threshold (43% of the pairs of the 1 GB benchmark's walk).
                small, large = sorted((len(own), len(kept[k])))
                if small < threshold * large:
                    continue
                j = _sorted_jaccard(own, kept[k])
                if j > threshold:
                    verified += 1
                    removed_by[k].append((doc_id[i], j))
                    gone.append(i)
                    break
            else:
                kept[i] = own
                for key in keys:
                    buckets[key].append(i)
    report = [
        {
            "survivor": doc_id[k],
            "removed": [{"doc_id": d, "jaccard": round(j, 6)} for d, j in sorted(removed_by[k])],
        }
        for k in removed_by
    ]
    report.sort(key=lambda c: c["survivor"])
    removed_nodes = pa.table({"node": pa.array(np.sort(node[gone]), pa.int64())})
    write_table(removed_nodes_path(out_path), removed_nodes)
    atomic_write_bytes(Path(out_path), jsonl(report))
    return {
        "extra": {
            "candidate_pairs": compared,
            "verified_pairs": verified,
            "components": int(start.sum()),
        }
    }


def _shingle_hashes(doc_paths: list[str], nodes: np.ndarray, n: int) -> dict[int, np.ndarray]:
    """Each node's shingles as sorted distinct 64-bit hashes (what its MinHash was made of):
    the Jaccard of two such arrays is that of the shingle sets but for a hash collision
    (about 2^-64 a pair), at a tenth of the memory and time of sets of strings."""
    texts = take(doc_paths, nodes, "text")
    return {
        node: ngram_hashes(text, n, underscore=True, short=True)
        for node, text in zip(nodes.tolist(), texts, strict=True)
    }
