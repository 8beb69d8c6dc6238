"""The `html` source: a web page per file, its article text and title extracted with
newspaper3k."""

from collections.abc import Iterator
from pathlib import Path

from megadata.sources.options import DEFAULT_MAX_DOC_BYTES
from megadata.sources.problems import Notes, too_large
from megadata.sources.reading import BOM, open_binary, read_at_most


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
    note = Notes(path, problems, listed)
    with open_binary(path) as f:
        data, size = read_at_most(f, max_doc_bytes)
    if data is None:
        too_large(note, None, size, max_doc_bytes, "page")
        return
    data = data.removeprefix(BOM)
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
