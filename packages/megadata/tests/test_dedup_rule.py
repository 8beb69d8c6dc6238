"""The dedup rule: a document is removed only for a kept document above the threshold, in the
survivor order (source, longest, doc_id), and a cluster of near-copies costs comparisons
linear in its size."""

import json
import random

import numpy as np

from megadata.documents import write_docs
from megadata.stages import dedup
from megadata.stages.dedup import components


def run(tmp_path, rows: list[dict], sources=None, n: int = 2, part_docs: int = 100) -> dict:
    docs, sigs = [], []
    for k in range(0, len(rows), part_docs):
        docs.append(str(tmp_path / f"docs-{k:06d}.arrow"))
        sigs.append(str(tmp_path / f"sig-{k:06d}.arrow"))
        write_docs(tmp_path / f"docs-{k:06d}.arrow", rows[k : k + part_docs])
        dedup.signature_partition(docs[-1], sigs[-1], 128, n, 1)
    counts = dedup.find_duplicates(sigs, docs, str(tmp_path / "lsh"), 0.7, 128, n, sources=sources)
    lines = (tmp_path / "lsh" / "clusters.jsonl").read_text().splitlines()
    return {
        "counts": counts,
        "removed": json.loads((tmp_path / "lsh" / "removed.json").read_text()),
        "report": {c["survivor"]: c["removed"] for c in map(json.loads, lines)},
    }


def words_of(documents) -> list[str]:
    return " ".join(d["text"] for d in documents).split()


def test_a_chain_is_not_removed_through_its_middle(tmp_path, documents):
    """A~B and B~C above 0.7, A~C below: with A first, B goes (for A) and C stays; with B
    first, both ends go, each reported with B and a Jaccard above 0.7."""
    words = words_of(documents)
    a, b, c = (" ".join(words[40 * k : 40 * k + 400]) for k in range(3))
    sets = [dedup.shingles(t) for t in (a, b, c)]
    assert dedup.jaccard(sets[0], sets[1]) > 0.7 and dedup.jaccard(sets[1], sets[2]) > 0.7
    assert dedup.jaccard(sets[0], sets[2]) < 0.7
    rows = [
        {"doc_id": "ends/a", "source": "ends", "text": a},
        {"doc_id": "mid/b", "source": "mid", "text": b},
        {"doc_id": "ends/c", "source": "ends", "text": c},
    ]
    first_a = run(tmp_path / "a", rows, sources=["ends", "mid"])
    # The sources' order comes first: A and C (source "ends") before B.  Whichever of A and
    # C is first is kept, the other is below 0.7 to it and kept too; B is removed.
    assert first_a["removed"] == ["mid/b"]
    ((kept, removed),) = first_a["report"].items()
    assert kept in ("ends/a", "ends/c") and removed[0]["doc_id"] == "mid/b"
    assert removed[0]["jaccard"] > 0.7
    assert removed[0]["jaccard"] == round(
        dedup.jaccard(sets[1], sets[0 if kept == "ends/a" else 2]), 6
    )

    first_b = run(tmp_path / "b", rows, sources=["mid", "ends"])
    assert first_b["removed"] == ["ends/a", "ends/c"]
    assert [m["doc_id"] for m in first_b["report"]["mid/b"]] == ["ends/a", "ends/c"]
    assert all(m["jaccard"] > 0.7 for m in first_b["report"]["mid/b"])
    extra = first_b["counts"]["extra"]
    assert extra["components"] == 1 and extra["clusters"] == 1 and extra["removed"] == 2


def test_the_longest_then_the_smallest_id_survives(tmp_path, documents):
    words = words_of(documents)[:300]
    text = " ".join(words)
    rows = [
        {"doc_id": "s/2", "source": "s", "text": text},
        {"doc_id": "s/1", "source": "s", "text": text},
        {"doc_id": "s/0", "source": "s", "text": " ".join(words[:-3])},  # shorter
    ]
    result = run(tmp_path, rows)  # no sources: one rank for all
    assert result["removed"] == ["s/0", "s/2"]
    assert [m["doc_id"] for m in result["report"]["s/1"]] == ["s/0", "s/2"]


