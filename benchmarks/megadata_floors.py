"""The CPU seconds a megadata recipe spends inside the libraries it calls, beside its whole.

    python benchmarks/megadata_floors.py --mb 50 --rounds 3
    (writes benchmarks/results/megadata-floors.json; --out elsewhere)

Each corpus of bench_megadata.py (the default recipe, its BERT variant, plain jsonl; `--mb`
MB of replicated text) is built `--rounds` times, the corpora alternated, in this process
(`workers = 1`: every task in the calling process, so CPU seconds are not inflated by a
second busy core).  Then the calls the recipe makes into libraries are timed again, alone,
on the same inputs:
- bz2 decompression of the Wikipedia dumps (libbz2);
- mwparserfromhell's parse of each article's wikitext (after megadata's prestrip, as
  ingest parses it; the pruning and `strip_code` after it are not counted);
- fastText's language identification of each document's first 2,000 characters;
- HF tokenizers encoding every document the filter stage reads, in one thread (the
  smaller of that and the filter stage's own CPU, less its sentence splitting, is counted:
  megadata's encoder encodes each distinct piece once);
- blingfire's sentence splitting of every line (BERT corpus), as the filter stage calls it;
- sacremoses' tokenization of the held-out documents (the WikiText evaluation file);
- the tokenizer stage as measured (HF's trainer; megadata's word counts are cheaper than
  HF's own pre-tokenization, so that is below HF's own figure).
Left out, so the sum is a lower bound: ftfy, Arrow I/O, MinHash and n-gram hashing (numpy),
LSH, the holdout and decontamination bookkeeping.  The budget is the CPU seconds that
2 MB/s per core allows for the corpus' text: the sum of the floors against it says how
much of the budget the libraries alone take.  The report holds every run and each figure's
median.
"""

import argparse
import bz2
import html
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # HF tokenizers in one thread: CPU per core

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megadata_corpora import bench_recipe

from megadata.documents import read_docs
from megadata.recipe import load_recipe, run_recipe

ROOT = Path(__file__).resolve().parent.parent
TARGET_MB_PER_S = 2.0
_TEXT = re.compile(rb"<text\b[^>]*>(.*?)</text>", re.S)


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return round(time.process_time() - start, 2)


def _docs(stage_dir: Path) -> list[dict]:
    return [d for p in sorted(stage_dir.glob("*.arrow")) for d in read_docs(p)]


def _wiki_floors(inputs: list[Path]) -> dict:
    dumps = [p for p in inputs if p.name.endswith(".bz2")]
    if not dumps:
        return {}
    compressed = [p.read_bytes() for p in dumps]
    xml: list[bytes] = []
    floors = {"bz2 decompression": _cpu(lambda: xml.extend(map(bz2.decompress, compressed)))}
    import mwparserfromhell

    from megadata.sources.wiki_prestrip import prestrip

    pages = [html.unescape(m.group(1).decode()) for x in xml for m in _TEXT.finditer(x)]
    stripped = [prestrip(p) for p in pages]
    floors["wikitext parse (mwparserfromhell)"] = _cpu(
        lambda: [mwparserfromhell.parse(p, skip_style_tags=True) for p in stripped]
    )
    return floors


