"""Near-duplicate removal: MinHash LSH over word shingles, verified by exact Jaccard, with the
grouping done as distributed stages (only the final report gathers to one process).

The rule.  The documents that LSH links (two documents are linked when they have the same
values in one of the b bands) form connected components.  Each component is walked in the
survivor order: earliest source in the recipe's order, then the longest text, then the
smallest doc_id.  A document is kept unless it has exact Jaccard > threshold with a document
kept before it that it shares a band bucket with (an LSH candidate); it is then removed, and
reported with that kept document (the first one in the order) and their Jaccard.  So no
document is removed without a kept document above the threshold beside it, and no two kept
documents that are LSH candidates are above it.

The cost is linear in a cluster's size: no step enumerates the pairs of a bucket.  A bucket
of m documents gives m - 1 links to its smallest node (enough for the components), the first
document of a component (kept by the rule) is compared with its candidates in parallel, and
only the members it does not remove are walked one by one, each compared with the kept
documents it shares a bucket with (for a cluster of near-copies: with none, or few).

Each step is a stage of independent tasks run by the Runner (on Dask workers when there is
a cluster), resumable like every stage.  Tasks exchange data through Arrow files under the
dedup work directory, never through the scheduler.  A document is known by its node number,
`partition << 32 | row`, which `_take` turns back into its text, doc_id, length or source.

1. minhash (`signature_partition`, per partition): datasketch's MinHash of the document's
   set of word n-grams, each n-gram hashed to 64 bits as verification hashes it
   (megadata.ngrams) and taken mod 2^32 (megadata.minhash.signatures_of_hashes).
2. bands (`band_partition`, per signature partition): each signature is cut into the
   b bands of r rows of `choose_bands`; the row (band, band's values, node) goes to bucket
   hash(band, values) % S.  One Arrow file of S record batches, batch k = bucket k: the
   map side of a shuffle.
3. links (`bucket_links`, per bucket): documents with the same values in the same band
   share a bucket (the rule of datasketch's MinHashLSH with params=(b, r); the values
   themselves are compared, the hash only routes).  Each bucket of m >= 2 documents names
   its smallest node its hub: m - 1 links (hub, member), and a row (node, band, hub) per
   member, both routed by node to S node shards.  Two documents are candidates when they
   have the same hub in some band.
4. components (`label_round`, per node shard, round after round): min-label propagation
   over the links.  Every node starts labelled with itself; in a round, each node whose
   label dropped sends it to its neighbours and keeps the smallest label it receives.  When
   a round sends nothing, each node's label is the smallest node of its component.  Each
   round is a stage of its own (`label-NNN/`), so a resumed run goes on from the last.
5. members (`component_members`, per node shard): each node with its hubs (one per band,
   -1 where its bucket holds only itself), source rank, text length and doc_id, routed by
   label to S component shards.
6. firsts (`component_firsts`, per component shard): each component in the survivor order
   (`order-NNNNN.arrow`); its first document is kept by the rule, and each member that is
   its candidate is sent, with it, to the member's node shard.
7. checked (`verify_against_first`, per node shard): the exact Jaccard of each such member
   to its component's first document, on their shingles as sorted 64-bit hashes (equal to
   the sets' but for a 2^-64 collision a pair); above the threshold it is removed by it.
   This is where the bulk of a large cluster goes, spread over the node shards.
8. greedy (`verify_remaining`, per component shard): the members the first did not remove,
   walked in order, each compared with the kept documents it shares a bucket with until
   one is above the threshold (a pair whose sizes alone put it at or below the threshold,
   Jaccard <= smaller / larger, is not computed); report lines (a kept document and those
   it removed).  The kept documents' shingles are held as sorted 64-bit hashes
   (megadata.ngrams): its memory grows with the kept members of the largest component.
9. report (`write_report`, one task): clusters.jsonl in survivor order, removed.json (the
   sorted removed ids) and removed-nodes.npy (their nodes, sorted).  This step gathers
   to one process: its memory grows with the number of removed documents (not the corpus).
10. `remove_partition` (per partition): drops its rows among the removed nodes, found by
   binary search in the memory-mapped file (each task reads its own slice, not the whole
   list), and links a partition that loses none.
"""

import io
import itertools
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megadata.documents import (
    atomic_write_bytes,
    atomic_write_json,
    drop_rows,
    read_docs,
    read_meta,
    read_table,
    write_table,
)
from megadata.minhash import scheme, signatures_of_hashes
from megadata.ngrams import NGRAM_HASH, ngram_hashes
from megadata.runner import Runner, Task
from megadata.shuffle import read_shuffled as _read_shuffled
from megadata.shuffle import write_shuffled as _write_shuffled

