"""The `wikipedia` source: a MediaWiki XML dump (.xml or .xml.bz2, or a piece of one:
megadata.file_pieces), articles only (namespace 0, no redirects), as plain text
(megadata.sources.wiki_markup).  A page the XML or wiki parser rejects costs only itself."""

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

from megadata.file_pieces import Bz2Streams, Piece, WholeFile, XmlRange
from megadata.sources.options import DEFAULT_MAX_DOC_BYTES
from megadata.sources.problems import Notes, too_large
from megadata.sources.reading import open_binary
from megadata.sources.wiki_markup import wikitext_to_text


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


_PAGE_START = re.compile(rb"<page[\s>]")
_PAGE_END = b"</page>"


def _xml_pages(source, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(first line, bytes, size) of each <page>...</page> of a dump, found in the bytes (text
    cannot hold a literal "<page": "<" is &lt;) so that a page the XML parser rejects costs
    only itself. The bytes are None for a page over `limit` bytes (read past, not held).
    `source`: `read()` gives the next bytes, and a page that starts at or after its
    `owned_until` (an offset in those bytes, or None) is not this task's: reading stops."""
    buf = bytearray()
    line = 1  # of buf[0]
    base = 0  # the offset of buf[0] in what source.read() gave
    inside, start, size, scan, too_large = False, 0, 0, 0, False
    while True:
        chunk = source.read()
        buf += chunk
        while True:
            if not inside:
                found = _PAGE_START.search(buf)
                at = found.start() if found else max(len(buf) - 5, 0)  # "<page" may go on
                owned = source.owned_until
                if owned is not None and base + at >= owned:  # the next piece's pages
                    return
                line += buf.count(b"\n", 0, at)
                del buf[:at]
                base += at
                if not found:
                    break
                inside, start, size, scan, too_large = True, line, 0, 0, False
            end = buf.find(_PAGE_END, scan)
            if end < 0:
                scan = max(len(buf) - len(_PAGE_END) + 1, 0)
                if too_large or size + len(buf) > limit:  # drop what was read, go on counting
                    too_large = True
                    line += buf.count(b"\n", 0, scan)
                    size += scan
                    del buf[:scan]
                    base += scan
                    scan = 0
                break
            end += len(_PAGE_END)
            page = bytes(buf[:end])
            del buf[:end]
            base += end
            line += page.count(b"\n")
            size += len(page)
            inside = False
            yield start, None if too_large or size > limit else page, size
        if not chunk:
            if inside:  # cut short: the XML parser names what is missing
                yield start, None if too_large else bytes(buf), size + len(buf)
            return


def _dump_reader(f, piece: Piece | None):
    if piece is None:
        return WholeFile(f)
    return (Bz2Streams if piece.how == "bz2-streams" else XmlRange)(f, piece.start, piece.end)


def read_wikipedia(
    path: Path,
    problems: dict,
    *,
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
    listed: list | None = None,
    piece: Piece | None = None,
) -> Iterator[dict]:
    from_byte = piece.start if piece is not None else None
    note = Notes(path, problems, listed, from_byte)
    with open_binary(path) if piece is None else open(path, "rb") as f:
        for line, raw, size in _xml_pages(_dump_reader(f, piece), max_doc_bytes):
            if raw is None:
                too_large(note, line, size, max_doc_bytes, "page")
                continue
            try:
                elem = ET.fromstring(raw)
            except ET.ParseError as e:
                row = line + e.position[0] - 1
                note("bad_xml", row, f"page not parsed as XML ({e})", "page skipped")
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
            if (ns is not None and ns.text != "0") or "redirect" in fields or not wikitext:
                continue
            try:
                text = wikitext_to_text(wikitext)
            except Exception as e:  # the wiki parser's surprise costs this page only
                what = f"page {page_id} {title!r} not parsed as wikitext"
                note("bad_wikitext", line, f"{what} ({type(e).__name__}: {e})", "page skipped")
                continue
            yield {
                "text": text,
                "title": title,
                "url": f"https://en.wikipedia.org/wiki?curid={page_id}",
                "_key": page_id,
            }
