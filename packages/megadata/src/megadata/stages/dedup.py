"""Near-duplicate removal: MinHash LSH over word shingles, verified by exact Jaccard, with the
grouping done as distributed stages (only the final report gathers to one process).

Each step is a stage of independent tasks run by the Runner (on Dask workers when there is
a cluster), resumable like every stage.  Tasks exchange data through Arrow files under the
dedup work directory, never through the scheduler.  A document is known by its node number,
`partition << 32 | row`, which `_take` turns back into its text, doc_id or length.

1. minhash (`signature_partition`, per partition): datasketch MinHash of the document's
   set of word n-grams.
2. bands (`band_partition`, per signature partition): each signature is cut into the
   b bands of r rows of `choose_bands`; the row (band, band's values, node) goes to bucket
   hash(band, values) % S.  One Arrow file of S record batches, batch k = bucket k: the
   map side of a shuffle.
3. pairs (`bucket_pairs`, per bucket): documents with the same values in the same band
   are candidate pairs (the rule of datasketch's MinHashLSH with params=(b, r); the
   values themselves are compared, the hash only routes), sent to S pair shards by pair.
4. verify (`verify_pairs`, per pair shard): each distinct candidate pair is verified on
   the exact shingle sets, reading only the texts of the shard's pairs; pairs with
   Jaccard > threshold are edges, written both ways and routed by node to S node shards.
5. components (`label_round`, per node shard, round after round): min-label propagation.
   Every node starts labelled with itself; in a round, each node whose label dropped
   sends it to its neighbours and keeps the smallest label it receives.  When a round
   sends nothing, each node's label is the smallest node of its connected component.
   Rounds: the longest shortest path from a component's smallest node, plus one: a few
   for near-duplicates (mostly cliques), as many as its length for a long chain.  Each
   round is a stage of its own (`round-NNN/`), so a resumed run goes on from the last.
6. members (`component_members`, per node shard): each node with its degree (verified
   pairs), text length and doc_id, routed by label to S component shards.
7. survivors (`choose_survivors`, per component shard): each cluster keeps one survivor
   (the member with the most verified pairs, then the longest text, then the smallest
   doc_id) and a report line lists the others with their Jaccard to it.
8. report (`write_report`, one task): clusters.jsonl in survivor order and removed.json,
   the sorted removed ids that every remove task reads whole.  This step gathers to one
   process: its memory grows with the number of documents in clusters (not the corpus).
9. `remove_partition` (per partition): drops the removed ids.
"""

import itertools
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
from datasketch import MinHash

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
from megadata.runner import Runner, Task

# S, the number of buckets, pair shards, node shards and component shards, grows with the
# documents rather than the partitions: a shard's task costs a file read per partition plus
# a write, so shards of a few partitions' worth of documents keep that overhead small.
DOCS_PER_SHARD = 2000
MAX_SHARDS = 1024

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


