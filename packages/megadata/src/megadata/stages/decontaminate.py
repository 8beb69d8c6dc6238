"""Decontaminate: remove test articles from the training documents, measure 8-gram overlap.

What the paper did: WikiText-103 test articles were removed from the training data, and the
overlap of each test set with the training corpus was measured as the fraction of its
8-grams found in a Bloom filter of the training set's 8-grams at a false-positive rate of
1e-3.  An n-gram here is 8 lower-cased words, a word being a run of letters and digits (`\\w+`
without the underscore, which Moses splits off: `add_argument` is `add _ argument` in
WikiText).  `word_ngrams` is the one helper for training and evaluation text, so the WikiText
marks `@-@`, `@,@`, `@.@` and its spaced punctuation vanish exactly as they do in plain text.
Percentages count distinct 8-grams.

The evaluation sets are the recipe's `eval_sets = [{name, kind, path}, ...]`, kind one of
- `wikitext`: a file in WikiText-103's format, split into articles at its ` = Title = ` lines;
- `lambada`: JSON lines with a `text` field, one passage a line;
- `text`: a plain text file, one unit.
A path is relative to the recipe file; `@holdout/NAME` names a file the holdout stage wrote
under `<corpus>/eval/` (`@holdout/wiki.test.tokens`, `@holdout/lambada.jsonl`).

1. `prepare_eval_sets` (one process) reads the sets into `eval_sets.json` (an empty file, or
   one with no text, is counted and reported with overlap n/a, never fatal) and, when
   `max_doc_overlap` is set, a Bloom filter of their 8-grams.
2. `remove_partition` (per partition, in workers) removes a training document when
   - its normalised title (its lower-cased words) equals a WikiText article's and more than
     `article_overlap` (0.5) of that article's 8-grams are in it ("title+content"), or
   - more than `copy_overlap` (0.8) of some article's 8-grams are in it, whatever its title
     ("content"), or
   - `max_doc_overlap` is set and more than that fraction of its own 8-grams are in the
     evaluation sets' Bloom filter ("doc_overlap").
   The reasons ride in each output partition's metadata.
3. `write_report` (one process), after the removal: the Bloom filter of the remaining
   training documents' 8-grams (`reports/train_8grams.bloom`, sized for the sum of the
   documents' distinct 8-gram counts, so the false-positive rate is at most the target),
   each set's overlap with it, and `reports/decontamination.json`.  Because removal comes
   first, the reported overlap is that of the final training corpus.

`megadata overlap --bloom FILE --eval KIND:PATH` measures any file against a saved filter.
"""

import functools
import json
import logging
import re
from collections import Counter
from pathlib import Path

import click
from tqdm import tqdm

from megadata.bloom import BloomFilter
from megadata.documents import atomic_write_json, read_docs, read_meta, text_bytes, write_docs
from megadata.wikitext_format import split_articles

log = logging.getLogger("megadata.decontaminate")

EVAL_KINDS = ("wikitext", "lambada", "text")
HOLDOUT_PREFIX = "@holdout/"
DEFAULTS = {
    "eval_sets": [],
    "ngram": 8,
    "fpr": 1e-3,
    "seed": 0,
    "article_overlap": 0.5,
    "copy_overlap": 0.8,
    "max_doc_overlap": None,
}
_WORD = re.compile(r"[^\W_]+")  # \w+ less "_": Moses splits add_argument as add _ argument


class EvalSetError(ValueError):
    pass


def word_ngrams(text: str, n: int = 8) -> set[str]:
    """Distinct n-grams of lower-cased words (none for a text of fewer than n words)."""
    words = _WORD.findall(text.lower())
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def normalise_title(title: str) -> str:
    return " ".join(_WORD.findall(title.lower()))


def settings(section: dict) -> dict:
    """The `[decontaminate]` section with defaults filled in; a bad value names its field."""
    unknown = sorted(set(section) - set(DEFAULTS))
    if unknown:
        raise EvalSetError(
            f"[decontaminate]: unknown field(s) {unknown}; expected {sorted(DEFAULTS)}"
        )
    cfg = {**DEFAULTS, **section}
    for key in ("article_overlap", "copy_overlap", "max_doc_overlap"):
        value = cfg[key]
        if value is not None and not (isinstance(value, int | float) and 0 <= value <= 1):
            raise EvalSetError(f"[decontaminate] {key} must be a fraction in [0, 1], got {value!r}")
    if not isinstance(cfg["ngram"], int) or cfg["ngram"] < 1:
        raise EvalSetError(
            f"[decontaminate] ngram must be a positive integer, got {cfg['ngram']!r}"
        )
    if not isinstance(cfg["eval_sets"], list):
        raise EvalSetError("[decontaminate] eval_sets must be a list of {name, kind, path} tables")
    return cfg


