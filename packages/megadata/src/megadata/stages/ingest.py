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
  megadata.wiki_prestrip).

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

import bz2
import functools
import gzip
import json
import logging
import lzma
import re
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Iterator
from pathlib import Path

from megadata.documents import atomic_write_bytes, text_bytes, write_docs
from megadata.file_pieces import Bz2Streams, Piece, WholeFile, XmlRange, open_lines
from megadata.wiki_prestrip import prestrip

log = logging.getLogger("megadata.ingest")

DEFAULT_MAX_DOC_BYTES = 16 * 2**20  # 3x the crawler's page cap; Wikipedia's longest is ~1 MB
WARNINGS_PER_FILE = 20  # problems of a file named in the log; all are in _problems/
PROBLEMS_DIR = "_problems"
_CHUNK = 1 << 20
_BOM = b"\xef\xbb\xbf"
_SURROGATES = re.compile("[\ud800-\udfff]")
_FIELDS = ("text", "url", "title", "source")


class _Notes:
    """Counts a file's problems by kind (into `problems`: the stage's statistics), names
    each in a warning (the first WARNINGS_PER_FILE) and lists it in `listed` (if given).
    With `from_byte`, line numbers count from that byte of the file (a piece of a dump:
    megadata.file_pieces)."""

    def __init__(
        self, path: Path, problems: dict, listed: list | None, from_byte: int | None = None
    ):
        self.path, self.problems, self.listed, self.warned = path, problems, listed, 0
        self.from_byte = from_byte

    def __call__(self, kind: str, line: int | None, message: str, action: str) -> None:
        self.problems[kind] = self.problems.get(kind, 0) + 1
        where = f"{self.path}:{line}" if line else str(self.path)
        if self.from_byte is not None:
            where = f"{self.path}, line {line} after byte {self.from_byte}"
        if self.listed is not None:
            record = {"file": str(self.path), "line": line, "problem": kind}
            if self.from_byte is not None:
                record["from_byte"] = self.from_byte
            self.listed.append({**record, "detail": message, "action": action})
        if self.warned < WARNINGS_PER_FILE:
            log.warning("%s: %s; %s", where, message, action)
        elif self.warned == WARNINGS_PER_FILE:
            log.warning(
                "%s: more problems not named here (all are counted, and listed under %s/)",
                self.path,
                PROBLEMS_DIR,
            )
        self.warned += 1


def _open_binary(path: Path):
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _max_doc_bytes(options: dict) -> int:
    value = options.get("max_doc_bytes", DEFAULT_MAX_DOC_BYTES)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_doc_bytes must be a positive integer, got {value!r}")
    return value


def _lines(
    f, limit: int, first: int = 1, stop: int | None = None
) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, bytes, size) per line of a binary file from line `first` on (while
    fewer than `stop` bytes are read, if given), a UTF-8 byte-order mark dropped; the bytes
    are None for a line of more than `limit` bytes, read past in chunks, never held."""
    number, read = first - 1, 0
    while (stop is None or read < stop) and (raw := f.readline(limit + 1)):
        number += 1
        read += len(raw)
        whole = len(raw) <= limit or raw.endswith(b"\n")
        if number == 1:
            raw = raw.removeprefix(_BOM)
        if whole:
            yield number, raw, len(raw)
            continue
        size = len(raw)
        while chunk := f.readline(_CHUNK):
            size += len(chunk)
            if chunk.endswith(b"\n"):
                break
        read += size - len(raw)
        yield number, None, size


def _read_at_most(f, limit: int) -> tuple[bytes | None, int]:
    """(the whole contents, size), or (None, size) when over `limit` bytes (read past)."""
    data = f.read(limit + 1)
    if len(data) <= limit:
        return data, len(data)
    size = len(data)
    del data
    while chunk := f.read(_CHUNK):
        size += len(chunk)
    return None, size


def _too_large(note: _Notes, line: int | None, size: int, limit: int, what: str) -> None:
    note("too_large", line, f"{what} of {size} bytes is over max_doc_bytes = {limit}", "skipped")


def _decode(data: bytes, note: _Notes, line: int | None, what: str) -> str | None:
    """Strict UTF-8, or None with the problem noted (line: of the first bad byte)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line if line is not None else data.count(b"\n", 0, e.start) + 1
        note("not_utf8", at, f"not UTF-8 ({e.reason} at byte {e.start})", f"{what} skipped")
        return None


def _without_nul(text: str, note: _Notes, line: int | None) -> str:
    if "\x00" in text:
        note("nul_chars", line, f"{text.count(chr(0))} NUL characters", "removed")
        text = text.replace("\x00", "")
    return text


# ---------------------------------------------------------------- text


