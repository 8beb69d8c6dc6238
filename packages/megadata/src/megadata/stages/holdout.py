"""Holdout: keep some real documents out of training and make evaluation files of them.

1. `split_partition` (per partition, in workers): a document is held out when the sha256 of
   "holdout:" + its doc_id falls in 1 of `every` buckets (and, with `sources`, it comes from
   one of them).  The salt keeps the choice independent of the shard stage's train/valid
   split, which hashes the bare id.  Held-out documents leave the partitions passed on, so
   they reach neither train/ nor valid/.  The held-out documents are also formatted there
   (`format_held`: WikiText article, LAMBADA passages), the costly part, in parallel.
2. `write_eval_files` (one process) joins the formatted pieces under `<corpus>/eval/`:
   - `wiki.test.tokens`: every held-out document as an article in WikiText-103's raw format
     (megadata.wikitext_format), for a perplexity evaluation like the paper's;
   - `lambada.jsonl`: LAMBADA-style passages, `{"text": ...}` a line: runs of whole sentences
     of `lambada_min_words`..`lambada_max_words` words, cut so that the passage ends with a
     plain alphabetic word (LAMBADA's target is the passage's last word; closing punctuation
     after it is dropped, as in LAMBADA), at most `lambada_per_doc` per document;
   - `holdout.json`: the held-out doc ids and the counts.
   Documents go in partition order, so a rerun writes the same bytes.

`documents.link_partition` is what this stage (and decontaminate) does when its recipe
section is absent: the partitions are hard-linked (copied where links cannot be made)
unchanged.
"""

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np

from megacommon.files import atomic_write_bytes, atomic_writer
from megadata.documents import read_docs, read_table, text_bytes, write_kept
from megadata.encode import DEFAULT_SPLITTER, split_sentences
from megadata.settings import Check, PositiveInt, load
from megadata.wikitext_format import format_article, paragraphs, title_from_text

LARGE_EVAL_BYTES = 1 << 30  # held-out text past which a warning says to hold out less
log = logging.getLogger("megadata.holdout")
_TARGET = re.compile(r"[A-Za-z]+")
_TRAILING = re.compile(r"\W+$")
_LEADING = re.compile(r"^[^\w\"'(]+")  # stray markup before a passage's first sentence


@dataclass(frozen=True)
class HoldoutSettings:
    """The recipe's `[holdout]` section."""

    every: PositiveInt = 40  # 1 in `every` documents is held out
    sources: Annotated[list[str], Check("a list of source names")] = field(
        default_factory=list
    )  # only documents of these sources (empty: of all)
    lambada_per_doc: PositiveInt = 10
    lambada_min_words: PositiveInt = 60
    lambada_max_words: PositiveInt = 120

    def __post_init__(self):
        if self.every < 2:
            raise ValueError("[holdout] every must be >= 2 (1 would hold out everything)")
        if self.lambada_min_words > self.lambada_max_words:
            raise ValueError("[holdout] lambada_min_words must not exceed lambada_max_words")


def settings(section) -> HoldoutSettings:
    """The `[holdout]` section (a table) with defaults filled in; a bad value names its field."""
    return load(HoldoutSettings, section, "[holdout]")


