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
`partition << 32 | row`, which `nodes.take` turns back into its text, doc_id, length or source.

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

This module runs steps 2-9 (`find_duplicates`) and holds step 10; the steps live in
`lsh` (1-3), `components` (4-6), `verify` (7-8) and `report` (9).
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megadata.documents import drop_rows, read_meta, read_table
from megadata.runner import Runner, Task
from megadata.settings import Fraction, PositiveInt
from megadata.stages.dedup.components import (
    component_firsts,
    component_members,
    label_round,
)
from megadata.stages.dedup.lsh import (
    band_partition,
    bucket_links,
    choose_bands,
    shingles,
    signature_partition,
)
from megadata.stages.dedup.report import REMOVED_NODES, write_removed_nodes, write_report
from megadata.stages.dedup.verify import jaccard, verify_against_first, verify_remaining

# The steps' functions are found here by name (a test stands in for one), and the stage's
# callers (the recipe, benchmarks, tests) reach its helpers through the package.
__all__ = [
    "REMOVED_NODES",
    "DedupSettings",
    "choose_bands",
    "find_duplicates",
    "jaccard",
    "remove_partition",
    "shingles",
    "signature_partition",
    "write_removed_nodes",
]


@dataclass(frozen=True)
class DedupSettings:
    """The recipe's `[dedup]` section."""

    threshold: Fraction = 0.7  # verified Jaccard above it: a duplicate
    num_perm: PositiveInt = 128  # MinHash permutations
    shingle_words: PositiveInt = 2  # words per shingle
    seed: int = 1  # of the permutations


# S, the number of buckets, pair shards, node shards and component shards, grows with the
# documents rather than the partitions: a shard's task costs a file read per partition plus
# a write, so shards of a few partitions' worth of documents keep that overhead small.
DOCS_PER_SHARD = 2000
MAX_SHARDS = 1024


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


def remove_partition(in_path: str, out_path: str, removed_nodes_path: str, part: int) -> dict:
    """Step 10: partition number `part` without its removed documents: its rows are read
    from the sorted removed nodes by two binary searches (memory-mapped, whatever their
    number), and a partition that loses none is linked, not rewritten."""
    nodes = np.load(removed_nodes_path, mmap_mode="r")  # a binary search reads a few pages
    lo, hi = np.searchsorted(nodes, [part << 32, (part + 1) << 32])
    return drop_rows(in_path, out_path, np.asarray(nodes[lo:hi]) & 0xFFFFFFFF)
