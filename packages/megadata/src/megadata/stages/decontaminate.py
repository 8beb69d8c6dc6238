"""Decontaminate: remove test articles from the training documents, measure 8-gram overlap.

What the paper did: WikiText-103 test articles were removed from the training data, and the
overlap of each test set with the training corpus was measured as the fraction of its
8-grams found in a Bloom filter of the training set's 8-grams at a false-positive rate of
1e-3.  Here the overlap is counted exactly (the filter's numbers exceed it by the filter's
false positives, tested) and the filter is built only when asked for.  An n-gram here is
8 lower-cased words, a word being a run of letters and digits (`\\w+` without the
underscore, which Moses splits off: `add_argument` is `add _ argument` in WikiText).
`word_ngrams` (and its hashed twin `ngrams.ngram_hashes`) is the one helper for training and
evaluation text, so the WikiText marks `@-@`, `@,@`, `@.@` and its spaced punctuation vanish
exactly as they do in plain text.
Percentages count distinct 8-grams.

The evaluation sets are the recipe's `eval_sets = [{name, kind, path}, ...]`, kind one of
- `wikitext`: a file in WikiText-103's format, split into articles at its ` = Title = ` lines;
- `lambada`: JSON lines with a `text` field, one passage a line;
- `text`: a plain text file, one unit.
A path is relative to the recipe file; `@holdout/NAME` names a file the holdout stage wrote
under `<corpus>/eval/` (`@holdout/wiki.test.tokens`, `@holdout/lambada.jsonl`).

1. `prepare_eval_sets` (one process) reads the sets into `eval_sets.json` (an empty file, or
   one with no text, is counted and reported with overlap n/a, never fatal) and indexes
   their distinct n-grams (megadata.ngrams: 64-bit hashes, each set's share of them and the
   WikiText articles'), a size set by the evaluation sets alone.
2. `remove_partition` (per partition, in workers) removes a training document when
   - its normalised title (its lower-cased words) equals a WikiText article's and more than
     `article_overlap` (0.5) of that article's 8-grams are in it ("title+content"), or
   - more than `copy_overlap` (0.8) of some article's 8-grams are in it, whatever its title
     ("content"), or
   - `max_doc_overlap` is set and more than that fraction of its own 8-grams are in the
     evaluation sets ("doc_overlap").
   The reasons ride in each output partition's metadata.  The same task writes which of
   the evaluation n-grams the documents it kept hold (`found`), and, with `train_bloom`, the
   digests of their n-grams, grouped by the shard of the training filter that holds them.
3. With `train_bloom`: `build_bloom_shard` (one task per shard, in workers) builds shard k
   of the training Bloom filter from its digests alone, sized for them (so the
   false-positive rate is at most the target), as `reports/train_8grams/shard-K-of-S.bloom`:
   no process holds more than one shard.
4. `write_report` (one process) merges the partitions' `found` into one array the size of
   the evaluation sets: each set's exact overlap (distinct n-grams found over its distinct
   n-grams), and by the filter too when there is one; `reports/decontamination.json`.
   Because removal comes first, the reported overlap is that of the final training corpus.

`megadata overlap --bloom DIR|FILE --eval KIND:PATH` measures any file against a saved filter.
"""

import functools
import json
import logging
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import click
import numpy as np
import pyarrow as pa

from megacommon.errors import CommandError
from megacommon.files import atomic_write_json
from megadata.bloom import SHARD_FILE, BloomFilter, contains_sharded, shard_files, shard_of
from megadata.documents import read_meta, read_table, text_bytes, write_kept, write_table
from megadata.ngrams import EvalIndex, build_index, ngram_hashes, sorted_distinct
from megadata.settings import Check, Fraction, PositiveInt, load
from megadata.shuffle import read_shuffled, write_shuffled
from megadata.wikitext_format import split_articles

log = logging.getLogger("megadata.decontaminate")

EVAL_KINDS = ("wikitext", "lambada", "text")
HOLDOUT_PREFIX = "@holdout/"
_WORD = re.compile(r"[^\W_]+")  # \w+ less "_": Moses splits add_argument as add _ argument