def is_held_out(doc_id: str, every: int) -> bool:
    digest = hashlib.sha256(b"holdout:" + doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % every == 0


def _counts(docs_in: list[dict], docs_out: list[dict], extra: dict | None = None) -> dict:
    return {
        "docs_in": len(docs_in),
        "docs_out": len(docs_out),
        "bytes_in": text_bytes(docs_in),
        "bytes_out": text_bytes(docs_out),
        "extra": extra or {},
    }


def split_partition(
    in_path: str,
    out_path: str,
    held_path: str,
    every: int,
    sources: list[str],
    formatted_path: str | None = None,
    cfg: HoldoutSettings | None = None,
    splitter: str = DEFAULT_SPLITTER,
) -> dict:
    """The partition less its held-out documents, and those documents; with
    `formatted_path`, also their evaluation-file pieces (`format_held`): formatting is the
    costly part of the evaluation files, so it runs here, in parallel over the partitions."""
    table = read_table(Path(in_path))
    docs = table.to_pylist()
    out = np.array(
        [(not sources or d["source"] in sources) and is_held_out(d["doc_id"], every) for d in docs],
        dtype=bool,
    )
    held = [d for d, o in zip(docs, out.tolist(), strict=True) if o]
    kept = [d for d, o in zip(docs, out.tolist(), strict=True) if not o]
    if formatted_path is not None:
        rows = format_held(held, cfg, splitter)
        atomic_write_bytes(Path(formatted_path), json.dumps(rows, ensure_ascii=False).encode())
    write_kept(Path(held_path), table, out)  # first: the partition passed on marks the task as done
    write_kept(Path(out_path), table, ~out)
    return _counts(docs, kept, {"held_out": len(held)})


def format_held(
    docs: list[dict], cfg: HoldoutSettings, splitter: str = DEFAULT_SPLITTER
) -> list[dict]:
    """Each held-out document as its WikiText article and LAMBADA passages, with the
    figures holdout.json lists."""
    rows = []
    for doc in docs:
        title = doc["title"].strip() or title_from_text(doc["text"])
        article = format_article(title, doc["text"])
        passages = lambada_passages(
            doc["text"],
            cfg.lambada_min_words,
            cfg.lambada_max_words,
            cfg.lambada_per_doc,
            splitter,
        )
        rows.append(
            {
                "article": article,
                "passages": passages,
                "listed": {
                    "doc_id": doc["doc_id"],
                    "title": title,
                    "words": len(doc["text"].split()),
                    "wikitext_tokens": len(article.split()),
                    "lambada_passages": len(passages),
                },
            }
        )
    return rows


def lambada_passages(
    text: str, min_words: int, max_words: int, limit: int, splitter: str = DEFAULT_SPLITTER
) -> list[str]:
    """Passages of whole sentences, min_words..max_words words, ending in an alphabetic word
    (sentences by the recipe's `sentence_splitter`: megadata.encode)."""
    sentences = [
        s for kind, line in paragraphs(text) if kind == "paragraph"
        for s in split_sentences(line, splitter)
    ]  # fmt: skip
    passages: list[str] = []
    window: list[str] = []
    for sentence in sentences:
        window.append(sentence)
        while sum(len(s.split()) for s in window) > max_words:
            window.pop(0)
        words = sum(len(s.split()) for s in window)
        if words < min_words:
            continue
        passage = _TRAILING.sub("", _LEADING.sub("", " ".join(" ".join(window).split())))
        last = passage.rsplit(" ", 1)[-1]
        if _TARGET.fullmatch(last) and len(passage.split()) >= min_words:
            passages.append(passage)
            window = []
            if len(passages) == limit:
                break
    return passages


def write_eval_files(
    formatted_parts: list[str], eval_dir: str, cfg: HoldoutSettings, split: dict, splitter: str
) -> dict:
    """wiki.test.tokens, lambada.jsonl and holdout.json from the held-out documents as
    `split_partition` formatted them (NAME.eval.json beside NAME.arrow), partition after
    partition; a partition split by an earlier megadata, which formatted nothing, is
    formatted here.  The files are written as the partitions are read: memory holds one
    partition's pieces (and each held-out document's line of holdout.json)."""
    eval_dir = Path(eval_dir)
    counts = dict.fromkeys(("held_out", "wikitext_articles", "wikitext_tokens"), 0)
    counts["lambada_passages"] = 0
    listed, text_bytes_out = [], 0
    with (
        atomic_writer(eval_dir / "wiki.test.tokens") as wiki,
        atomic_writer(eval_dir / "lambada.jsonl") as lambada,
    ):
        for p in map(Path, formatted_parts):
            if p.exists():
                rows = json.loads(p.read_text())
            else:
                held = p.with_name(p.name.removesuffix(".eval.json") + ".arrow")
                rows = format_held(list(read_docs(held)), cfg, splitter)
            for r in rows:
                article = r["article"].encode("utf-8")
                wiki.write(article)
                text_bytes_out += len(article)
                counts["held_out"] += 1
                counts["wikitext_articles"] += bool(r["article"])
                counts["wikitext_tokens"] += len(r["article"].split())
                for t in r["passages"]:
                    lambada.write((json.dumps({"text": t}, ensure_ascii=False) + "\n").encode())
                counts["lambada_passages"] += len(r["passages"])
                listed.append(r["listed"])
    if text_bytes_out > LARGE_EVAL_BYTES:
        log.warning(
            "holdout: %d MB of held-out text in %s; decontamination indexes the evaluation "
            "sets' 8-grams in every worker's memory (about 25 bytes a word): raise [holdout] "
            "every (now %d) for a corpus this large",
            text_bytes_out // 10**6, eval_dir / "wiki.test.tokens", cfg.every,
        )  # fmt: skip
    summary = {
        "every": cfg.every,
        "sources": cfg.sources,
        "by": 'sha256("holdout:" + doc_id)',
        "counts": {"docs_in": split["docs_in"], **counts},
        "files": ["wiki.test.tokens", "lambada.jsonl"],
        "docs": listed,
    }
    atomic_write_bytes(
        eval_dir / "holdout.json", (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode()
    )
    return {
        "docs_in": split["docs_in"],
        "docs_out": split["docs_out"],
        "bytes_in": split["bytes_in"],
        "bytes_out": split["bytes_out"],
        "extra": {
            "held_out": counts["held_out"],
            "lambada_passages": counts["lambada_passages"],
            "wikitext_tokens": counts["wikitext_tokens"],
        },
    }