REMOVED_NODES = "removed-nodes.npy"  # the removed documents' nodes, sorted (step 9)
# S, the number of buckets, pair shards, node shards and component shards, grows with the
# documents rather than the partitions: a shard's task costs a file read per partition plus
# a write, so shards of a few partitions' worth of documents keep that overhead small.
DOCS_PER_SHARD = 2000
MAX_SHARDS = 1024

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


def find_duplicates(
    signature_paths: list[str],
    doc_paths: list[str],
    out_dir: str,
    threshold: float,
    num_perm: int,
    n: int,
    runner: Runner | None = None,
    shards: int | None = None,
    sources: Sequence[str] | None = None,
) -> dict:
    """Steps 2-9 above: write `<out_dir>/removed.json` (sorted ids) and `clusters.jsonl`;
    return the counts, wall seconds and CPU seconds.  `signature_paths[k]` holds the
    signatures of `doc_paths[k]`, row for row; `num_perm` and `n` are what they were made
    with (the bands are cut from the signatures, so their seed is not needed again).
    `sources` is the recipe's order of sources (a document of a source not in it, or of any
    source when it is None, comes after them).  Without a runner the tasks run in this
    process.  `shards` (S) defaults to one per DOCS_PER_SHARD documents; the result does
    not depend on it."""
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
    sources = list(sources or [])

    stats = []

    def stage(name: str, fn, task_args: list[tuple]):
        tasks = [Task(f"{k:05d}", args) for k, args in enumerate(task_args)]
        stats.append(runner.run(f"lsh-{name}", out / name, tasks, fn))
        return stats[-1]

    def files(name: str, count: int, prefix: str = "") -> list[str]:
        return [str(out / name / f"{prefix}{k:05d}.arrow") for k in range(count)]

    counts = dict.fromkeys(("candidate_pairs", "verified_pairs", "bucket_pairs", "components"), 0)
    if sigs:
        band_files, each = files("bands", len(sigs)), range(shards)
        link_files, hub_files = files("links", shards), files("links", shards, "hubs-")
        member_files = files("component-members", shards)
        order_files, check_files = files("firsts", shards, "order-"), files("firsts", shards)
        checked_files, chunk_files = files("checked", shards), files("greedy", shards)
        stage(
            "bands",
            band_partition,
            [(sigs[k], docs[k], k, band_files[k], bands, rows, shards) for k in range(len(sigs))],
        )
        links = stage(
            "links",
            bucket_links,
            [(band_files, k, link_files[k], hub_files[k], shards) for k in each],
        )
        labels_dir = None
        for r in itertools.count():
            name = f"label-{r:03d}"
            tasks = [(link_files, k, labels_dir, str(out / name), shards) for k in each]
            labels_dir = str(out / name)
            if stage(name, label_round, tasks).extra.get("messages", 0) == 0:
                break
        stage(
            "component-members",
            component_members,
            [
                (labels_dir, hub_files, k, sigs, docs, sources, bands, member_files[k], shards)
                for k in each
            ],
        )
        stage(
            "firsts",
            component_firsts,
            [(member_files, k, order_files[k], check_files[k], shards) for k in each],
        )
        checked = stage(
            "checked",
            verify_against_first,
            [(check_files, k, docs, checked_files[k], threshold, n, shards) for k in each],
        )
        greedy = stage(
            "greedy",
            verify_remaining,
            [
                (order_files[k], checked_files, k, docs, chunk_files[k], threshold, n, shards)
                for k in each
            ],
        )
        for key in counts:
            for step in (links, checked, greedy):
                counts[key] += step.extra.get(key, 0)
    else:  # no partitions: nothing to group
        chunk_files = []
    report = runner.run(
        "lsh",
        out,
        [Task("report", (chunk_files, str(out), docs_in, bands, rows, counts))],
        write_report,
    )
    return {
        "docs_in": report.docs_in,
        "docs_out": report.docs_out,
        "extra": report.extra,
        "seconds": report.seconds + sum(s.seconds for s in stats),
        "cpu_seconds": report.cpu_seconds + sum(s.cpu_seconds for s in stats),
        "peak_rss_mb": max(s.peak_rss_mb for s in [report, *stats]),
    }


def _count_signatures(signature_paths: list[str]) -> int:
    """The number of signatures, once they are known to be comparable."""
    schemes, count = set(), 0
    for path in signature_paths:
        count += read_table(Path(path)).num_rows  # memory-mapped: reads no data
        meta = read_meta(Path(path))
        if meta.get("scheme") is None or meta.get("shingle_hash") is None:
            raise ValueError(
                f"{path}: MinHash signatures without their hashing scheme (written by an older "
                "megadata); delete the directory to have them recomputed"
            )
        schemes.add((meta["scheme"], meta["shingle_hash"]))
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