def read_text(
    path: Path,
    split: str,
    problems: dict,
    *,
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
    listed: list | None = None,
    piece: Piece | None = None,
) -> Iterator[dict]:
    if split not in ("file", "line", "paragraph"):
        raise ValueError(f"source {path}: split must be file, line or paragraph, got {split!r}")
    return _read_text(path, split, _Notes(path, problems, listed), max_doc_bytes, piece)


def _lines_within(
    path: Path, piece: Piece | None, note: _Notes, limit: int
) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of the file (or of the piece) of at most `limit`
    bytes; a longer one is noted and read past."""
    f, first, stop = (_open_binary(path), 1, None) if piece is None else open_lines(path, piece)
    with f:
        for number, raw, size in _lines(f, limit, first, stop):
            if raw is None:
                _too_large(note, number, size, limit, "line")
            else:
                yield number, raw


def _read_text(
    path: Path, split: str, note: _Notes, limit: int, piece: Piece | None
) -> Iterator[dict]:
    if split == "line":
        for number, raw in _lines_within(path, piece, note, limit):
            text = _decode(raw, note, number, "line")
            # Keyed by line (0-based), so that a piece names its documents as the whole
            # file would: a line cut at a form feed or U+2028 gives line.1, line.2, ...
            pieces = [p.strip() for p in _without_nul(text or "", note, number).splitlines()]
            for k, text in enumerate(p for p in pieces if p):
                yield {"text": text, "_key": f"{number - 1}.{k}" if k else str(number - 1)}
        return
    with _open_binary(path) as f:
        if split == "file":
            data, size = _read_at_most(f, limit)
            if data is None:
                _too_large(note, None, size, limit, "file")
                return
            text = _decode(data.removeprefix(_BOM), note, None, "file")
            if text is not None and (text := _without_nul(text, note, None).strip()):
                yield {"text": text}
            return
        # paragraph: the lines up to an empty one ("\n\n" separates, as it always did); a
        # paragraph with a line that is not UTF-8, or over the size limit, is skipped whole
        lines: list[str] = []
        start, size, skipped = None, 0, False
        for number, raw, length in _lines(f, limit):
            if raw in (b"\n", b"\r\n"):
                if lines and not skipped and (text := "\n".join(lines).strip()):
                    yield {"text": text}
                lines, start, size, skipped = [], None, 0, False
                continue
            start, size = start or number, size + length
            if skipped:
                continue
            if raw is None or size > limit:
                _too_large(note, start, size, limit, "paragraph")
                lines, skipped = [], True
                continue
            text = _decode(raw, note, number, "paragraph")
            if text is None:
                lines, skipped = [], True
                continue
            text = _without_nul(text, note, number)
            lines.append(text[:-1].removesuffix("\r") if text.endswith("\n") else text)
        if lines and not skipped and (text := "\n".join(lines).strip()):
            yield {"text": text}


# ---------------------------------------------------------------- jsonl


def read_jsonl(
    path: Path,
    problems: dict,
    *,
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
    listed: list | None = None,
    piece: Piece | None = None,
) -> Iterator[dict]:
    note = _Notes(path, problems, listed)
    for number, raw in _lines_within(path, piece, note, max_doc_bytes):
        if b"\x00" in raw:  # NUL bytes are NUL characters in UTF-8, wherever they are
            note("nul_chars", number, f"{raw.count(0)} NUL bytes", "removed")
            raw = raw.replace(b"\x00", b"")
        line = _decode(raw, note, number, "line")
        if line is None or not (line := line.strip()):
            continue
        try:
            obj = json.loads(line, strict=False)  # control characters inside strings are kept
        except RecursionError:
            note("too_deep", number, "JSON nested too deeply", "line skipped")
            continue
        except ValueError as e:  # JSONDecodeError, or an integer of over 4300 digits
            note("bad_json", number, f"not JSON ({getattr(e, 'msg', e)})", "line skipped")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            note("no_text", number, "no 'text' string field", "line skipped")
            continue
        doc = {k: str(obj.get(k) or "") for k in _FIELDS}
        if any(_SURROGATES.search(v) for v in doc.values()):
            # Half of a UTF-16 pair (\ud800): no character, and not encodable as UTF-8.
            found = sum(len(_SURROGATES.findall(v)) for v in doc.values())
            note("lone_surrogates", number, f"{found} lone surrogate escapes", "removed")
            doc = {k: _SURROGATES.sub("", v) for k, v in doc.items()}
        if any("\x00" in v for v in doc.values()):  # from \u0000 escapes
            found = sum(v.count("\x00") for v in doc.values())
            note("nul_chars", number, f"{found} NUL characters", "removed")
            doc = {k: v.replace("\x00", "") for k, v in doc.items()}
        doc["_key"] = str(number - 1)  # by line (0-based): the same in a piece of the file
        yield doc


# ---------------------------------------------------------------- html


def extract_html(html: str | bytes, url: str = "") -> dict:
    """Article text and title of a web page, by newspaper3k (no network: the HTML is given).
    Bytes are decoded by the page's declared charset (or detected)."""
    from newspaper import Article, Config  # imports lxml and nltk: only when HTML is ingested

    config = Config()
    config.fetch_images = False  # parse() would otherwise download the page's images
    article = Article(url or "http://localhost/", config=config)
    article.set_html(html)
    article.parse()
    return {"text": article.text, "title": article.title or "", "url": url}


