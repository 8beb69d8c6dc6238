"""Bench corpora for bench_megadata.py: the default recipe's sample replicated to a size.

A replica that were a byte copy would be removed whole by dedup, and every stage after it
would then see a fraction of the text; so each copy after the first mixes the sample:
- Wikipedia (the bz2 XML dump): each article keeps its lead section and receives, in
  place of its other sections, as many sections drawn (seeded, without replacement) from
  the pool of all articles' non-lead sections; the markup is untouched (sections close
  their templates and tables);
- the Lee news lines: each keeps its first sentence and receives the others from the
  pool of all lines' later sentences;
- the plain jsonl corpus: the sample's ingested documents mixed the same way by
  paragraph (by sentence for a one-paragraph document).
Documents too short to mix (one section, one sentence) repeat in every copy, as
boilerplate does on the web; dedup finds them.
"""

import bz2
import json
import random
import re
from pathlib import Path

from megadata.stages.ingest import read_source_file

ROOT = Path(__file__).resolve().parent.parent
RAW = ROOT / "data/raw"
WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE = "lee_background.cor"
_TEXT = re.compile(rb"(<text\b[^>]*>)(.*?)(</text>)", re.S)
_SECTION = re.compile(rb"(?=\n==[^=\n][^\n]*==[ \t]*\n)")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")
_PARAGRAPH = re.compile(r"\n\s*\n")


def mix(units: list[list], seed: int) -> list[list]:
    """Each document keeps its first unit; its others are drawn from everyone's others."""
    pool = [u for doc in units for u in doc[1:]]
    random.Random(seed).shuffle(pool)
    out, at = [], 0
    for doc in units:
        take = len(doc) - 1
        out.append(doc[:1] + pool[at : at + take])
        at += take
    return out


def _wiki_copy(xml: bytes, seed: int) -> bytes:
    texts = [m for m in _TEXT.finditer(xml)]
    units = [_SECTION.split(m.group(2)) for m in texts]
    mixed = mix(units, seed)
    out, last = [], 0
    for m, sections in zip(texts, mixed, strict=True):
        out += [xml[last : m.start(2)], b"".join(sections)]
        last = m.end(2)
    out.append(xml[last:])
    return b"".join(out)


def _lee_copy(lines: list[str], seed: int) -> str:
    mixed = mix([_SENTENCE.split(line) for line in lines], seed)
    return "".join(" ".join(s) + "\n" for s in mixed)


def sample_documents() -> list[dict]:
    """The default recipe's inputs as ingested documents (text, title)."""
    docs = []
    for kind, name, options in (("wikipedia", WIKI, {}), ("text", LEE, {"split": "line"})):
        for d in read_source_file(kind, RAW / name, options, {}):
            docs.append({"text": d["text"], "title": d.get("title", "")})
    return docs


def _units(text: str) -> tuple[list[str], str]:
    paragraphs = _PARAGRAPH.split(text)
    if len(paragraphs) > 1:
        return paragraphs, "\n\n"
    return _SENTENCE.split(text), " "


def write_jsonl_copies(out: Path, copies: int) -> list[Path]:
    docs = sample_documents()
    split = [_units(d["text"]) for d in docs]
    paths = []
    for c in range(copies):
        units = [u for u, _ in split] if c == 0 else mix([u for u, _ in split], c)
        path = out / f"docs-{c:04d}.jsonl"
        with open(path, "w") as f:
            for d, u, (_, sep) in zip(docs, units, split, strict=True):
                f.write(json.dumps({"text": sep.join(u), "title": d["title"]}) + "\n")
        paths.append(path)
    return paths


def write_recipe_copies(out: Path, copies: int) -> None:
    """`copies` mixed copies of the default recipe's two raw files under `out`."""
    xml = bz2.decompress((RAW / WIKI).read_bytes())
    lines = (RAW / LEE).read_text().splitlines()
    for c in range(copies):
        wiki = xml if c == 0 else _wiki_copy(xml, c)
        (out / f"wiki-{c:04d}.xml.bz2").write_bytes(bz2.compress(wiki, 9))
        lee = "".join(line + "\n" for line in lines) if c == 0 else _lee_copy(lines, c)
        (out / f"lee-{c:04d}.cor").write_text(lee)


def sample_text_mb() -> float:
    return sum(len(d["text"].encode()) for d in sample_documents()) / 1e6


def bench_recipe(kind: str, target_mb: float, work: Path) -> Path:
    """A recipe file under `work` for corpus `kind` (default, bert, jsonl): the shipped
    recipe's settings over the sample replicated to about `target_mb` MB of text."""
    inputs = work / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    copies = max(1, round(target_mb / sample_text_mb()))
    marker = inputs / f"_{kind}-{copies}-copies"  # a complete set made earlier is reused
    base = "default-bert.toml" if kind == "bert" else "default.toml"
    text = (ROOT / "pipelines/corpus" / base).read_text()
    head, rest = text.split("[[sources]]", 1)
    rest = rest[rest.index("[clean]") :]
    made = marker.exists()
    if kind == "jsonl":
        if not made:
            write_jsonl_copies(inputs, copies)
        sources = (
            f'[[sources]]\nname = "web"\nkind = "jsonl"\npaths = ["{inputs}/docs-*.jsonl"]\n\n'
        )
    else:
        if not made:
            write_recipe_copies(inputs, copies)
        sources = (
            f'[[sources]]\nname = "enwiki"\nkind = "wikipedia"\n'
            f'paths = ["{inputs}/wiki-*.xml.bz2"]\n\n'
            f'[[sources]]\nname = "lee-news"\nkind = "text"\nsplit = "line"\n'
            f'paths = ["{inputs}/lee-*.cor"]\n\n'
        )
    marker.touch()
    path = work / f"{kind}.toml"
    path.write_text(head + sources + rest)
    return path