def label_round(
    edge_paths: list[str], shard: int, previous: str | None, out_dir: str, shards: int
) -> dict:
    """Step 4, one round for the nodes of one shard: take the smallest label received,
    spread labels over the shard's own links until they settle, and send a label that
    dropped (every label, in round 0) to the neighbours in other shards.  So a round
    crosses a shard boundary once, and one shard settles in one round."""
    edges = _read_shuffled(edge_paths, shard, shards)
    node, neighbor = edges.column("node").to_numpy(), edges.column("neighbor").to_numpy()
    nodes = np.unique(node)
    if previous is None:
        before = nodes
        labels, changed = nodes.copy(), np.ones(len(nodes), dtype=bool)
    else:
        before = read_table(Path(previous) / f"labels-{shard:05d}.arrow").column("label")
        before = before.to_numpy()
        outboxes = [str(Path(previous) / f"outbox-{k:05d}.arrow") for k in range(shards)]
        inbox = _read_shuffled(outboxes, shard, shards)
        labels = before.copy()
        to = np.searchsorted(nodes, inbox.column("node").to_numpy())
        np.minimum.at(labels, to, inbox.column("label").to_numpy())
    source = np.searchsorted(nodes, node)
    inside = neighbor % shards == shard
    root = _local_roots(source[inside], np.searchsorted(nodes, neighbor[inside]), len(nodes))
    lowest = labels.copy()
    np.minimum.at(lowest, root, labels)
    labels = lowest[root]
    if previous is not None:
        changed = labels < before
    send = changed[source] & ~inside
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
    return {"extra": {"messages": len(to), "relabelled": int((labels < before).sum())}}


def _local_roots(a: np.ndarray, b: np.ndarray, count: int) -> np.ndarray:
    """For each of `count` nodes, the smallest node of its component over the links a-b
    (hook each tree's root to the smallest root it touches, then shortcut: the number of
    trees halves at least every pass)."""
    root = np.arange(count)
    while True:
        ra, rb = root[a], root[b]
        apart = ra != rb
        if not apart.any():
            return root
        low, high = np.minimum(ra[apart], rb[apart]), np.maximum(ra[apart], rb[apart])
        np.minimum.at(root, high, low)
        while True:
            up = root[root]
            if (up == root).all():
                break
            root = up


def component_members(
    labels_dir: str,
    hub_paths: list[str],
    shard: int,
    signature_paths: list[str],
    doc_paths: list[str],
    sources: list[str],
    bands: int,
    out_path: str,
    shards: int,
) -> dict:
    """Step 5: the shard's nodes with what the survivor order and the candidate test need,
    routed by component."""
    labels = read_table(Path(labels_dir) / f"labels-{shard:05d}.arrow")
    nodes, label = labels.column("node").to_numpy(), labels.column("label").to_numpy()
    memberships = _read_shuffled(hub_paths, shard, shards)
    hubs = np.full((len(nodes), bands), -1, dtype=np.int64)
    at = np.searchsorted(nodes, memberships.column("node").to_numpy())
    hubs[at, memberships.column("band").to_numpy()] = memberships.column("hub").to_numpy()
    if sources:
        rank_of = {name: i for i, name in enumerate(sources)}
        rank = [rank_of.get(s, len(sources)) for s in _take(doc_paths, nodes, "source")]
    else:
        rank = [0] * len(nodes)
    _write_shuffled(
        out_path,
        {
            "label": pa.array(label),
            "node": pa.array(nodes),
            "rank": pa.array(rank, pa.int32()),
            "length": pa.array(_take(signature_paths, nodes, "length"), pa.int64()),
            "doc_id": pa.array(_take(signature_paths, nodes, "doc_id"), pa.string()),
            "hubs": pa.FixedSizeListArray.from_arrays(pa.array(hubs.reshape(-1)), bands),
        },
        label % shards,
        shards,
    )
    return {}


# Components one after the other, each in the survivor order: earliest source, longest text,
# smallest doc_id (Arrow compares strings by UTF-8 bytes: the order of Python's str).
SURVIVOR_ORDER = [
    ("label", "ascending"),
    ("rank", "ascending"),
    ("length", "descending"),
    ("doc_id", "ascending"),
]