def resolve_eval_sets(cfg: dict, recipe_dir: Path, holdout_dir: Path | None) -> list[dict]:
    """[{name, kind, path, as_given}]: the file to read and the path as the recipe wrote it
    (the report shows that one, so it is the same wherever the corpus is built); a missing
    file is an error naming its recipe field."""
    resolved, names = [], set()
    for i, spec in enumerate(cfg["eval_sets"]):
        field = f"decontaminate.eval_sets[{i}]"
        if not isinstance(spec, dict) or any(k not in spec for k in ("name", "kind", "path")):
            raise EvalSetError(f"{field} must have name, kind and path; got {spec!r}")
        if spec["kind"] not in EVAL_KINDS:
            raise EvalSetError(f"{field}.kind is {spec['kind']!r}; expected one of {EVAL_KINDS}")
        if spec["name"] in names:
            raise EvalSetError(f"{field}.name {spec['name']!r} is used twice")
        names.add(spec["name"])
        raw = str(spec["path"])
        if raw.startswith(HOLDOUT_PREFIX):
            if holdout_dir is None:
                raise EvalSetError(f"{field}.path is {raw!r} but the recipe has no [holdout]")
            path = holdout_dir / raw[len(HOLDOUT_PREFIX) :]
            hint = " (the holdout stage writes it: run `megadata holdout` first)"
        else:
            path = Path(raw) if Path(raw).is_absolute() else recipe_dir / raw
            hint = ""
        if not path.is_file():
            raise EvalSetError(f"{field}.path: {path} does not exist{hint}")
        resolved.append(
            {"name": spec["name"], "kind": spec["kind"], "path": str(path), "as_given": raw}
        )
    return resolved


def read_eval_set(kind: str, path: Path) -> tuple[list[dict], dict]:
    """([{title, text}] units, problems): articles, passages, or the whole text."""
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    problems: dict = {}
    if kind == "wikitext":
        units = [{"title": t, "text": body} for t, body in split_articles(text)]
    elif kind == "lambada":
        units = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                problems["bad_lines"] = problems.get("bad_lines", 0) + 1
                log.warning("%s:%d: not a JSON object with a 'text' string; skipped", path, number)
                continue
            units.append({"title": "", "text": obj["text"]})
    else:
        units = [{"title": "", "text": text}]
    return [u for u in units if u["text"].strip()], problems


def prepare_eval_sets(eval_sets: list[dict], out_dir: str, cfg: dict) -> dict:
    """Read every evaluation set once into `eval_sets.json` (+ their Bloom filter if needed)."""
    out_dir = Path(out_dir)
    prepared, empty = [], 0
    for spec in eval_sets:
        units, problems = read_eval_set(spec["kind"], Path(spec["path"]))
        if not units:
            empty += 1
            log.warning(
                "evaluation set %r (%s) has no text; its overlap is reported as n/a",
                spec["name"],
                spec["path"],
            )
        prepared.append({**spec, "units": units, "problems": problems})
    if cfg["max_doc_overlap"] is not None:
        grams = {
            g for s in prepared for u in s["units"] for g in word_ngrams(u["text"], cfg["ngram"])
        }
        bloom = BloomFilter(max(1, len(grams)), cfg["fpr"], cfg["seed"], {"ngram": cfg["ngram"]})
        bloom.add_many(sorted(grams))
        bloom.save(out_dir / "eval_8grams.bloom")
    atomic_write_json(out_dir / "eval_sets.json", prepared)
    return {"extra": {"eval_sets": len(prepared), "empty_eval_sets": empty}}


def _article_index(prep_dir: str, n: int):
    path = Path(prep_dir) / "eval_sets.json"
    return _cached_article_index(str(path), path.stat().st_mtime_ns, n)


