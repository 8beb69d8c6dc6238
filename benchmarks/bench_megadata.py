"""megadata speed and dedup quality on the default recipe's real text.

    python benchmarks/bench_megadata.py --out bench-results/megadata.json

1. Each stage of the default recipe (pipelines/corpus/default.toml, inputs from
   `make data`'s fetch) built from scratch in a temporary directory: MB/s per
   worker = input bytes / seconds / workers; and the whole recipe's MB of text per
   second per core, with the core-hours it implies for the paper's 174 GB.
2. Dedup on planted near-duplicates: the recipe's cleaned documents cut into
   pieces of about 150 words, each with copies that have 5%, 15% and 40% of words
   replaced (>= 5,000 documents): documents/s per core of our MinHash
   (datasketch `update_batch`) + LSH + verification, precision and recall
   against exact Jaccard, and the time of datasketch's plain per-shingle
   `update()` loop on the same documents beside our signature step (ratio).
"""

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from datasketch import MinHash

from megadata.documents import read_docs
from megadata.planted import plant, run_dedup, score
from megadata.recipe import load_recipe, run_recipe
from megadata.stages.dedup import minhash, shingles

ROOT = Path(__file__).resolve().parent.parent


def stage_speeds(workers: int, work: Path) -> tuple[list[dict], list[str]]:
    recipe = load_recipe(ROOT / "pipelines/corpus/default.toml", output=work / "corpus")
    results = run_recipe(recipe, workers=workers, progress=False)
    rows = []
    for r in results:
        mb = r.bytes_in / 1e6
        rows.append(
            {
                "stage": r.stage,
                "docs_in": r.docs_in,
                "mb_in": round(mb, 3),
                "seconds": round(r.seconds, 3),
                "mb_per_s_per_worker": round(mb / r.seconds / workers, 3)
                if r.seconds and mb
                else None,
            }
        )
    texts = [
        d["text"] for p in sorted((recipe.work / "clean").glob("*.arrow")) for d in read_docs(p)
    ]
    return rows, texts, whole_recipe(results, workers)


PAPER_CORPUS_MB = 174_000  # the paper's deduplicated corpus: 174 GB of text


def whole_recipe(results: list, workers: int) -> dict:
    """The whole recipe's rate per core in MB of ingested text, and what 174 GB would cost.

    The rate is ingested text (ingest's output bytes) over the sum of the stages' wall
    times x workers: the core-time the recipe held, idle time included.
    """
    text_mb = results[0].bytes_out / 1e6
    seconds = sum(r.seconds for r in results)
    rate = text_mb / seconds / workers
    slowest = max(results, key=lambda r: r.seconds)
    return {
        "text_mb": round(text_mb, 3),
        "seconds": round(seconds, 2),
        "workers": workers,
        "mb_per_s_per_core": round(rate, 4),
        "core_hours_for_174_gb": round(PAPER_CORPUS_MB / rate / 3600),
        "slowest_stage": slowest.stage,
        "slowest_stage_share": round(slowest.seconds / seconds, 3),
    }


def pieces(texts: list[str], words: int = 150) -> list[str]:
    out = []
    for t in texts:
        w = t.split()
        out += [" ".join(w[i : i + words]) for i in range(0, len(w) - words + 1, words)]
    return out


def dedup_quality(texts: list[str], work: Path, min_docs: int = 5000) -> dict:
    bases = pieces(texts)
    rows, pairs = plant(bases, fractions=(0.05, 0.15, 0.40), seed=0)
    assert len(rows) >= min_docs, f"only {len(rows)} planted documents"
    start = time.perf_counter()
    removed, clusters, counts = run_dedup(rows, work, threshold=0.7, n=2)
    seconds = time.perf_counter() - start
    result = score(rows, pairs, removed, clusters, threshold=0.7, n=2)

    sample = [r["text"] for r in rows]
    start = time.perf_counter()
    ours = [minhash(t, 128, 2, 1) for t in sample]
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    plain = []
    for t in sample:
        m = MinHash(num_perm=128, seed=1)
        for s in shingles(t, 2):
            m.update(s.encode("utf-8"))
        plain.append(m)
    plain_s = time.perf_counter() - start
    identical = all((a.hashvalues == b.hashvalues).all() for a, b in zip(ours, plain, strict=True))
    return {
        "documents": len(rows),
        "planted_pairs": len(pairs),
        "dedup_seconds_one_core": round(seconds, 3),
        "dedup_docs_per_s_per_core": round(len(rows) / seconds, 1),
        **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()},
        "lsh": counts["extra"],
        "signature_seconds_update_batch": round(ours_s, 3),
        "signature_seconds_plain_update_loop": round(plain_s, 3),
        "speedup_vs_plain_update": round(plain_s / ours_s, 2),
        "signatures_identical_to_plain_update": bool(identical),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/megadata.json"))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stages, texts, whole = stage_speeds(args.workers, Path(tmp))
        (Path(tmp) / "planted").mkdir()
        quality = dedup_quality(texts, Path(tmp) / "planted")
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "workers": args.workers,
        "stages": stages,
        "whole_recipe": whole,
        "dedup_planted": quality,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