def component_firsts(
    member_paths: list[str], shard: int, order_path: str, check_path: str, shards: int
) -> dict:
    """Step 6: the shard's components in the survivor order, and each member that is a
    candidate of its component's first document sent with it to the member's node shard."""
    members = _read_shuffled(member_paths, shard, shards)
    members = members.take(pc.sort_indices(members, sort_keys=SURVIVOR_ORDER))
    write_table(Path(order_path), members)
    label, node = members.column("label").to_numpy(), members.column("node").to_numpy()
    hubs = _hub_matrix(members)
    start = np.ones(len(label), dtype=bool)
    start[1:] = label[1:] != label[:-1]
    first = np.maximum.accumulate(np.where(start, np.arange(len(label)), 0))
    candidate = ((hubs == hubs[first]) & (hubs >= 0)).any(axis=1) & ~start
    _write_shuffled(
        check_path,
        {
            "label": pa.array(label[candidate]),
            "node": pa.array(node[candidate]),
            "first": pa.array(node[first][candidate]),
        },
        node[candidate] % shards,
        shards,
    )
    return {}


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
    hubs = _hub_matrix(members)
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
        texts = _take(doc_paths, node[chunk], "text")
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
    write_table(_removed_nodes_path(out_path), removed_nodes)
    atomic_write_bytes(Path(out_path), _jsonl(report))
    return {
        "extra": {
            "candidate_pairs": compared,
            "verified_pairs": verified,
            "components": int(start.sum()),
        }
    }


def write_report(
    chunk_paths: list[str], out_dir: str, docs_in: int, bands: int, rows: int, counts: dict
) -> dict:
    """Step 9: clusters.jsonl (one line per kept document that removed others, by its id)
    and removed.json."""
    clusters = [json.loads(line) for p in chunk_paths for line in Path(p).read_text().splitlines()]
    clusters.sort(key=lambda c: c["survivor"])
    removed = sorted(m["doc_id"] for c in clusters for m in c["removed"])
    nodes = [np.zeros(0, np.int64)]
    for p in chunk_paths:
        if not _removed_nodes_path(p).exists():  # a shard walked by an earlier megadata
            raise FileNotFoundError(
                f"{_removed_nodes_path(p)} is missing: delete {Path(p).parent} to walk again"
            )
        nodes.append(read_table(_removed_nodes_path(p)).column("node").to_numpy())
    nodes = np.concatenate(nodes)  # write_removed_nodes sorts them
    if len(nodes) != len(removed):
        raise ValueError(f"dedup: {len(nodes)} removed nodes for {len(removed)} removed ids")
    write_removed_nodes(Path(out_dir) / REMOVED_NODES, nodes)
    atomic_write_bytes(Path(out_dir) / "clusters.jsonl", _jsonl(clusters))
    atomic_write_json(Path(out_dir) / "removed.json", removed)
    return {
        "docs_in": docs_in,
        "docs_out": docs_in - len(removed),
        "extra": {
            "bands": bands,
            "rows": rows,
            "candidate_pairs": counts["candidate_pairs"],
            "verified_pairs": counts["verified_pairs"],
            "bucket_pairs": counts["bucket_pairs"],
            "components": counts["components"],
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


def _u64_matrix(column, width: int) -> np.ndarray:
    """A fixed-size binary column of 8 * width bytes as an (n, width) uint64 array."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(array) == 0:
        return np.zeros((0, width), dtype=np.uint64)
    data = np.frombuffer(array.buffers()[1], dtype=np.uint64)
    return data[array.offset * width : (array.offset + len(array)) * width].reshape(-1, width)


def _hub_matrix(members: pa.Table) -> np.ndarray:
    column = members.column("hubs").combine_chunks()
    width = members.schema.field("hubs").type.list_size
    return column.flatten().to_numpy().reshape(-1, width)


def _shingle_hashes(doc_paths: list[str], nodes: np.ndarray, n: int) -> dict[int, np.ndarray]:
    """Each node's shingles as sorted distinct 64-bit hashes (what its MinHash was made of):
    the Jaccard of two such arrays is that of the shingle sets but for a hash collision
    (about 2^-64 a pair), at a tenth of the memory and time of sets of strings."""
    texts = _take(doc_paths, nodes, "text")
    return {
        node: ngram_hashes(text, n, underscore=True, short=True)
        for node, text in zip(nodes.tolist(), texts, strict=True)
    }


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


def remove_partition(in_path: str, out_path: str, removed_nodes_path: str, part: int) -> dict:
    """Step 10: partition number `part` without its removed documents: its rows are read
    from the sorted removed nodes by two binary searches (memory-mapped, whatever their
    number), and a partition that loses none is linked, not rewritten."""
    nodes = np.load(removed_nodes_path, mmap_mode="r")  # a binary search reads a few pages
    lo, hi = np.searchsorted(nodes, [part << 32, (part + 1) << 32])
    return drop_rows(in_path, out_path, np.asarray(nodes[lo:hi]) & 0xFFFFFFFF)


def write_removed_nodes(path: Path, nodes: np.ndarray) -> None:
    """The sorted int64 nodes `remove_partition` reads, as one .npy array it can map."""
    buffer = io.BytesIO()
    np.save(buffer, np.sort(np.asarray(nodes, dtype=np.int64)))
    atomic_write_bytes(Path(path), buffer.getvalue())


def _removed_nodes_path(chunk_path: str) -> Path:
    return Path(chunk_path).with_suffix(".removed.arrow")
