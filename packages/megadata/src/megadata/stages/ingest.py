"""Ingest: raw files of a source -> document partitions.

Formats (`kind` of a source in the recipe):
- `text`: plain text; `split` = "file" (one document per file), "line" (one per
  line) or "paragraph" (separated by blank lines);
- `jsonl`: one JSON object per line with `text` and optionally `url`, `title`, `source`;
- `html`: web pages; the article text and title are extracted with newspaper3k;
- `wikipedia`: a MediaWiki XML dump (.xml or .xml.bz2), articles only (namespace
  0, no redirects), wiki markup stripped with mwparserfromhell.

Bad input never stops the run: bytes that are not UTF-8 are replaced, an empty
file, a line that is not JSON or has no text are skipped; each is counted and
named (file and line) in a warning.
"""

import bz2
import gzip
import json
import logging
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

from megadata.documents import text_bytes, write_docs

log = logging.getLogger("megadata.ingest")


def _open_binary(path: Path):
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _decode(data: bytes, path: Path, problems: dict) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        problems["not_utf8"] = problems.get("not_utf8", 0) + 1
        log.warning("%s: not UTF-8 (%s); undecodable bytes replaced with U+FFFD", path, e.reason)
        return data.decode("utf-8", errors="replace")


def read_text(path: Path, split: str, problems: dict) -> Iterator[dict]:
    with _open_binary(path) as f:
        text = _decode(f.read(), path, problems)
    if split == "file":
        pieces = [text]
    elif split == "line":
        pieces = text.splitlines()
    elif split == "paragraph":
        pieces = text.replace("\r\n", "\n").split("\n\n")
    else:
        raise ValueError(f"source {path}: split must be file, line or paragraph, got {split!r}")
    for piece in pieces:
        if piece.strip():
            yield {"text": piece.strip()}


def read_jsonl(path: Path, problems: dict) -> Iterator[dict]:
    with _open_binary(path) as f:
        for number, raw in enumerate(f, 1):
            line = _decode(raw, path, problems).strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                problems["bad_json"] = problems.get("bad_json", 0) + 1
                log.warning("%s:%d: not JSON (%s); line skipped", path, number, e.msg)
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                problems["no_text"] = problems.get("no_text", 0) + 1
                log.warning("%s:%d: no 'text' string field; line skipped", path, number)
                continue
            yield {k: str(obj.get(k) or "") for k in ("text", "url", "title", "source")}


def extract_html(html: str, url: str = "") -> dict:
    """Article text and title of a web page, by newspaper3k (no network: the HTML is given)."""
    from newspaper import Article, Config  # imports lxml and nltk: only when HTML is ingested

    config = Config()
    config.fetch_images = False  # parse() would otherwise download the page's images
    article = Article(url or "http://localhost/", config=config)
    article.set_html(html)
    article.parse()
    return {"text": article.text, "title": article.title or "", "url": url}


def read_html(path: Path, problems: dict) -> Iterator[dict]:
    with _open_binary(path) as f:
        html = _decode(f.read(), path, problems)
    doc = extract_html(html)
    if doc["text"].strip():
        yield doc
    else:
        problems["no_article_text"] = problems.get("no_article_text", 0) + 1
        log.warning("%s: no article text found in the HTML; skipped", path)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def read_wikipedia(path: Path, problems: dict) -> Iterator[dict]:
    import mwparserfromhell

    with _open_binary(path) as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if _local(elem.tag) != "page":
                continue
            fields = {_local(c.tag): c for c in elem}
            ns = fields.get("ns")
            title = (fields["title"].text or "") if "title" in fields else ""
            page_id = (fields["id"].text or "") if "id" in fields else ""
            revision = fields.get("revision")
            text_el = None
            if revision is not None:
                text_el = next((c for c in revision if _local(c.tag) == "text"), None)
            wikitext = text_el.text if text_el is not None else None
            elem.clear()
            if (ns is not None and ns.text != "0") or "redirect" in fields or not wikitext:
                continue
            text = mwparserfromhell.parse(wikitext).strip_code(normalize=True, collapse=True)
            text = "\n".join(line.strip() for line in text.splitlines())
            yield {
                "text": text.strip(),
                "title": title,
                "url": f"https://en.wikipedia.org/wiki?curid={page_id}",
                "wiki_id": page_id,
            }


def read_source_file(kind: str, path: Path, options: dict, problems: dict) -> Iterator[dict]:
    if kind == "text":
        return read_text(path, options.get("split", "file"), problems)
    if kind == "jsonl":
        return read_jsonl(path, problems)
    if kind == "html":
        return read_html(path, problems)
    if kind == "wikipedia":
        return read_wikipedia(path, problems)
    raise ValueError(f"unknown source kind {kind!r}: expected text, jsonl, html or wikipedia")


def ingest_file(
    source: str,
    kind: str,
    options: dict,
    path: str,
    file_index: int,
    out_dir: str,
    partition_docs: int,
) -> dict:
    """One input file -> partitions `<source>-<file index>-<part>.arrow`, `partition_docs` each."""
    path, out_dir = Path(path), Path(out_dir)
    problems: dict = {}
    docs_in_bytes = path.stat().st_size
    if docs_in_bytes == 0:
        problems["empty_files"] = 1
        log.warning("%s: empty file; nothing to ingest", path)
    batch, part, n, out_bytes = [], 0, 0, 0

    def flush():
        nonlocal batch, part, out_bytes
        write_docs(out_dir / f"{source}-{file_index:05d}-{part:04d}.arrow", batch)
        out_bytes += text_bytes(batch)
        batch, part = [], part + 1

    for doc in read_source_file(kind, path, options, problems) if docs_in_bytes else ():
        key = doc.pop("wiki_id", None) or str(n)
        doc["doc_id"] = f"{source}/{path.name}#{key}"
        doc["source"] = source
        batch.append(doc)
        n += 1
        if len(batch) == partition_docs:
            flush()
    if batch or part == 0:
        flush()
    return {
        "docs_in": n,
        "docs_out": n,
        "bytes_in": docs_in_bytes,
        "bytes_out": out_bytes,
        "extra": problems,
    }