def read_html(
    path: Path,
    problems: dict,
    *,
    max_doc_bytes: int = DEFAULT_MAX_DOC_BYTES,
    listed: list | None = None,
) -> Iterator[dict]:
    note = _Notes(path, problems, listed)
    with _open_binary(path) as f:
        data, size = _read_at_most(f, max_doc_bytes)
    if data is None:
        _too_large(note, None, size, max_doc_bytes, "page")
        return
    data = data.removeprefix(_BOM)
    if b"\x00" in data:
        note("nul_chars", None, f"{data.count(0)} NUL bytes", "removed")
        data = data.replace(b"\x00", b"")
    try:
        html: str | bytes = data.decode("utf-8")
    except UnicodeDecodeError:
        html = data  # a page in another charset: decoded by its <meta charset>, not mangled
    try:
        doc = extract_html(html)
    except Exception as e:  # a parser's surprise costs this page, not the stage
        note("bad_html", None, f"not parsed ({type(e).__name__}: {e})", "skipped")
        return
    if doc["text"].strip():
        yield doc
    else:
        note("no_article_text", None, "no article text found in the HTML", "skipped")


# ---------------------------------------------------------------- wikipedia

_DROPPED_TAGS = frozenset(
    {
        "ref",
        "references",
        "table",
        "gallery",
        "imagemap",
        "timeline",
        "graph",
        "score",
        "math",
        "chem",
        "ce",
        "templatedata",
        "includeonly",
        "inputbox",
        "categorytree",
        "section",
        "mapframe",
        "maplink",
    }
)
_DROPPED_NAMESPACES = frozenset({"file", "image", "media", "category"})
_LANGUAGE_PREFIX = re.compile(r"[a-z]{2,3}(?:-[a-z0-9]+)*|simple")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
# Patterns open with a literal of two characters or more where they can: the regex engine
# then jumps from one occurrence of it to the next, where a pattern that opens with a
# character class (or with a repeat of one) is tried at every character of that class.
_STYLE_QUOTES = re.compile(r"'''*")  # two quotes or more: italics, bold
_PAREN_LEAD = re.compile(r"\((?:\s*[,;:])+\s*")  # "(; born" -> "(born"
# The two below run on the text reversed, so that they open with the ")" (a literal) rather
# than with the spaces before it: reversed, "(born 1900; )" is ") ;0091 nrob(".
# "(born 1900; )" -> "(born 1900)": the run of spaces and [,;:] before a ")" if it holds one
# of [,;:] (what r"(?:\s*[,;:])+\s*\)" matches, forwards).
_PAREN_TAIL_REVERSED = re.compile(r"\)\s*[,;:][\s,;:]*")
# "Paris ()" -> "Paris": a "()" with the spaces before it, or one that opens a line; f() stays
# (what r"(?:^|[ \t\xa0]+)\(\s*\)" with re.M matches, forwards).
_PAREN_EMPTY_REVERSED = re.compile(r"\)\s*\((?:[ \t\xa0]+|$)", re.M)
_SPACES = re.compile(r"[ \t]{2,}")
_SPACES_NO_TAB = re.compile(r"   *")  # the same, where the text has no tab
# A space (or tab) between a word character and a [.,;:] that ends a word ("born , in"), the
# word character found by a look-behind once the space is (a look-behind that opened the
# pattern would be tried at every character).  One character of space is enough: _SPACES
# has collapsed the runs.
_SPACE_BEFORE_PUNCT = re.compile(r"[ \t](?<=\w[ \t])[.,;:](?=\s|$)")
_SPACE_BEFORE_PUNCT_NO_TAB = re.compile(r" (?<=\w )[.,;:](?=\s|$)")  # a literal: faster
_BLANK_LINES = re.compile("\n\n\n\n*")  # three newlines or more


@functools.cache
def _mw_nodes():
    """mwparserfromhell.nodes, imported on first use (as the parser is) and once: an import
    statement in a function that runs for every node costs more than the test it serves."""
    from mwparserfromhell import nodes

    return nodes