class EvalSetError(ValueError):
    pass


def word_ngrams(text: str, n: int = 8) -> set[str]:
    """Distinct n-grams of lower-cased words (none for a text of fewer than n words)."""
    words = _WORD.findall(text.lower())
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def normalise_title(title: str) -> str:
    return " ".join(_WORD.findall(title.lower()))


@dataclass(frozen=True)
class DecontaminateSettings:
    """The recipe's `[decontaminate]` section."""

    eval_sets: Annotated[list, Check("a list of {name, kind, path} tables")] = field(
        default_factory=list
    )
    ngram: PositiveInt = 8
    fpr: float = 1e-3
    seed: int = 0
    article_overlap: Fraction = 0.5
    copy_overlap: Fraction = 0.8
    max_doc_overlap: Fraction | None = None
    train_bloom: bool = False  # also build the reusable Bloom filter of the training 8-grams
    bloom_shards: PositiveInt = 8  # its shards, one file and one task each


def settings(section) -> DecontaminateSettings:
    """The `[decontaminate]` section (a table) with defaults filled in; a bad value names its
    field."""
    return load(DecontaminateSettings, section, "[decontaminate]")


def resolve_eval_sets(
    cfg: DecontaminateSettings, recipe_dir: Path, holdout_dir: Path | None
) -> list[dict]:
    """[{name, kind, path, as_given}]: the file to read and the path as the recipe wrote it
    (the report shows that one, so it is the same wherever the corpus is built); a missing
    file is an error naming its recipe field."""
    resolved, names = [], set()
    for i, spec in enumerate(cfg.eval_sets):
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


def prepare_eval_sets(eval_sets: list[dict], out_dir: str, cfg: DecontaminateSettings) -> dict:
    """Read every evaluation set once into `eval_sets.json` and index its n-grams
    (`eval_index.npz`, `eval_articles.json`: megadata.ngrams)."""
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
    index, articles = build_index(prepared, cfg.ngram)
    index.save(out_dir / "eval_index.npz")
    atomic_write_json(out_dir / "eval_articles.json", articles)
    atomic_write_json(out_dir / "eval_sets.json", prepared)
    return {"extra": {"eval_sets": len(prepared), "empty_eval_sets": empty}}