def test_a_cluster_of_near_copies_costs_comparisons_linear_in_its_size(tmp_path, documents):
    """600 copies of one text with 3 words edited each, among 40 other documents: every copy
    is compared once (with the kept first), never with all the others of its buckets."""
    words = words_of(documents)
    base = words[:400]
    rng = random.Random(0)
    rows = []
    for i in range(600):
        copy = list(base)
        for k in rng.sample(range(len(copy)), 3):
            copy[k] = rng.choice(words)
        rows.append({"doc_id": f"copy/{i:04d}", "source": "s", "text": " ".join(copy)})
    rows += [
        {"doc_id": f"other/{i:02d}", "source": "s", "text": " ".join(words[500 + 200 * i :][:200])}
        for i in range(40)
    ]
    rng.shuffle(rows)
    result = run(tmp_path, rows)
    extra = result["counts"]["extra"]
    assert extra["removed"] == 599 == len(result["removed"])
    assert all(d.startswith("copy/") for d in result["removed"])
    ((kept, removed),) = result["report"].items()
    assert kept.startswith("copy/") and all(m["jaccard"] > 0.7 for m in removed)
    assert extra["verified_pairs"] == 599
    # All-pairs would have compared ~600^2 / 2 pairs per band; this compared about 600.
    assert extra["bucket_pairs"] > 10 * 600 * 599 // 2
    assert 599 <= extra["candidate_pairs"] <= 650


def test_local_roots_are_each_components_smallest_node():
    rng = np.random.default_rng(0)
    for count, links in [(1, 0), (50, 20), (500, 400), (2000, 2500)]:
        a, b = rng.integers(0, count, links), rng.integers(0, count, links)
        parent = list(range(count))  # union-find, the plain way

        def find(x, parent=parent):
            while parent[x] != x:
                x = parent[x]
            return x

        for x, y in zip(a.tolist(), b.tolist(), strict=True):
            rx, ry = find(x), find(y)
            parent[max(rx, ry)] = min(rx, ry)
        expected = [find(x) for x in range(count)]
        assert components._local_roots(a, b, count).tolist() == expected


def test_remove_takes_each_partitions_rows_and_links_an_untouched_one(tmp_path):
    """Step 10: partition k drops the rows of the nodes k << 32 | row (and no other
    partition's), keeps the others in order, and is linked when it loses none."""
    from megadata.documents import read_docs, read_table, write_docs

    parts = []
    for k in range(3):
        docs = [{"doc_id": f"{k}-{r}", "source": "s", "text": "é" * r} for r in range(5)]
        parts.append(tmp_path / f"p{k}.arrow")
        write_docs(parts[-1], docs)
    nodes = np.array(sorted([0 << 32 | 1, 0 << 32 | 4, 2 << 32 | 0]), dtype=np.int64)
    dedup.write_removed_nodes(tmp_path / dedup.REMOVED_NODES, nodes)
    kept = {}
    for k, p in enumerate(parts):
        out = tmp_path / "out" / p.name
        counts = dedup.remove_partition(str(p), str(out), str(tmp_path / dedup.REMOVED_NODES), k)
        kept[k] = [d["doc_id"] for d in read_docs(out)]
        assert counts["docs_out"] == len(kept[k]) and counts["docs_in"] == 5
        assert counts["bytes_out"] == sum(2 * int(i.split("-")[1]) for i in kept[k])
        assert read_table(out).schema == read_table(p).schema
    assert kept == {
        0: ["0-0", "0-2", "0-3"],
        1: [f"1-{r}" for r in range(5)],
        2: ["2-1", "2-2", "2-3", "2-4"],
    }
    assert (tmp_path / "out" / "p1.arrow").stat().st_ino == parts[1].stat().st_ino  # linked