def _unwanted(node, nodes) -> bool:
    if isinstance(node, nodes.Template | nodes.Comment):
        return True
    if isinstance(node, nodes.Tag):
        return str(node.tag).strip().lower() in _DROPPED_TAGS
    if isinstance(node, nodes.Wikilink):
        title = str(node.title).strip()
        if title.startswith(":") or ":" not in title:  # [[:Category:X]] is a visible link
            return False
        prefix = title.split(":", 1)[0].strip()
        if prefix.lower() in _DROPPED_NAMESPACES:  # with the caption: thumb|left|alt=...|text
            return True
        return node.text is None and _LANGUAGE_PREFIX.fullmatch(prefix) is not None
    return False


def _prune(code) -> None:
    """Unwanted nodes out of `code` and of everything inside what stays."""
    nodes = _mw_nodes()
    kept = []
    for node in code.nodes:
        # Most nodes are plain text: never unwanted, nothing inside.
        if type(node) is not nodes.Text:
            if _unwanted(node, nodes):
                continue
            for child in node.__children__():
                _prune(child)
        kept.append(node)
    code.nodes = kept


def _drop_empty_sections(code) -> None:
    """Headings whose section (subsections included) has no text left."""
    from mwparserfromhell.wikicode import Wikicode

    heading = _mw_nodes().Heading
    nodes = code.nodes
    heads = [i for i, node in enumerate(nodes) if isinstance(node, heading)]
    if not heads:
        return
    has_text: dict[int, bool] = {}  # by node index: found only where a section asks

    def text_at(j: int) -> bool:
        if j not in has_text:
            node = nodes[j]
            has_text[j] = not isinstance(node, heading) and bool(
                _MAGIC_WORD.sub("", Wikicode([node]).strip_code()).strip()
            )
        return has_text[j]

    empty = set()
    for h, i in enumerate(heads):
        level = nodes[i].level
        end = next((j for j in heads[h + 1 :] if nodes[j].level <= level), len(nodes))
        if not any(text_at(j) for j in range(i + 1, end)):  # stops at the first text
            empty.add(i)
    code.nodes = [node for i, node in enumerate(nodes) if i not in empty]


def _tidy(text: str) -> str:
    text = _MAGIC_WORD.sub("", _STYLE_QUOTES.sub("", text))
    text = _PAREN_LEAD.sub("(", text)
    reversed_text = _PAREN_TAIL_REVERSED.sub(")", text[::-1])
    text = _PAREN_EMPTY_REVERSED.sub("", reversed_text)[::-1]
    tab = "\t" in text
    text = (_SPACES if tab else _SPACES_NO_TAB).sub(" ", text)
    before_punct = _SPACE_BEFORE_PUNCT if tab else _SPACE_BEFORE_PUNCT_NO_TAB
    text = _cut_out(text, [m.start() for m in before_punct.finditer(text)])
    text = "\n".join([line.strip() for line in text.splitlines()])
    return _BLANK_LINES.sub("\n\n", text).strip()


def _cut_out(text: str, positions: list[int]) -> str:
    """`text` without the characters at `positions` (ascending)."""
    if not positions:
        return text
    pieces, kept_from = [], 0
    for at in positions:
        pieces.append(text[kept_from:at])
        kept_from = at + 1
    pieces.append(text[kept_from:])
    return "".join(pieces)


def wikitext_to_text(wikitext: str) -> str:
    """The prose of an article's wikitext: headings and paragraphs, no markup."""
    import mwparserfromhell

    # Bold and italic quotes are kept as text (and dropped by _tidy): an unbalanced pair (a
    # caption's bold closed as italics) would make the parser give up its construct as text.
    code = mwparserfromhell.parse(prestrip(wikitext), skip_style_tags=True)
    _prune(code)
    _drop_empty_sections(code)
    return _tidy(code.strip_code(normalize=True, collapse=True))


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
    note = _Notes(path, problems, listed, from_byte)
    with _open_binary(path) if piece is None else open(path, "rb") as f:
        for line, raw, size in _xml_pages(_dump_reader(f, piece), max_doc_bytes):
            if raw is None:
                _too_large(note, line, size, max_doc_bytes, "page")
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


# ---------------------------------------------------------------- a file of a source


def read_source_file(
    kind: str,
    path: Path,
    options: dict,
    problems: dict,
    listed: list | None = None,
    piece: Piece | None = None,
) -> Iterator[dict]:
    """The documents of a file (of its `piece`: megadata.file_pieces); a document's
    "_key", when it has one, names it within the file (ingest_file makes it the doc_id)."""
    limits = {"max_doc_bytes": _max_doc_bytes(options), "listed": listed}
    if kind == "text":
        return read_text(path, options.get("split", "file"), problems, **limits, piece=piece)
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
    options: dict,
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
    note = _Notes(path, problems, listed)
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
