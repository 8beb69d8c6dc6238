"""Planted near-duplicates of real text: high recall above 0.8, nothing removed below 0.5."""

from megadata.planted import plant, run_dedup, score


def test_planted_near_duplicates(tmp_path, documents):
    texts = [d["text"] for d in documents]
    rows, pairs = plant(texts, fractions=(0.05, 0.15, 0.40), seed=0)
    removed, clusters, counts = run_dedup(rows, tmp_path, threshold=0.7, n=2)
    result = score(rows, pairs, removed, clusters, threshold=0.7, n=2)
    print("planted near-duplicates:", result, counts["extra"])  # the measured precision/recall
    assert result["pairs_at_0.8"] >= 30  # the 5% copies: the check below is not vacuous
    assert result["recall_at_0.8"] >= 0.95
    assert result["lowest_removed_jaccard"] > 0.5  # no document removed for a pair below 0.5
    # Only verified pairs count, so what is flagged is above the threshold...
    assert result["precision"] >= 0.95
    # ...and the LSH bands let nearly every pair above it through.
    assert result["recall"] >= 0.9