def _eval_index(prep_dir: str):
    path = Path(prep_dir) / "eval_index.npz"
    return _cached_eval_index(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_eval_index(path: str, _mtime_ns: int):
    """The evaluation sets' n-gram index, their WikiText articles, those by title, and each
    article's number of n-grams.

    Loaded once per worker process (the cache key holds the file's mtime, so a changed file
    is read again) and used for every partition it removes documents from."""
    index = EvalIndex.load(Path(path))
    articles = json.loads(Path(path).with_name("eval_articles.json").read_text())
    by_title: dict[str, list[int]] = {}
    for a, article in enumerate(articles):
        by_title.setdefault(normalise_title(article["title"]), []).append(a)
    grams = np.array([a["grams"] for a in articles], dtype=np.float64)  # each article's n-grams
    return index, articles, by_title, grams


def contamination(
    doc: dict,
    hashes: np.ndarray,
    prep_dir: str,
    cfg: DecontaminateSettings,
    in_eval: np.ndarray | None = None,
) -> dict | None:
    """Why `doc` (whose distinct n-gram hashes are `hashes`) must leave the training set,
    or None.

    The answer is {reason, set, article, overlap}: overlap is the fraction of the article's
    n-grams found in the document ("title+content", "content"), or of the document's n-grams
    found in the evaluation sets ("doc_overlap").
    """
    index, articles, by_title, grams = _eval_index(prep_dir)
    in_eval = index.found(hashes) if in_eval is None else in_eval  # positions in the index
    if not len(in_eval):  # no n-gram of any evaluation set: no rule can apply
        return None
    hits = index.article_hits(in_eval, len(articles))

    def share(a: int) -> float:
        return int(hits[a]) / articles[a]["grams"]

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
        if share(a) > cfg.article_overlap:
            return found("title+content", a)
    if hits.any():
        shares = hits / grams
        best = int(np.argmax(shares))  # the first of the highest, as before
        if share(best) > cfg.copy_overlap:
            return found("content", best)
    if cfg.max_doc_overlap is not None and len(hashes):
        share_in_eval = len(in_eval) / len(hashes)
        if share_in_eval > cfg.max_doc_overlap:
            return {
                "reason": "doc_overlap",
                "set": None,
                "article": None,
                "overlap": round(share_in_eval, 4),
            }
    return None


def remove_partition(
    in_path: str,
    out_path: str,
    prep_dir: str,
    cfg: DecontaminateSettings,
    found_path: str | None = None,
    digests_path: str | None = None,
) -> dict:
    """Remove the contaminated documents of a partition; write to `found_path` which of the
    evaluation n-grams (positions in the index) the documents kept hold, and, to build the
    training Bloom filter, the digests of their n-grams routed to its shards."""
    table = read_table(Path(in_path))
    docs = table.to_pylist()
    index = _eval_index(prep_dir)[0]
    kept, removed, found, train_ngrams = [], [], [], 0
    for doc in docs:
        hashes = ngram_hashes(doc["text"], cfg.ngram)
        in_eval = index.found(hashes)
        why = contamination(doc, hashes, prep_dir, cfg, in_eval)
        if why is None:
            kept.append(doc)
            train_ngrams += len(hashes)
            found.append(in_eval)
        else:
            removed.append({"doc_id": doc["doc_id"], "title": doc["title"], **why})
    gone = {r["doc_id"] for r in removed}
    keep = [d["doc_id"] not in gone for d in docs]
    write_kept(Path(out_path), table, keep, meta={"removed": removed})
    if found_path is not None:
        rows = sorted_distinct(np.concatenate([np.zeros(0, np.int64), *found]))
        write_table(Path(found_path), pa.table({"row": pa.array(rows, pa.int64())}))
    if digests_path is not None:
        _write_digests(kept, digests_path, cfg)
    reasons = Counter(r["reason"] for r in removed)
    return {
        "docs_in": len(docs),
        "docs_out": len(kept),
        "bytes_in": text_bytes(docs),
        "bytes_out": text_bytes(kept),
        "extra": {
            "removed": len(removed),
            **{f"removed_{k.replace('+', '_and_')}": v for k, v in reasons.items()},
            "train_ngrams": train_ngrams,  # per-document distinct n-grams, summed
        },
    }


def _train_bloom(cfg: DecontaminateSettings) -> BloomFilter:
    """A filter that only hashes: every shard's filter uses the same seed, so the same
    digests."""
    return BloomFilter(1, cfg.fpr, cfg.seed)


def _write_digests(docs: list[dict], path: str, cfg: DecontaminateSettings) -> None:
    """The map side of the sharded training filter: each document's distinct n-grams as
    digests, grouped by the shard that holds them."""
    grams = [g.encode() for d in docs for g in word_ngrams(d["text"], cfg.ngram)]
    h = _train_bloom(cfg).digests(grams) if grams else np.zeros((0, 2), np.uint64)
    shards = cfg.bloom_shards
    columns = {"h1": pa.array(h[:, 0], pa.uint64()), "h2": pa.array(h[:, 1], pa.uint64())}
    write_shuffled(path, columns, shard_of(h, shards).astype(np.int64), shards)


def build_bloom_shard(
    digest_paths: list[str], shard: int, out_dir: str, cfg: DecontaminateSettings
) -> dict:
    """The reduce side: shard `shard` of the training filter from its digests alone, sized
    for them, saved as one file."""
    shards = cfg.bloom_shards
    table = read_shuffled(digest_paths, shard, shards)
    h = np.column_stack(
        [table.column(c).to_numpy().astype(np.uint64) for c in ("h1", "h2")]
    ).reshape(-1, 2)
    meta = {"ngram": cfg.ngram, "shard": shard, "shards": shards}
    bloom = BloomFilter(max(1, len(h)), cfg.fpr, cfg.seed, meta)
    bloom.add_digests(h)
    bloom.save(Path(out_dir) / SHARD_FILE.format(shard=shard, shards=shards))
    return {"extra": {"added": len(h)}}


def set_overlap(bloom: BloomFilter | str | Path, units: list[dict], n: int) -> dict:
    """Distinct n-grams of the units and how many of them the filter holds (percent or None).
    `bloom` is a filter, or the path of a filter file or of a directory of its shards."""
    grams = sorted({g for u in units for g in word_ngrams(u["text"], n)})
    if isinstance(bloom, BloomFilter):
        hits = bloom.contains_many(grams) if grams else np.zeros(0, dtype=bool)
    else:
        hits = contains_sharded(bloom, grams)[0]
    found = int(hits.sum())
    percent = round(100 * found / len(grams), 2) if grams else None
    return {"units": len(units), "ngrams": len(grams), "found": found, "overlap_percent": percent}


def write_report(
    parts: list[str],
    prep_dir: str,
    reports: str,
    cfg: DecontaminateSettings,
    removal: dict,
    found_paths: list[str],
    bloom_dir: str | None = None,
) -> dict:
    """Each evaluation set's overlap with the training corpus left after removal: exact,
    from the per-partition found n-grams (merged here into one array the size of the
    evaluation sets), and, when the training filter was built, by that filter too."""
    reports = Path(reports)
    index = _eval_index(prep_dir)[0]
    seen = np.zeros(len(index.hashes), dtype=bool)
    for path in found_paths:
        seen[read_table(Path(path)).column("row").to_numpy()] = True
    sets = json.loads((Path(prep_dir) / "eval_sets.json").read_text())
    measured = []
    for s in sets:
        rows = index.set_rows[s["name"]]
        found = int(seen[rows].sum())
        row = {"name": s["name"], "kind": s["kind"], "path": s["as_given"], **s["problems"]}
        row.update(units=len(s["units"]), ngrams=len(rows), found=found)
        row["overlap_percent"] = round(100 * found / len(rows), 2) if len(rows) else None
        if bloom_dir is not None:
            by_bloom = set_overlap(bloom_dir, s["units"], cfg.ngram)
            row["bloom_found"] = by_bloom["found"]
            row["bloom_overlap_percent"] = by_bloom["overlap_percent"]
        if row["overlap_percent"] is None:
            row["note"] = "no text (empty file or no 'text' fields): overlap n/a"
        measured.append(row)
    train = {"docs": removal["docs_out"], "ngrams": removal["extra"].get("train_ngrams", 0)}
    if bloom_dir is not None:
        _, totals = contains_sharded(bloom_dir, [])
        name = Path(bloom_dir).relative_to(reports).as_posix() + "/"
        train.update(bloom=name, **{k: totals[k] for k in ("shards", "m", "capacity", "added")})
        train["fpr"] = cfg.fpr
    removed = [r for p in parts for r in read_meta(Path(p)).get("removed", [])]
    atomic_write_json(
        reports / "decontamination.json",
        {
            "ngram": cfg.ngram,
            "order": "documents removed first; overlap measured on the remaining training corpus",
            "method": "exact: distinct n-grams of each evaluation set found in the training "
            "documents (64-bit n-gram hashes)"
            + ("; bloom_*: the same by the training Bloom filter" if bloom_dir else ""),
            "settings": {k: v for k, v in asdict(cfg).items() if k != "eval_sets"},
            "train": train,
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
        "extra": {"removed": len(removed), "train_ngrams": train["ngrams"]},
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
    type=click.Path(),
    help="A training Bloom filter saved by the decontaminate stage: the directory of its "
    "shards (reports/train_8grams/) or one filter file.",
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
        first = BloomFilter.load(shard_files(bloom_path)[0])
    except ValueError as e:
        raise CommandError(str(e)) from None
    n = int(first.meta.get("ngram", 8))
    del first
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
        try:
            row.update(set_overlap(bloom_path, units, n))
        except ValueError as e:
            raise CommandError(str(e)) from None
        if row["overlap_percent"] is None:
            log.warning("%s has no text: overlap n/a", path)
        rows.append(row)
    click.echo(format_overlap_table(rows))
    if json_out:
        atomic_write_json(Path(json_out), {"bloom": str(bloom_path), "ngram": n, "eval_sets": rows})