@functools.lru_cache(maxsize=2)
def _cached_article_index(path: str, _mtime_ns: int, n: int):
    """WikiText articles of the evaluation sets: their 8-grams, a reverse index, their titles.

    Built once per worker process (the cache key holds the file's mtime, so a changed file
    is read again) and used for every partition it removes documents from.
    """
    sets = json.loads(Path(path).read_text())
    articles, by_gram, by_title = [], {}, {}
    for s in sets:
        if s["kind"] != "wikitext":
            continue
        for unit in s["units"]:
            grams = word_ngrams(unit["text"], n)
            if not grams:
                continue
            a = len(articles)
            articles.append({"set": s["name"], "title": unit["title"], "grams": len(grams)})
            for g in grams:
                by_gram.setdefault(g, []).append(a)
            by_title.setdefault(normalise_title(unit["title"]), []).append(a)
    bloom_path = Path(path).with_name("eval_8grams.bloom")
    bloom = BloomFilter.load(bloom_path) if bloom_path.exists() else None
    return articles, by_gram, by_title, bloom


def contamination(doc: dict, grams: set[str], prep_dir: str, cfg: dict) -> dict | None:
    """Why `doc` (whose n-grams are `grams`) must leave the training set, or None.

    The answer is {reason, set, article, overlap}: overlap is the fraction of the article's
    n-grams found in the document ("title+content", "content"), or of the document's n-grams
    found in the evaluation sets ("doc_overlap").
    """
    articles, by_gram, by_title, eval_bloom = _article_index(prep_dir, cfg["ngram"])
    hits = Counter(a for g in grams for a in by_gram.get(g, ()))

    def share(a: int) -> float:
        return hits[a] / articles[a]["grams"]

    def found(reason: str, a: int) -> dict:
        article = articles[a]
        return {
            "reason": reason,
            "set": article["set"],
            "article": article["title"],
            "overlap": round(share(a), 4),
        }

    title = normalise_title(doc["title"])
    for a in by_title.get(title, []) if title else []:
        if share(a) > cfg["article_overlap"]:
            return found("title+content", a)
    if hits:
        best = max(hits, key=lambda a: (share(a), -a))
        if share(best) > cfg["copy_overlap"]:
            return found("content", best)
    if cfg["max_doc_overlap"] is not None and grams and eval_bloom is not None:
        in_eval = float(eval_bloom.contains_many(grams).mean())
        if in_eval > cfg["max_doc_overlap"]:
            return {
                "reason": "doc_overlap",
                "set": None,
                "article": None,
                "overlap": round(in_eval, 4),
            }
    return None


def remove_partition(in_path: str, out_path: str, prep_dir: str, cfg: dict) -> dict:
    docs = list(read_docs(Path(in_path)))
    kept, removed, train_ngrams = [], [], 0
    for doc in docs:
        grams = word_ngrams(doc["text"], cfg["ngram"])
        why = contamination(doc, grams, prep_dir, cfg)
        if why is None:
            kept.append(doc)
            train_ngrams += len(grams)
        else:
            removed.append({"doc_id": doc["doc_id"], "title": doc["title"], **why})
    write_docs(Path(out_path), kept, meta={"removed": removed})
    reasons = Counter(r["reason"] for r in removed)
    return {
        "docs_in": len(docs),
        "docs_out": len(kept),
        "bytes_in": text_bytes(docs),
        "bytes_out": text_bytes(kept),
        "extra": {
            "removed": len(removed),
            **{f"removed_{k.replace('+', '_and_')}": v for k, v in reasons.items()},
            "train_ngrams": train_ngrams,  # the train Bloom filter's capacity (an upper bound)
        },
    }


def set_overlap(bloom: BloomFilter, units: list[dict], n: int) -> dict:
    """Distinct n-grams of the units and how many of them the filter holds (percent or None)."""
    grams = sorted({g for u in units for g in word_ngrams(u["text"], n)})
    found = int(bloom.contains_many(grams).sum()) if grams else 0
    percent = round(100 * found / len(grams), 2) if grams else None
    return {"units": len(units), "ngrams": len(grams), "found": found, "overlap_percent": percent}


