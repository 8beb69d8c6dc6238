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
3. `--dedup-scaling` (alone; writes bench-results/megadata_dedup_scaling.json): the dedup
   stage (signatures, LSH grouping and verification, removal; on `--workers` workers, as
   `megadata run` runs it) on N documents that are all one near-duplicate cluster (one
   text of 1,154 words, each copy with 3 words replaced) and on N distinct documents of
   the same length, for N in `--sizes` (2,000 and 20,000 by default): seconds of each and
   their ratio, the pairs compared against the pairs all-pairs bucket verification would
   have compared.  The words are drawn from a Zipf law over 50,000 made-up words, so the
   distinct documents share few word pairs (as unrelated web pages do).
"""

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
from datasketch import MinHash

from megadata.documents import read_docs, write_docs
from megadata.planted import plant, run_dedup, score
from megadata.recipe import load_recipe, run_recipe
from megadata.runner import Runner, Task
from megadata.stages import dedup
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


SCALING_WORDS = 1154  # the cluster: 4,000 copies of 1,154 words, 3 edited in each
SCALING_EDITS = 3
PARTITION_DOCS = 500  # the recipes' partition_docs


class TextMaker:
    """Documents of made-up words drawn from a Zipf law (seeded): independent draws share
    few word pairs, like unrelated pages."""

    def __init__(self, seed: int, vocabulary: int = 50_000):
        self.rng = np.random.default_rng(seed)
        self.words = np.array([f"{_word(i)}" for i in range(vocabulary)])
        weights = 1.0 / np.arange(1, vocabulary + 1)
        self.cumulative = np.cumsum(weights / weights.sum())

    def draw(self, count: int) -> np.ndarray:
        picks = np.searchsorted(self.cumulative, self.rng.random(count), side="right")
        return np.minimum(picks, len(self.words) - 1)

    def text(self, indices: np.ndarray) -> str:
        return " ".join(self.words[indices].tolist())


def _word(i: int) -> str:
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    out = ""
    i += 26
    while i:
        i, r = divmod(i, 26)
        out += letters[r]
    return out


def write_scaling_corpus(kind: str, docs: int, out: Path, seed: int = 0) -> list[str]:
    """`docs` documents of SCALING_WORDS words in partitions of PARTITION_DOCS: one cluster
    (copies of one text, SCALING_EDITS words replaced in each) or all distinct."""
    maker = TextMaker(seed)
    base = maker.draw(SCALING_WORDS)
    paths = []
    for start in range(0, docs, PARTITION_DOCS):
        rows = []
        for i in range(start, min(docs, start + PARTITION_DOCS)):
            if kind == "cluster":
                words = base.copy()
                at = maker.rng.choice(SCALING_WORDS, SCALING_EDITS, replace=False)
                words[at] = maker.draw(SCALING_EDITS)
            else:
                words = maker.draw(SCALING_WORDS)
            rows.append({"doc_id": f"{kind}/{i:07d}", "source": "bench", "text": maker.text(words)})
        paths.append(out / "filter" / f"part-{start // PARTITION_DOCS:05d}.arrow")
        write_docs(paths[-1], rows)
    return [str(p) for p in paths]


def dedup_stage(runner: Runner, parts: list[str], work: Path) -> dict:
    """The recipe's dedup stage (as `recipe._dedup` runs it) on `parts`: its timings."""
    num_perm, n, seed, threshold = 128, 2, 1, 0.7
    start = time.perf_counter()
    sig_dir, out_dir = work / "signatures", work / "dedup"
    tasks = [Task(Path(p).stem, (p, str(sig_dir / Path(p).name), num_perm, n, seed)) for p in parts]
    signatures = runner.run("minhash", sig_dir, tasks, dedup.signature_partition)
    sigs = [str(sig_dir / Path(p).name) for p in parts]
    grouping = dedup.find_duplicates(
        sigs, parts, str(work / "lsh"), threshold, num_perm, n, runner=runner
    )
    removed = str(work / "lsh" / "removed.json")
    tasks = [Task(Path(p).stem, (p, str(out_dir / Path(p).name), removed)) for p in parts]
    removal = runner.run("dedup", out_dir, tasks, dedup.remove_partition)
    seconds = time.perf_counter() - start
    return {
        "seconds": round(seconds, 2),
        "cpu_seconds": round(
            signatures.cpu_seconds + grouping["cpu_seconds"] + removal.cpu_seconds, 2
        ),
        "signature_seconds": round(signatures.seconds, 2),
        "grouping_seconds": round(grouping["seconds"], 2),
        "removal_seconds": round(removal.seconds, 2),
        "docs_out": removal.docs_out,
        **{
            k: grouping["extra"][k]
            for k in ("candidate_pairs", "bucket_pairs", "components", "clusters", "removed")
        },
    }


def dedup_scaling(sizes: list[int], workers: int, work: Path) -> dict:
    """The dedup stage on one near-duplicate cluster of N documents and on N distinct ones."""
    curve = []
    with Runner(workers, progress=False) as runner:
        runner.run("warm-up", work / "warm-up", [Task("a", (0,)), Task("b", (1,))], _noop)
        for i, size in enumerate(sizes):
            row = {"documents": size}
            for kind in ("distinct", "cluster"):
                root = work / f"{kind}-{size}-{i}"
                parts = write_scaling_corpus(kind, size, root)
                row["mb"] = round(sum(Path(p).stat().st_size for p in parts) / 1e6, 1)
                row[kind] = dedup_stage(runner, parts, root)
                print(f"{size} {kind}: {row[kind]}", flush=True)
            row["cluster_over_distinct"] = round(
                row["cluster"]["seconds"] / row["distinct"]["seconds"], 2
            )
            curve.append(row)
    return {
        "workers": workers,
        "words_per_document": SCALING_WORDS,
        "edits_per_copy": SCALING_EDITS,
        "threshold": 0.7,
        "curve": curve,
    }


def _noop(_) -> dict:
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dedup-scaling", action="store_true", help="only item 3 above")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    args = parser.parse_args()
    if args.dedup_scaling:
        with tempfile.TemporaryDirectory() as tmp:
            scaling = dedup_scaling(args.sizes, args.workers, Path(tmp))
        scaling["machine"] = {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        }
        out = args.out or Path("bench-results/megadata_dedup_scaling.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(scaling, indent=2) + "\n")
        print(json.dumps(scaling, indent=2))
        return
    args.out = args.out or Path("bench-results/megadata.json")
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