def find_duplicates(
    signature_paths: list[str],
    doc_paths: list[str],
    out_dir: str,
    threshold: float,
    num_perm: int,
    n: int,
    runner: Runner | None = None,
    shards: int | None = None,
) -> dict:
    """Steps 2-8 above: write `<out_dir>/removed.json` (sorted ids) and `clusters.jsonl`;
    return the counts.  `signature_paths[k]` holds the signatures of `doc_paths[k]`, row
    for row; `num_perm` and `n` are what they were made with (the bands are cut from the
    signatures, so their seed is not needed again).  Without a runner the tasks run
    in this process.  `shards` (S) defaults to one per DOCS_PER_SHARD documents; the
    result does not depend on it."""
    if len(signature_paths) != len(doc_paths):
        raise ValueError(
            f"dedup: {len(signature_paths)} signature files for {len(doc_paths)} partitions"
        )
    docs_in = _count_signatures(signature_paths)
    runner = runner or Runner(workers=1, progress=False)
    # Absolute paths: a worker of a real cluster does not share our working directory.
    sigs = [str(Path(p).absolute()) for p in signature_paths]
    docs = [str(Path(p).absolute()) for p in doc_paths]
    out = Path(out_dir).absolute()
    bands, rows = choose_bands(threshold, num_perm)
    if shards is None:
        shards = min(MAX_SHARDS, max(1, -(-docs_in // DOCS_PER_SHARD)))

    stats = []

    def stage(name: str, fn, task_args: list[tuple]):
        tasks = [Task(f"{k:05d}", args) for k, args in enumerate(task_args)]
        stats.append(runner.run(f"lsh-{name}", out / name, tasks, fn))
        return stats[-1]

    def files(name: str, count: int) -> list[str]:
        return [str(out / name / f"{k:05d}.arrow") for k in range(count)]

    if sigs:
        band_files, pair_files = files("bands", len(sigs)), files("pairs", shards)
        edge_files, member_files = files("verified", shards), files("members", shards)
        chunk_files, each = files("survivors", shards), range(shards)
        stage(
            "bands",
            band_partition,
            [(sigs[k], docs[k], k, band_files[k], bands, rows, shards) for k in range(len(sigs))],
        )
        stage("pairs", bucket_pairs, [(band_files, k, pair_files[k], shards) for k in each])
        verified = stage(
            "verified",
            verify_pairs,
            [(pair_files, k, docs, edge_files[k], threshold, n, shards) for k in each],
        )
        labels_dir = None
        for r in itertools.count():
            name = f"round-{r:03d}"
            tasks = [(edge_files, k, labels_dir, str(out / name), shards) for k in each]
            labels_dir = str(out / name)
            if stage(name, label_round, tasks).extra.get("messages", 0) == 0:
                break
        stage(
            "members",
            component_members,
            [(labels_dir, edge_files, k, sigs, member_files[k], shards) for k in each],
        )
        stage(
            "survivors",
            choose_survivors,
            [(member_files, k, docs, chunk_files[k], n, shards) for k in each],
        )
        pairs = {key: verified.extra.get(key, 0) for key in ("candidate_pairs", "verified_pairs")}
    else:  # no partitions: nothing to group
        chunk_files, pairs = [], {"candidate_pairs": 0, "verified_pairs": 0}
    report = runner.run(
        "lsh",
        out,
        [Task("report", (chunk_files, str(out), docs_in, bands, rows, pairs))],
        write_report,
    )
    return {
        "docs_in": report.docs_in,
        "docs_out": report.docs_out,
        "extra": report.extra,
        "seconds": report.seconds + sum(s.seconds for s in stats),
    }


def _count_signatures(signature_paths: list[str]) -> int:
    """The number of signatures, once they are known to be comparable."""
    schemes, count = set(), 0
    for path in signature_paths:
        count += read_table(Path(path)).num_rows  # memory-mapped: reads no data
        scheme = read_meta(Path(path)).get("scheme")
        if scheme is None:
            raise ValueError(
                f"{path}: MinHash signatures without their hashing scheme (written by an older "
                "megadata); delete the directory to have them recomputed"
            )
        schemes.add(scheme)
    if len(schemes) > 1:
        raise ValueError(f"dedup: signatures made with different hashing schemes {sorted(schemes)}")
    return count


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


def bucket_pairs(band_paths: list[str], bucket: int, out_path: str, shards: int) -> dict:
    """Step 3: every two documents with equal values in a band of this bucket."""
    rows = _read_shuffled(band_paths, bucket, shards)
    groups = rows.group_by(["band", "key"]).aggregate([("node", "list")])
    first, second = [], []
    for nodes in groups.column("node_list").to_pylist():
        for a, b in itertools.combinations(sorted(nodes), 2):
            first.append(a)
            second.append(b)
    pairs = _unique_pairs(np.array(first, dtype=np.int64), np.array(second, dtype=np.int64))
    _write_shuffled(
        out_path,
        {"a": pa.array(pairs[:, 0]), "b": pa.array(pairs[:, 1])},
        _mix(pairs[:, 0], pairs[:, 1]) % np.uint64(shards),
        shards,
    )
    return {}


def verify_pairs(
    pair_paths: list[str],
    shard: int,
    doc_paths: list[str],
    out_path: str,
    threshold: float,
    n: int,
    shards: int,
) -> dict:
    """Step 4: the shard's distinct candidate pairs, kept when their exact Jaccard > threshold.
    A pair is routed by its own hash, so it is counted in one shard only."""
    table = _read_shuffled(pair_paths, shard, shards)
    pairs = _unique_pairs(table.column("a").to_numpy(), table.column("b").to_numpy())
    nodes = np.unique(pairs)
    sets = _shingle_sets(doc_paths, nodes, n)
    keep = np.array([jaccard(sets[a], sets[b]) > threshold for a, b in pairs.tolist()], dtype=bool)
    a, b = pairs[keep, 0], pairs[keep, 1]
    node, neighbor = np.concatenate([a, b]), np.concatenate([b, a])
    _write_shuffled(
        out_path,
        {"node": pa.array(node), "neighbor": pa.array(neighbor)},
        node % shards,
        shards,
    )
    return {"extra": {"candidate_pairs": len(pairs), "verified_pairs": int(keep.sum())}}


def label_round(
    edge_paths: list[str], shard: int, previous: str | None, out_dir: str, shards: int
) -> dict:
    """Step 5, one round for the nodes of one shard: take the smallest label received, and
    send a label that dropped (every label, in round 0) to the neighbours."""
    edges = _read_shuffled(edge_paths, shard, shards)
    node, neighbor = edges.column("node").to_numpy(), edges.column("neighbor").to_numpy()
    nodes = np.unique(node)
    if previous is None:
        labels, changed = nodes.copy(), np.ones(len(nodes), dtype=bool)
    else:
        before = read_table(Path(previous) / f"labels-{shard:05d}.arrow").column("label")
        before = before.to_numpy()
        outboxes = [str(Path(previous) / f"outbox-{k:05d}.arrow") for k in range(shards)]
        inbox = _read_shuffled(outboxes, shard, shards)
        labels = before.copy()
        to = np.searchsorted(nodes, inbox.column("node").to_numpy())
        np.minimum.at(labels, to, inbox.column("label").to_numpy())
        changed = labels < before
    source = np.searchsorted(nodes, node)
    send = changed[source]
    to, label = neighbor[send], labels[source][send]
    order = np.lexsort((label, to))  # one message per receiver: the smallest label
    to, label = to[order], label[order]
    first = np.ones(len(to), dtype=bool)
    first[1:] = to[1:] != to[:-1]
    to, label = to[first], label[first]
    write_table(
        Path(out_dir) / f"labels-{shard:05d}.arrow",
        pa.table({"node": pa.array(nodes), "label": pa.array(labels)}),
    )
    _write_shuffled(
        Path(out_dir) / f"outbox-{shard:05d}.arrow",
        {"node": pa.array(to), "label": pa.array(label)},
        to % shards,
        shards,
    )
    return {"extra": {"messages": len(to), "relabelled": int(changed.sum())}}


def component_members(
    labels_dir: str,
    edge_paths: list[str],
    shard: int,
    signature_paths: list[str],
    out_path: str,
    shards: int,
) -> dict:
    """Step 6: the shard's nodes with what choosing a survivor needs, routed by component."""
    labels = read_table(Path(labels_dir) / f"labels-{shard:05d}.arrow")
    nodes, label = labels.column("node").to_numpy(), labels.column("label").to_numpy()
    edges = _read_shuffled(edge_paths, shard, shards)
    degree = np.bincount(
        np.searchsorted(nodes, edges.column("node").to_numpy()), minlength=len(nodes)
    )
    _write_shuffled(
        out_path,
        {
            "label": pa.array(label),
            "node": pa.array(nodes),
            "degree": pa.array(degree.astype(np.int64)),
            "length": pa.array(_take(signature_paths, nodes, "length"), pa.int64()),
            "doc_id": pa.array(_take(signature_paths, nodes, "doc_id"), pa.string()),
        },
        label % shards,
        shards,
    )
    return {}


def choose_survivors(
    member_paths: list[str], shard: int, doc_paths: list[str], out_path: str, n: int, shards: int
) -> dict:
    """Step 7: a survivor per cluster of this shard, and the clusters' report lines."""
    members = _read_shuffled(member_paths, shard, shards).to_pylist()
    nodes = np.array([m["node"] for m in members], dtype=np.int64)
    sets = _shingle_sets(doc_paths, nodes, n)
    clusters = defaultdict(list)
    for m in members:
        clusters[m["label"]].append(m)
    report = []
    for cluster in clusters.values():
        # The document most others duplicate (the original, for copies of one text), then
        # the longest, then the smallest id: deterministic, and close to every member.
        survivor = min(cluster, key=lambda m: (-m["degree"], -m["length"], m["doc_id"]))
        others = sorted((m for m in cluster if m is not survivor), key=lambda m: m["doc_id"])
        report.append(
            {
                "survivor": survivor["doc_id"],
                "removed": [
                    {
                        "doc_id": m["doc_id"],
                        "jaccard": round(jaccard(sets[m["node"]], sets[survivor["node"]]), 4),
                    }
                    for m in others
                ],
            }
        )
    report.sort(key=lambda c: c["survivor"])
    atomic_write_bytes(Path(out_path), _jsonl(report))
    return {}


def write_report(
    chunk_paths: list[str], out_dir: str, docs_in: int, bands: int, rows: int, pairs: dict
) -> dict:
    """Step 8: clusters.jsonl (one line per cluster, by survivor) and removed.json."""
    clusters = [json.loads(line) for p in chunk_paths for line in Path(p).read_text().splitlines()]
    clusters.sort(key=lambda c: c["survivor"])
    removed = sorted(m["doc_id"] for c in clusters for m in c["removed"])
    atomic_write_bytes(Path(out_dir) / "clusters.jsonl", _jsonl(clusters))
    atomic_write_json(Path(out_dir) / "removed.json", removed)
    return {
        "docs_in": docs_in,
        "docs_out": docs_in - len(removed),
        "extra": {
            "bands": bands,
            "rows": rows,
            "candidate_pairs": pairs["candidate_pairs"],
            "verified_pairs": pairs["verified_pairs"],
            "clusters": len(clusters),
            "removed": len(removed),
        },
    }


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


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


def _write_shuffled(path, columns: dict, target: np.ndarray, shards: int) -> None:
    """The map side of a shuffle: the rows as an Arrow file of `shards` record batches,
    batch k holding the rows whose target is k (in their order)."""
    target = np.asarray(target).astype(np.int64)
    batch = pa.record_batch(columns)
    order = np.argsort(target, kind="stable")
    batch = batch.take(pa.array(order))
    ends = np.cumsum(np.bincount(target, minlength=shards))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        start = 0
        for end in ends.tolist():
            writer.write_batch(batch.slice(start, end - start))
            start = end
    atomic_write_bytes(Path(path), sink.getvalue().to_pybytes())


def _read_shuffled(paths: list[str], shard: int, shards: int) -> pa.Table:
    """The reduce side: the rows that each file of `paths` routed to `shard`."""
    batches = []
    for path in paths:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        if reader.num_record_batches != shards:
            raise ValueError(
                f"{path}: written for {reader.num_record_batches} shards, not {shards} "
                "(by a run with other settings); delete the dedup work directory"
            )
        batches.append(reader.get_batch(shard))
    return pa.Table.from_batches(batches)


def _shingle_sets(doc_paths: list[str], nodes: np.ndarray, n: int) -> dict[int, set[str]]:
    texts = _take(doc_paths, nodes, "text")
    return {node: shingles(text, n) for node, text in zip(nodes.tolist(), texts, strict=True)}


def _take(paths: list[str], nodes: np.ndarray, column: str) -> list:
    """`column` of each node's document: row `node & 0xFFFFFFFF` of `paths[node >> 32]`,
    reading (memory-mapped) only the partitions and rows asked for."""
    values = [None] * len(nodes)
    parts = nodes >> 32
    for part in np.unique(parts).tolist():
        where = np.flatnonzero(parts == part)
        rows = pa.array(nodes[where] & 0xFFFFFFFF)
        got = read_table(Path(paths[part])).column(column).take(rows).to_pylist()
        for i, value in zip(where.tolist(), got, strict=True):
            values[i] = value
    return values


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