def build_train_bloom(parts: list[str], capacity: int, cfg: dict, progress: bool) -> BloomFilter:
    bloom = BloomFilter(max(1, capacity), cfg["fpr"], cfg["seed"], {"ngram": cfg["ngram"]})
    for part in tqdm(parts, desc="    bloom", unit="part", disable=not progress, leave=False):
        for doc in read_docs(Path(part)):
            bloom.add_many(word_ngrams(doc["text"], cfg["ngram"]))
    return bloom


def write_report(
    parts: list[str], prep_dir: str, reports: str, cfg: dict, removal: dict, progress: bool
) -> dict:
    reports = Path(reports)
    bloom = build_train_bloom(parts, removal["extra"].get("train_ngrams", 0), cfg, progress)
    bloom.save(reports / "train_8grams.bloom")
    sets = json.loads((Path(prep_dir) / "eval_sets.json").read_text())
    measured = []
    for s in sets:
        row = {"name": s["name"], "kind": s["kind"], "path": s["as_given"], **s["problems"]}
        row.update(set_overlap(bloom, s["units"], cfg["ngram"]))
        if row["overlap_percent"] is None:
            row["note"] = "no text (empty file or no 'text' fields): overlap n/a"
        measured.append(row)
    removed = [r for p in parts for r in read_meta(Path(p)).get("removed", [])]
    atomic_write_json(
        reports / "decontamination.json",
        {
            "ngram": cfg["ngram"],
            "order": "documents removed first; overlap measured on the remaining training corpus",
            "settings": {k: v for k, v in cfg.items() if k != "eval_sets"},
            "train": {
                "docs": removal["docs_out"],
                "bloom": "train_8grams.bloom",
                **{k: bloom.header()[k] for k in ("m", "k", "capacity", "fpr", "added")},
            },
            "eval_sets": measured,
            "counts": {
                "docs_in": removal["docs_in"],
                "docs_out": removal["docs_out"],
                "removed": Counter(r["reason"] for r in removed),
                "empty_eval_sets": sum(1 for r in measured if r["overlap_percent"] is None),
            },
            "removed": removed,
        },
    )
    return {
        **{k: removal[k] for k in ("docs_in", "docs_out", "bytes_in", "bytes_out")},
        "extra": {"removed": len(removed), "train_ngrams": bloom.added},
    }


def format_overlap_table(rows: list[dict]) -> str:
    head = f"{'eval set':<24}{'kind':<10}{'units':>8}{'8-grams':>10}{'found':>10}{'overlap %':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        pct = "n/a" if r["overlap_percent"] is None else f"{r['overlap_percent']:.2f}"
        lines.append(
            f"{r['name'][:23]:<24}{r['kind']:<10}{r['units']:>8}{r['ngrams']:>10}"
            f"{r['found']:>10}{pct:>11}"
        )
    return "\n".join(lines)


@click.command("overlap")
@click.option(
    "--bloom",
    "bloom_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="A Bloom filter saved by the decontaminate stage (reports/train_8grams.bloom).",
)
@click.option(
    "--eval",
    "evals",
    required=True,
    multiple=True,
    metavar="KIND:PATH",
    help=f"An evaluation file; KIND is one of {', '.join(EVAL_KINDS)}. Repeatable.",
)
@click.option(
    "--json", "json_out", type=click.Path(dir_okay=False), help="Also write the rows as JSON here."
)
def overlap_command(bloom_path, evals, json_out):
    """Percent of each evaluation file's 8-grams found in a saved training Bloom filter."""
    try:
        bloom = BloomFilter.load(bloom_path)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    n = int(bloom.meta.get("ngram", 8))
    rows = []
    for spec in evals:
        kind, sep, path = spec.partition(":")
        if not sep or kind not in EVAL_KINDS:
            raise click.BadParameter(
                f"{spec!r}: expected KIND:PATH with KIND in {EVAL_KINDS}", param_hint="--eval"
            )
        if not Path(path).is_file():
            raise click.BadParameter(f"{path} does not exist", param_hint="--eval")
        units, problems = read_eval_set(kind, Path(path))
        row = {"name": Path(path).name, "kind": kind, "path": path, **problems}
        row.update(set_overlap(bloom, units, n))
        if row["overlap_percent"] is None:
            log.warning("%s has no text: overlap n/a", path)
        rows.append(row)
    click.echo(format_overlap_table(rows))
    if json_out:
        atomic_write_json(Path(json_out), {"bloom": str(bloom_path), "ngram": n, "eval_sets": rows})