def floors(kind: str, mb: float, work: Path) -> dict:
    recipe = load_recipe(bench_recipe(kind, mb, work), output=work / "corpus")
    stages = {r.stage: r for r in run_recipe(recipe, workers=1, progress=False)}
    text_mb = stages["ingest"].bytes_out / 1e6
    stage_cpu = {name: round(r.cpu_seconds, 2) for name, r in stages.items()}
    found = _wiki_floors(sorted((work / "inputs").iterdir()))

    from megadata.stages.clean import DETECT_CHARS, _fasttext

    heads = [d["text"][:DETECT_CHARS] for d in _docs(recipe.work / "ingest")]
    detector = _fasttext()
    found["language id (fastText)"] = _cpu(
        lambda: [detector.detect(h, model="lite", k=3) for h in heads if h.strip()]
    )

    from tokenizers import Tokenizer

    filter_in = [d["text"] for d in _docs(recipe.work / "clean")]
    tok = Tokenizer.from_file(str(recipe.output / "tokenizer.json"))
    hf_encode = _cpu(lambda: tok.encode_batch(filter_in))
    splitting = 0.0
    if recipe.tokenizer.kind == "bert-wordpiece":
        import blingfire

        from megadata.encode import _text_to_sentences

        lines = [line for t in filter_in for line in t.split("\n") if line.strip()]
        splitting = _cpu(lambda: [_text_to_sentences(line, blingfire) for line in lines])
        found["sentence splitting (blingfire)"] = splitting
    # the filter stage splits sentences too: its encoding is the rest
    found["encoding (HF tokenizers, 1 thread; or the filter stage if less)"] = min(
        hf_encode, round(stage_cpu["filter"] - splitting, 2)
    )
    from megadata.wikitext_format import tokenize

    held = [d["text"] for d in _docs(recipe.work / "holdout_docs")]
    held_lines = [line for t in held for line in t.split("\n") if line.strip()]
    found["WikiText tokenization of held-out text (sacremoses)"] = _cpu(
        lambda: [tokenize(line) for line in held_lines]
    )
    found["tokenizer training (stage as measured)"] = stage_cpu["tokenizer"]
    total = round(sum(found.values()), 2)
    budget = round(text_mb / TARGET_MB_PER_S, 2)
    whole = round(sum(stage_cpu.values()), 2)
    return {
        "corpus": kind,
        "text_mb": round(text_mb, 2),
        "library_floors_cpu_seconds": found,
        "hf_encode_cpu_seconds": hf_encode,
        "floors_total": total,
        "budget_cpu_seconds_at_2_mb_s_per_core": budget,
        "floors_share_of_budget": round(total / budget, 2),
        "whole_recipe_cpu_seconds": whole,
        "whole_recipe_mb_per_cpu_s": round(text_mb / whole, 3),
        "stage_cpu_seconds": stage_cpu,
    }


def _medians(runs: list[dict]) -> dict:
    def median(values):
        return round(statistics.median(values), 3)

    keys = ("floors_total", "floors_share_of_budget", "whole_recipe_cpu_seconds")
    out = {"text_mb": runs[0]["text_mb"], "rounds": len(runs)}
    out.update({k: median([r[k] for r in runs]) for k in keys})
    out["whole_recipe_mb_per_cpu_s"] = median([r["whole_recipe_mb_per_cpu_s"] for r in runs])
    out["budget_cpu_seconds_at_2_mb_s_per_core"] = runs[0]["budget_cpu_seconds_at_2_mb_s_per_core"]
    floors_of = runs[0]["library_floors_cpu_seconds"]
    out["library_floors_cpu_seconds"] = {
        k: median([r["library_floors_cpu_seconds"][k] for r in runs]) for k in floors_of
    }
    out["stage_cpu_seconds"] = {
        k: median([r["stage_cpu_seconds"][k] for r in runs]) for k in runs[0]["stage_cpu_seconds"]
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50)
    parser.add_argument("--corpora", nargs="+", default=["default", "bert", "jsonl"])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each corpus (medians)")
    out = ROOT / "benchmarks/results/megadata-floors.json"
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    report = {"command": "python benchmarks/megadata_floors.py " + " ".join(sys.argv[1:])}
    report["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs: dict[str, list[dict]] = {kind: [] for kind in args.corpora}
    for _ in range(args.rounds):  # the corpora alternate: a slow minute of the VM hits each
        for kind in args.corpora:
            with tempfile.TemporaryDirectory() as tmp:
                runs[kind].append(floors(kind, args.mb, Path(tmp)))
            print(json.dumps(runs[kind][-1]), flush=True)
    report["median"] = {kind: _medians(found) for kind, found in runs.items()}
    report["runs"] = runs
    print(json.dumps(report["median"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
