"""Planted near-duplicates for measuring deduplication: copies of real documents with a
fraction of their words replaced, and precision/recall of a removal against exact Jaccard."""

import json
import random
from collections.abc import Sequence
from pathlib import Path

from megadata.documents import write_docs
from megadata.stages.dedup import find_duplicates, jaccard, shingles, signature_partition


def edit_words(text: str, fraction: float, vocabulary: Sequence[str], rng: random.Random) -> str:
    words = text.split()
    for i in rng.sample(range(len(words)), k=round(fraction * len(words))):
        words[i] = rng.choice(vocabulary)
    return " ".join(words)


def plant(
    docs: Sequence[str], fractions: Sequence[float], seed: int = 0
) -> tuple[list[dict], list[tuple[str, str]]]:
    """Each document and one edited copy per fraction: (rows, planted (copy, base) pairs)."""
    rng = random.Random(seed)
    vocabulary = sorted({w for d in docs for w in d.split()})
    rows, pairs = [], []
    for i, text in enumerate(docs):
        base = f"base/{i:06d}"
        rows.append({"doc_id": base, "source": "planted", "text": text})
        for f in fractions:
            copy = f"copy/{i:06d}/{round(f * 100):02d}"
            rows.append(
                {"doc_id": copy, "source": "planted", "text": edit_words(text, f, vocabulary, rng)}
            )
            pairs.append((copy, base))
    return rows, pairs


def score(
    rows: list[dict], pairs, removed: set[str], clusters: list[dict], threshold: float, n: int
):
    """Over the planted pairs: precision and recall of "same cluster" against exact
    Jaccard > threshold, recall over pairs with Jaccard >= 0.8, and the lowest Jaccard
    of a removed document to its survivor."""
    text = {r["doc_id"]: r["text"] for r in rows}
    cluster_of = {}
    for c in clusters:
        cluster_of[c["survivor"]] = c["survivor"]
        for m in c["removed"]:
            cluster_of[m["doc_id"]] = c["survivor"]
    truth = {p: jaccard(shingles(text[p[0]], n), shingles(text[p[1]], n)) for p in pairs}
    flagged = {
        p for p in pairs if p[0] in cluster_of and cluster_of.get(p[0]) == cluster_of.get(p[1])
    }
    positive = {p for p, j in truth.items() if j > threshold}
    high = {p for p, j in truth.items() if j >= 0.8}
    lowest = min((m["jaccard"] for c in clusters for m in c["removed"]), default=1.0)
    return {
        "pairs": len(pairs),
        "true_pairs": len(positive),
        "flagged_pairs": len(flagged),
        "precision": len(flagged & positive) / len(flagged) if flagged else 1.0,
        "recall": len(flagged & positive) / len(positive) if positive else 1.0,
        "recall_at_0.8": len(flagged & high) / len(high) if high else 1.0,
        "pairs_at_0.8": len(high),
        "lowest_removed_jaccard": lowest,
        "removed": len(removed),
    }


def run_dedup(rows: list[dict], workdir, threshold=0.7, num_perm=128, n=2, seed=1, part_docs=1000):
    """The dedup stage's two steps over `rows` in `workdir`: (removed ids, clusters, counts)."""
    workdir = Path(workdir)
    docs, sigs = [], []
    for k in range(0, len(rows), part_docs):
        doc_path, sig_path = workdir / f"docs-{k:08d}.arrow", workdir / f"sig-{k:08d}.arrow"
        write_docs(doc_path, rows[k : k + part_docs])
        signature_partition(str(doc_path), str(sig_path), num_perm, n, seed)
        docs.append(str(doc_path))
        sigs.append(str(sig_path))
    counts = find_duplicates(sigs, docs, str(workdir), threshold, num_perm, n)
    removed = set(json.loads((workdir / "removed.json").read_text()))
    clusters = [json.loads(line) for line in (workdir / "clusters.jsonl").read_text().splitlines()]
    return removed, clusters, counts
