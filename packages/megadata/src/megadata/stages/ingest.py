"""Ingest: raw files of a source -> document partitions.

Formats (`kind` of a source in the recipe):
- `text`: plain text; `split` = "file" (one document per file), "line" (one per
  line) or "paragraph" (separated by blank lines);
- `jsonl`: one JSON object per line with `text` and optionally `url`, `title`, `source`;
- `html`: web pages; the article text and title are extracted with newspaper3k;
- `wikipedia`: a MediaWiki XML dump (.xml or .xml.bz2), articles only (namespace
  0, no redirects), wiki markup stripped with mwparserfromhell: templates, tables,
  references, file/image links with their captions, category and interlanguage
  links, headings of sections left empty and the parentheses they leave empty
  (`Paris (; born ...)`) are removed (most of them by a scan before the parser:
  megadata.sources.wiki_prestrip).

The readers are megadata.sources' modules, one per kind; this module reads a file (or a
piece of it) with its kind's reader and writes the documents as partitions.

A file over its source's `split_mb` is read as pieces, a task each, where its format allows
(megadata.file_pieces): the same documents, ids and problems as the file whole.

Bad input never stops the run and never lands in the corpus mangled. What is
skipped (a line or file that is not UTF-8, a line that is not JSON, is nested too
deeply or has no text, a document over `max_doc_bytes`, an empty file, a page the
XML or wiki parser rejects, a compressed file cut short: the documents before it
are kept) and what is repaired (NUL characters and lone UTF-16 surrogates removed,
a UTF-8 byte-order mark dropped silently) is counted by kind in the stage's
statistics, named with file and line in a warning (the first `WARNINGS_PER_FILE` of
a file) and listed in full, one JSON line each, in `<stage dir>/_problems/<task>.jsonl`.
A document is never cut: over `max_doc_bytes` (a source option, 16 MiB by default)
it is skipped whole, and a line that long is read past in chunks, never held.
"""

import gzip
import json
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path

from megacommon.files import atomic_write_bytes
from megadata.documents import text_bytes, write_docs
from megadata.file_pieces import Piece
from megadata.settings import load
from megadata.sources.html import read_html
from megadata.sources.jsonl import read_jsonl
from megadata.sources.options import SourceOptions
from megadata.sources.problems import PROBLEMS_DIR, WARNINGS_PER_FILE, Notes
from megadata.sources.text import read_text
from megadata.sources.wikipedia import read_wikipedia

# The stage's API: the readers it dispatches to, and the names of its problem reports.
__all__ = [
    "PROBLEMS_DIR",
    "WARNINGS_PER_FILE",
    "ingest_file",
    "read_html",
    "read_jsonl",
    "read_source_file",
    "read_text",
    "read_wikipedia",
]


def read_source_file(
    kind: str,
    path: Path,
    options: SourceOptions,
    problems: dict,
    listed: list | None = None,
    piece: Piece | None = None,
) -> Iterator[dict]:
    """The documents of a file (of its `piece`: megadata.file_pieces); a document's
    "_key", when it has one, names it within the file (ingest_file makes it the doc_id)."""
    options = load(SourceOptions, options, "source")
    limits = {"max_doc_bytes": options.max_doc_bytes, "listed": listed}
    if kind == "text":
        return read_text(path, options.split, problems, **limits, piece=piece)
    if kind == "jsonl":
        return read_jsonl(path, problems, **limits, piece=piece)
    if kind == "html":
        return read_html(path, problems, **limits)
    if kind == "wikipedia":
        return read_wikipedia(path, problems, **limits, piece=piece)
    raise ValueError(f"unknown source kind {kind!r}: expected text, jsonl, html or wikipedia")


def _cut_short(e: BaseException, path: Path) -> bool:
    """A compressed file that ends early or is corrupt (not an I/O error of the disk)."""
    if isinstance(e, EOFError | gzip.BadGzipFile | zlib.error | lzma.LZMAError):
        return True
    return isinstance(e, OSError) and e.errno is None and path.suffix in (".bz2", ".gz")


def ingest_file(
    source: str,
    kind: str,
    options: SourceOptions,
    path: str,
    file_index: int,
    out_dir: str,
    partition_docs: int,
    piece: Piece | None = None,
) -> dict:
    """One input file (or a `piece` of it: megadata.file_pieces) -> partitions
    `<name>-<part>.arrow`, `partition_docs` each, and its problems listed in
    `_problems/<name>.jsonl` (when it has any); the name is `<source>-<file index>`, and
    `-p<piece index>` after it for a piece."""
    path, out_dir = Path(path), Path(out_dir)
    name = f"{source}-{file_index:05d}" + (f"-p{piece.index:04d}" if piece is not None else "")
    problems: dict = {}
    listed: list = []
    note = Notes(path, problems, listed)
    docs_in_bytes = path.stat().st_size if piece is None else piece.end - piece.start
    if docs_in_bytes == 0 and piece is None:
        note("empty_files", None, "empty file", "nothing to ingest")
    batch, part, n, out_bytes = [], 0, 0, 0

    def flush():
        nonlocal batch, part, out_bytes
        write_docs(out_dir / f"{name}-{part:04d}.arrow", batch)
        out_bytes += text_bytes(batch)
        batch, part = [], part + 1

    docs = read_source_file(kind, path, options, problems, listed, piece) if docs_in_bytes else ()
    try:
        for doc in docs:
            key = doc.pop("_key", None) or (f"{piece.index}.{n}" if piece else str(n))
            doc["doc_id"] = f"{source}/{path.name}#{key}"
            doc["source"] = source
            batch.append(doc)
            n += 1
            if len(batch) == partition_docs:
                flush()
    except Exception as e:
        if not _cut_short(e, path):
            raise
        note("cut_short", None, f"compressed file cut short or corrupt ({e})", "rest skipped")
    if batch or part == 0:
        flush()
    report = out_dir / PROBLEMS_DIR / f"{name}.jsonl"
    if listed:
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in listed)
        atomic_write_bytes(report, lines.encode("utf-8", errors="backslashreplace"))
    else:
        report.unlink(missing_ok=True)
    return {
        "docs_in": n,
        "docs_out": n,
        "bytes_in": docs_in_bytes,
        "bytes_out": out_bytes,
        "extra": problems,
    }
